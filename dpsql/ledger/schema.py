"""The ledger's tables, written once for every backend.

``{blob}``, ``{serial}`` and ``{bigint}`` are the backend's names for binary data, an
auto-incrementing key and a 64-bit integer. Amounts of budget are text: a charge as the
decimal its float shows (exact), running totals as exact fractions ``"p/q"``.
"""

from __future__ import annotations

#: Version of the table layout; older ledgers are upgraded when opened (see :func:`upgrades`).
#: 2: running totals, streams, release records. 3: released rows stored by :mod:`dpsql._chunks`
#: (keys as differences from a first key in the field's metadata), which dpsql of version 2
#: would misread: it refuses a ledger of version 3 instead. Tables are the same. 4: the answer cache
#: keeps, per principal, what recomputes a release (its key), not its values; charges record their
#: principal and what the release read (source). Answers stored before (their values, no principal)
#: are kept but answer no one. 5: a continual stream's open state as columns (``stream_state``: a
#: directory of its partitions and one record per shard of them) and one chunk of released rows per
#: append, for all its partitions (``stream_rows`` with ordinal -1); a stream kept per partition
#: before is converted when next appended. 6: released rows' value tags (32 bits) and row numbers
#: encoded by :mod:`dpsql._chunks` too, and values on a power-of-two lattice (Laplace releases) kept
#: as its 32-bit units, which dpsql of version 5 would misread: it refuses a ledger of version 6.
#: 7: a ``laplace`` stream's chunks keep no value tags (a repeat is told by its release), where dpsql
#: of version 6 would look for them.
VERSION = 7

TABLES = [
    # key/value facts about the ledger itself: version, id, next row handle
    """CREATE TABLE IF NOT EXISTS ledger_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS scopes (
        scope TEXT PRIMARY KEY,
        notion TEXT NOT NULL,
        w INTEGER,
        epsilon TEXT NOT NULL,
        delta TEXT NOT NULL,
        created TEXT NOT NULL,
        spent_epsilon TEXT NOT NULL DEFAULT '0/1',
        spent_delta TEXT NOT NULL DEFAULT '0/1',
        charges {bigint} NOT NULL DEFAULT 0)""",
    # one row per charge and per cache hit (epsilon and delta '0'), in order
    """CREATE TABLE IF NOT EXISTS charges (
        seq {serial},
        release_id TEXT NOT NULL UNIQUE,
        scope TEXT NOT NULL REFERENCES scopes(scope),
        time TEXT NOT NULL,
        method TEXT NOT NULL,
        params TEXT NOT NULL,
        epsilon TEXT NOT NULL,
        delta TEXT NOT NULL,
        rows {bigint} NOT NULL,
        partitions {bigint} NOT NULL,
        neighbour TEXT NOT NULL,
        private INTEGER NOT NULL,
        note TEXT,
        kind TEXT NOT NULL DEFAULT 'release',
        stream TEXT,
        answers TEXT,
        principal TEXT,
        source TEXT)""",
    "CREATE INDEX IF NOT EXISTS charges_scope ON charges(scope, seq)",
    # the public record of a release: description and error models (never data), its row handles
    """CREATE TABLE IF NOT EXISTS releases (
        release_id TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        first_handle {bigint} NOT NULL,
        handles {bigint} NOT NULL,
        description {blob} NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS releases_handle ON releases(first_handle)",
    # the answer cache: for an identical repeat by the same principal (fingerprint of request, principal
    # and data), the release's secret key that recomputes it and the digest of its values that checks the
    # recomputation (``answer``; before version 4: the values themselves, with no principal)
    """CREATE TABLE IF NOT EXISTS answers (
        fingerprint TEXT PRIMARY KEY,
        scope TEXT NOT NULL,
        release_id TEXT NOT NULL,
        created TEXT NOT NULL,
        answer {blob} NOT NULL,
        principal TEXT,
        private INTEGER,
        secret {blob})""",
    "CREATE INDEX IF NOT EXISTS answers_scope ON answers(scope)",
    # continual streams: registration, secret key, open state per partition, released rows
    """CREATE TABLE IF NOT EXISTS streams (
        scope TEXT NOT NULL,
        name TEXT NOT NULL,
        release_id TEXT NOT NULL UNIQUE,
        method TEXT NOT NULL,
        spec TEXT NOT NULL,
        secret {blob} NOT NULL,
        created TEXT NOT NULL,
        version {bigint} NOT NULL DEFAULT 0,
        rows {bigint} NOT NULL DEFAULT 0,
        partitions {bigint} NOT NULL DEFAULT 0,
        PRIMARY KEY (scope, name))""",
    """CREATE TABLE IF NOT EXISTS stream_partitions (
        release_id TEXT NOT NULL,
        address {blob} NOT NULL,
        ordinal {bigint} NOT NULL,
        key_text TEXT NOT NULL,
        first_handle {bigint} NOT NULL,
        rows {bigint} NOT NULL,
        watermark {blob},
        state {blob} NOT NULL,
        PRIMARY KEY (release_id, address))""",
    # a stream's open state as columns: shard -1 its facts, -2 its partitions' directory, 0.. shards
    """CREATE TABLE IF NOT EXISTS stream_state (
        release_id TEXT NOT NULL,
        shard {bigint} NOT NULL,
        data {blob} NOT NULL,
        PRIMARY KEY (release_id, shard))""",
    """CREATE TABLE IF NOT EXISTS stream_rows (
        release_id TEXT NOT NULL,
        ordinal {bigint} NOT NULL,
        first_row {bigint} NOT NULL,
        rows {bigint} NOT NULL,
        data {blob} NOT NULL,
        PRIMARY KEY (release_id, ordinal, first_row))""",
]

#: Columns added since version 1 (round 1's ledger: scopes and charges only), per table; added to
#: a ledger of any version that lacks them when it is opened (``charges.source``, what a release read,
#: came within version 4: a nullable column).
_ADDED = {
    "scopes": [("spent_epsilon", "TEXT NOT NULL DEFAULT '0/1'"), ("spent_delta", "TEXT NOT NULL DEFAULT '0/1'"),
               ("charges", "{bigint} NOT NULL DEFAULT 0")],
    "charges": [("kind", "TEXT NOT NULL DEFAULT 'release'"), ("stream", "TEXT"), ("answers", "TEXT"),
                ("principal", "TEXT"), ("source", "TEXT")],
    "answers": [("principal", "TEXT"), ("private", "INTEGER"), ("secret", "{blob}")],
}


def upgrades(existing_columns: dict[str, set[str]]) -> list[str]:
    """``ALTER TABLE`` statements bringing an older ledger's tables to this version
    (``existing_columns``: each existing table's column names). Running totals of an
    upgraded scope are recomputed from its charges by the caller."""
    statements = []
    for table, columns in _ADDED.items():
        if table in existing_columns:
            statements += [f"ALTER TABLE {table} ADD COLUMN {name} {kind}" for name, kind in columns
                           if name not in existing_columns[table]]
    return statements
