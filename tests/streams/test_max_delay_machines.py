"""``max_delay`` on the machines that hold rows back (the flat hierarchy, ToPS's and PAK's hold-out):
fed in chunks of any size, no row waits for more than ``max_delay - 1`` later rows before its final
value is output, the final values are those of one feed of the whole stream, and the machine accounts
for every row (final or provisional) after every feed."""

import numpy as np
import pytest

import dpsql
from dpsql.methods import machine_for, run
from dpsql.testing import keys
from dpsql.timegrid import RowGrid

HOURLY = ("2024-03-01T09:00", "1h")

CASES = [
    ("hierarchy", {"upper": 60.0}, 24),
    ("hierarchy", {"upper": 60.0}, 1),
    ("hierarchy", {"upper": 60.0, "r": 1024}, 37),
    ("hierarchy", {"upper": 60.0, "grid": HOURLY}, 24),  # calendar days fit
    ("hierarchy", {"upper": 60.0, "grid": HOURLY}, 6),  # a day does not: row-count blocks of at most 6
    ("hierarchy", {"upper": 60.0, "smoother": "recent"}, 3),
    ("tops", {"upper": 200.0, "m": 300}, 24),  # the hold-out is released at the bound as it comes
    ("tops", {"upper": 200.0, "m": 20}, 24),  # the hold-out completes within max_delay: it waits
    ("tops", {"upper": 200.0, "m": 300, "grid": HOURLY}, 24),
    ("tops", {"upper": 200.0, "m": 300, "smoother": "recent"}, 10),
    ("tops", {"upper": 200.0, "threshold": 40.0}, 5),
    ("pak", {"upper": 200.0, "m": 300, "delta": 1e-6}, 50),
]


def _values(n, seed=0):
    return np.round(np.random.default_rng(seed).gamma(2.0, 6.0, n), 2)


@pytest.mark.parametrize(("method", "params", "max_delay"), CASES, ids=str)
def test_no_row_waits_longer_than_max_delay_and_finals_do_not_depend_on_the_chunks(method, params, max_delay):
    n = 2000
    values = _values(n)
    whole = run(method, values, noise=keys(4), epsilon=1.0, max_delay=max_delay, **params).values
    rng = np.random.default_rng(max_delay)
    machine = machine_for(method, None, keys(4).partition(), {"epsilon": 1.0, "max_delay": max_delay, **params})
    outputs, fed = [], 0
    while fed < n:
        step = int(rng.integers(1, 3 * max_delay + 2))
        outputs.append(machine.feed(values[fed:fed + step]))
        fed = min(n, fed + step)
        final = sum(len(o) for o in outputs)
        waiting = machine.provisional()
        assert final + (0 if waiting is None else len(waiting)) == fed  # every row has a value
        assert fed - final <= max_delay - 1, (fed, final)  # none waits for max_delay later rows
    final = np.concatenate(outputs)
    np.testing.assert_array_equal(final, whole[:len(final)])


def test_blocks_follow_the_calendar_where_a_day_fits_else_max_delay_rows():
    with dpsql.testing.seeded(0) as release_keys:
        day = dpsql.methods.machine_for("hierarchy", None, release_keys.partition(),
                                        {"epsilon": 1.0, "upper": 10.0, "grid": HOURLY, "max_delay": 24})
        quarter = dpsql.methods.machine_for("hierarchy", None, release_keys.partition(),
                                            {"epsilon": 1.0, "upper": 10.0, "grid": HOURLY, "max_delay": 6})
        rows = dpsql.methods.machine_for("hierarchy", None, release_keys.partition(),
                                         {"epsilon": 1.0, "upper": 10.0, "max_delay": 100})
    assert day.params()["units"] == ["day", "month", "year"] and day.params()["blocks"][0] == 24
    assert quarter.params()["units"] is None and quarter.params()["blocks"] == [6]
    assert rows.params()["blocks"] == [100]  # the flat rule's 128 at this length, capped
    assert rows.params()["max_delay"] == 100


def test_a_hold_out_longer_than_max_delay_is_released_at_the_bound_with_its_share():
    values = _values(3000, seed=1)
    # a loose bound (the values' largest is 58): the threshold below it, for the noise's ratio to show
    # focus="paper" (Eq. 6): a choice that does not weigh the stream phase's layout, which max_delay changes
    release = run("tops", values, noise=keys(2), epsilon=1.0, upper=400.0, m=300, max_delay=24, focus="paper")
    waited = run("tops", values, noise=keys(2), epsilon=1.0, upper=400.0, m=300, focus="paper")
    assert release.params["holdout_at_bound"] and not waited.params["holdout_at_bound"]
    assert release.epsilon == waited.epsilon == 1.0 and release.components == waited.components
    # the same threshold (chosen from the same rows, the same draws), the hold-out's noise at the bound
    assert release.threshold == waited.threshold < 400.0
    # its noise scales with the bound, not the threshold: (400 / threshold)^2 times the variance
    ratio = release.range_variance(0, 24) / waited.range_variance(0, 24)
    assert ratio > (400.0 / release.threshold) ** 2 / 2
    # and its blocks are at most 24 rows: every 24-row stretch of it ends on a block boundary
    assert set(range(0, 289, 24)) <= set(release.error.block_boundaries(300).tolist())


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "24"])
def test_a_max_delay_that_is_not_a_positive_number_of_rows_is_refused_naming_it(bad):
    for method, params in (("hierarchy", {"upper": 1.0}), ("tops", {"upper": 1.0}), ("pak", {"upper": 1.0,
                                                                                             "delta": 1e-6})):
        with pytest.raises(dpsql.InvalidParameter, match="max_delay"):
            machine_for(method, None, keys(0).partition(), {"epsilon": 1.0, "max_delay": bad, **params})


def test_blocks_longer_than_max_delay_are_refused_naming_it():
    for params in ({"block": 48}, {"depth": 2}):
        with pytest.raises(dpsql.InvalidParameter, match="max_delay=24"):
            machine_for("hierarchy", None, keys(0).partition(), {"epsilon": 1.0, "upper": 1.0, "max_delay": 24,
                                                                  **params})
    # a predictive smoother releases every row on arrival: its blocks never hold a row back
    machine_for("hierarchy", None, keys(0).partition(), {"epsilon": 1.0, "upper": 1.0, "max_delay": 2,
                                                          "smoother": "recent", "depth": 2})
    assert RowGrid.of(HOURLY).rows_per_day == 24
