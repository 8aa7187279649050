"""What every front end checks the same way, in the same words: the budget, the parameter
names, the keys.

The DuckDB macros (:mod:`dpsql.duckdb`) and the Polars namespace (:mod:`dpsql.polars`) read
their input differently, but refuse the same things with the same messages, through the
functions here: a budget that is not a :class:`~dpsql.Budget`, a parameter name that neither
the front end nor the method knows (named, with the closest valid name and the whole list),
a NULL or NaN time key, an old parameter name. Stream order itself is :mod:`dpsql.ordering`; the
charge is :func:`dpsql.publishing.publish`.

The defaults of the choices every front end offers live here too, so that SQL, Polars and
Python agree (docs/vocabulary.md lists the words).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from dpsql.budget import Budget
from dpsql.errors import InvalidParameter, RenamedParameter
from dpsql.methods import METHODS, check_method, parameter_names

#: The method of a one-shot range-sum release when none is named (``dp_range_sum``, ``.dpsql.range_sum``).
RANGE_SUM_METHOD = "tops"
#: The local-DP user-stream method when none is named (``dp_ldp``, ``.dpsql.ldp``).
LDP_METHOD = "capp"
#: The count-stream method when none is named (``dp_count_stream``, ``dpsql.count_stream``).
COUNT_METHOD = "pegasus"
#: The threshold's estimator when none is named (``method`` of ``dp_threshold``, ``dpsql.threshold`` and
#: ``.dpsql.threshold``; the registered ``threshold`` method calls it ``estimator``).
THRESHOLD_ESTIMATOR = "nm"
#: Old parameter names, refused in every front end with the name to use (:func:`refuse_renamed`).
RENAMED = {"time_column": "order_by", "time_col": "order_by", "order_col": "order_by", "window_size": "window",
           "estimator": "method"}


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


def suggestion(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to ``name``, or ``""``; for an old
    name (:data:`RENAMED`), the name to use.

    >>> suggestion("epsilonn", ["epsilon", "upper"]), suggestion("window_size", ["window"])
    (" (did you mean 'epsilon'?)", " ('window_size' is now called 'window')")
    """
    if name in RENAMED:
        return f" ({name!r} is now called {RENAMED[name]!r})"
    close = difflib.get_close_matches(name, [*valid, *RENAMED], n=1, cutoff=0.6)
    return f" (did you mean {RENAMED.get(close[0], close[0])!r}?)" if close else ""


def unknown_parameters_message(where: str, unknown: Sequence[str], valid: Sequence[str]) -> str:
    """The one message for parameter names nobody knows: each named with a suggestion, then the valid names."""
    return f"{no_such_parameters(where, unknown, valid)}. Valid parameters: {', '.join(valid)}"


def no_such_parameters(where: str, unknown: Sequence[str], valid: Sequence[str], *, fold=str) -> str:
    """``where`` has no parameter(s) ``unknown``, each with the closest valid name (compared
    as ``fold`` gives them: SQL names are case-insensitive)."""
    named = "; ".join(f"{name!r}{suggestion(fold(name), valid)}" for name in unknown)
    noun = "parameter" if len(unknown) == 1 else "parameters"
    return f"{where} has no {noun} {named}"


def method_parameters(method: str) -> list[str]:
    """What ``method`` accepts by name in a front end (``delta`` too: pure methods accept
    ``delta=0``; not the registry's ``estimator``, which front ends call ``method``)."""
    return sorted({*parameter_names(method), "delta"} - set(RENAMED))


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


def refuse_renamed(where: str, given: Iterable[str]) -> None:
    """Refuse the old names (:data:`RENAMED`) in ``given`` with a :class:`RenamedParameter`
    naming the one to use, before anything is read or charged.

    >>> refuse_renamed("dpsql.count_stream()", ["every", "time_column"])
    Traceback (most recent call last):
    ...
    dpsql.errors.RenamedParameter: dpsql.count_stream(): time_column= is now called order_by=
    """
    old = [name for name in given if name in RENAMED]
    if old:
        raise RenamedParameter(f"{where}: " + "; ".join(f"{name}= is now called {RENAMED[name]}=" for name in old))


def check_range_sum_method(method: str) -> None:
    """A method that releases one value per row (what a range-sum front end returns)."""
    check_method(method, per_row=True)
