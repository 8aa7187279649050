"""The partitions of a partitioned release, made when looked at.

A fleet release has up to millions of partitions, and most of them share one description (the
same method, parameters and error model: a meter's release differs from another's only by its
values). A partition's :class:`~dpsql.release.Release`, its description and its key are
therefore made the first time they are looked at, and partitions of one *kind* (equal
descriptions, :meth:`~dpsql.release.StreamMachine.partition_kinds`) share one description,
made once: releasing a million partitions makes a handful of Python objects, not millions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

import numpy as np
import pyarrow as pa

from dpsql.error_models import ErrorModel
from dpsql.release import Release, StreamMachine, described

Item = TypeVar("Item")


class _Lazy(Sequence[Item]):
    """A sequence whose items are made when first looked at (:meth:`_item`)."""

    @overload
    def __getitem__(self, k: int) -> Item: ...

    @overload
    def __getitem__(self, k: slice) -> tuple[Item, ...]: ...

    def __getitem__(self, k: int | slice) -> Item | tuple[Item, ...]:
        if isinstance(k, slice):
            return tuple(self._item(i) for i in range(*k.indices(len(self))))
        if not -len(self) <= k < len(self):
            raise IndexError(f"partition {k} of {len(self)}")
        return self._item(k % len(self))

    def _item(self, k: int) -> Item:
        raise NotImplementedError


#: How a kind of partitions is described: a description made already, or ``(machine, j)``
#: (``describe_partition(j)`` of a driven batched machine; ``j`` None: the machine's ``describe()``).
Maker = dict | tuple[StreamMachine, int | None]


class Descriptions(_Lazy[dict]):
    """What :meth:`StreamMachine.describe` says of each partition, with the machine's cost,
    neighbour relation and notion: a :class:`Release`'s arguments but its values, ``private``
    and ``release_id``.

    ``kinds[k]`` is partition ``k``'s kind and ``makers[kind]`` how that kind is described (see
    :data:`Maker`): a kind's description is made the first time one of its partitions is looked
    at, and kept. A batched machine is kept only after it closed, when it holds no secret state
    (:attr:`StreamMachine.batchable`); a machine of one partition is described at once and not
    kept.
    """

    def __init__(self, kinds: np.ndarray, makers: Sequence[Maker]):
        self._kinds = np.asarray(kinds, dtype=np.int64)
        self._makers: list = [described(m[0], m[0].describe()) if isinstance(m, tuple) and m[1] is None else m
                              for m in makers]

    def __len__(self) -> int:
        return len(self._kinds)

    @property
    def kinds(self) -> np.ndarray:
        """Each partition's kind (partitions of one kind have equal descriptions)."""
        return self._kinds

    def kind(self, kind: int) -> dict:
        """The description of the partitions of ``kind``."""
        made = self._makers[kind]
        if not isinstance(made, dict):  # two threads at once would both describe, equally
            machine, j = made
            made = self._makers[kind] = described(machine, machine.describe_partition(j))
        return made

    def _item(self, k: int) -> dict:
        return self.kind(int(self._kinds[k]))

    def distinct(self) -> tuple[list[dict], np.ndarray]:
        """Every kind's description, and each partition's kind."""
        return [self.kind(kind) for kind in range(len(self._makers))], self._kinds

    def described_kinds(self) -> list[int]:
        """The kinds described so far."""
        return [kind for kind, made in enumerate(self._makers) if isinstance(made, dict)]


class ErrorModels(_Lazy[ErrorModel]):
    """The :class:`ErrorModel` of each partition (from its :class:`Descriptions`), holding
    nothing else of the release: neither its values nor, once every kind is described, its
    other descriptions (local-DP reports can be larger than the values)."""

    def __init__(self, descriptions: Descriptions):
        self._kinds = descriptions.kinds
        self._errors: dict[int, ErrorModel] = {k: descriptions.kind(k)["error"]
                                               for k in descriptions.described_kinds()}
        self._descriptions: Descriptions | None = descriptions
        self._forget_when_complete()

    def _forget_when_complete(self) -> None:
        if self._descriptions is not None and len(self._errors) == len(self._descriptions._makers):
            self._descriptions = None

    def __len__(self) -> int:
        return len(self._kinds)

    def _item(self, k: int) -> ErrorModel:
        kind = int(self._kinds[k])
        error = self._errors.get(kind)
        if error is None:
            assert self._descriptions is not None  # kept exactly while some kind is still to describe
            error = self._errors[kind] = self._descriptions.kind(kind)["error"]
            self._forget_when_complete()
        return error


class Parts(_Lazy[Release]):
    """The per-partition :class:`Release` objects of a partitioned release, each made the
    first time it is looked at (see :class:`Descriptions`): partition ``k``'s released values
    are ``values[outputs[k]:outputs[k + 1]]`` and, with ``release_id``, every part carries that
    ledger id and its first row handle (``first_handle`` plus ``outputs[k]``). Pickled as a
    tuple of its releases (the machines it describes from hold a noise source)."""

    def __init__(self, descriptions: Descriptions, values: np.ndarray, outputs: np.ndarray, *, private: bool,
                 release_id: str | None = None, first_handle: int | None = None):
        self.descriptions = descriptions
        self._values = values
        self._outputs = np.asarray(outputs, dtype=np.int64)
        self._private = private
        self._release_id = release_id
        self._first_handle = first_handle
        self._made: dict[int, Release] = {}

    def with_id(self, release_id: str, first_handle: int) -> Parts:
        """The same partitions, each given the ledger id ``release_id`` and its first row handle."""
        return Parts(self.descriptions, self._values, self._outputs, private=self._private, release_id=release_id,
                     first_handle=first_handle)

    @property
    def errors(self) -> ErrorModels:
        """Each partition's error model, without holding the released values."""
        return ErrorModels(self.descriptions)

    def __len__(self) -> int:
        return len(self._outputs) - 1

    def _item(self, k: int) -> Release:
        release = self._made.get(k)
        if release is None:
            a, b = int(self._outputs[k]), int(self._outputs[k + 1])
            release = Release(values=self._values[a:b], private=self._private, release_id=self._release_id,
                              first_handle=None if self._first_handle is None else self._first_handle + a,
                              **self.descriptions[k])
            self._made[k] = release
        return release

    def __reduce__(self):
        return tuple, (tuple(self),)

    def __repr__(self) -> str:
        return f"Parts({len(self)} partitions)"


class Keys(_Lazy):
    """Partition keys held as Arrow columns (one row per partition, one column per partition
    column), each made a Python value (a tuple for several columns) when looked at. Equal to any
    sequence of the same keys."""

    def __init__(self, columns: Sequence[pa.Array]):
        self.columns = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns]

    def __len__(self) -> int:
        return len(self.columns[0])

    def _item(self, k: int):
        values = tuple(c[k].as_py() for c in self.columns)
        return values[0] if len(values) == 1 else values

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # compared by content

    def __repr__(self) -> str:
        shown = ", ".join(repr(self[k]) for k in range(min(len(self), 5)))
        return f"Keys([{shown}{', ...' if len(self) > 5 else ''}], {len(self)} partitions)"
