"""Release records: the public description of a release that the ledger keeps with its charge
(method, parameters, cost, partitions and every partition's error model; never data, never
noise), and releases rebuilt from it with their values, in another process or a year later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsql import _state
from dpsql.error_models import ErrorModel
from dpsql.errors import InvalidParameter
from dpsql.release import PartitionedRelease, Release


def describe(release: Release | PartitionedRelease) -> dict:
    """The public description of ``release`` (see the module docstring)."""
    if isinstance(release, PartitionedRelease):
        parts: Sequence[Release] = release.parts
        offsets, keys = release.offsets, None if release.keys is None else [str(key) for key in release.keys]
    else:
        parts, offsets, keys = [release], np.array([0, len(release.values)]), None
    first = parts[0]
    return {
        "method": release.method, "epsilon": release.epsilon, "delta": release.delta, "private": release.private,
        "notion": str(getattr(first.notion, "value", first.notion)),
        "neighbour": str(getattr(first.neighbour, "value", first.neighbour)),
        "offsets": np.asarray(offsets, dtype=np.int64), "keys": keys,
        "partitioned": isinstance(release, PartitionedRelease),
        "parts": [{"params": dict(p.params), "threshold": p.threshold,
                   "components": {k: list(v) for k, v in p.components.items()}, "error": p.error.to_state()}
                  for p in parts],
    }


@dataclass(frozen=True)
class ReleaseRecord:
    """What the ledger recorded of a release: :attr:`description` (see :func:`describe`), its id,
    its scope and its block of row handles (``first_handle .. first_handle + handles - 1``)."""

    release_id: str
    scope: str
    first_handle: int
    handles: int
    description: dict

    @classmethod
    def from_row(cls, row) -> ReleaseRecord:
        return cls(row.release_id, row.scope, row.first_handle, row.handles, _state.unpack(row.description))

    @property
    def method(self) -> str:
        return self.description["method"]

    @property
    def epsilon(self) -> float:
        return self.description["epsilon"]

    @property
    def delta(self) -> float:
        return self.description["delta"]

    @property
    def params(self) -> dict:
        return self.description["parts"][0]["params"]

    @property
    def offsets(self) -> np.ndarray:
        return np.asarray(self.description["offsets"], dtype=np.int64)

    @property
    def partitions(self) -> int:
        return len(self.description["parts"])

    def error(self, partition: int = 0) -> ErrorModel:
        """The error model of partition ``partition`` (0 for an unpartitioned release)."""
        return ErrorModel.from_state(self.description["parts"][partition]["error"])

    def range_variance(self, i, j, *, partition: int = 0):
        """Noise variance of the sum of rows ``i .. j - 1`` of ``partition`` (its own row numbers)."""
        i, j = np.atleast_1d(np.asarray(i, dtype=np.int64)), np.atleast_1d(np.asarray(j, dtype=np.int64))
        rows = int(self.offsets[partition + 1] - self.offsets[partition])
        if np.any(i < 0) or np.any(j > rows) or np.any(i > j):
            raise InvalidParameter(f"range [i, j) must satisfy 0 <= i <= j <= {rows}")
        out = self.error(partition).range_variance(i, j)
        return float(out[0]) if out.size == 1 else out

    def with_values(self, values: np.ndarray) -> Release | PartitionedRelease:
        """The release this record describes, with its released ``values``."""
        d = self.description
        offsets = self.offsets
        if len(values) != offsets[-1]:
            raise InvalidParameter(f"release {self.release_id} has {offsets[-1]} values; got {len(values)}")
        parts = [Release(values=values[a:b], method=d["method"], params=p["params"], epsilon=d["epsilon"],
                         delta=d["delta"], error=ErrorModel.from_state(p["error"]), private=d["private"],
                         neighbour=d["neighbour"], notion=d["notion"], threshold=p["threshold"],
                         components={k: tuple(v) for k, v in p["components"].items()}, release_id=self.release_id,
                         first_handle=self.first_handle + int(a))
                 for p, a, b in zip(d["parts"], offsets[:-1].tolist(), offsets[1:].tolist())]
        if not d["partitioned"]:
            return parts[0]
        return PartitionedRelease(values=values, offsets=offsets, parts=parts, method=d["method"], epsilon=d["epsilon"],
                                  delta=d["delta"], private=d["private"], release_id=self.release_id, keys=d["keys"],
                                  first_handle=self.first_handle)

    def __repr__(self) -> str:
        return (f"ReleaseRecord({self.method}, id={self.release_id}, partitions={self.partitions}, "
                f"epsilon={self.epsilon:g}, delta={self.delta:g})")
