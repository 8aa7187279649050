"""Regression tests from the privacy audit: calibration invariants that the proofs need."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import dpsql
from dpsql import testing
from dpsql.errors import NonPrivateRelease
from dpsql.mechanisms.hierarchy import Chunk, Forest
from dpsql.mechanisms.svt import AboveThreshold
from dpsql.methods import COUNT_METHODS, METHODS, machine_for
from dpsql.noise import Lane

# 0.599853515625 / 2**-11 = 1228.5: a sensitivity that is not a whole number of query units.
SENSITIVITIES = [2.0, 4.0, 0.599853515625, 0.3, 1.5, 7.0]


@pytest.mark.parametrize("sensitivity", SENSITIVITIES)
@pytest.mark.parametrize("epsilon", [0.2, 1.0, 3.7])
def test_above_threshold_noise_covers_the_rounded_query_change(sensitivity, epsilon):
    """AboveThreshold with lattice noise is epsilon-DP if, for the largest change ``u`` of a
    rounded query (query-lattice units) between neighbours, the threshold shift ``u gamma_q``
    costs at most epsilon/2 and the "above" query's shift ``2 u`` at most epsilon/2: both
    scales, in their own units, at least ``4 u / epsilon`` (threshold units are half as wide).
    The rounding of a query moving by at most ``sensitivity`` can change it by
    ``ceil(sensitivity / gamma_q) + 1`` units (float error in computing the query can push an
    exact change past an integer); one unit of slack on the 4x sensitivity is not enough."""
    svt = AboveThreshold(sensitivity, epsilon)
    query, threshold = svt.query_noise, svt.threshold_noise
    assert query.granularity == 2 * threshold.granularity
    u = math.ceil(sensitivity / query.granularity) + 1
    assert Fraction(4 * u) / Fraction(query.scale_units) <= Fraction(epsilon)
    assert Fraction(2 * 2 * u) / Fraction(threshold.scale_units) <= Fraction(epsilon)
    # and the calibration costs no more than the needed slack (at most ~0.1% more noise)
    assert query.scale_units * epsilon < 4 * u * (1 + 1e-12)


def test_above_threshold_rounded_change_exceeds_lattice_slack_example():
    """A concrete neighbour pair: two queries ``sensitivity`` apart whose rounded values differ by
    ``ceil(sensitivity / gamma_q)`` units, so four of those exceed the scale
    ``(ceil(4 s / gamma_q) + 1) / epsilon`` that LaplaceLattice alone would give."""
    sensitivity = 0.599853515625
    svt = AboveThreshold(sensitivity, 1.0)
    gamma = svt.query_noise.granularity
    q = np.array([0.4999 * gamma])
    q_neighbour = q + sensitivity
    assert q_neighbour[0] - q[0] <= sensitivity
    change = int(svt.query_noise.to_units(q_neighbour)[0] - svt.query_noise.to_units(q)[0])
    assert change == math.ceil(sensitivity / gamma)
    assert 4 * change > math.ceil(4 * sensitivity / gamma) + 1
    assert svt.query_noise.scale_units >= 4 * change


@pytest.mark.parametrize("monotonic", [True, False])
@pytest.mark.parametrize("sensitivity", [1.0, 0.3, 5.0])
def test_report_noisy_max_scale_covers_rounded_score_change(monotonic, sensitivity, monkeypatch):
    """Report-Noisy-Max rounds every score to the lattice, so a score moving by ``s`` moves by
    up to ``u = ceil(s / gamma) + 1`` units; the noise scale must be ``u / epsilon``
    (monotone) or ``2 u / epsilon`` (not monotone, Dwork & Roth Claim 3.9)."""
    import dpsql.mechanisms.noisy_max as noisy_max

    built = []
    real = noisy_max.LaplaceLattice

    def spy(**kwargs):
        built.append(real(**kwargs))
        return built[-1]

    monkeypatch.setattr(noisy_max, "LaplaceLattice", spy)
    epsilon = 0.7
    noisy_max.report_noisy_max(np.array([0.0, 1.0]), epsilon=epsilon, noise=testing.draws(0).lane(Lane.NOISY_MAX),
                               sensitivity=sensitivity, monotonic=monotonic)
    (lap,) = built
    u = math.ceil(sensitivity / lap.granularity) + 1
    factor = 1 if monotonic else 2
    # LaplaceLattice's float division units / epsilon may round down by half an ulp
    assert Fraction(factor * u) / Fraction(lap.scale_units) <= Fraction(epsilon) * (1 + Fraction(1, 2**52))


@pytest.mark.parametrize("method", ["tops", "pak"])
@pytest.mark.parametrize(("epsilon", "share"), [(0.3, 0.15), (0.7, 0.1), (1.1, 0.2), (1.0, 0.15)])
def test_holdout_budget_pieces_never_exceed_epsilon_exactly(method, epsilon, share):
    """The hold-out spends ``epsilon_threshold`` (its threshold) then ``epsilon_holdout`` (its own
    release) on the same rows; charged ``epsilon``, their exact sum must not exceed it
    (``(1 - s) e + s e`` in floats can exceed ``e`` by one ulp)."""
    params = {"epsilon": epsilon, "upper": 10.0, "holdout_share": share}
    if method == "pak":
        params["delta"] = 1e-8
    machine = machine_for(method, 10_000, testing.draws(0), params)
    assert Fraction(machine.epsilon_threshold) + Fraction(machine.epsilon_holdout) <= Fraction(epsilon)
    assert machine.epsilon_threshold + machine.epsilon_holdout == pytest.approx(epsilon, rel=1e-15)
    assert machine.cost[0] == epsilon


@pytest.mark.parametrize("holdout", [np.arange(20.0), np.sort(np.arange(50_000) % 20.0), np.full(5000, 3.0)])
def test_pak_threshold_noise_scale_within_the_samplers_resolution(holdout, monkeypatch):
    """The sampler's geometric variable comes from a 53-bit uniform: a scale of ``s`` integer
    units reaches every integer only within ``ln(2**53 / s)`` scales of the centre. The PAK
    threshold's integer noise scale must stay far below 2**53 (it was ~2**47 with a 54-bit
    lattice: integers beyond ~4 scales, 2 % of the mass, were unreachable, which ones
    depending on the private centre), and the lattice must stay fine against the noise."""
    from dpsql.mechanisms.smooth_sensitivity import pak_threshold

    scales = []
    lane = testing.draws(0).lane(Lane.SMOOTH_SENSITIVITY)
    real = lane.discrete_laplace

    def spy(scale, start, count):
        scales.append(scale)
        return real(scale, start, count)

    monkeypatch.setattr(lane, "discrete_laplace", spy)
    pak_threshold(holdout, epsilon=0.85, delta=1e-10, upper=100.0, noise=lane)
    (scale,) = scales
    assert scale <= 2**29
    assert scale >= 2**8  # a unit is at most 2**-8 of the noise scale


@pytest.mark.parametrize("method", ["binary_tree", "hierarchy"])
@pytest.mark.parametrize("epsilon", [0.3, 0.7, 1.1, 0.05])
def test_per_level_budgets_compose_to_at_most_epsilon_exactly(method, epsilon):
    """Every value lies in one node per level: ``levels`` draws at the per-level epsilon must
    not add up to more than the charged epsilon (``L * (e / L)`` can exceed ``e`` by an ulp)."""
    for n in (7, 100, 1000, 5000):
        if method == "binary_tree":  # a declared horizon: one tree of ceil(log2 n) levels
            machine = machine_for(method, n, testing.draws(0), {"epsilon": epsilon, "upper": 3.0, "horizon": n})
            assert Fraction(machine._lattice.epsilon) * machine.levels <= Fraction(epsilon)
        else:  # a chunk whose forest has L levels gives each epsilon / L
            machine = machine_for(method, n, testing.draws(0), {"epsilon": epsilon, "upper": 3.0, "fanout": 2,
                                                                  "depth": 0})
            for levels in range(1, 40):
                per_level = machine.layout.level_epsilons(Chunk(0, 0, 1, 1, Forest(2, levels, 1)))
                assert len(per_level) == levels and sum(map(Fraction, per_level)) <= Fraction(epsilon)
        assert machine.cost == (epsilon, 0.0)


@pytest.mark.parametrize("epsilon", [0.3, 0.7, 1.1, 0.05])
def test_the_unbounded_binary_tree_splits_epsilon_exactly(epsilon):
    """Without a horizon: every epoch's total at epsilon / 2, and a tree inside each epoch whose
    levels share the other half; a value lies in one epoch total and one node per level."""
    machine = machine_for("binary_tree", None, testing.draws(0), {"epsilon": epsilon, "upper": 3.0})
    assert Fraction(machine._total_epsilon) + Fraction(machine._tree_epsilon) <= Fraction(epsilon)
    for epoch in range(0, 60):
        levels = max(epoch, 1)
        assert Fraction(machine._epoch_lattice(epoch).epsilon) * levels <= Fraction(machine._tree_epsilon)


def _minimal_params(method):
    notion = getattr(METHODS[method], "notion", "central")
    if notion == "w-event-ldp":
        params = {"epsilon": 1.0, "w": 4}
        if method != "pm_direct":
            params.update(lower=0.0, upper=10.0)
        return params, notion, 4
    if method in COUNT_METHODS:
        return {"epsilon": 1.0}, notion, None
    return {"epsilon": 1.0, "upper": 10.0}, notion, None


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_under_seeded_noise_is_non_private_and_refused_by_a_persistent_ledger(method, tmp_path):
    params, notion, w = _minimal_params(method)
    values = np.linspace(0.0, 10.0, 5000)  # longer than the default hold-out (4096 rows)
    with testing.seeded(3):
        release = dpsql.publish(method, values, **params)
    assert release.private is False
    with pytest.raises(dpsql.InvalidParameter, match="needs a budget"):  # private noise, no budget: refused
        dpsql.publish(method, values, **params)
    budget = dpsql.Budget.open(tmp_path / "ledger.sqlite", epsilon=5.0, delta=1e-3 if notion == "central" else 0.0,
                               notion=notion, w=w)
    with testing.seeded(3), pytest.raises(NonPrivateRelease):
        dpsql.publish(method, values, budget=budget, **params)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0
    # the same call with the OS source is private and charged exactly its cost
    private = dpsql.publish(method, values, budget=budget, **params)
    assert private.private is True
    assert budget.spent == (private.epsilon, private.delta)
    assert budget.history(full=True)["private"].to_list() == [True]


@pytest.mark.parametrize(("epsilon", "w"), [(0.3, 7), (1.1, 10), (0.9, 3)])
def test_pm_direct_reports_in_a_window_never_exceed_epsilon_exactly(epsilon, w):
    machine = machine_for("pm_direct", 50, testing.draws(0), {"epsilon": epsilon, "w": w})
    assert Fraction(machine.epsilon_report) * w <= Fraction(epsilon)
