"""dpsql: differentially private stream release as ordinary SQL and dataframe work.

Importing dpsql registers the ``dpsql`` namespace on Polars expressions
(``pl.col("kwh").dpsql.range_sum(...)``); :func:`register` installs the SQL functions
into a DuckDB connection.
"""

from dpsql import duckdb, ldp, polars, testing
from dpsql.accountant import Budget
from dpsql.api import binary_tree, hierarchy, laplace_stream, pak, threshold, tops
from dpsql.counts import count_stream, pegasus
from dpsql.duckdb import register
from dpsql.errors import (
    BudgetExhausted,
    ConflictingRow,
    DPError,
    HorizonExceeded,
    InvalidData,
    InvalidParameter,
    InvalidTimeKey,
    LateRow,
    LedgerError,
    NonPrivateRelease,
    NotionMismatch,
    UnknownRelease,
    UnknownStream,
)
from dpsql.publish import PartitionedRelease, publish
from dpsql.release import Release

__all__ = [
    "Budget",
    "BudgetExhausted",
    "ConflictingRow",
    "DPError",
    "HorizonExceeded",
    "InvalidData",
    "InvalidParameter",
    "InvalidTimeKey",
    "LateRow",
    "LedgerError",
    "NonPrivateRelease",
    "NotionMismatch",
    "PartitionedRelease",
    "Release",
    "UnknownRelease",
    "UnknownStream",
    "binary_tree",
    "count_stream",
    "duckdb",
    "hierarchy",
    "laplace_stream",
    "ldp",
    "pak",
    "pegasus",
    "polars",
    "publish",
    "register",
    "testing",
    "threshold",
    "tops",
]
