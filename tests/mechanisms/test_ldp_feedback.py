"""Deviation feedback around Square Wave (Du et al., APP and CAPP): the papers' arithmetic with
scripted randomisers, CAPP's frames, the memory the strict accounting relies on, and the plain-float
loop against the numpy step."""

import numpy as np
import pytest
from doubles import Scripted
from scipy import optimize

from dpsql.mechanisms.ldp import SQUARE_WAVE, UNIT, FeedbackEncoder, capp_ranges, capp_threshold, report_uniforms
from dpsql.mechanisms.ldp.feedback import PLAIN_LOOP_USERS
from dpsql.testing import keys


class Echo:
    """Returns its input plus a scripted offset (keeps the feedback input inside [0, 1])."""

    uniforms = 1

    def __init__(self, offsets):
        self.offsets = list(offsets)

    def perturb(self, z, eps, u):
        return np.asarray(z, dtype=float) + self.offsets.pop(0)


NO_UNIFORMS = np.zeros((1, 1))


def steps(encoder, values):
    return np.array([encoder.step(np.array([x]), NO_UNIFORMS)[0] for x in values])


def test_ipp_reproduces_figure_2_arithmetic():
    stub = Scripted([0.0, 0.19, 0.5])
    encoder = FeedbackEncoder(1, eps=1.0, memory=1, ranges=UNIT, randomiser=stub)
    assert steps(encoder, [0.01, 0.15]).tolist() == [0.0, 0.19]  # x'_1 = 0: d_1 = 0.01; xI_2 = 0.16: d_2 = -0.04
    steps(encoder, [0.30])                                          # xI_3 = 0.30 + d_2 (memory 1: d_1 forgotten)
    assert [float(z[0]) for z in stub.inputs] == pytest.approx([0.01, 0.16, 0.26], abs=1e-15)


@pytest.mark.parametrize("memory", [None, 4])
def test_app_telescoping_and_finite_memory(memory):
    rng = np.random.default_rng(5)  # test values, not privacy noise
    x = rng.uniform(0.3, 0.7, 40)
    offsets = rng.uniform(-0.02, 0.02, 40)
    encoder = FeedbackEncoder(1, eps=1.0, memory=memory, ranges=UNIT, randomiser=Echo(offsets))
    reports = steps(encoder, x)
    deviations = x - reports
    remembered = float(encoder._remembered()[0])
    if memory is None:  # sum x' = sum x - D_T: the subsequence-mean error is -D_T / T
        assert reports.sum() == pytest.approx(x.sum() - remembered, abs=1e-12)
        assert reports.mean() - x.mean() == pytest.approx(-remembered / 40, abs=1e-13)
    else:
        assert remembered == pytest.approx(deviations[-memory:].sum(), abs=1e-12)
    # each input was the true value plus the remembered deviations (nothing clipped here)
    for t in (1, 17, 39):
        window = deviations[0 if memory is None else max(0, t - memory):t]
        assert reports[t] == pytest.approx(x[t] + window.sum() + offsets[t], abs=1e-12)


def test_memory_zero_is_plain_square_wave():
    x = np.linspace(0, 1, 50)
    u = report_uniforms(keys(9).partition(), 0, 50, uniforms=1)
    encoder = FeedbackEncoder(50, eps=0.3, memory=0, ranges=UNIT)
    np.testing.assert_array_equal(encoder.step(x, u), SQUARE_WAVE.perturb(x, 0.3, u))


class _Recording:
    """Records its inputs and always reports 0.3."""

    uniforms = 1

    def __init__(self):
        self.inputs = []

    def perturb(self, z, eps, u):
        self.inputs.append(z.copy())
        return np.full_like(z, 0.3)


@pytest.mark.parametrize("memory", [1, 2, 3, 5])
@pytest.mark.parametrize("first", [0.0, 0.1, 0.7, 1.0, 0.333])
def test_feedback_inputs_beyond_the_memory_do_not_depend_on_an_old_value(first, memory):
    """Strict accounting charges a window's change to the ``w`` reports inside it and the next
    ``memory`` ones only, so with the same reports every later SW input must be bit-for-bit
    independent of the changed value (a running float sum would keep its rounding residue
    forever), whichever block of the memory the changed value fell in."""
    rest = [0.123456789, 0.987654321, 0.55, 0.11, 0.77, 0.33, 0.2, 0.91, 0.05, 0.6, 0.45, 0.3]

    def inputs(x0, at):
        stub = _Recording()
        values = [*rest[:at], x0, *rest[at:]]
        steps(FeedbackEncoder(1, eps=1.0, memory=memory, ranges=UNIT, randomiser=stub), values)
        return np.array(stub.inputs)[:, 0]

    for at in range(memory + 1):  # the changed value at every position within a block
        changed, other = inputs(first, at), inputs(0.9, at)
        np.testing.assert_array_equal(changed[at + memory + 1:], other[at + memory + 1:])


@pytest.mark.parametrize("memory", [0, 1, 3, 7, None])
@pytest.mark.parametrize("users", [1, 3, PLAIN_LOOP_USERS + 4])
def test_run_equals_one_step_per_report_in_any_pieces(memory, users):
    """``run`` (plain floats per user for a few users, numpy across users for more, everything at
    once without feedback) gives the reports of the numpy step, bit for bit, however the reports
    are cut into runs."""
    rng = np.random.default_rng(11)  # test values, not privacy noise
    x = rng.uniform(-0.2, 1.2, (users, 57))
    u = report_uniforms(keys(3).partitions([bytes([j]) for j in range(users)]), 0, 57, uniforms=1)
    ranges = capp_ranges(0.1, "reference_code")
    stepped = FeedbackEncoder(users, eps=0.1, memory=memory, ranges=ranges)
    expected = np.stack([stepped.step(x[:, t], u[:, t]) for t in range(57)], axis=1)
    run = FeedbackEncoder(users, eps=0.1, memory=memory, ranges=ranges)
    pieces = [run.run(x[:, a:b], u[:, a:b]) for a, b in [(0, 1), (1, 12), (12, 13), (13, 57)]]
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), expected)


# -- CAPP's frame ----------------------------------------------------------------------------------


@pytest.mark.parametrize("eps, e_s, e_d, t", [
    (0.05, 0.6286, 0.5679, 0.0607), (0.1, 0.6093, 0.5587, 0.0506), (0.3, 0.5403, 0.5245, 0.0158),
    (0.5, 0.4821, 0.4942, -0.0121), (1.0, 0.3717, 0.4320, -0.0603), (2.0, 0.2413, 0.3487, -0.1074),
])
def test_capp_threshold_table(eps, e_s, e_d, t):
    assert [round(v, 4) for v in capp_threshold(eps)] == [e_s, e_d, t]


def test_capp_threshold_changes_sign_at_0_40788():
    root = optimize.brentq(lambda e: capp_threshold(e)[2], 0.3, 0.5, xtol=1e-10)
    assert round(root, 5) == 0.40788


def test_capp_bounds_modes():
    t = capp_threshold(0.05)[2]
    assert capp_ranges(0.05, "reference_code") == pytest.approx((0.0, 1.0, t, 1 - t))       # shrink output only
    assert capp_ranges(1.0, "reference_code") == pytest.approx((-0.0603, 1.0603, -0.0603, 1.0603), abs=1e-4)
    assert capp_ranges(0.05, "paper") == pytest.approx((-t, 1 + t, -t, 1 + t))
    assert capp_ranges(0.05, "fixed_delta", 0.25) == (-0.25, 1.25, -0.25, 1.25)
    # reference_code at T > 0: the feedback input is clipped to [0, 1] and the report lands in [T, 1 - T]
    stub = Scripted([0.0, 1.0])
    encoder = FeedbackEncoder(1, eps=0.05, memory=3, ranges=capp_ranges(0.05, "reference_code"), randomiser=stub)
    assert steps(encoder, [0.9, 0.9]).tolist() == pytest.approx([t, 1 - t])
    assert float(stub.inputs[1][0]) == 1.0  # 0.9 + (0.9 - T) clipped
