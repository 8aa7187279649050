"""One clipping threshold for a fleet of partitions, from its pooled hold-out.

A partitioned ToPS or PAK release with ``threshold_by="fleet"`` (the default) pools the fleet's
``m`` earliest rows (:mod:`dpsql.streams.holdout`) and chooses one threshold from them, by the
method's rule, from the fleet's draws (the unpartitioned address, which no partition has), at
``(1 - holdout_share) * epsilon``: a row is in the pool at most once, so the pool is one mechanism
whatever the number of partitions. The local one-shot release (:func:`fleet_threshold`) and
Spark's driver (:class:`dpsql.publishing.DistributedRelease`) choose it with :func:`fleet_params`
for the same public lengths, so both release the same values for the same rows and key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import pyarrow as pa

from dpsql import _validate
from dpsql.addresses import address_ranks
from dpsql.errors import InvalidParameter
from dpsql.methods import machine_for
from dpsql.noise import Keystream
from dpsql.streams.holdout import DEFAULT_HOLDOUT, ThresholdedStream, pooled_by_key, pooled_counts


def fleet_threshold(method: str, data: np.ndarray, lengths: np.ndarray, addresses: pa.Array, keystream: Keystream,
                    params: dict, order_values=None) -> tuple[list[dict], np.ndarray]:
    """The fleet's threshold from its pooled hold-out (its earliest rows by ``order_values``, each
    row's order key, ties by partition address, or without them the first rows of every partition
    by row number then address; ``m`` rows in all: :mod:`dpsql.streams.holdout`), chosen
    once by the method's rule from the fleet's draws (the unpartitioned address, which no
    partition has) at ``(1 - holdout_share) * epsilon`` (a row is in the pool once, so the pool is
    one mechanism); then the parameters of each partition's machine (the threshold, and how many
    of its first rows were pooled: released at ``holdout_share * epsilon``, the rest at
    ``epsilon``) as a list of distinct parameter sets and each partition's entry in it.

    Privacy contract: draws only the threshold's noise; the caller charges the release first."""
    fleet = fleet_machine(method, params, int(lengths.sum()), keystream)
    m = fleet_holdout(params)
    rank = address_ranks(addresses)
    if isinstance(order_values, list):  # a front end's chunks
        order_values = pa.chunked_array(order_values)
    if order_values is None:  # the first rows of every partition, by row number
        counts = pooled_counts(np.zeros(len(lengths), np.int64), lengths, rank, m)
    else:  # the fleet's earliest rows
        counts = pooled_by_key(order_values, np.repeat(np.arange(len(lengths)), lengths), rank, m, len(lengths))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pool = data[np.repeat(starts, counts) + (np.arange(m) - np.repeat(np.cumsum(counts) - counts, counts))]
    return pooled_params(fleet_params(method, params, fleet, pool, int(lengths.max())), counts)


def pooled_params(shared: dict, pooled_rows) -> tuple[list[dict], np.ndarray]:
    """The parameters of each partition of a fleet whose threshold is in ``shared``: the distinct
    parameter sets (``shared`` and a partition's pooled rows, ``pooled_rows[k]`` for partition
    ``k``) and each partition's entry in them. Public: draws nothing."""
    distinct, which = np.unique(np.asarray(pooled_rows, np.int64), return_inverse=True)
    return [{**shared, "pooled_rows": int(c)} for c in distinct.tolist()], which.reshape(-1)


def fleet_holdout(params: Mapping, total: int | None = None) -> int:
    """The rows of a fleet's pooled hold-out (``m``); refuses a pool not shorter than the fleet's
    ``total`` rows. Public: from the parameters alone."""
    m = DEFAULT_HOLDOUT if params.get("m") is None else _validate.integer(params["m"], "m", minimum=1)
    if total is not None and m >= total:
        raise InvalidParameter(f"m (the fleet's pooled hold-out) must be < the number of values ({total}), got m={m}; "
                               "pass a smaller m, or a threshold released before (threshold=)")
    return m


def fleet_machine(method: str, params: dict, total: int, keystream: Keystream) -> ThresholdedStream:
    """The machine choosing a fleet's threshold (over the fleet's ``total`` rows, drawing from the
    fleet's address; ``method`` is one of POOLED_METHODS); refuses a pool of ``m`` rows not
    shorter than them. Draws nothing until :func:`fleet_params` chooses with it."""
    m = fleet_holdout(params, total)
    return cast(ThresholdedStream, machine_for(method, total, keystream.partition(b""), {**params, "m": m}))


def fleet_params(method: str, params: dict, fleet: ThresholdedStream, pool: np.ndarray | None,
                 longest: int) -> dict:
    """What every partition's machine of a fleet takes: the parameters, the fleet's threshold (chosen
    by ``fleet`` from the ``pool``'s values for ranges in the fleet's ``longest`` partition: a
    threshold for what the release is for serves no longer range; with no pool, the public bound,
    for validation), PAK's delta (the pooled threshold's, paid here) and the pool's ``m`` (do
    pooled rows wait within a max_delay?).

    Privacy contract: with a pool, draws the threshold's Noisy Max (or PAK's quantile) from the
    fleet's address at ``(1 - holdout_share) * epsilon``: call it only after the release is charged."""
    theta = float(params["upper"]) if pool is None else fleet.pooled_threshold(pool, longest)
    shared = {**params, "m": fleet_holdout(params), "threshold": theta}
    if method == "pak":
        shared["delta"] = fleet.cost[1]
    return shared
