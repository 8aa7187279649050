"""A fleet stream's pooled hold-out: one clipping threshold for all its partitions.

A partitioned ToPS or PAK stream with ``threshold_by="fleet"`` (the default) pools the first rows
of every partition, ``m`` rows in all (4096 by default), and chooses one threshold from them
(:meth:`~dpsql.streams.holdout.ThresholdedStream.pooled_threshold`): each row is in the pool at
most once, so the pool is one mechanism at ``(1 - holdout_share) * epsilon``, whatever the number of
partitions. Rows join the pool in the order they are appended, and within an append by order
key, then by partition address (the fleet's earliest rows:
:func:`~dpsql.streams.holdout.pooled_by_key`); an append that brings the first day of a few hundred
hourly meters fills it. Until it is full, rows are released provisionally (the middle of the public
bounds: nothing is released to predict from yet), and their values are kept in the stream's state
(secret, like a single stream's pending hold-out). Once the threshold is chosen, each partition's
machine releases its pooled rows at ``holdout_share * epsilon`` and the rest at ``epsilon``, clipped
at it: a one-shot release of the same table gives the same values when the fleet's rows were
appended in time order and its longest partition has at most 2**16 rows (a stream chooses its
threshold for ranges of that span, not knowing how long it will grow; a one-shot release for its
longest partition's: docs/algorithms.md, "The threshold's objective").
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from dpsql.continual.fleet import Fleet
from dpsql.methods import machine_for, pools_fleet
from dpsql.streams.holdout import DEFAULT_HOLDOUT, pooled_by_key


def pools(method: str, params: dict, partition_by) -> bool:
    """Does a stream of ``method`` with ``params`` pool its partitions' hold-outs?"""
    return bool(partition_by) and pools_fleet(method, params)


class Pool:
    """The pool of ``fleet`` (its facts ``pool_ordinal``, ``pool_value``, ``pooled`` while it
    fills, ``threshold`` once chosen)."""

    def __init__(self, fleet: Fleet, method: str, params: dict, draws):
        self.fleet, self.method, self.params, self._draws = fleet, method, params, draws
        self.m = int(params.get("m") or DEFAULT_HOLDOUT)

    @property
    def threshold(self) -> float | None:
        return self.fleet.facts.get("threshold")

    def add(self, ordinals: np.ndarray, counts: np.ndarray, starts: np.ndarray, values: np.ndarray,
            keys) -> None:
        """Pool the new rows (``counts[g]`` rows of partition ``ordinals[g]`` from ``values[starts[g]]
        ..``, order keys ``keys`` at the same places) that the pool still takes, earliest first; choose
        the threshold when it is full."""
        facts = self.fleet.facts
        pooled = int(facts.get("pooled", 0))
        if self.threshold is not None or not len(ordinals):
            return
        rank = np.empty(len(ordinals), np.int64)  # by address
        rank[pc.sort_indices(self.fleet.directory["__address"].take(ordinals)).to_numpy()] = np.arange(len(ordinals))
        rows = np.repeat(starts, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts,
                                                                                      counts))
        taken = pooled_by_key(keys.take(rows), np.repeat(np.arange(len(ordinals)), counts), rank, self.m - pooled,
                              len(ordinals))
        chosen = np.repeat(starts, taken) + (np.arange(int(taken.sum())) - np.repeat(np.cumsum(taken) - taken, taken))
        facts["pool_ordinal"] = np.concatenate([facts.get("pool_ordinal", np.empty(0, np.int64)),
                                                np.repeat(ordinals, taken)])
        facts["pool_value"] = np.concatenate([facts.get("pool_value", np.empty(0)), values[chosen]])
        facts["pooled"] = pooled + int(taken.sum())
        if facts["pooled"] == self.m:
            fleet_params = {k: v for k, v in self.params.items() if k != "threshold_by"}
            machine = machine_for(self.method, None, self._draws, fleet_params)
            facts["threshold"] = machine.pooled_threshold(facts["pool_value"])

    def partition_params(self, ordinals: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Each partition's pooled rows (how many) and their values, in row order; forgotten here
        (their machines now hold them)."""
        facts = self.fleet.facts
        owners = facts.get("pool_ordinal", np.empty(0, np.int64))
        values = facts.get("pool_value", np.empty(0))
        mine = [values[owners == o] for o in ordinals.tolist()]
        keep = ~np.isin(owners, ordinals)
        facts["pool_ordinal"], facts["pool_value"] = owners[keep], values[keep]
        return np.array([len(v) for v in mine], np.int64), mine

    def machine_params(self, pooled_rows: int) -> dict:
        """What a partition's machine takes besides the stream's: the fleet's threshold and its pooled rows."""
        return {"threshold": self.threshold, "pooled_rows": int(pooled_rows)}
