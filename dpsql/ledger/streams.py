"""Continual streams in the ledger: their registration (with the secret key), their open state
and the rows released so far.

A stream's registration is written in the same transaction as its one charge. An append
reads and rewrites a stream's open state inside one write transaction that locks the stream
(:meth:`StreamStore.appending`): two appends to one stream are serialised, and the state and
the released rows are committed together or not at all.

The open state is columnar (:mod:`dpsql.continual.fleet`): records in ``stream_state`` (its
facts, the directory of its partitions, one record per shard of partitions), written only for
what an append changed. Released rows are one chunk per append, all partitions together
(``stream_rows`` with ordinal -1, numbered by append), so an append costs a bounded number of
statements whatever its partitions, and its own rows, never the history. Streams stored by
earlier versions (a row per partition in ``stream_partitions``, a chunk per append and
partition) are read as they are and converted when next appended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsql import _state
from dpsql.errors import InvalidParameter, UnknownStream
from dpsql.ledger.store import Ledger, Receipt, _now

if TYPE_CHECKING:
    import pyarrow as pa

#: Row handles reserved for each partition of a stream: its released rows are consecutive.
PARTITION_HANDLES = 1 << 32


@dataclass
class StreamRow:
    scope: str
    name: str
    release_id: str
    method: str
    spec: dict
    secret: bytes
    created: str
    version: int
    rows: int
    partitions: int
    #: The partition key types of the first partition, once read or written in this transaction.
    key_types: list[str] | None = None


@dataclass
class PartitionRow:
    address: bytes
    ordinal: int
    key_text: str
    first_handle: int
    rows: int
    watermark: bytes | None
    state: bytes


class StreamStore:
    """The ledger's stream tables (see the module docstring)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def _q(self, conn, sql: str, params=()):
        return self.ledger.execute(conn, sql, params)

    def register(self, conn, receipt: Receipt, *, scope: str, name: str, method: str, spec: dict,
                 secret: bytes) -> None:
        """Insert a stream (inside the transaction of its charge, ``receipt``)."""
        self._q(conn, "INSERT INTO streams (scope, name, release_id, method, spec, secret, created) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (scope, name, receipt.release_id, method, json.dumps(spec, sort_keys=True),
                 self.ledger.backend.blob(secret), _now()))

    def find(self, scope: str, name: str) -> StreamRow | None:
        with self.ledger.reading(f"read stream {name!r}") as conn:
            return self._stream(conn, scope, name, lock=False)

    def get(self, scope: str, name: str) -> StreamRow:
        row = self.find(scope, name)
        if row is None:
            raise UnknownStream(f"no stream named {name!r} in scope {scope!r} of ledger {self.ledger.location}")
        return row

    def all(self, scope: str) -> list[StreamRow]:
        with self.ledger.reading("list the streams") as conn:
            names = [r[0] for r in self._q(conn, "SELECT name FROM streams WHERE scope = ? ORDER BY created",
                                            (scope,)).fetchall()]
            return [self._stream(conn, scope, name, lock=False) for name in names]

    def by_release(self, release_id: str) -> StreamRow:
        """The stream registered with ``release_id``."""
        with self.ledger.reading("read a stream") as conn:
            row = self._q(conn, "SELECT scope, name FROM streams WHERE release_id = ?", (release_id,)).fetchone()
            if row is None:
                raise UnknownStream(f"no stream with release id {release_id} in ledger {self.ledger.location}")
            return self._stream(conn, row[0], row[1], lock=False)

    def _stream(self, conn, scope: str, name: str, *, lock: bool) -> StreamRow | None:
        lock_row = self.ledger.backend.lock_row if lock else ""
        row = self._q(conn, "SELECT scope, name, release_id, method, spec, secret, created, version, rows, partitions "
                            "FROM streams WHERE scope = ? AND name = ?" + lock_row, (scope, name)).fetchone()
        if row is None:
            return None
        return StreamRow(row[0], row[1], row[2], row[3], json.loads(row[4]), bytes(row[5]), row[6], int(row[7]),
                         int(row[8]), int(row[9]))

    def appending(self, scope: str, name: str):
        """A write transaction holding stream ``name``: ``with store.appending(scope, name) as
        (connection, stream row)``. (The ledger's own block, not a generator around it: an
        interrupt between a generator's steps would leave the transaction open.)"""
        def lock(conn) -> tuple[object, StreamRow]:
            stream = self._stream(conn, scope, name, lock=True)
            if stream is None:
                raise UnknownStream(f"no stream named {name!r} in scope {scope!r} of ledger {self.ledger.location}")
            return conn, stream

        return self.ledger.transaction(f"append to stream {name!r}", opened=lock)

    # -- columnar state ----------------------------------------------------------------------

    def state(self, conn, release_id: str, shard: int) -> bytes | None:
        """Record ``shard`` of a stream's state (-1 its facts, -2 its directory), or None."""
        row = self._q(conn, "SELECT data FROM stream_state WHERE release_id = ? AND shard = ?",
                      (release_id, shard)).fetchone()
        return None if row is None else bytes(row[0])

    def save_state(self, conn, release_id: str, shard: int, data: bytes) -> None:
        self._q(conn, "INSERT INTO stream_state (release_id, shard, data) VALUES (?, ?, ?) "
                      "ON CONFLICT (release_id, shard) DO UPDATE SET data = excluded.data",
                (release_id, shard, self.ledger.backend.blob(data)))

    def reserve_handles(self, conn, stream: StreamRow, first_ordinal: int, count: int) -> int:
        """Row handles for ``count`` new partitions (ordinals ``first_ordinal ..``), one block of
        :data:`PARTITION_HANDLES` each, recorded as one block in ``releases``; its first handle."""
        first_handle = self.ledger.allocate_handles(conn, count * PARTITION_HANDLES)
        self._q(conn, "INSERT INTO releases (release_id, scope, first_handle, handles, description) "
                      "VALUES (?, ?, ?, ?, ?)",
                (f"{stream.release_id}/p{first_ordinal}", stream.scope, first_handle, count * PARTITION_HANDLES,
                 self.ledger.backend.blob(_state.pack({"stream": stream.release_id, "first_ordinal": first_ordinal,
                                                       "partitions": count}))))
        return first_handle

    def add_chunk(self, conn, stream: StreamRow, number: int, rows: int, data: bytes | pa.Buffer) -> None:
        """Store the released rows of an append (all partitions: ordinal -1), numbered ``number``
        (``data``: bytes, or an Arrow buffer the driver copies without an intermediate copy)."""
        self._q(conn, "INSERT INTO stream_rows (release_id, ordinal, first_row, rows, data) VALUES (?, -1, ?, ?, ?)",
                (stream.release_id, number, rows, self.ledger.backend.blob(data)))

    def finish(self, conn, stream: StreamRow, rows: int, partitions: int) -> None:
        """Count the append's new rows and the stream's partitions, and bump its version."""
        self._q(conn, "UPDATE streams SET version = version + 1, rows = rows + ?, partitions = ? "
                      "WHERE release_id = ?", (rows, partitions, stream.release_id))

    def chunks(self, conn, release_id: str, *, newest_first: bool = False):
        """The stream's released-row chunks, oldest first (or newest first): ``(ordinal, first_row,
        rows, data)``: ordinal -1 and the append's number for an append's chunk, or the partition's
        ordinal and its first row for a chunk stored per partition by earlier versions; an
        iterator, so callers may stop early."""
        order = "DESC" if newest_first else "ASC"
        # earlier versions' per-partition chunks come before any append's chunk (converted streams)
        cursor = self._q(conn, "SELECT ordinal, first_row, rows, data FROM stream_rows WHERE release_id = ? "
                               f"ORDER BY (ordinal >= 0) {'ASC' if newest_first else 'DESC'}, first_row {order}, "
                               f"ordinal {order}", (release_id,))
        for row in cursor:
            yield int(row[0]), int(row[1]), int(row[2]), bytes(row[3])

    # -- streams stored by earlier versions ------------------------------------------------------

    def legacy_partitions(self, conn, release_id: str) -> list[PartitionRow]:
        """The partitions of a stream stored a row each (by ordinal)."""
        rows = self._q(conn, "SELECT address, ordinal, key_text, first_handle, rows, watermark, state "
                             "FROM stream_partitions WHERE release_id = ? ORDER BY ordinal", (release_id,)).fetchall()
        return [PartitionRow(bytes(r[0]), int(r[1]), r[2], int(r[3]), int(r[4]),
                             None if r[5] is None else bytes(r[5]), bytes(r[6])) for r in rows]

    def drop_legacy_partitions(self, conn, release_id: str) -> None:
        """Forget the per-partition rows of a stream whose state is now columnar."""
        self._q(conn, "DELETE FROM stream_partitions WHERE release_id = ?", (release_id,))


def _partition_release_id(release_id: str, ordinal: int) -> str:
    """The id of a stream partition's handle block in ``releases`` (its description lives with the stream)."""
    if ordinal < 0:
        raise InvalidParameter("partition ordinals are not negative")
    return f"{release_id}/{ordinal}"
