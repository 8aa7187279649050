"""dpsql: differentially private stream release as ordinary SQL and dataframe work.

Importing dpsql registers the ``dpsql`` namespace on Polars expressions
(``pl.col("kwh").dpsql.range_sum(...)``); :func:`register` installs the SQL functions
into a DuckDB connection.
"""

from importlib.metadata import PackageNotFoundError, version

from dpsql import duckdb, ldp, polars, testing
from dpsql.api import binary_tree, hierarchy, laplace, pak, threshold, tops
from dpsql.budget import Budget, use_budget
from dpsql.continual import Stream
from dpsql.counts import pegasus
from dpsql.duckdb import register
from dpsql.errors import (
    BudgetExhausted,
    ConflictingRow,
    DataChanged,
    DPError,
    EnvironmentUnusable,
    HorizonExceeded,
    InvalidData,
    InvalidParameter,
    InvalidTimeKey,
    LateRow,
    LedgerError,
    NonPrivateRelease,
    NotionMismatch,
    RenamedParameter,
    UnknownRelease,
    UnknownStream,
)
from dpsql.polars.counts import count_stream
from dpsql.preview import Preview, preview
from dpsql.publishing import publish
from dpsql.release import PartitionedRelease, Release

try:
    __version__ = version("dpsql")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Budget",
    "BudgetExhausted",
    "ConflictingRow",
    "DPError",
    "DataChanged",
    "EnvironmentUnusable",
    "HorizonExceeded",
    "InvalidData",
    "InvalidParameter",
    "InvalidTimeKey",
    "LateRow",
    "LedgerError",
    "NonPrivateRelease",
    "NotionMismatch",
    "PartitionedRelease",
    "Preview",
    "Release",
    "RenamedParameter",
    "Stream",
    "UnknownRelease",
    "UnknownStream",
    "binary_tree",
    "count_stream",
    "duckdb",
    "hierarchy",
    "laplace",
    "ldp",
    "pak",
    "pegasus",
    "polars",
    "preview",
    "publish",
    "register",
    "testing",
    "threshold",
    "tops",
    "use_budget",
]
