"""A private clipping threshold as a release of its own (method ``"threshold"``).

All rows are the hold-out: they are clipped to the public ``[lower, upper]``, shifted to
``[0, upper - lower]`` and the threshold is chosen on them by

* ``estimator="nm"``: Report-Noisy-Max, ``epsilon``-DP, over a score for what the later
  release is for (``focus="mixed"``, ``"windows"``, ``"long"``:
  :func:`dpsql.mechanisms.query_mix.mix_thresholds`, for the hierarchy at ``epsilon_perturber``
  with chunks of ``r`` rows and long ranges in ``min(r, 2**16)`` rows, or ``2**16``, and ``fanout``) or ToPS Eq. 6
  (``focus="paper"``:
  :func:`dpsql.mechanisms.noisy_max.nm_threshold`);
* ``estimator="pak"``: PAK's smooth-sensitivity quantile
  (:func:`dpsql.mechanisms.smooth_sensitivity.pak_threshold`), ``(epsilon, delta)``-DP.

Neighbours: one row's value replaced (row order public). The one output is the threshold
in the original units (``lower + theta``); the machine emits it when the stream closes.
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.error_models import ErrorModel
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.noisy_max import NM_LEVELS, default_step, nm_threshold
from dpsql.mechanisms.query_mix import FOCUSES, mix_thresholds, ranges_span, refuse_paper_options
from dpsql.mechanisms.smooth_sensitivity import check_pak_threshold, pak_threshold
from dpsql.noise import BatchLaneDraws, Draws, Lane
from dpsql.release import StreamMachine
from dpsql.streams.hierarchy import HierarchyStream

ESTIMATORS = ("nm", "pak")

#: Estimator-specific options and their defaults. ``r = None`` means the hierarchy's geometric
#: chunks, or for Eq. 6 the paper's 2**20; ``epsilon_perturber = None`` means the threshold's own
#: ``epsilon``; ``delta = None`` means ``1 / n**2``.
_OPTIONS = {
    "nm": {"focus": "mixed", "r": None, "fanout": 16, "epsilon_perturber": None, "c": None, "step": None,
           "levels_for_nm": None},
    "pak": {"delta": None, "tail_p": 0.005, "lam": 0.85, "beta_lt": 0.006, "rho": 1.0},
}


class NoRangeSums(ErrorModel):
    """A scalar release has no rows to sum."""

    def range_variance(self, starts, stops):
        raise InvalidParameter("a threshold release is one number, not a stream: range sums are undefined")


class ThresholdRelease(StreamMachine):
    """Buffers the rows, then releases one threshold at :meth:`close`.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     machine = ThresholdRelease(1000, epsilon=5.0, upper=100.0, epsilon_perturber=0.1, noise=keys.partition())
    ...     _ = machine.feed(np.full(1000, 7.0))
    ...     float(machine.close()[0])  # the smallest candidate 100 * 2**(-j / 8) above 7
    7.432544468767007
    """

    n_outputs = 1

    def __init__(self, n: int, *, epsilon: float, upper: float, lower: float = 0.0, estimator: str = "nm",
                 delta: float | None = None, focus: str | None = None, r: int | None = None,
                 fanout: int | None = None, c: float | None = None, step: float | None = None,
                 levels_for_nm: str | None = None, epsilon_perturber: float | None = None, tail_p: float | None = None,
                 lam: float | None = None, beta_lt: float | None = None, rho: float | None = None, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.lower, self.upper = _validate.bounds(lower, upper)
        self.estimator = _validate.choice(estimator, "method", ESTIMATORS)
        given = {k: v for k, v in dict(delta=delta, focus=focus, r=r, fanout=fanout, c=c, step=step,
                                       levels_for_nm=levels_for_nm, epsilon_perturber=epsilon_perturber,
                                       tail_p=tail_p, lam=lam, beta_lt=beta_lt, rho=rho).items() if v is not None}
        if self.estimator == "nm" and "delta" in given:
            _validate.delta(given.pop("delta"), pure=True, method="threshold (nm)")
        unknown = sorted(set(given) - set(_OPTIONS[self.estimator]))
        if unknown:
            allowed = ", ".join(map(repr, _OPTIONS[self.estimator]))
            raise InvalidParameter(f"option(s) {', '.join(map(repr, unknown))} do not apply to threshold method "
                                   f"{self.estimator!r}; its options are {allowed}")
        self.options = {**_OPTIONS[self.estimator], **given}
        self._noise = noise
        bound = self.upper - self.lower
        if self.estimator == "nm":
            self.options = self._check_nm(self.options)
            self.cost = (self.epsilon, 0.0)
        else:
            self.options["delta"] = 1.0 / n**2 if self.options["delta"] is None else self.options["delta"]
            checked = check_pak_threshold(epsilon=self.epsilon, upper=bound, **self.options)
            self.options = {k: getattr(checked, k) for k in _OPTIONS["pak"]}
            self.cost = (self.epsilon, checked.delta)
        self._held: list[np.ndarray] = []
        self.threshold: float | None = None

    def _check_nm(self, options: dict) -> dict:
        focus = _validate.choice(options["focus"], "focus", FOCUSES)
        common = {
            "focus": focus,
            "fanout": _validate.integer(options["fanout"], "fanout", minimum=2),
            "epsilon_perturber": self.epsilon if options["epsilon_perturber"] is None
            else _validate.epsilon(options["epsilon_perturber"], "epsilon_perturber"),
        }
        r = options["r"] if options["r"] is None else _validate.integer(options["r"], "r", minimum=1)
        if focus == "paper":
            return {**common, "r": 1 << 20 if r is None else r,
                    "c": 60.0 if options["c"] is None else _validate.real(options["c"], "c", minimum=0.0, strict=True),
                    "step": default_step(self.upper - self.lower) if options["step"] is None
                    else _validate.real(options["step"], "step", minimum=0.0, strict=True),
                    "levels_for_nm": _validate.choice(options["levels_for_nm"] or "paper", "levels_for_nm",
                                                      NM_LEVELS)}
        refuse_paper_options(focus, options)
        stream = HierarchyStream(epsilon=common["epsilon_perturber"], upper=1.0, r=r, fanout=common["fanout"],
                                 noise=self._noise)
        self._mix = stream.focus_mix(focus, ranges_span(None, r))  # the later release's length unknown
        return {**common, "r": r}

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        self._held.append(chunk)
        return np.empty(0)

    def close(self) -> np.ndarray:
        bound = self.upper - self.lower
        holdout = np.sort(np.clip(np.concatenate(self._held) - self.lower, 0.0, bound))
        self._held = []
        if self.estimator == "nm" and self.options["focus"] == "paper":
            theta = nm_threshold(holdout, epsilon=self.epsilon, upper=bound, noise=self._noise.lane(Lane.NOISY_MAX),
                                 **{k: v for k, v in self.options.items() if k != "focus"})
        elif self.estimator == "nm":
            theta = float(mix_thresholds(holdout[None], epsilon=self.epsilon, upper=bound, mix=self._mix,
                                         noise=BatchLaneDraws.of(self._noise.lane(Lane.NOISY_MAX)))[0])
        else:
            theta = pak_threshold(holdout, epsilon=self.epsilon, upper=bound,
                                  noise=self._noise.lane(Lane.SMOOTH_SENSITIVITY), **self.options)
        self.threshold = self.lower + theta
        return np.array([self.threshold])

    def describe(self) -> dict:
        params = {"epsilon": self.epsilon, "lower": self.lower, "upper": self.upper, "method": self.estimator,
                  **self.options}
        return dict(method="threshold", params=params, error=NoRangeSums(), threshold=self.threshold,
                    components={f"threshold_{self.estimator}": self.cost})
