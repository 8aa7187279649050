"""Error models: what a release's structure says about the error of any range sum.

Every release carries one. An error model is public (its arguments are public parameters
and functions of released values) and is recorded in the ledger with its release, so error
bars can be drawn in another process, from the ledger alone.

A range sum's error has two parts:

* **noise**, random, with the variance :meth:`ErrorModel.range_variance` gives exactly;
* **structure**: a release that spreads a block's noisy sum over its rows (a hierarchy's
  flat blocks, a hold-out) or predicts rows from earlier blocks does not say how a block's
  mass is shared among its rows. A range that cuts a block can be off by up to
  :meth:`ErrorModel.range_bias_bound` even without noise; ranges along block boundaries have
  no such error.

:meth:`ErrorModel.range_margin` adds both: ``k * sd + bound``, with ``k`` covering the noise
at the requested level (:func:`quantile_multiplier`); :meth:`ErrorModel.range_margin_parts` gives
the two terms apart. An interval ``sum ± margin`` covers
the sum of the *clipped* values (clipped to the public bounds, or to a private threshold) at
least at that level. Clipping itself is part of the mechanism and not in the margin: values
above the bound or threshold are not what any release of them can show.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from statistics import NormalDist
from typing import ClassVar, NamedTuple

import numpy as np

from dpsql.errors import InvalidParameter


class MarginParts(NamedTuple):
    """An interval's half-width in its two parts (module docstring): ``noise`` at the level
    asked, and ``spreading``, the bound on the error of sharing a block's sum among its rows."""

    noise: np.ndarray
    spreading: np.ndarray


class ErrorModel(ABC):
    """What a release's structure says about the error of its range sums (module docstring).

    Subclasses give :meth:`range_variance` (the noise) and, where rows share a block's
    mass, :meth:`range_bias_bound`.

    An error model is public (its arguments are public parameters and functions of
    released values) and is recorded in the ledger with its release: every subclass's
    constructor arguments are remembered, and :meth:`to_state` / :meth:`from_state` turn the
    model into plain data and back (only registered subclasses, only plain data: reading a
    ledger never runs code).
    """

    #: An upper bound on the excess kurtosis of the noise of any range sum. Any
    #: weighted sum of i.i.d. Laplace variables has excess kurtosis <= 3.
    excess_kurtosis: float = 3.0
    _registry: ClassVar[dict[str, type[ErrorModel]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ErrorModel._registry[cls.__name__] = cls
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def remembering(self, *args, **kw):
            if "_arguments" not in self.__dict__:  # the outermost constructor's arguments
                bound = signature.bind(self, *args, **kw)
                bound.apply_defaults()
                self._arguments = dict(list(bound.arguments.items())[1:])
            init(self, *args, **kw)

        cls.__init__ = remembering

    @abstractmethod
    def range_variance(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Noise variance of ``values[start:stop].sum()`` for each pair (int64 arrays)."""

    def range_bias_bound(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """A bound on each range sum's error that is not noise: how far the released rows'
        sharing of a block's mass can be from the clipped values' (0 for ranges along block
        boundaries, and for releases without blocks)."""
        return np.zeros(np.broadcast(np.asarray(starts), np.asarray(stops)).shape, dtype=np.float64)

    def block_boundaries(self, n: int) -> np.ndarray | None:
        """The rows ``0 .. n`` at which released blocks start (and ``n``): ranges between two of
        them carry no spreading error. None when every row is released on its own."""
        return None

    def range_margin(self, starts: np.ndarray, stops: np.ndarray, level: float) -> np.ndarray:
        """Half-width of the interval at confidence ``level`` for each range sum:
        ``quantile_multiplier(level) * sd + range_bias_bound`` (module docstring)."""
        noise, spreading = self.range_margin_parts(starts, stops, level)
        return noise + spreading

    def range_margin_parts(self, starts: np.ndarray, stops: np.ndarray, level: float) -> MarginParts:
        """The two parts of :meth:`range_margin`: the noise's half-width at ``level``
        (``quantile_multiplier(level) * sd``) and the spreading bound, so that a margin far
        above the noise says why (a range that cuts a block)."""
        check_level(level)
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        noise = quantile_multiplier(level, self.excess_kurtosis) * np.sqrt(self.range_variance(starts, stops))
        return MarginParts(noise, np.asarray(self.range_bias_bound(starts, stops), dtype=np.float64))

    def to_state(self) -> dict:
        """This model as plain data (see :meth:`from_state`)."""
        return {"kind": type(self).__name__, "arguments": _plain(self.__dict__.get("_arguments", {}))}

    @staticmethod
    def from_state(state: dict) -> ErrorModel:
        """The model :meth:`to_state` described."""
        kind = ErrorModel._registry.get(str(state.get("kind")))
        if kind is None:
            raise InvalidParameter(f"unknown error model {state.get('kind')!r} in a release record")
        return kind(**_models(state["arguments"]))


def _plain(value):
    if isinstance(value, ErrorModel):
        return {"error_model": value.to_state()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _models(value):
    if isinstance(value, dict):
        if set(value) == {"error_model"}:
            return ErrorModel.from_state(value["error_model"])
        return {k: _models(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_models(v) for v in value]
    return value


class IndependentNoise(ErrorModel):
    """Independent noise per row with known per-row variances (e.g. per-value Laplace)."""

    def __init__(self, row_variance: np.ndarray | float, n: int, excess_kurtosis: float = 3.0):
        row_variance = np.asarray(row_variance, dtype=np.float64)
        # equal variances (the common case) need no O(n) prefix sums
        self._equal = float(row_variance) if row_variance.ndim == 0 else None
        if self._equal is None:
            row_variance = np.broadcast_to(row_variance, (n,))
            self._cumulative = np.concatenate([[0.0], np.cumsum(row_variance)])
        self.excess_kurtosis = excess_kurtosis

    def range_variance(self, starts, stops):
        if self._equal is not None:
            return (np.asarray(stops) - np.asarray(starts)) * self._equal
        return self._cumulative[stops] - self._cumulative[starts]


class SegmentedNoise(ErrorModel):
    """Independent noise on consecutive row segments (e.g. hold-out, then chunks):
    variances of the pieces of a range add up.

    ``boundaries`` are ``[0, b_1, ..., n]``; segment ``k`` covers rows
    ``boundaries[k]:boundaries[k+1]`` and ``models[k]`` sees segment-local row indices.
    """

    def __init__(self, boundaries, models):
        self._boundaries = np.asarray(boundaries, dtype=np.int64)
        self._models = list(models)
        self.excess_kurtosis = max(m.excess_kurtosis for m in self._models)

    def range_variance(self, starts, stops):
        return self._add_pieces(starts, stops, "range_variance")

    def range_bias_bound(self, starts, stops):
        return self._add_pieces(starts, stops, "range_bias_bound")

    def block_boundaries(self, n: int) -> np.ndarray | None:
        pieces = [model.block_boundaries(int(min(b, n) - a)) for a, b, model in
                  zip(self._boundaries[:-1], self._boundaries[1:], self._models) if a < n]
        if all(piece is None for piece in pieces):
            return None
        starts = self._boundaries[:len(pieces)]
        return np.unique(np.concatenate([
            a + (np.arange(min(b, n) - a + 1) if piece is None else piece)
            for a, b, piece in zip(starts, [*self._boundaries[1:len(pieces)], n], pieces)]))

    def _add_pieces(self, starts, stops, measure: str) -> np.ndarray:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        total = np.zeros(np.shape(starts), dtype=np.float64)
        for a, b, model in zip(self._boundaries[:-1], self._boundaries[1:], self._models):
            s = np.clip(starts, a, b) - a
            e = np.clip(stops, a, b) - a
            hit = e > s
            if hit.any():
                total[hit] += getattr(model, measure)(s[hit], e[hit])
        return total


def quantile_multiplier(level: float, excess_kurtosis: float) -> float:
    """Two-sided multiplier ``k`` of the noise standard deviation at ``level``.

    Range-sum noise is a weighted sum of independent Laplace (or Gaussian) variables.
    A single Laplace variable has the heaviest tail of that family at the levels used
    for error bars, a sum of many is close to Gaussian; taking the larger of the two
    quantiles, ``max(z, ln(1 / (1 - level)) / sqrt(2))``, covers both ends. At 95 %
    that is 2.12 sigma (exact for one Laplace variable; the Gaussian 1.96 would cover
    only 93.7 % of it).
    """
    gaussian = NormalDist().inv_cdf(0.5 + level / 2)
    if excess_kurtosis <= 0:
        return gaussian
    return max(gaussian, math.log(1.0 / (1.0 - level)) / math.sqrt(2.0))


def check_level(level: float) -> float:
    """``level`` if it is a confidence level (``0 < level < 1``), else :class:`~dpsql.InvalidParameter`."""
    if not (isinstance(level, (int, float)) and 0 < level < 1):
        raise InvalidParameter(f"level must satisfy 0 < level < 1, got {level!r}")
    return float(level)


class ProvisionalRows(ErrorModel):
    """Rows released with a provisional value (a continual stream's prediction from what was
    released before, waiting for later rows): each lies within ``bound`` of the row's clipped
    value (both are clipped to the public bound, or the private threshold), so a range's error
    is at most ``bound`` per provisional row it holds. No noise is counted apart: the bound
    covers the prediction's own noise too. ``rows``: how many rows are provisional."""

    def __init__(self, bound: float, rows: int):
        self.bound = float(bound)
        self.rows = int(rows)

    def range_variance(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        return np.zeros(np.broadcast(np.asarray(starts), np.asarray(stops)).shape, dtype=np.float64)

    def range_bias_bound(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        covered = np.minimum(np.asarray(stops), self.rows) - np.minimum(np.asarray(starts), self.rows)
        return self.bound * np.maximum(covered, 0).astype(np.float64)
