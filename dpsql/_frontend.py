"""What every front end checks the same way, in the same words: the budget, the parameter
names, the keys.

The DuckDB macros (:mod:`dpsql.duckdb`), the Polars namespace (:mod:`dpsql.polars`) and the
Python functions (:func:`checked_call`) read their input differently, but refuse the same
things with the same messages, through the functions here: a budget that is not a
:class:`~dpsql.Budget`, a parameter name that neither the front end nor the method knows
(named, with the closest valid name and the whole list), a missing one, a NULL or NaN time
key, an old parameter name. The words about names (old names, the closest valid name,
:func:`checked_call`) are :mod:`dpsql._names`, below the front ends so that the core's public
functions use them too; they are re-exported here. Stream order itself is
:mod:`dpsql.ordering`; the charge is :func:`dpsql.publishing.publish`.

The defaults of the choices every front end offers live here too, so that SQL, Polars and
Python agree (docs/vocabulary.md lists the words).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dpsql._names import (
    RENAMED,
    checked_call,
    method_parameters,
    no_such_parameters,
    refuse_renamed,
    suggestion,
    unknown_parameters_message,
)
from dpsql.budget import Budget
from dpsql.errors import InvalidParameter
from dpsql.methods import METHODS, check_method

__all__ = ["COUNT_METHOD", "LDP_METHOD", "RANGE_SUM_METHOD", "RENAMED", "THRESHOLD_ESTIMATOR", "check_budget",
           "check_parameters", "check_range_sum_method", "checked_call", "method_parameters", "no_such_parameters",
           "refuse_renamed", "suggestion", "unknown_parameters_message"]

#: The method of a one-shot range-sum release when none is named (``dp_range_sum``, ``.dpsql.range_sum``).
RANGE_SUM_METHOD = "tops"
#: The local-DP user-stream method when none is named (``dp_ldp``, ``.dpsql.ldp``).
LDP_METHOD = "capp"
#: The count-stream method when none is named (``dp_count_stream``, ``dpsql.count_stream``).
COUNT_METHOD = "pegasus"
#: The threshold's estimator when none is named (``method`` of ``dp_threshold``, ``dpsql.threshold`` and
#: ``.dpsql.threshold``; the registered ``threshold`` method calls it ``estimator``).
THRESHOLD_ESTIMATOR = "nm"


def check_budget(budget, *, required: str | None = None) -> None:
    """Refuse a ``budget`` that is not a :class:`dpsql.Budget`. None passes unless ``required``,
    which then says why a budget is needed and how to pass one.

    >>> check_budget(None, required="SQL releases are charged to it")
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: budget must be a dpsql.Budget, got None: SQL releases are charged to it
    """
    if budget is None and required is None:
        return
    if budget is None:
        raise InvalidParameter(f"budget must be a dpsql.Budget, got None: {required}")
    if not isinstance(budget, Budget):
        raise InvalidParameter(f"budget must be a dpsql.Budget, got {type(budget).__name__}")


def check_parameters(where: str, given: Iterable[str], *, own: Sequence[str] = (), method: str | None = None) -> None:
    """Refuse names in ``given`` that are neither the front end's ``own`` keywords nor
    parameters of ``method`` (:class:`InvalidParameter` naming each, with the valid ones).
    Checked when an expression or call is built, before anything is read or charged. An old
    name is a :class:`RenamedParameter` (:func:`refuse_renamed`)."""
    given = list(given)
    refuse_renamed(where, given)
    valid = [*own, *(method_parameters(method) if method is not None and method in METHODS else [])]
    unknown = [name for name in given if name not in valid]
    if unknown:
        label = where if method is None else f"{where} with method {method!r}"
        raise InvalidParameter(unknown_parameters_message(label, unknown, valid))


def check_range_sum_method(method: str) -> None:
    """A method that releases one value per row (what a range-sum front end returns)."""
    check_method(method, per_row=True)
