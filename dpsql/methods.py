"""The method registry: every release algorithm by name, above the machines and below
:mod:`dpsql.publishing` and the front ends.

A method is a :class:`~dpsql.release.StreamMachine` factory ``(n, *, noise, **params)``;
:func:`machine_for` validates the parameters a caller passes (unknown or missing ones
are refused, naming them) and builds the machine, drawing nothing. :func:`run` releases
an array without any ledger (tests and benchmarks).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from dpsql import _validate
from dpsql.accounting import Charge, Neighbour, Notion
from dpsql.errors import InvalidParameter
from dpsql.noise import Draws, Keystream
from dpsql.release import Release, StreamMachine, chunks_of, release_from
from dpsql.streams.binary_tree import BinaryTreeStream
from dpsql.streams.count_laplace import CountLaplaceStream, CountSmoothedStream
from dpsql.streams.du import MACHINES as DU_MACHINES
from dpsql.streams.hierarchy import HierarchyStream
from dpsql.streams.laplace import LaplaceStream
from dpsql.streams.pak import PakStream
from dpsql.streams.pegasus import PegasusStream
from dpsql.streams.threshold import ThresholdRelease
from dpsql.streams.topl import PmDirectStream, ToplStream
from dpsql.streams.tops import ToPS

#: name -> machine factory ``(n, *, noise, **params) -> StreamMachine``.
METHODS: dict[str, Callable[..., StreamMachine]] = {
    "laplace": LaplaceStream,
    "binary_tree": BinaryTreeStream,
    "pak": PakStream,
    "hierarchy": HierarchyStream,
    "tops": ToPS,
    "threshold": ThresholdRelease,
    "pegasus": PegasusStream,
    "count_laplace": CountLaplaceStream,
    "count_smoothed": CountSmoothedStream,
    "topl": ToplStream,
    "pm_direct": PmDirectStream,
    **DU_MACHINES,
}

#: Methods releasing counts of events per time bucket (the input is an event table's time column).
COUNT_METHODS = ("pegasus", "count_laplace", "count_smoothed")
#: Methods whose partitioned release chooses one threshold for the fleet by default (``threshold_by``).
POOLED_METHODS = ("tops", "pak")
#: Methods whose blocks and levels follow the calendar when a partition's rows lie on a time grid.
GRID_METHODS = ("hierarchy", "tops")


def pools_fleet(method: str, params: dict) -> bool:
    """Does a partitioned release of ``method`` with ``params`` choose one threshold for the
    fleet (ToPS or PAK, ``threshold_by="fleet"``, the default, and no threshold given)?"""
    return method in POOLED_METHODS and params.get("threshold") is None and \
        params.get("threshold_by", "fleet") == "fleet"


@functools.cache
def _parameters(factory: Callable[..., StreamMachine]):
    # Cached: a partitioned release builds one machine per partition (thousands).
    return inspect.signature(factory).parameters


def parameter_names(method: str) -> list[str]:
    """The parameters ``method`` accepts (besides ``n`` and ``noise``), sorted."""
    check_method(method)
    return sorted(set(_parameters(METHODS[method])) - {"n", "noise"})


def named_parameters(method: str) -> list[str]:
    """The parameters ``method`` accepts by name (besides ``n`` and ``noise``), in its
    signature's order."""
    check_method(method)
    return [p.name for p in _parameters(METHODS[method]).values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("n", "noise")]


def check_method(method: str, *, per_row: bool = False, online: bool = False) -> None:
    """Refuse an unknown method (:class:`InvalidParameter`) before anything runs; with
    ``per_row``, also a method that does not release one value per row (a threshold), for
    front ends that return one private value per input row; with ``online``, a method that
    has no online form (for continual streams)."""
    if method not in METHODS:
        raise InvalidParameter(f"unknown method {method!r}; expected one of {', '.join(map(repr, sorted(METHODS)))}")
    factory = METHODS[method]
    outputs = getattr(factory, "n_outputs", None)
    if online and outputs is not None:
        raise InvalidParameter(f"method {method!r} has no online form: it releases {outputs} value(s) from all of "
                               "a table's rows at once, so it cannot be a continual stream (release it once with "
                               "dpsql.threshold and pass threshold= to a tops or pak stream)")
    if per_row and outputs is not None:
        raise InvalidParameter(f"method {method!r} releases {outputs} value(s) per stream, not one per row: release "
                               "it with the front end's threshold function (dp_threshold, .dpsql.threshold)")
    if online and getattr(factory, "snapshot", None) is StreamMachine.snapshot:
        raise InvalidParameter(f"method {method!r} has no online form: it needs all of its rows at once, so it "
                               "cannot be a continual stream")


def machine_for(method: str, n: int | None, noise: Draws, params: dict) -> StreamMachine:
    """The validated state machine for ``method`` (``n`` rows, or None for a continual
    stream), drawing from ``noise``; draws nothing yet."""
    check_method(method)
    factory = METHODS[method]
    accepted = _parameters(factory)
    params = dict(params)
    if "delta" in params and "delta" not in accepted:
        _validate.delta(params.pop("delta"), pure=True, method=method)
    unknown = sorted(set(params) - set(accepted) - {"n", "noise"})
    if unknown:
        known = sorted(set(accepted) - {"n", "noise"})
        raise InvalidParameter(f"unknown parameter(s) {', '.join(map(repr, unknown))} for method {method!r}; "
                               f"expected {', '.join(map(repr, known))}")
    missing = [name for name, p in accepted.items()
               if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in params and name != "noise"]
    if missing:
        raise InvalidParameter(f"missing required parameter(s) {', '.join(map(repr, missing))} for method {method!r}")
    return factory(n, noise=noise, **params)


def run(method: str, values, *, noise: Keystream, chunk: int = 1 << 20, **params) -> Release:
    """Pure release of one unpartitioned stream: ``values`` through ``method`` with the
    keystream ``noise``; charges nothing (tests and benchmarks)."""
    data = _validate.values(values)
    machine = machine_for(method, len(data), noise.partition(), params)
    return release_from(machine, chunks_of(data, chunk), len(data), private=noise.private)


def unsized_charge(method: str, params: dict, keystream: Keystream, *, public_params: dict, **fields) -> Charge:
    """The charge of a release of ``method`` whose length is unknown when it is charged (a
    continual stream, a partitioned job released on other machines): the method's machine built
    without a length validates ``params`` and gives the cost; it draws nothing. ``public_params``:
    ``params`` as the ledger records them; ``fields``: the rest of the
    :class:`~dpsql.accounting.Charge` (note, kind, ...)."""
    machine = machine_for(method, None, keystream.partition(b""), params)
    return Charge(method=method, epsilon=machine.cost[0], delta=machine.cost[1],
                  neighbour=Neighbour(machine.neighbour), notion=Notion(machine.notion), w=machine.w, rows=0,
                  partitions=0, params=public_params, private=keystream.private, **fields)
