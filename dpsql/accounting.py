"""What a release costs, in one typed record, and the exact arithmetic that adds costs up.

Every charge the ledger records is a :class:`Charge`: the method, its (epsilon, delta) under
a privacy :class:`Notion` and a :class:`Neighbour` relation, and the public facts of the
release. Costs are added exactly: each float is taken as the decimal number its shortest
representation shows (``0.1`` is one tenth, so ten charges of 0.1 fit a budget of 1.0) and
summed as a :class:`fractions.Fraction`, whatever the caller's :mod:`decimal` context or
float rounding: a charge can never slip past the cap by rounding.

Composition rules (Dwork & Roth): sequential releases add up; one release over disjoint
partitions costs the maximum over its partitions (:func:`compose`); post-processing is free.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction


class Notion(enum.StrEnum):
    """A ledger scope's privacy notion: losses of different notions do not add up."""

    CENTRAL = "central"  #: central DP, (epsilon, delta)
    LDP = "ldp"  #: event-level local DP (each report)
    W_EVENT_LDP = "w-event-ldp"  #: local DP over any window of ``w`` slots of one user


class Neighbour(enum.StrEnum):
    """The neighbouring relation a release protects (recorded with every charge)."""

    REPLACE_ONE = "replace-one-value (time order and partition keys public)"
    ADD_REMOVE_EVENT = "add/remove one event (time domain and partition keys public)"
    ADD_REMOVE_UNIT = ("add/remove one privacy unit's events within one time step, at most the release's "
                       "sensitivity counted (time domain and partition keys public)")
    LDP_EVENT = "local: any one reported value replaced by any other value in [lower, upper] (event-level LDP)"
    LDP_W_EVENT = ("local: one user's values replaced arbitrarily within any window of w consecutive slots "
                   "(w-event LDP)")


class Kind(enum.StrEnum):
    """What a history row records."""

    RELEASE = "release"  #: a one-shot release, charged
    STREAM = "stream"  #: a continual stream registered, charged once for all its appends
    CACHE_HIT = "cache hit"  #: an identical repeat answered from the ledger, free


@dataclass(frozen=True)
class Charge:
    """One charge: everything the ledger records about what a release costs.

    ``params`` are the release's public parameters (JSON-able), ``rows`` and ``partitions``
    its size, ``private`` False for test (seeded) noise, ``stream`` the continual stream a
    registration charge is for, ``source`` what the release read (``"table hourly (ts,
    volume)"``, ``"array of 48204 values"``), ``note`` the user's words.
    """

    method: str
    epsilon: float
    delta: float
    neighbour: Neighbour
    notion: Notion = Notion.CENTRAL
    w: int | None = None
    rows: int = 0
    partitions: int = 1
    params: dict = field(default_factory=dict)
    private: bool = True
    note: str | None = None
    kind: Kind = Kind.RELEASE
    stream: str | None = None
    source: str | None = None


def exact(x: float | str) -> Fraction:
    """The exact value of a charge: the decimal number the float's shortest repr shows.

    Context-free: a :class:`~decimal.Decimal` built from a string and turned into a
    Fraction involves no rounding.

    >>> sum((exact(0.1) for _ in range(10)), Fraction(0)) == exact(1.0)
    True
    """
    return Fraction(Decimal(x if isinstance(x, str) else repr(float(x))))


def fraction_text(value: Fraction) -> str:
    """A running total as text, exactly (``"p/q"``)."""
    return f"{value.numerator}/{value.denominator}"


def parse_fraction(text: str) -> Fraction:
    return Fraction(text)


def compose(costs: list[float], levels: list[int]) -> float:
    """Maximum within a level (disjoint partitions), sum across levels (sequential), added
    exactly and rounded up to a float, so the recorded charge is never below the cost.

    >>> compose([0.5, 0.25, 0.5], [0, 0, 1])
    1.0
    """
    per_level: dict[int, float] = {}
    for level, cost in zip(levels, costs):
        per_level[level] = max(per_level.get(level, 0.0), cost)
    total = sum((Fraction(c) for c in per_level.values()), Fraction(0))
    rounded = float(total)
    return rounded if Fraction(rounded) >= total else math.nextafter(rounded, math.inf)


# Cached: a partitioned release asks the same question once per partition.
@functools.lru_cache(maxsize=1024)
def largest_share(total: float, share: float, *, count: int = 1, rest: float = 0.0) -> float:
    """The largest float ``x <= share`` with ``count * x + rest <= total`` in exact
    arithmetic, so that budget pieces never add up to more than ``total`` by rounding.

    >>> largest_share(0.3, 0.3 - 0.03, rest=0.03) + 0.03 <= 0.3
    True
    """
    def exact_sum(x):
        return count * Fraction(x) + Fraction(rest)

    if exact_sum(share) > Fraction(total):
        # the exact bound rounded to the nearest float is at most one step above the answer:
        # stepping down ulp by ulp from ``share`` alone could take ~10**11 steps when ``share``
        # is far smaller than the rounding of ``rest`` (a hold-out share of 1e-12)
        share = min(share, float((Fraction(total) - Fraction(rest)) / count))
    while exact_sum(share) > Fraction(total):
        share = math.nextafter(share, -math.inf)
    return share
