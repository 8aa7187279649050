"""Row handles: ledger-wide numbers for released rows, resolved through the ledger.

Every charged release owns a block of consecutive handles in its ledger, one per released
value in output order (a partition's rows are consecutive), recorded with its description
(:mod:`dpsql.records`). A handle alone therefore finds the release, the partition and the
row within it, in any process that opens the same ledger: a table of released rows saved
anywhere keeps its error bars. Handles of another ledger are refused, not misread (each
ledger's handles start at a random multiple of 2**32).

:class:`HandleResolver` is what front ends use (DuckDB's ``dp_range_variance``,
``dp_range_margin`` and ``dp_release_id``; Polars' window intervals): it caches what it read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dpsql import _state
from dpsql.error_models import ErrorModel
from dpsql.errors import InvalidParameter, UnknownRelease
from dpsql.records import ReleaseRecord

#: Release records a resolver keeps in memory (more are read back from the ledger as needed).
CACHED_RECORDS = 256
#: Recent releases of this process whose budget a handle finds without being told (bounded).
_RECENT: OrderedDict[int, tuple[int, object]] = OrderedDict()
_RECENT_LIMIT = 256
_recent_lock = threading.Lock()


def remember(first_handle: int, handles: int, budget) -> None:
    """Note that handles ``first_handle ..`` (``handles`` of them) were charged to ``budget``,
    so that :func:`budget_of` finds its ledger without being told (a convenience only: any
    budget of the same ledger resolves them)."""
    with _recent_lock:
        _RECENT[first_handle] = (first_handle + handles, budget)
        while len(_RECENT) > _RECENT_LIMIT:
            _RECENT.popitem(last=False)


def budget_of(handle: int, default=None):
    """The budget a recent release of this process with row ``handle`` was charged to, else ``default``."""
    with _recent_lock:
        for first, (stop, budget) in reversed(_RECENT.items()):
            if first <= handle < stop:
                return budget
    return default


@dataclass
class _Held:
    """What error bars need of one release (or one partition of a continual stream)."""

    release_id: str
    first: int  # its first handle
    count: int  # its handles
    starts: np.ndarray  # first handle of each partition
    stops: np.ndarray  # handle after each partition's released rows
    errors: dict[int, ErrorModel]
    record: ReleaseRecord | None = None

    def error(self, partition: int) -> ErrorModel:
        if partition not in self.errors:
            self.errors[partition] = self.record.error(partition)
        return self.errors[partition]


class HandleResolver:
    """Maps row handles to error models and rows through ``budget``'s ledger."""

    def __init__(self, budget):
        self.budget = budget
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._lock = threading.Lock()

    def _record_at(self, handle: int) -> _Held:
        self._asked = handle
        row = self.budget.ledger.release_at(handle)
        if row is None:
            raise UnknownRelease(f"dp_row {handle} is not a row handle of any release recorded in ledger "
                                 f"{self.budget.location}: use the dp_row column of a release charged to this ledger "
                                 "(a table saved from another ledger needs that ledger's budget)")
        description = _state.unpack(row.description)
        if "stream" in description:  # a partition of a continual stream: its rows so far
            return self._stream_partition(row, description)
        record = ReleaseRecord(row.release_id, row.scope, row.first_handle, row.handles, description)
        offsets = record.offsets
        return _Held(record.release_id, record.first_handle, record.handles, record.first_handle + offsets[:-1],
                     record.first_handle + offsets[1:], {}, record)

    def _stream_partition(self, row, description: dict) -> _Held:
        """The continual stream's partition owning handles in ``row``'s block: one partition
        (``ordinal``, stored by earlier versions) or a block of partitions (``first_ordinal``,
        :data:`~dpsql.ledger.streams.PARTITION_HANDLES` handles each); its rows released so far."""
        from dpsql.continual import Stream
        from dpsql.ledger.streams import PARTITION_HANDLES, StreamStore

        store = StreamStore(self.budget.ledger)
        stream = Stream(self.budget, store.by_release(description["stream"]))
        ordinal = description.get("ordinal", description.get("first_ordinal"))
        first = row.first_handle
        if "first_ordinal" in description:  # the caller's handle picks the partition within the block
            ordinal += (self._asked - row.first_handle) // PARTITION_HANDLES
            first = row.first_handle + (self._asked - row.first_handle) // PARTITION_HANDLES * PARTITION_HANDLES
        with self.budget.ledger.reading("read a stream partition") as conn:
            rows, directory = stream._latest(conn)
            release = stream.partition_release(conn, ordinal, directory, rows)
        return _Held(stream.release_id, first, PARTITION_HANDLES, np.array([first]),
                     np.array([first + len(release)]), {0: release.error})

    def _owners(self, handles: np.ndarray) -> tuple[list[_Held], np.ndarray]:
        """The held releases covering ``handles`` and, per handle, which of them owns it."""
        owners = np.full(len(handles), -1)
        found: list[_Held] = []
        with self._lock:
            cached = list(self._held.values())
        for held in cached:
            inside = (owners < 0) & (handles >= held.first) & (handles < held.first + held.count)
            if inside.any():
                owners[inside] = len(found)
                found.append(held)
        while (owners < 0).any():
            held = self._record_at(int(handles[owners < 0][0]))
            inside = (handles >= held.first) & (handles < held.first + held.count)
            owners[inside] = len(found)
            found.append(held)
            if held.record is not None:  # a stream partition grows: read afresh each time
                with self._lock:
                    self._held[held.first] = held
                    while len(self._held) > CACHED_RECORDS:
                        self._held.popitem(last=False)
        return found, owners

    def release_ids(self, handles: np.ndarray) -> np.ndarray:
        found, owners = self._owners(np.asarray(handles, dtype=np.int64))
        return np.array([h.release_id for h in found], dtype=object)[owners] if len(owners) else np.empty(
            0, dtype=object)

    def ranges(self, starts: np.ndarray, stops: np.ndarray) -> Iterator[tuple[np.ndarray, ErrorModel, np.ndarray,
                                                                               np.ndarray]]:
        """Group the handle ranges ``[start, stop)`` by partition: yields ``(positions, model,
        i, j)`` with ``i, j`` the rows within the partition. Every range must be non-empty and
        lie within one partition of one release."""
        if not len(starts):
            return
        backwards = starts >= stops
        if backwards.any():
            k = int(np.flatnonzero(backwards)[0])
            raise InvalidParameter(f"a row range needs start_row < stop_row (dp_row handles, stop_row "
                                   f"excluded), got start_row={starts[k]}, stop_row={stops[k]}")
        found, owners = self._owners(starts)
        for r, held in enumerate(found):
            mine = np.flatnonzero(owners == r)
            part = np.searchsorted(held.starts, starts[mine], side="right") - 1
            beyond = stops[mine] > held.stops[part]
            if beyond.any():
                k = mine[int(np.flatnonzero(beyond)[0])]
                if stops[k] > held.first + held.count:
                    what = "two releases"
                elif held.record is None:
                    what = "rows not released yet"
                else:
                    what = f"two partitions of release {held.release_id}"
                raise InvalidParameter(f"rows start_row={starts[k]} .. stop_row={stops[k]} span {what}: a range must "
                                       "stay within one partition's stream (PARTITION BY the partition key)")
            for p in np.unique(part).tolist():
                positions = mine[part == p]
                yield (positions, held.error(p), starts[positions] - held.starts[p],
                       stops[positions] - held.starts[p])
