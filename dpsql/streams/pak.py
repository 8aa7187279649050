"""PAK (Perrier, Asghar, Kaafar, NDSS 2019): a smooth-sensitivity
threshold from a hold-out prefix, then the binary-tree counter on the rest, clipped at
that threshold.

Privacy, replace-one-value neighbours (time order public; values clipped to the public
``[lower, upper]``, which is part of the mechanism):

* hold-out (first ``m`` rows): the threshold (:func:`~dpsql.mechanisms.smooth_sensitivity.pak_threshold`)
  at ``epsilon_1 = (1 - holdout_share) * epsilon`` and ``delta``, then the hold-out's
  total clipped at the threshold with Laplace noise at ``epsilon_2 = holdout_share *
  epsilon``: ``(epsilon, delta)`` by sequential composition;
* the remaining rows: :class:`~dpsql.streams.binary_tree.BinaryTreeStream` with bound
  ``[0, threshold]``: pure ``epsilon``-DP (PAK §3.3);
* disjoint rows, parallel composition: the release costs ``(epsilon, delta)``.

``delta`` defaults to ``1 / n**2`` (the paper's recommendation; ``n`` is public under
replace-one-value neighbours).
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.errors import InvalidParameter
from dpsql.mechanisms.smooth_sensitivity import check_pak_threshold, pak_threshold
from dpsql.noise import Draws, Lane
from dpsql.streams.binary_tree import BinaryTreeStream
from dpsql.streams.holdout import ThresholdedStream
from dpsql.timegrid import RowGrid


class PakStream(ThresholdedStream):
    """PAK as an online state machine: the hold-out is buffered until its threshold is
    chosen, then every row streams through the binary counter (unbounded unless a
    ``horizon`` is declared, see :class:`~dpsql.streams.binary_tree.BinaryTreeStream`).
    ``grid`` (the rows' public time grid) gives the hold-out's release calendar blocks, as in
    ToPS; ``max_delay`` bounds the hold-out's wait (:class:`~dpsql.streams.holdout.ThresholdedStream`):
    the counter releases every later row when it arrives.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(2) as keys:
    ...     rel = dpsql.methods.run("pak", np.arange(200_000) % 10, noise=keys, epsilon=1.0, upper=100.0,
    ...                             m=50_000)
    >>> rel.delta == 1 / 200_000**2, rel.params["m"], 9.0 <= rel.threshold < 50.0
    (True, 50000, True)
    """

    method = "pak"

    def __init__(self, n: int | None = None, *, epsilon: float, upper: float, delta: float | None = None,
                 lower: float = 0.0, m: int | None = None, holdout_share: float = 0.15, tail_p: float = 0.005,
                 lam: float = 0.85, beta_lt: float = 0.006, rho: float = 1.0, horizon: int | None = None,
                 threshold: float | None = None, threshold_by: str = "fleet", pooled_rows: int | None = None,
                 grid=None, max_delay: int | None = None, noise: Draws):
        # before the base class starts the stream phase, which a given threshold does at once
        self.horizon = None if horizon is None else _validate.integer(horizon, "horizon", minimum=1)
        self.grid = None if grid is None else RowGrid.of(grid)
        super().__init__(n, epsilon=epsilon, upper=upper, lower=lower, m=m, holdout_share=holdout_share,
                         threshold=threshold, threshold_by=threshold_by, pooled_rows=pooled_rows, max_delay=max_delay,
                         noise=noise)
        if threshold is not None and not self.pooled:  # chosen (and paid for) before: no hold-out, no delta
            if delta:
                raise InvalidParameter("delta does not apply to PAK with a given threshold (its stream phase is pure "
                                       "epsilon-DP)")
            self._threshold_params = None
        else:
            if delta is None:
                if n is None:
                    raise InvalidParameter("delta is required for a PAK stream (its one-shot default, 1 / n**2, "
                                           "needs the stream's length)")
                delta = 1.0 / n**2
            self._threshold_params = check_pak_threshold(epsilon=self.epsilon_threshold, delta=delta,
                                                         upper=self.bound, tail_p=tail_p, lam=lam, beta_lt=beta_lt,
                                                         rho=rho)
            self.threshold_delta = self._threshold_params.delta

    def _choose_thresholds(self, holdout, rows):  # PAK's quantile does not depend on the release's length
        p = self._threshold_params
        return np.array([pak_threshold(row, epsilon=p.epsilon, delta=p.delta, upper=p.upper, tail_p=p.tail_p,
                                       lam=p.lam, beta_lt=p.beta_lt, rho=p.rho,
                                       noise=self._draws[0].lane(Lane.SMOOTH_SENSITIVITY))
                         for row in np.sort(holdout, axis=1)])

    def _stream_phase(self, thresholds, initials):
        # one partition: PAK's binary tree is not batchable
        return BinaryTreeStream(epsilon=self.epsilon, upper=float(thresholds.item()), horizon=self.horizon,
                                noise=self._draws[0])

    def _method_params(self) -> dict:
        p = self._threshold_params
        if p is None:
            return {"horizon": self.horizon}
        return {"delta": p.delta, "tail_p": p.tail_p, "lam": p.lam, "beta_lt": p.beta_lt, "rho": p.rho,
                "kappa": p.kappa, "horizon": self.horizon}
