"""The paper algorithms as online state machines, registered by method name.

Each module defines a :class:`dpsql.release.StreamMachine`; this package registers
their factories with :func:`dpsql.api.register_method`, and :func:`run` drives one over
a whole array with an explicit noise source, without any ledger (used by tests and
benchmarks).
"""

from __future__ import annotations

from dpsql import _validate
from dpsql.api import machine_for, register_method
from dpsql.ldp.du import MACHINES as DU_MACHINES
from dpsql.ldp.topl import PmDirectStream, ToplStream
from dpsql.noise import NoiseSource
from dpsql.release import Release, chunks_of, release_from
from dpsql.streams.binary_tree import BinaryTreeStream
from dpsql.streams.laplace import LaplaceStream
from dpsql.streams.pak import PakStream
from dpsql.streams.pegasus import CountLaplaceStream, PegasusStream
from dpsql.streams.threshold import ThresholdRelease
from dpsql.streams.tops import HierarchyStream, ToPS

for _name, _factory in {
    "laplace": LaplaceStream,
    "binary_tree": BinaryTreeStream,
    "pak": PakStream,
    "hierarchy": HierarchyStream,
    "tops": ToPS,
    "threshold": ThresholdRelease,
    "pegasus": PegasusStream,
    "count_laplace": CountLaplaceStream,
    "topl": ToplStream,
    "pm_direct": PmDirectStream,
    **DU_MACHINES,
}.items():
    register_method(_name, _factory)


def run(method: str, values, *, noise: NoiseSource, chunk: int = 1 << 20, **params) -> Release:
    """Pure release: ``values`` through ``method`` with ``noise``; charges nothing."""
    data = _validate.values(values)
    machine = machine_for(method, len(data), noise, params)
    return release_from(machine, chunks_of(data, chunk), len(data), private=noise.private)
