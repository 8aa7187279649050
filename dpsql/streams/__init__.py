"""The paper algorithms as online state machines, registered by method name.

Each module defines a :class:`dpsql.release.StreamMachine` and registers its factory
with :func:`dpsql.api.register_method`; :func:`run` drives one over a whole array
with an explicit noise source, without any ledger (used by tests and benchmarks).
"""

from __future__ import annotations

from dpsql import _validate
from dpsql.api import machine_for, register_method
from dpsql.noise import NoiseSource
from dpsql.release import Release, chunks_of, run_machine
from dpsql.streams.laplace import LaplaceStream

register_method("laplace", LaplaceStream)
from dpsql.streams.binary_tree import BinaryTreeStream  # noqa: E402
from dpsql.streams.pak import PakStream  # noqa: E402

register_method("binary_tree", BinaryTreeStream)
register_method("pak", PakStream)
from dpsql.ldp.topl import PmDirectStream, ToplStream  # noqa: E402

register_method("topl", ToplStream)
register_method("pm_direct", PmDirectStream)
from dpsql.ldp.du import MACHINES as _DU_MACHINES  # noqa: E402

for _name, _factory in _DU_MACHINES.items():
    register_method(_name, _factory)
from dpsql.streams.pegasus import CountLaplaceStream, PegasusStream  # noqa: E402

register_method("pegasus", PegasusStream)
register_method("count_laplace", CountLaplaceStream)
from dpsql.streams.threshold import ThresholdRelease  # noqa: E402
from dpsql.streams.tops import HierarchyStream, ToPS  # noqa: E402

register_method("hierarchy", HierarchyStream)
register_method("tops", ToPS)
register_method("threshold", ThresholdRelease)

def run(method: str, values, *, noise: NoiseSource, chunk: int = 1 << 20, **params) -> Release:
    """Pure release: ``values`` through ``method`` with ``noise``; charges nothing."""
    data = _validate.values(values)
    machine = machine_for(method, len(data), noise, params)
    out = run_machine(machine, chunks_of(data, chunk), len(data))
    return Release(values=out, epsilon=machine.cost[0], delta=machine.cost[1], private=noise.private,
                   neighbour=machine.neighbour, notion=machine.notion, **machine.describe())
