"""What a release would cost and how accurate it would be, before any budget is spent.

:func:`preview` builds the method's machine with the given public parameters, runs it on a
stand-in stream of the given length (never the data) and reads the cost and the error model
the release would have. Nothing is charged and no data is read, so a preview can be shown to
anyone.

For the methods whose accuracy depends on the data, the stand-in is their least favourable
stream and the preview an upper bound:

* a private threshold (``tops``, ``pak``) is assumed at its largest value, ``upper``: the
  released threshold is usually far below it, and the error scales with it;
* PeGaSus is assumed to find no group longer than one step (every count smoothed alone);
* the spreading bound of a block release (:mod:`dpsql.error_models`) is the largest a window
  of that length can have.

Windows of each length are spread evenly along the stream. With a time ``grid`` (the rows on a
regular clock, :class:`~dpsql.timegrid.RowGrid`), a length of whole days is previewed on calendar
days (windows from midnight to midnight, what ``date_trunc('day', ...)`` or a ``"1d"`` bucket
asks), and the default lengths are a row, a day and a week of the grid's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dpsql import _validate
from dpsql.error_models import check_level
from dpsql.errors import InvalidParameter
from dpsql.methods import COUNT_METHODS, check_method, machine_for
from dpsql.noise import Keystream
from dpsql.release import chunks_of, release_from
from dpsql.timegrid import RowGrid

#: Window lengths previewed when none are given and no grid: a row, a day and a week of hourly rows.
DEFAULT_LENGTHS = (1, 24, 168)
#: Windows of one length whose error is averaged (evenly spaced over the stream).
_WINDOWS = 2048
#: What the stand-in stream assumes, by method.
_ASSUMPTIONS = {
    "tops": "the private threshold at its largest value (upper)",
    "pak": "the private threshold at its largest value (upper)",
    "pegasus": "no group longer than one step",
    "count_smoothed": "counts that jump at every step, so the smoother returns the noisy counts",
}


@dataclass(frozen=True)
class Preview:
    """The cost and expected error of a release that has not happened.

    Attributes
    ----------
    method, params :
        The method and its public parameters, defaults resolved.
    epsilon, delta, notion, neighbour :
        What the release would be charged, under which notion, protecting which neighbours.
    n :
        The stream length previewed.
    sd, margin :
        For each window length: the root mean square of the noise standard deviation of a
        window sum, and the mean half-width of its interval at ``level`` (noise and
        spreading bound, as :meth:`dpsql.Release.range_ci`), over windows spread along the
        stream.
    noise, spreading :
        The two parts of ``margin``: the mean half-width of the noise at ``level``, and the
        mean bound on the error of sharing a block's sum among its rows (0 for windows along
        block boundaries, such as calendar days on a grid).
    assumption :
        The least favourable case assumed for a data-dependent method, or None.
    """

    method: str
    params: dict
    epsilon: float
    delta: float
    notion: str
    neighbour: str
    n: int
    level: float
    sd: dict[int, float] = field(default_factory=dict)
    margin: dict[int, float] = field(default_factory=dict)
    assumption: str | None = None
    noise: dict[int, float] = field(default_factory=dict)
    spreading: dict[int, float] = field(default_factory=dict)

    def to_polars(self):
        """One row per window length: ``length``, ``sd``, ``margin``, ``noise``, ``spreading``."""
        import polars as pl

        return pl.DataFrame({"length": list(self.sd), "sd": list(self.sd.values()),
                             "margin": list(self.margin.values()), "noise": list(self.noise.values()),
                             "spreading": list(self.spreading.values())})

    def __repr__(self) -> str:
        errors = ", ".join(f"{k} rows: sd {self.sd[k]:.4g}, ±{self.margin[k]:.4g} (noise ±{self.noise[k]:.4g}, "
                           f"spreading ±{self.spreading[k]:.4g})" for k in self.sd)
        note = f"; assuming {self.assumption}" if self.assumption else ""
        return (f"Preview({self.method}, n={self.n}, epsilon={self.epsilon:g}, delta={self.delta:g}, "
                f"{self.notion}; {errors}{note})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{k}</td><td>{self.sd[k]:.4g}</td><td>±{self.margin[k]:.4g}</td>"
                       f"<td>±{self.noise[k]:.4g}</td><td>±{self.spreading[k]:.4g}</td></tr>" for k in self.sd)
        note = f"<p>Assuming {self.assumption}.</p>" if self.assumption else ""
        return (f"<div><b>Preview of {self.method}</b> on {self.n:,} rows: costs <b>epsilon {self.epsilon:g}, "
                f"delta {self.delta:g}</b> ({self.notion}). Nothing charged, no data read.{note}"
                f"<table><tr><th>window (rows)</th><th>noise sd</th><th>{self.level:.0%} interval</th>"
                f"<th>of which noise</th><th>of which spreading</th></tr>"
                f"{rows}</table></div>")


def preview(method: str, *, n: int, lengths=None, level: float = 0.95, **params) -> Preview:
    """The cost and expected error of releasing ``n`` rows with ``method`` and ``params``,
    with nothing charged and no data read (module docstring).

    Parameters
    ----------
    method : str
        A registered method name (:data:`dpsql.methods.METHODS`).
    n : int
        Rows of the stream (per partition: partitions are disjoint and cost the same as one).
    lengths : sequence of int
        Window lengths whose error to preview (those longer than ``n`` are left out); by
        default a row, a day and a week of hourly rows, or of the ``grid``'s rows.
    level : float
        Confidence level of the interval half-widths.
    **params
        The method's parameters, as the release would get them.

    Examples
    --------
    >>> import dpsql
    >>> p = dpsql.preview("laplace", n=1000, epsilon=1.0, upper=10.0)
    >>> p.epsilon, round(p.sd[24] ** 2 / (24 * 2 * 10.0**2), 3)  # 24 Laplace draws of scale 10
    (1.0, 1.0)
    >>> dpsql.preview("tops", n=100_000, epsilon=1.0, upper=50.0).assumption
    'the private threshold at its largest value (upper)'
    """
    check_method(method)
    n = _validate.integer(n, "n", minimum=1)
    level = check_level(level)
    keystream = Keystream(bytes(32), private=False)  # a stand-in stream: its noise is never shown
    machine = machine_for(method, n, keystream.partition(), params)
    grid = None if params.get("grid") is None else RowGrid.of(params["grid"])  # valid: the machine took it
    if lengths is None:
        lengths = DEFAULT_LENGTHS if grid is None else (1, grid.rows_per_day, 7 * grid.rows_per_day)
    lengths = sorted({_validate.integer(length, "lengths", minimum=1) for length in lengths})
    release = release_from(machine, chunks_of(_stand_in(method, n, params)), n, private=False)
    sd, margin, noise, spreading = {}, {}, {}, {}
    if machine.n_outputs is None:
        for length in (k for k in lengths if k <= n):
            starts = _window_starts(n, length, grid)
            stops = starts + length
            sd[length] = float(np.sqrt(np.mean(release.error.range_variance(starts, stops))))
            parts = release.error.range_margin_parts(starts, stops, level)
            noise[length], spreading[length] = float(np.mean(parts.noise)), float(np.mean(parts.spreading))
            margin[length] = noise[length] + spreading[length]
    return Preview(method=method, params=dict(release.params), epsilon=machine.cost[0], delta=machine.cost[1],
                   notion=str(machine.notion), neighbour=str(machine.neighbour), n=n, level=level, sd=sd,
                   margin=margin, assumption=_ASSUMPTIONS.get(method), noise=noise, spreading=spreading)


def _window_starts(n: int, length: int, grid: RowGrid | None) -> np.ndarray:
    """Up to ``_WINDOWS`` first rows of windows of ``length`` rows evenly along ``n`` rows: at
    midnights when ``length`` is whole days of ``grid`` and one fits (module docstring)."""
    candidates = np.arange(n - length + 1)
    if grid is not None and length % grid.rows_per_day == 0:
        midnights = grid.day_starts(n)
        candidates = midnights[midnights + length <= n] if np.any(midnights + length <= n) else candidates
    return candidates[np.unique(np.linspace(0, len(candidates) - 1, min(_WINDOWS, len(candidates))).astype(np.int64))]


def _stand_in(method: str, n: int, params: dict) -> np.ndarray:
    """The least favourable stream of ``n`` rows for ``method`` (module docstring)."""
    if method in COUNT_METHODS:
        # a count that jumps at every step (by far more than any grouping threshold) keeps groups single
        sensitivity = float(params.get("sensitivity", 1.0))
        return np.where(np.arange(n) % 2 == 0, 0.0, 1e6 * sensitivity)
    if "upper" not in params:
        raise InvalidParameter(f"preview of {method!r} needs its public bound upper=")
    return np.full(n, float(params["upper"]))
