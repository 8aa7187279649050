"""ToPS's threshold for what the release is for (``focus``) on every public layout: the query mix
(beta) is computed from the stream phase's whole layout, never from another release's cached mix,
and a layout whose mix cannot be computed never fails a release after its charge (review of the
``objective`` merge)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap

import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql import publishing
from dpsql.partition_digests import AdmittedPartitions

_THRESHOLD_OF_A_DELAYED_STREAM = textwrap.dedent("""
    import sys, numpy as np, polars as pl, dpsql
    frame = pl.DataFrame({"hour": np.arange(6000), "kwh": np.random.default_rng(1).exponential(10.0, 6000)})
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    if sys.argv[1] == "after":  # another stream first, alike but for max_delay, in the same process
        budget.stream("a", method="tops", epsilon=1.0, order_by="hour", value="kwh", upper=1000.0).append(frame)
    with dpsql.testing.seeded(7):
        stream = budget.stream("b", method="tops", epsilon=1.0, order_by="hour", value="kwh", upper=1000.0,
                               max_delay=24)
    stream.append(frame)
    print(repr(stream.release().threshold))
""")


def _threshold_in_a_fresh_process(mode: str) -> float:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _THRESHOLD_OF_A_DELAYED_STREAM, mode], capture_output=True,
                          text=True, env=environment, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def test_a_stream_s_threshold_does_not_depend_on_the_releases_made_before_it_in_the_process():
    # max_delay sets the stream phase's blocks, hence its noise per range: a query mix cached
    # for the same layout without it would give this stream another release's beta
    assert _threshold_in_a_fresh_process("alone") == _threshold_in_a_fresh_process("after")


def _daily(n: int) -> pl.DataFrame:
    days = [dt.datetime(2000, 1, 1) + dt.timedelta(days=i) for i in range(n)]
    return pl.DataFrame({"day": days, "kwh": np.random.default_rng(0).exponential(10.0, n)})


@pytest.mark.parametrize("layout", [{"grid": ("2000-01-01", "1d")}, {"max_delay": "7d"}])
def test_a_charged_stream_on_daily_keys_releases_its_rows(layout):
    # a daily grid's 2**18 rows reach past 2262: the query mix must not need them
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    stream = budget.stream("daily", method="tops", epsilon=1.0, order_by="day", value="kwh", upper=1000.0,
                           **layout)
    assert budget.spent == (1.0, 0.0)  # charged at registration: every append after must release
    released = stream.append(_daily(5000))
    assert released.num_rows == 5000 and 0.0 < stream.release().threshold <= 1000.0


def test_a_one_shot_tops_release_on_a_daily_grid_is_released():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    release = dpsql.tops(_daily(6000)["kwh"].to_numpy(), epsilon=1.0, upper=1000.0, grid=("2000-01-01", "1d"),
                         budget=budget)
    assert len(release) == 6000 and budget.spent == (1.0, 0.0)


def test_a_distributed_fleet_on_a_daily_grid_is_refused_before_its_charge_or_released():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    values = _daily(3000)["kwh"].to_numpy()
    with dpsql.testing.seeded(1):
        planned = publishing.DistributedRelease("tops", {"epsilon": 1.0, "upper": 1000.0, "m": 500,
                                                         "grid": ("2000-01-01", "1d")}, budget=budget)
        planned.check(rows=3000)
        try:
            task = planned.charge(shapes={(1500, 250): "a"}, admitted=AdmittedPartitions([]), rows=3000,
                                  pool=values[:500])
        except dpsql.DPError:
            assert budget.spent == (0.0, 0.0)  # a refusal charges nothing
        else:
            assert 0.0 < task.params["threshold"] <= 1000.0


def test_an_hourly_grid_with_no_whole_month_before_2262_chooses_for_its_days_and_weeks():
    """Months that the grid's times cannot hold (they end on 2262-04-11) are not asked of it; a
    mix with no whole unit at all is refused before the charge."""
    values = np.random.default_rng(3).exponential(10.0, 600)
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    release = dpsql.tops(values, epsilon=1.0, upper=1000.0, m=200, grid=("2262-03-15", "1h"), budget=budget)
    assert np.isfinite(release.threshold) and 0 < release.threshold <= 1000.0
    hierarchy = dpsql.streams.hierarchy.HierarchyStream(epsilon=1.0, upper=1.0, grid=("2262-03-15", "1h"),
                                                        noise=dpsql.testing.draws(0))
    assert hierarchy.query_mix(("day", "week", "month")).lengths == (24, 168)
    with pytest.raises(dpsql.InvalidParameter, match="no whole month fits"):
        hierarchy.query_mix(("month",))
