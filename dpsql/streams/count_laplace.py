"""Per-step Laplace count streams: ``count_laplace`` (the baseline) and ``count_smoothed``
(the same noisy counts, then the adaptive smoother of :mod:`dpsql.streams.smoothing`).

Both release ``c_t + Lap(sensitivity / epsilon)`` at every step ``t`` (negative counts
clipped to 0 first, the public lower bound of a count), step ``t``'s draw being index ``t``
of the ``ROWS`` lane: ``epsilon``-DP for add/remove-one-event neighbours (one count moves
by at most ``sensitivity``; steps are disjoint, so the stream as a whole costs
``epsilon``). ``count_smoothed`` then publishes the smoother's estimate, a function of the
noisy counts released so far and nothing else: post-processing, no further cost. Both
draw the same noise, so with one key their noisy counts are the same.

These are the PeGaSus Perturber alone (Chen et al., CCS 2017, ``eps_p = epsilon``): see
docs/algorithms.md, "Counts of events".
"""

from __future__ import annotations

import numpy as np

from dpsql import _validate
from dpsql.accounting import Neighbour
from dpsql.mechanisms import LaplaceLattice
from dpsql.noise import Draws, Lane
from dpsql.streams.laplace import RowNoiseStream
from dpsql.streams.smoothing import AdaptiveNoise, AdaptiveSmoother

#: What a smoothed count stream keeps per released row (all public: the noisy count and
#: the smoother's choices, functions of the noisy counts).
SMOOTHED_COLUMNS = ("noisy", "level", "weight", "spread")


class PublicRows:
    """The public columns of the rows a count machine has output (its ``public_columns``, and
    any other it keeps for its error model), piece by piece, joined once when read; and how many
    of the last rows :meth:`take` has not handed out yet (a continual stream stores them with
    the released rows). A batched machine's columns have a partition axis first."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self._pieces: list[dict[str, np.ndarray]] = []
        self._untaken = 0

    def add(self, columns: dict[str, np.ndarray]) -> None:
        """The columns of the rows just output."""
        self._pieces.append(columns)
        self._untaken += next(iter(columns.values())).shape[-1]

    def columns(self, partition: int | None = None) -> dict[str, np.ndarray]:
        """Every row's columns (of one ``partition`` of a batched machine)."""
        if len(self._pieces) > 1:  # joined once, not at every call
            self._pieces = [{name: np.concatenate([piece[name] for piece in self._pieces], axis=-1)
                             for name in self._pieces[0]}]
        if not self._pieces:
            return {name: np.empty(0) for name in self.names}
        return dict(self._pieces[0]) if partition is None else {
            name: values[partition] for name, values in self._pieces[0].items()}

    def take(self, partition: int | None = None) -> dict[str, np.ndarray]:
        """The public columns of the rows output since the last call."""
        columns = self.columns(partition)
        taken = {name: columns[name][len(columns[name]) - self._untaken:] for name in self.names if name in columns}
        self._untaken = 0
        return taken

    def restore(self, columns: dict[str, np.ndarray]) -> None:
        """The rows output before (a restored stream's), none left to take."""
        self._pieces = [columns]
        self._untaken = 0


def count_neighbour(sensitivity: float) -> str:
    """The neighbour relation of a count release in which one count moves by ``sensitivity``."""
    if sensitivity == 1.0:
        return Neighbour.ADD_REMOVE_EVENT.value
    return Neighbour.ADD_REMOVE_UNIT.value


def perturb_units(counts: np.ndarray, lattice: LaplaceLattice, noise: Draws, start: int) -> np.ndarray:
    """Noisy counts in lattice units: negative counts are clipped to 0 (a count's public
    lower bound), then lattice Laplace noise (step ``t``'s draw: index ``t`` of the ``ROWS``
    lane) is added."""
    units = lattice.to_units(np.maximum(counts, 0.0))
    units += lattice.noise_units(noise.lane(Lane.ROWS), start, units.size)
    return units


class CountLaplaceStream(RowNoiseStream):
    """Per-step Laplace on counts (the PeGaSus Perturber alone, ``eps_p = epsilon``):
    ``c_t + Lap(sensitivity / epsilon)``, negatives clipped to 0 first.

    Privacy: ``epsilon``-DP for add/remove-one-event neighbours (one count moves by at
    most ``sensitivity``). The baseline PeGaSus and ``count_smoothed`` are compared against.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     rel = dpsql.methods.run("count_laplace", np.array([3.0, 0.0, 7.0]), noise=keys, epsilon=1.0)
    >>> len(rel), rel.range_variance(0, 3) > 0
    (3, True)
    """

    method = "count_laplace"
    component = "perturber"

    def __init__(self, n: int | None = None, *, epsilon: float, sensitivity: float = 1.0, noise: Draws):
        self.epsilon = _validate.epsilon(epsilon)
        self.sensitivity = _validate.real(sensitivity, "sensitivity", minimum=0.0, strict=True)
        self.cost = (self.epsilon, 0.0)
        self.neighbour = count_neighbour(self.sensitivity)
        self._start(self.sensitivity, self.epsilon, noise)

    def _values_to_release(self, rows: np.ndarray) -> np.ndarray:
        return np.maximum(rows, 0.0)

    def params(self) -> dict:
        return {"epsilon": self.epsilon, "sensitivity": self.sensitivity}


class CountSmoothedStream(CountLaplaceStream):
    """Per-step Laplace on counts, then the adaptive online smoother
    (:mod:`dpsql.streams.smoothing`): the estimate at ``t`` reads the noisy counts released
    up to ``t`` only.

    Privacy: as ``count_laplace`` (``epsilon``-DP, add/remove one event); the smoother is
    post-processing of the noisy counts and costs nothing.

    Every released row also keeps public columns (``public_columns``): its noisy count and
    the smoother's choices. The error model (:class:`~dpsql.streams.smoothing.AdaptiveNoise`,
    exact given the choices) needs the choices, window sums re-smoothed at ``t``
    (:func:`dpsql.streams.windows.window_sums`) the noisy counts (``Release.reports``). The
    smoother's state (a few arrays of 13 numbers) is part of the snapshot, so a continual
    stream restored from its ledger continues exactly.

    Examples
    --------
    >>> import numpy as np, dpsql
    >>> with dpsql.testing.seeded(0) as keys:
    ...     smooth = dpsql.methods.run("count_smoothed", np.full(2000, 5.0), noise=keys, epsilon=0.5)
    >>> bool(np.mean((smooth.values[500:] - 5.0) ** 2) < 1.0)  # per-step Laplace: 8
    True
    """

    method = "count_smoothed"
    public_columns = SMOOTHED_COLUMNS

    def _start(self, sensitivity, epsilon, noise) -> None:
        super()._start(sensitivity, epsilon, noise)
        self._smoother = AdaptiveSmoother(self._lattice.variance, partitions=len(self._draws))
        self._public = PublicRows(SMOOTHED_COLUMNS)  # per row released: noisy count and the smoother's choices

    def _after_release(self, released: np.ndarray) -> np.ndarray:
        out = self._smoother.feed(released)
        self._public.add({"noisy": released, "level": out.level, "weight": out.weight, "spread": out.spread})
        return out.values

    def take_public(self) -> dict[str, np.ndarray]:
        """Each row output since the last call: its noisy count and the smoother's choices."""
        return self._public.take(0)

    def restore_public(self, public: dict[str, np.ndarray]) -> None:
        """The rows output before (a restored stream's error model and window sums)."""
        self._public.restore({name: np.asarray(public[name])[None] for name in SMOOTHED_COLUMNS})

    def snapshot(self) -> dict:
        return {**super().snapshot(), "smoother": self._smoother.snapshot()}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self._smoother.restore(state["smoother"])

    def describe_partition(self, partition: int) -> dict:
        description = super().describe_partition(partition)
        columns = self._public.columns(partition)
        description["error"] = AdaptiveNoise(float(self._lattice.variance[partition]), columns["level"],
                                             columns["weight"], columns["spread"], np.zeros(1, dtype=np.int64),
                                             columns["noisy"])
        description["reports"] = columns["noisy"]
        description["components"] = {self.component: self.cost, "smoother": (0.0, 0.0)}
        return description
