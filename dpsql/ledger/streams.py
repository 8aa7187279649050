"""Continual streams in the ledger: their registration (with the secret key), each
partition's open state and watermark, and the rows released so far.

A stream's registration is written in the same transaction as its one charge. An append
reads and rewrites a stream's partitions inside one write transaction that locks the stream
(:meth:`StreamStore.appending`): two appends to one stream are serialised, and the state,
the released rows and the watermark are committed together or not at all. Released rows are
stored as one compressed chunk per (append, partition), so an append costs its own rows and
the open state, never the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dpsql import _state
from dpsql.errors import InvalidParameter, UnknownStream
from dpsql.ledger.store import Ledger, Receipt, _now

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

    def partitions(self, conn, release_id: str, addresses=None) -> dict[bytes, PartitionRow]:
        """The stream's partitions (all, or those of ``addresses``), by address."""
        sql = ("SELECT address, ordinal, key_text, first_handle, rows, watermark, state FROM stream_partitions "
               "WHERE release_id = ?")
        found = {}
        if addresses is None:
            rows = self._q(conn, sql + " ORDER BY ordinal", (release_id,)).fetchall()
        else:
            rows = []
            for address in addresses:
                rows += self._q(conn, sql + " AND address = ?", (release_id, self.ledger.backend.blob(address))
                                ).fetchall()
        for row in rows:
            found[bytes(row[0])] = PartitionRow(bytes(row[0]), int(row[1]), row[2], int(row[3]), int(row[4]),
                                                None if row[5] is None else bytes(row[5]), bytes(row[6]))
        return found

    def key_types(self, conn, stream: StreamRow) -> list[str] | None:
        """The partition key types of the stream's first partition (None before it has one), read
        once per transaction."""
        if stream.key_types is None and stream.partitions:
            row = self._q(conn, "SELECT key_text FROM stream_partitions WHERE release_id = ? AND ordinal = 0",
                          (stream.release_id,)).fetchone()
            stream.key_types = json.loads(row[0])["types"]
        return stream.key_types

    def new_partition(self, conn, stream: StreamRow, address: bytes, key_text: str, state: bytes) -> PartitionRow:
        """Add a partition (inside an append), with its block of row handles."""
        ordinal = stream.partitions  # the stream's row is locked by this transaction
        first_handle = self.ledger.allocate_handles(conn, PARTITION_HANDLES)
        self._q(conn, "INSERT INTO stream_partitions (release_id, address, ordinal, key_text, first_handle, rows, "
                      "watermark, state) VALUES (?, ?, ?, ?, ?, 0, NULL, ?)",
                (stream.release_id, self.ledger.backend.blob(address), ordinal, key_text, first_handle,
                 self.ledger.backend.blob(state)))
        self._q(conn, "INSERT INTO releases (release_id, scope, first_handle, handles, description) "
                      "VALUES (?, ?, ?, ?, ?)",
                (_partition_release_id(stream.release_id, ordinal), stream.scope, first_handle, PARTITION_HANDLES,
                 self.ledger.backend.blob(_state.pack({"stream": stream.release_id, "ordinal": ordinal}))))
        stream.partitions = ordinal + 1  # counted inside this transaction: what finish records
        if ordinal == 0:
            stream.key_types = json.loads(key_text)["types"]
        return PartitionRow(address, ordinal, key_text, first_handle, 0, None, state)

    def save_partition(self, conn, stream: StreamRow, partition: PartitionRow) -> None:
        self._q(conn, "UPDATE stream_partitions SET rows = ?, watermark = ?, state = ? "
                      "WHERE release_id = ? AND address = ?",
                (partition.rows, None if partition.watermark is None else self.ledger.backend.blob(partition.watermark),
                 self.ledger.backend.blob(partition.state), stream.release_id,
                 self.ledger.backend.blob(partition.address)))

    def add_rows(self, conn, stream: StreamRow, ordinal: int, first_row: int, rows: int, data: bytes) -> None:
        self._q(conn, "INSERT INTO stream_rows (release_id, ordinal, first_row, rows, data) VALUES (?, ?, ?, ?, ?)",
                (stream.release_id, ordinal, first_row, rows, self.ledger.backend.blob(data)))

    def finish(self, conn, stream: StreamRow, rows: int) -> None:
        """Count the append's released rows and partitions (``stream.partitions``, kept by
        :meth:`new_partition` in this transaction) and bump the stream's version."""
        self._q(conn, "UPDATE streams SET version = version + 1, rows = rows + ?, partitions = ? "
                      "WHERE release_id = ?", (rows, stream.partitions, stream.release_id))

    def chunks(self, conn, release_id: str, ordinal: int | None = None, *, newest_first: bool = False):
        """The released-row chunks of the stream (of one partition), in row order (or newest first):
        ``(ordinal, first_row, rows, data)``; an iterator, so callers may stop early."""
        sql = "SELECT ordinal, first_row, rows, data FROM stream_rows WHERE release_id = ?"
        params: tuple = (release_id,)
        if ordinal is not None:
            sql, params = sql + " AND ordinal = ?", (release_id, ordinal)
        order = "DESC" if newest_first else "ASC"
        cursor = self._q(conn, sql + f" ORDER BY ordinal {order}, first_row {order}", params)
        for row in cursor:
            yield int(row[0]), int(row[1]), int(row[2]), bytes(row[3])


def _partition_release_id(release_id: str, ordinal: int) -> str:
    """The id of a stream partition's handle block in ``releases`` (its description lives with the stream)."""
    if ordinal < 0:
        raise InvalidParameter("partition ordinals are not negative")
    return f"{release_id}/{ordinal}"
