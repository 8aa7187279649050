"""Parameter names: the old ones (refused with the new name), the closest valid name to a
misspelt one, and :func:`checked_call`, which makes a Python function refuse bad arguments in
those words. Below the front ends (:mod:`dpsql._frontend` re-exports what they use), so that
the core's public functions (:mod:`dpsql.counts`, :mod:`dpsql.ldp.api`) use it too.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from dpsql.errors import InvalidParameter, RenamedParameter
from dpsql.methods import parameter_names

#: Old parameter names, refused in every front end with the name to use (:func:`refuse_renamed`).
RENAMED = {"time_column": "order_by", "time_col": "order_by", "order_col": "order_by", "window_size": "window",
           "estimator": "method", "units": "privacy_unit", "cap": "contribution_cap"}


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


_Function = TypeVar("_Function", bound=Callable)


def checked_call(prefix: str = "dpsql", *, method: str | None = None,
                 extra: Sequence[str] = ()) -> Callable[[_Function], _Function]:
    """Make a public Python function refuse a misspelt, old, missing, repeated or surplus
    argument with :class:`InvalidParameter` (:class:`RenamedParameter` for an old name) in the
    words SQL and Polars use, naming the closest valid name, before anything is read or
    charged, instead of Python's ``TypeError``. The function keeps its signature (``help()``,
    IDEs). Names a ``**params`` function takes besides its own: ``method``'s parameters and ``extra``.

    >>> @checked_call()
    ... def tops(values, *, epsilon, upper, lower=0.0):
    ...     return upper
    >>> tops([1.0], epsilon=1.0, uper=5.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: dpsql.tops() has no parameter 'uper' (did you mean 'upper'?). Valid parameters: ...
    >>> tops([1.0], epsilon=1.0)
    Traceback (most recent call last):
    ...
    dpsql.errors.InvalidParameter: dpsql.tops() needs upper. Valid parameters: values, epsilon, upper, lower
    """
    def decorate(function: _Function) -> _Function:
        where = f"{prefix}.{function.__name__}()"
        parameters = inspect.signature(function).parameters.values()
        positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        own = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        # required positional parameters come first: those not given by position must be given by name
        required_positional = [p.name for p in parameters if p.default is p.empty and p.name in positional]
        required_named = [p.name for p in parameters if p.default is p.empty and p.kind is p.KEYWORD_ONLY]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters)
        valid = list(dict.fromkeys([*own, *(method_parameters(method) if method else []), *extra]))
        accepted = frozenset(valid if open_ended else own)

        @functools.wraps(function)
        def call(*args, **kwargs):
            if (len(args) > len(positional) or not accepted.issuperset(kwargs)
                    or any(name not in kwargs for name in required_named)
                    or any(name not in kwargs for name in required_positional[len(args):])
                    or any(name in kwargs for name in positional[:len(args)])):
                _refuse_arguments(where, args, kwargs, positional=positional,
                                  required=[*required_positional, *required_named], valid=valid)
            return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


def _refuse_arguments(where: str, args: tuple, kwargs: dict, *, positional: Sequence[str], required: Sequence[str],
                      valid: Sequence[str]) -> None:
    """Raise what is wrong with a call (``args``, ``kwargs``) of :func:`checked_call`'s function."""
    refuse_renamed(where, kwargs)
    listing = f"Valid parameters: {', '.join(valid)}"
    unknown = [name for name in kwargs if name not in valid]
    if unknown:
        raise InvalidParameter(unknown_parameters_message(where, unknown, valid))
    twice = [name for name in positional[:len(args)] if name in kwargs]
    if twice:
        raise InvalidParameter(f"{where}: {', '.join(map(repr, twice))} given twice, by position and by name. "
                               f"{listing}")
    if len(args) > len(positional):
        raise InvalidParameter(f"{where} takes {len(positional)} positional argument(s) ({', '.join(positional)}), "
                               f"got {len(args)}: pass the others by name (name=value). {listing}")
    given = {*positional[:len(args)], *kwargs}
    missing = [name for name in required if name not in given]
    raise InvalidParameter(f"{where} needs {', '.join(missing)}. {listing}")
