"""The budget :class:`dpsql.use_budget` set, if any.

Kept in a module of its own, importing nothing, so that code below :mod:`dpsql.budget` (a
release reading its error model from a ledger, :meth:`dpsql.Release.from_arrow`) finds the
default without importing the module that imports it: no import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpsql.budget import Budget

#: The default budget, set and restored by :class:`dpsql.use_budget`.
budget: Budget | None = None
