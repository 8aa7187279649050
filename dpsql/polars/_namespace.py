"""The ``.dpsql`` expression namespace class and the decorator that adds methods to it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import polars as pl


class DpsqlExpr:
    """Private stream releases as Polars expressions: ``pl.col("kwh").dpsql.<method>(...)``.

    Methods are added by :func:`namespace_method`; see :mod:`dpsql.polars`.
    """

    def __init__(self, expr: pl.Expr):
        self._expr = expr


def namespace_method(function: Callable[..., pl.Expr]) -> Callable[..., pl.Expr]:
    """Expose ``function(expr, **options)`` as ``expr.dpsql.<function name>(**options)``.

    The function stays importable and callable with the expression as its first
    argument; the namespace method is a thin forwarder with the same docstring.
    """

    @functools.wraps(function)
    def method(self: DpsqlExpr, *args, **kwargs) -> pl.Expr:
        return function(self._expr, *args, **kwargs)

    method.__doc__ = f"Namespace form of :func:`{function.__module__}.{function.__qualname__}`."
    setattr(DpsqlExpr, function.__name__, method)
    return function
