"""Release records: the public description of a release that the ledger keeps with its charge
(method, parameters, cost, partitions and every partition's error model; never data, never
noise), and releases rebuilt from it with their values, in another process or a year later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dpsql import _state
from dpsql._chunks import table_bytes, table_of
from dpsql.error_models import ErrorModel
from dpsql.errors import InvalidParameter
from dpsql.parts import Descriptions, Keys, Parts
from dpsql.release import PartitionedRelease, Release


def describe(release: Release | PartitionedRelease) -> dict:
    """The public description of ``release`` (see the module docstring): one description per
    kind of partition (partitions of one kind are described alike, :mod:`dpsql.parts`) and each
    partition's kind, its length and its key."""
    if isinstance(release, PartitionedRelease):
        if isinstance(release.parts, Parts):
            kinds_described, kinds = release.parts.descriptions.distinct()
            parts = [_part(d["params"], d.get("threshold"), d.get("components", {}), d["error"])
                     for d in kinds_described]
        else:
            parts = [_part(p.params, p.threshold, p.components, p.error) for p in release.parts]
            kinds = np.arange(len(parts))
        lengths, keys = np.diff(release.offsets), release.keys
        first = release.parts[0]
    else:
        first, keys = release, None
        parts = [_part(release.params, release.threshold, release.components, release.error)]
        kinds, lengths = np.zeros(1, dtype=np.int64), np.array([len(release.values)])
    description = {
        "method": release.method, "epsilon": release.epsilon, "delta": release.delta, "private": release.private,
        "notion": str(getattr(first.notion, "value", first.notion)),
        "neighbour": str(getattr(first.neighbour, "value", first.neighbour)),
        "lengths": np.asarray(lengths, dtype=np.int64), "partitioned": isinstance(release, PartitionedRelease),
        "parts": parts, "part_of": np.asarray(kinds, dtype=np.int64), "keys": None,
    }
    if isinstance(keys, Keys):  # a front end's key columns, stored compactly (a fleet's keys are many)
        description["key_table"] = table_bytes(pa.table({f"k{i}": c for i, c in enumerate(keys.columns)}))
    elif keys is not None:
        description["keys"] = [str(key) for key in keys]
    return description


def _part(params, threshold, components, error: ErrorModel) -> dict:
    return {"params": dict(params), "threshold": threshold, "components": {k: list(v) for k, v in components.items()},
            "error": error.to_state()}


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
        d = self.description
        if "lengths" in d:
            return np.concatenate([[0], np.cumsum(np.asarray(d["lengths"], dtype=np.int64))])
        return np.asarray(d["offsets"], dtype=np.int64)  # records written before kinds

    @property
    def part_of(self) -> np.ndarray:
        """Each partition's entry of ``description["parts"]`` (records written before kinds: one each)."""
        d = self.description
        return np.asarray(d["part_of"], dtype=np.int64) if "part_of" in d else np.arange(len(d["parts"]))

    @property
    def partitions(self) -> int:
        return len(self.part_of)

    @property
    def keys(self) -> Keys | list | None:
        d = self.description
        if "key_table" in d:
            return Keys(table_of(d["key_table"]).columns)
        return d["keys"]

    def error(self, partition: int = 0) -> ErrorModel:
        """The error model of partition ``partition`` (0 for an unpartitioned release)."""
        return ErrorModel.from_state(self.description["parts"][int(self.part_of[partition])]["error"])

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
        common = dict(method=d["method"], epsilon=d["epsilon"], delta=d["delta"], neighbour=d["neighbour"],
                      notion=d["notion"])
        makers = [{**common, "params": p["params"], "threshold": p["threshold"], "error": ErrorModel.from_state(
            p["error"]), "components": {k: tuple(v) for k, v in p["components"].items()}} for p in d["parts"]]
        parts = Parts(Descriptions(self.part_of, makers), values, offsets, private=d["private"],
                      release_id=self.release_id, first_handle=self.first_handle)
        if not d["partitioned"]:
            return parts[0]
        return PartitionedRelease(values=values, offsets=offsets, parts=parts, method=d["method"], epsilon=d["epsilon"],
                                  delta=d["delta"], private=d["private"], release_id=self.release_id, keys=self.keys,
                                  first_handle=self.first_handle)

    def __repr__(self) -> str:
        return (f"ReleaseRecord({self.method}, id={self.release_id}, partitions={self.partitions}, "
                f"epsilon={self.epsilon:g}, delta={self.delta:g})")
