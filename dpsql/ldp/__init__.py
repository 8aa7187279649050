"""Local-DP streams: each value is perturbed on its owner's device; the server only post-processes.

Releases here are recorded under their own privacy notions (``"ldp"``: event-level LDP,
``"w-event-ldp"``: w-event LDP with its window) and are refused by a ledger scope created
for another notion. Primitives live in :mod:`dpsql.mechanisms.ldp`.
"""

from dpsql.ldp.du import DeviceEncoder, app, ba_sw, capp, ipp, pp_s, sampling, sw_direct
from dpsql.ldp.topl import ToplDevice, estimate_holdout, estimate_stream, estimate_threshold, pm_direct, topl

__all__ = ["DeviceEncoder", "ToplDevice", "app", "ba_sw", "capp", "estimate_holdout", "estimate_stream",
           "estimate_threshold", "ipp", "pm_direct", "pp_s", "sampling", "sw_direct", "topl"]
