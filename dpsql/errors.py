"""Typed errors. Every refusal dpsql makes is a :class:`DPError` subclass.

Messages name the parameter or column and the problem, so the same text reaches a
user whether the call came from Python, SQL or a Polars expression.
"""

from __future__ import annotations


class DPError(Exception):
    """Base class of every error dpsql raises on purpose."""


class InvalidParameter(DPError, ValueError):
    """A mechanism parameter (epsilon, delta, bounds, method, ...) is unusable."""


class RenamedParameter(InvalidParameter):
    """An old name of a parameter, method or choice, no longer accepted; the message names the
    one to use instead (docs/vocabulary.md lists the renamings)."""


class InvalidData(DPError, ValueError):
    """The data column is unusable: NaN, null, infinite, empty, wrong shape or type."""


class InvalidTimeKey(InvalidData):
    """The order / time column has nulls or duplicates within a partition."""


class BudgetExhausted(DPError):
    """A charge would exceed the ledger's budget. Nothing was charged or released."""

    # Optional because eager Polars re-raises a UDF's exception as ``type(e)(message)``.
    def __init__(self, message: str, *, remaining: tuple[float, float] | None = None,
                 requested: tuple[float, float] | None = None):
        super().__init__(message)
        self.remaining = remaining
        self.requested = requested


class NonPrivateRelease(DPError):
    """A release made with test (seeded) noise was offered to a real ledger."""


class NotionMismatch(DPError):
    """A release's privacy notion differs from the notion the ledger scope was created with."""


class HorizonExceeded(InvalidData):
    """More rows than a counter's declared ``horizon`` (nothing of the offending rows is released)."""


class LateRow(InvalidTimeKey):
    """A row of a continual stream at or below its partition's watermark (the largest order
    key already appended), that is not an exact repeat of a row appended before."""


class ConflictingRow(InvalidData):
    """A row of a continual stream with the order key of a row already released but another value."""


class UnknownStream(InvalidParameter):
    """No continual stream of that name exists in the ledger scope."""


class UnknownRelease(InvalidParameter):
    """No release with that id (or row handle) is recorded in the ledger."""


class DataChanged(InvalidData):
    """A distributed release's task (Spark) read rows other than those checked before the release
    was charged: its source changed since. Nothing of that partition was released; a new release
    (charged again) publishes the current data."""


class EnvironmentUnusable(DPError):
    """The machines a distributed release runs on cannot run it: executors that cannot import
    dpsql, run another version of it, or lack what Spark needs to run its tasks (pandas, pyarrow).
    The message names what is missing and where; nothing was charged."""


class LedgerError(DPError):
    """The ledger cannot be used: a read-only or full disk, a corrupt file, a lock held too
    long, a server gone away, an in-memory ledger used from a forked process. The message
    names the ledger and the cause; nothing was charged or released by the failing call."""


def scrubbed(error: BaseException) -> BaseException:
    """A fresh exception like ``error`` (type, message; a budget refusal's amounts) carrying
    nothing else: no traceback into the frames that held noisy values, no context, no cause.
    Every call that computes noisy values before it may fail (a release refused at its charge,
    an append refused or failed before its commit) raises this instead of ``error``."""
    kind = type(error)
    if isinstance(error, BudgetExhausted):
        return BudgetExhausted(str(error), remaining=error.remaining, requested=error.requested)
    if isinstance(error, (DPError, KeyboardInterrupt, SystemExit, MemoryError)):
        try:
            return kind(*[a if isinstance(a, (str, int, float)) else str(a) for a in error.args])
        except TypeError:
            pass
    return RuntimeError(f"{kind.__name__}: {error}")
