"""Literal oracles shared by the tests: a forest's design matrix and the ToPS block smoothers
(ToPS App. D) written as the paper states them, one block at a time."""

import numpy as np

from dpsql.mechanisms.hierarchy import Forest


def design_matrix(forest: Forest) -> np.ndarray:
    """Rows: every node, level by level from the leaves; columns: leaves."""
    rows = []
    for level in range(forest.levels):
        size = forest.fanout**level
        for node in range(forest.n_leaves // size):
            row = np.zeros(forest.n_leaves)
            row[node * size:(node + 1) * size] = 1.0
            rows.append(row)
    return np.array(rows)


def reference_predictions(name, sums, g, initial, window=3, alpha=0.6):
    """The per-row prediction of every block t = 0..T from the released block sums u_0..u_{t-1}."""
    preds = [initial / g]
    level = None
    for t in range(1, len(sums) + 1):
        past = sums[:t]
        if name == "recent":
            preds.append(past[-1] / g)
        elif name == "mean":
            preds.append(np.mean(past) / g)
        elif name == "median":
            preds.append(np.median(past) / g)
        elif name == "moving":
            preds.append(np.mean(past[-window:]) / g)
        else:
            level = past[-1] if level is None else alpha * past[-1] + (1 - alpha) * level
            preds.append(level / g)
    return np.array(preds)


def reference_outputs(name, sums, g, n, initial=0.0, window=3, alpha=0.6):
    """The rows of a stream of ``n`` rows in blocks of ``g`` whose released block sums are
    ``sums``: spread evenly (``none``; a short last block over its own rows) or predicted,
    the block's last row taking the rest (rows of a block never released keep the prediction)."""
    out = np.empty(n)
    preds = None if name == "none" else reference_predictions(name, sums, g, initial, window, alpha)
    for t in range(-(-n // g)):
        lo, hi = t * g, min(n, (t + 1) * g)
        if name == "none":
            out[lo:hi] = sums[t] / (hi - lo)
        elif t < len(sums):
            out[lo:hi - 1] = preds[t]
            out[hi - 1] = sums[t] - (hi - lo - 1) * preds[t]
        else:
            out[lo:hi] = preds[t]
    return out
