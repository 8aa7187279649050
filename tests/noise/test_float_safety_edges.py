"""Float-safety edges a privacy review found: Noisy-Max scores beyond ``2**53`` lattice units,
noise scales beyond the sampler's resolution limit (``2**33`` units), and values too large to
carry lattice noise exactly in float64. Refused calls charge nothing."""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest

import dpsql
from dpsql import noise, sampling
from dpsql.errors import InvalidParameter
from dpsql.mechanisms import LaplaceLattice, report_noisy_max
from dpsql.mechanisms.laplace import LatticeBatch, draw_bound
from dpsql.mechanisms.noisy_max import candidate_grid, default_step, nm_slope, nm_thresholds, noisy_max_lattice
from dpsql.mechanisms.smooth_sensitivity import pak_threshold
from dpsql.noise import Lane

# The reviewer's case: ToPS scores -slope * theta - m_theta reach 2**53 lattice units and beyond.
UPPER, EPSILON, HOLDOUT, RANGE = 1e11, 0.01, 4096, 2**12
SMALLEST_EPSILON_AT_SENSITIVITY_1 = 4097 / 2**33  # (ceil(1 / 2**-12) + 1) units / 2**33


def lane(seed: int = 0, which: Lane = Lane.ROWS) -> noise.LaneDraws:
    return dpsql.testing.draws(seed).lane(which)


class ForcedDraws:
    """Stands for the partitions' Noisy-Max draws: hands out ``draws[row][column]`` and records
    every (row, column) asked for."""

    def __init__(self, draws):
        self._draws = draws
        self.requests = []

    def discrete_laplace_at(self, scale, rows, indices):
        self.requests.append(list(zip(rows.tolist(), indices.tolist())))
        return np.array([self._draws[r][c] for r, c in zip(rows.tolist(), indices.tolist())], dtype=np.int64)


def exact_score_units(holdout_sorted, candidates, slope, lap):
    """Eq. 6 scores in lattice units as Python integers: the public part rounded to the lattice,
    the count times ``1 / gamma`` exactly."""
    public = [int(p) for p in np.rint(-slope * candidates / lap.granularity)]
    values = holdout_sorted.tolist()
    counts = [len(values) - bisect.bisect_right(values, float(theta)) for theta in candidates]
    return [p - round(1 / lap.granularity) * c for p, c in zip(public, counts)]


def re_float(x: float) -> str:
    """``repr(x)`` as a regular expression."""
    return repr(x).replace(".", r"\.").replace("+", r"\+")


def budget_untouched(budget):
    return budget.remaining == (1.0, 0.0) and budget.history().height == 0


@pytest.mark.parametrize("pattern", ["contenders_low", "first_low", "alternating"])
def test_tops_threshold_beyond_2_53_units_is_the_exact_integer_argmax(pattern):
    rng = np.random.default_rng(5)
    holdouts = np.sort(np.round(rng.uniform(0, UPPER, (3, HOLDOUT)) * rng.uniform(0, 1, (3, 1))), axis=1)
    candidates = candidate_grid(UPPER, default_step(UPPER))
    slope = nm_slope(HOLDOUT, epsilon_perturber=EPSILON, r=RANGE)
    lap = noisy_max_lattice(EPSILON)
    assert slope * UPPER / lap.granularity > 2 * 2.0**53  # the regime the review found
    largest = math.floor(lap.scale_units * sampling.MAX_NEG_LOG_UNIFORM)  # the sampler's most extreme draw
    bound = draw_bound(lap.scale_units)
    forced, expected, alive_pairs = [], [], []
    for row, holdout in enumerate(holdouts):
        units = exact_score_units(holdout, candidates, slope, lap)
        alive = [i for i, u in enumerate(units) if u >= max(units) - 2 * bound]
        draws = [largest] * len(units)  # candidates that get no draw: as high as a draw could lift them
        for rank, i in enumerate(alive):
            low = {"contenders_low": True, "first_low": rank == 0, "alternating": rank % 2 == 0}[pattern]
            draws[i] = -largest if low else largest
        forced.append(draws)
        alive_pairs += [(row, i) for i in alive]
        noisy = [u + z for u, z in zip(units, draws)]
        expected.append(candidates[noisy.index(max(noisy))])
    source = ForcedDraws(forced)
    chosen = nm_thresholds(holdouts, epsilon=EPSILON, upper=UPPER, epsilon_perturber=EPSILON, r=RANGE,
                           noise=source)
    np.testing.assert_array_equal(chosen, expected)
    # one request, for exactly the candidates that can still win
    assert len(source.requests) == 1 and sorted(source.requests[0]) == alive_pairs


def test_report_noisy_max_refuses_float_scores_beyond_2_53_units():
    draws = lane(0, Lane.NOISY_MAX)
    with pytest.raises(InvalidParameter, match=r"below 2\*\*53 lattice units"):
        report_noisy_max(np.array([2.0**41, 0.0]), epsilon=1.0, noise=draws)  # 2**53 units
    with pytest.raises(InvalidParameter, match="finite"):
        report_noisy_max(np.array([np.nan, 0.0]), epsilon=1.0, noise=draws)
    # just inside the limit the argmax is taken, exactly
    below = 2.0**41 - 2.0**-12 * (draw_bound(noisy_max_lattice(1.0).scale_units) + 1)
    assert report_noisy_max(np.array([0.0, below]), epsilon=1.0, noise=draws) == 1


@pytest.mark.parametrize(("epsilon", "refusal"), [
    (1e-15, r"epsilon must be between 1e-09 and 100"),  # below any lattice: refused by validation
    # a valid epsilon, but too small for sensitivity 1: refused by the lattice (ToPS refuses its split
    # before anything is drawn: the hold-out's share leaves "too little")
    (1e-7, r"too (small|little)"),
])
def test_noise_scales_beyond_2_33_units_are_refused_and_charge_nothing(epsilon, refusal):
    message = rf"epsilon={epsilon!r} is too small.*smallest epsilon allowed for this sensitivity is " + \
        re_float(SMALLEST_EPSILON_AT_SENSITIVITY_1)
    with pytest.raises(InvalidParameter, match=message):
        LaplaceLattice(sensitivity=1.0, epsilon=epsilon)
    with pytest.raises(InvalidParameter, match=message):
        LatticeBatch(np.array([1.0, 1.0]), epsilon)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    values = np.linspace(0, 1, 10_000)  # longer than ToPS's default hold-out (4096 rows)
    for method in ("laplace", "binary_tree", "tops"):
        with dpsql.testing.seeded(0), pytest.raises(InvalidParameter, match=refusal):
            dpsql.publish(method, values, epsilon=epsilon, upper=1.0, budget=budget)
    assert budget_untouched(budget)


def test_the_smallest_epsilon_allowed_is_the_largest_scale_the_sampler_reaches():
    assert LaplaceLattice(sensitivity=1.0, epsilon=SMALLEST_EPSILON_AT_SENSITIVITY_1).scale_units == 2.0**33
    with pytest.raises(InvalidParameter):
        LaplaceLattice(sensitivity=1.0, epsilon=math.nextafter(SMALLEST_EPSILON_AT_SENSITIVITY_1, 0))
    with pytest.raises(InvalidParameter, match=r"2\*\*33"):
        lane().discrete_laplace(2.0**33 * (1 + 2.0**-52), 0, 3)
    batch = dpsql.testing.keys(0).partitions([b"a", b"b"]).lane(Lane.ROWS)
    with pytest.raises(InvalidParameter, match=r"2\*\*33"):
        batch.discrete_laplace(np.array([1.0, 2.0**34]), 0, 2)
    assert lane().discrete_laplace(2.0**33, 0, 3).dtype == np.int64


def test_pak_threshold_refuses_epsilons_whose_scale_could_pass_the_sampler_limit():
    holdout = np.sort(np.arange(2000.0) % 97)
    draws = lane(0, Lane.SMOOTH_SENSITIVITY)
    with pytest.raises(InvalidParameter, match=r"smallest epsilon allowed is 1\.19"):
        pak_threshold(holdout, epsilon=1e-7, delta=1e-6, upper=100.0, noise=draws)
    # at the smallest epsilon allowed the largest scale the threshold can draw at stays within the limit
    epsilon = 2.0**-23
    assert 2.0**28 + 2.0**8 / (epsilon / 2) < 2.0**33
    assert 0 <= pak_threshold(holdout, epsilon=epsilon, delta=1e-6, upper=100.0, noise=draws) <= 100


def test_values_of_2_60_lattice_units_are_refused_and_charge_nothing():
    lap = LaplaceLattice(sensitivity=1.0, epsilon=1.0)  # 2**12 units per unit: 2**48 is 2**60 units
    batch_draws = dpsql.testing.keys(0).partitions([b""]).lane(Lane.ROWS)
    for release, draws in ((lap.release, lane()), (LatticeBatch(np.array([1.0]), 1.0).release, batch_draws)):
        with pytest.raises(InvalidParameter, match=r"2\*\*60\.0 lattice units.*shift the data closer to 0"):
            release(np.array([[0.0, -(2.0**48)]]), draws)
    with pytest.raises(InvalidParameter, match="too large for lattice noise"):
        lap.to_units(np.array([2.0**48]))
    # the same data shifted by a public offset is released exactly
    with dpsql.testing.seeded(0):
        shifted = dpsql.publish("laplace", np.full(10, 1.0), epsilon=1.0, lower=0.0, upper=1.0).values
    assert np.all(np.mod(shifted, lap.granularity) == 0)


@pytest.mark.parametrize("method", ["laplace", "binary_tree"])
def test_streams_shift_by_the_public_lower_bound_so_far_offsets_stay_exact(method):
    """Data far from 0 within narrow public bounds: the lattice works on ``value - lower``
    (small units), and adding ``lower`` back is post-processing, so nothing is refused."""
    lower, upper = 2.0**48 - 1, 2.0**48
    with dpsql.testing.seeded(0):
        far = dpsql.publish(method, np.full(4000, upper), epsilon=1.0, lower=lower, upper=upper)
    with dpsql.testing.seeded(0):
        near = dpsql.publish(method, np.full(4000, 1.0), epsilon=1.0, lower=0.0, upper=1.0)
    np.testing.assert_allclose(far.values - lower, near.values, atol=2.0**-4)  # 2**-4: the float spacing at 2**48
    assert far.range_variance(0, 4000) == near.range_variance(0, 4000)
