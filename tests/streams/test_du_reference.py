"""Du et al.'s releases against a sequential reference, and reports as functions of (key, user, slot).

The reference below is deliberately slow and plain: one user, one report at a time, straight from
Du et al.'s algorithms, each uniform drawn by its own address through the noise API. The library's paths
(all reports at once without feedback, a plain-float loop per user, numpy across many users, any
chunking, batches of users in one release, the device encoder) must give exactly its outputs.
"""

import numpy as np
import pytest

import dpsql
from dpsql.addresses import partition_address
from dpsql.mechanisms.ldp import SQUARE_WAVE
from dpsql.mechanisms.ldp.feedback import PLAIN_LOOP_USERS
from dpsql.methods import machine_for, run
from dpsql.noise import Lane
from dpsql.streams.du.plan import budget_absorption_unit
from dpsql.testing import keys, seeded

# -- the reference -------------------------------------------------------------------------------------


def uniform(draws, lane: Lane, index: int) -> float:
    return float(draws.lane(lane, 0).uniform(index, 1)[0])


def square_wave(z: float, eps: float, u: float) -> float:
    return float(SQUARE_WAVE.perturb(np.array([z]), eps, np.array([[u]]))[0])


def clip(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), hi)


def remembered(deviations: list[float], t: int, memory: int | None) -> float:
    """``D_t``: the sum of the deviations of reports ``t - memory .. t - 1``, added as the
    library specifies (FeedbackEncoder): the previous memory block's part from its end
    backwards, the current block's from its start, then the two."""
    if memory == 0:
        return 0.0
    if memory is None:
        total = 0.0
        for d in deviations:
            total += d
        return total
    start = t - t % memory
    suffix = 0.0
    if start:
        suffix = deviations[start - 1]
        for i in range(start - 2, t - memory - 1, -1):
            suffix += deviations[i]
    prefix = 0.0
    for i in range(start, t):
        prefix += deviations[i]
    return suffix + prefix


def segments(plan, n: int) -> list[tuple[int, int]]:
    """(first slot, length) of every complete sampling segment of ``n`` slots."""
    out, start, k = [], 0, 0
    while start + plan.pattern[k % len(plan.pattern)] <= n:
        length = int(plan.pattern[k % len(plan.pattern)])
        out.append((start, length))
        start, k = start + length, k + 1
    return out


def reference_reports(plan, values, draws) -> tuple[list[float], list[int]]:
    """One user's reports (data units) and the slots each covers."""
    unit = [(clip(v, plan.lower, plan.upper) - plan.lower) / (plan.upper - plan.lower) for v in values]
    lo, hi, out_lo, out_hi = plan.ranges
    reports, lengths, deviations = [], [], []
    for t, (start, length) in enumerate(segments(plan, len(values))):
        total = unit[start]
        for v in unit[start + 1:start + length]:
            total += v
        mean = total / length
        z = clip((mean + remembered(deviations, t, plan.memory) - lo) / (hi - lo), 0.0, 1.0)
        report = out_lo + (out_hi - out_lo) * square_wave(z, plan.epsilon_report, uniform(draws, Lane.LDP_REPORT, t))
        deviations.append(mean - report)
        reports.append(plan.lower + (plan.upper - plan.lower) * report)
        lengths.append(length)
    return reports, lengths


def reference_absorption(plan, values, draws) -> tuple[list[float], list[int]]:
    """BA-SW: one user's value in force per slot (data units) and the units each publication used."""
    unit_budget, w = budget_absorption_unit(plan), plan.w
    last, last_slot, last_units = 0.0, 0, 0
    out, used = [], []
    for t, v in enumerate(values):
        x = (clip(v, plan.lower, plan.upper) - plan.lower) / (plan.upper - plan.lower)
        units = 1 if t == 0 else clip(t - (last_slot + last_units - 1), 0, w)
        publish = t == 0 or (units > 0 and abs(square_wave(clip(abs(last - x), 0.0, 1.0), unit_budget,
                                                            uniform(draws, Lane.LDP_CHOICE, t)))
                             > SQUARE_WAVE.constants(unit_budget * units).b)
        if publish:
            last = square_wave(x, unit_budget * units, uniform(draws, Lane.LDP_REPORT, t))
            last_slot, last_units = t, units
        out.append(plan.lower + (plan.upper - plan.lower) * last)
        used.append(units if publish else 0)
    return out, used


def reference_release(method: str, values, draws, params) -> tuple[np.ndarray, np.ndarray]:
    """(published values, reports) of one user's release."""
    plan = machine_for(method, len(values), draws, params).plan
    if method == "ba_sw":
        reports, _ = reference_absorption(plan, values, draws)
        raw = list(reports)
    else:
        reports, lengths = reference_reports(plan, values, draws)
        raw = [r for r, length in zip(reports, lengths) for _ in range(length)]
        raw += [reports[-1]] * (len(values) - len(raw))  # an unsampled tail repeats the last report
    back, ahead = (plan.window - 1, 0) if plan.align == "trailing" else (plan.window // 2, plan.window // 2)
    published = []
    for t in range(len(raw)):
        lo, hi = max(t - back, 0), min(t + ahead + 1, len(raw))
        total = raw[lo]
        for v in raw[lo + 1:hi]:
            total += v
        published.append(total / (hi - lo))
    return np.array(published), np.array(reports)


# -- the library against it ------------------------------------------------------------------------

COMMON = dict(epsilon=1.0, w=5, lower=-10.0, upper=50.0)
CASES = [
    ("sw_direct", {}),
    ("sw_direct", dict(window=3, align="center")),
    ("sampling", dict(n_s=3, qlen=10)),
    ("ba_sw", {}),
    ("ba_sw", dict(window=4)),
    ("ipp", {}),
    ("app", dict(memory=3)),
    ("app", dict(memory=7, window=5, align="center")),
    ("capp", {}),
    ("capp", dict(bounds_mode="paper")),
    ("capp", dict(bounds_mode="fixed_delta", clip_delta=0.2, memory=2)),
    ("pp_s", dict(n_s=3, qlen=10, window=3)),
    ("pp_s", dict(base="ipp", n_s=2, qlen=5)),
]
IDS = [f"{method}-{'-'.join(map(str, params.values())) or 'defaults'}" for method, params in CASES]


def readings(n: int, seed: int) -> np.ndarray:
    """A smooth stream with excursions beyond the public bounds (clipped): test data, not noise."""
    rng = np.random.default_rng(seed)
    return 20 + 25 * np.sin(np.arange(n) / 9) + rng.normal(0, 8, n)


@pytest.mark.parametrize("method, params", CASES, ids=IDS)
def test_one_user_equals_the_reference_in_any_chunks(method, params):
    x = readings(97, 1)
    expected_values, expected_reports = reference_release(method, x, keys(4).partition(), {**COMMON, **params})
    for chunk in (97, 13, 1):
        rel = run(method, x, noise=keys(4), chunk=chunk, **COMMON, **params)
        np.testing.assert_array_equal(rel.reports, expected_reports)
        np.testing.assert_array_equal(rel.values, expected_values)


@pytest.mark.parametrize("users", [2, PLAIN_LOOP_USERS + 3])
@pytest.mark.parametrize("method, params", CASES, ids=IDS)
def test_users_released_together_equal_the_reference_each(method, params, users):
    """A partitioned release batches equal-length users (a plain-float loop per user up to
    PLAIN_LOOP_USERS, numpy across users beyond); a user of another length runs alone. Each
    user's values and reports are the reference's with that user's draws."""
    lengths = [41] * users + [29]
    x = np.concatenate([readings(n, j) for j, n in enumerate(lengths)])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    names = [f"user {j}" for j in range(len(lengths))]
    with seeded(8):
        release = dpsql.publish(method, x, partition_offsets=offsets, partition_keys=names, **COMMON, **params)
    for j, name in enumerate(names):
        draws = keys(8).partition(partition_address(name))
        values, reports = reference_release(method, x[offsets[j]:offsets[j + 1]], draws, {**COMMON, **params})
        np.testing.assert_array_equal(release.parts[j].reports, reports)
        np.testing.assert_array_equal(release.parts[j].values, values)


@pytest.mark.parametrize("method, params", CASES, ids=IDS)
def test_the_device_sends_the_reports_the_release_simulates_for_its_user(method, params):
    x = readings(60, 3)
    with seeded(5):
        release = dpsql.publish(method, np.concatenate([x, x]), partition_offsets=[0, 60, 120],
                                partition_keys=["alice", "bob"], **COMMON, **params)
    device = dpsql.ldp.DeviceEncoder(method, noise=keys(5).partition(partition_address("bob")), **COMMON, **params)
    sent = np.concatenate([device.push(x[:7]), device.push(x[7:8]), device.push(x[8:])])
    np.testing.assert_array_equal(sent, release.parts[1].reports)


def test_reports_are_a_function_of_key_user_and_slot():
    x = readings(80, 4)
    again = [run("capp", x, noise=keys(9), **COMMON).reports for _ in range(2)]
    np.testing.assert_array_equal(*again)  # a re-run encoder sends the same reports
    assert not np.array_equal(run("capp", x, noise=keys(10), **COMMON).reports, again[0])
    with seeded(9):
        one = dpsql.publish("capp", np.concatenate([x, x]), partition_offsets=[0, 80, 160], partition_keys=[1, 2],
                            **COMMON)
    with seeded(9):  # user 2 alone: the same reports as beside user 1
        alone = dpsql.publish("capp", x, partition_offsets=[0, 80], partition_keys=[2], **COMMON)
    np.testing.assert_array_equal(alone.parts[0].reports, one.parts[1].reports)
    assert not np.array_equal(one.parts[0].reports, one.parts[1].reports)  # same readings, other user
