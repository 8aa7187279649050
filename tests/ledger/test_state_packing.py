"""A stream's open state as the ledger stores it (:mod:`dpsql._state`): bodies longer than one
frame (4 MiB) are compressed a frame at a time on two threads, and come back bit for bit."""

from __future__ import annotations

import numpy as np

from dpsql._state import pack, unpack


def test_a_state_of_many_frames_round_trips_bit_for_bit():
    rng = np.random.default_rng(0)
    state = {"noise": rng.standard_normal(1_500_000),  # 12 MB: incompressible, stored raw
             "handles": np.arange(3_000_000, dtype=np.int64),  # 24 MB: compressible
             "bounds": np.array([-0.0, np.inf, 5e-324]), "params": {"upper": 10.0, "grid": [0, 3600]}}
    packed = pack(state)
    assert len(packed) < 12_000_000 + 24_000_000  # the compressible frames were compressed
    back = unpack(packed)
    for name in ("noise", "handles", "bounds"):
        assert back[name].dtype == state[name].dtype
        assert back[name].tobytes() == state[name].tobytes()
    assert back["params"] == state["params"]
    assert unpack(pack({"small": np.arange(3)}))["small"].tolist() == [0, 1, 2]
