"""Table front ends for LDP user streams: DuckDB ``dp_ldp*`` macros and Polars ``.dpsql.ldp``."""

from types import SimpleNamespace

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
import dpsql.duckdb
import dpsql.polars
from dpsql import ldp
from dpsql.errors import InvalidParameter, NotionMismatch
from dpsql.polars import ldp as pl_ldp
from dpsql.testing import seeded

USERS, SLOTS, W = 4, 24, 6
PARAMS = dict(epsilon=1.0, w=W, lower=0.0, upper=50.0)


@pytest.fixture
def frame():
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(USERS), SLOTS)
    times = np.tile(np.arange(SLOTS), USERS)
    values = rng.uniform(0, 60, USERS * SLOTS)  # some above the public bound: clipped
    order = rng.permutation(len(values))      # rows arrive in no particular order
    return pl.DataFrame({"user": users[order], "t": times[order], "v": values[order]})


def per_user_releases(frame, method, **params):
    """The oracle: one Python release per user, in user order, each with the key of a front end's
    release in ``seeded(3)`` and the user's key as its partition key (so the user's draws)."""
    ordered = frame.sort("user", "t")
    out = []
    for user in range(USERS):
        values = ordered.filter(pl.col("user") == user)["v"].to_numpy()
        with seeded(3):
            out.append(dpsql.publish(method, values, partition_offsets=[0, len(values)], partition_keys=[user],
                                     **PARAMS, **params).parts[0])
    return out


def connect(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    return con


@pytest.mark.parametrize("method, params", [("capp", {}), ("capp", {"window": 5}), ("pp_s", {"n_s": 3}),
                                            ("ba_sw", {})])
def test_sql_release_equals_per_user_releases_and_is_charged_once(frame, method, params):
    budget = dpsql.Budget.in_memory(epsilon=3.0, notion="w-event-ldp", w=W)
    con = connect(budget)
    con.execute("CREATE TABLE readings AS SELECT * FROM frame")
    extra = "".join(f', "{k}" := {v}' for k, v in params.items())  # "window" is an SQL keyword
    with seeded(3):
        out = con.sql(f"SELECT * FROM dp_ldp('readings', 't', 'v', method := '{method}', partition_by := 'user', "
                          f"epsilon := 1, w := {W}, lower := 0, upper := 50{extra})").pl()
    assert budget.spent == (1.0, 0.0)
    history = budget.history(full=True)
    assert history["partitions"].to_list() == [USERS] and history["method"].to_list() == [method]
    expected = per_user_releases(frame, method, **params)
    assert np.array_equal(out["v"].to_numpy(), np.concatenate([r.values for r in expected]))
    reports, index = ldp.report_view(SimpleNamespace(parts=expected))
    assert np.array_equal(out["report"].to_numpy(), reports)
    assert np.array_equal(out["dp_report"].to_numpy(), index)
    assert out["user"].to_list() == sorted(out["user"].to_list())
    assert np.array_equal(out["dp_user"].to_numpy(), np.repeat(np.arange(USERS), SLOTS))
    assert np.array_equal(out["dp_slot"].to_numpy(), np.tile(np.arange(SLOTS), USERS))
    first = out["dp_row"][0]
    assert np.array_equal(out["dp_row"].to_numpy(), first + np.arange(USERS * SLOTS))  # one block of handles
    # Error bars by handle: user 1's slots 2..8 are handles first + SLOTS + 2 .. first + SLOTS + 8.
    (variance,) = con.execute(f"SELECT dp_range_variance({first + SLOTS + 2}, {first + SLOTS + 9})").fetchall()[0]
    assert variance == pytest.approx(expected[1].range_variance(2, 9), rel=1e-12)


def test_sql_collector_macros_are_the_library_estimators(frame):
    budget = dpsql.Budget.in_memory(epsilon=3.0, notion="w-event-ldp", w=W)
    con = connect(budget)
    con.execute("CREATE TABLE readings AS SELECT * FROM frame")
    with seeded(3):
        con.execute(f"CREATE TABLE r AS SELECT * FROM dp_ldp('readings', 't', 'v', method := 'ipp', "
                    f"partition_by := 'user', epsilon := 1, w := {W}, lower := 0, upper := 50)")
    spent = budget.spent
    expected = per_user_releases(frame, "ipp")
    means = con.execute("SELECT mean FROM dp_ldp_subsequence_means('r', 5, 17)").fetchall()
    assert np.allclose([m for (m,) in means], [ldp.subsequence_means(ldp.slot_values(r), [5], [17])[0]
                                                for r in expected])
    # IPP publishes the trailing SMA-3 of its reports: the SQL smoother gives it back
    smoothed = con.execute("""SELECT value FROM dp_ldp_smoothed('r', "window" := 3)""").fetchall()
    assert np.allclose([v for (v,) in smoothed], np.concatenate([r.values for r in expected]))
    centred = con.execute("""SELECT value FROM dp_ldp_smoothed('r', "window" := 5, align := 'center')""").fetchall()
    assert np.allclose([v for (v,) in centred], np.concatenate(
        [ldp.published_stream(r.reports, ldp.report_lengths(r), SLOTS, window=5, align="center") for r in expected]))
    crowd = con.execute("SELECT mean, cdf FROM dp_ldp_crowd_distribution('r', 0, 24)").fetchall()
    support, cdf = ldp.crowd_distribution([ldp.slot_values(r).mean() for r in expected])
    assert np.allclose([m for m, _ in crowd], support) and np.allclose([c for _, c in crowd], cdf)
    assert budget.spent == spent  # post-processing charges nothing
    with pytest.raises(duckdb.Error, match="align must be"):
        con.execute("SELECT * FROM dp_ldp_smoothed('r', align := 'left')").fetchall()


def test_sql_refusals_charge_nothing(frame):
    central = dpsql.Budget.in_memory(epsilon=3.0)
    con = connect(central)
    con.execute("CREATE TABLE readings AS SELECT * FROM frame")
    with pytest.raises(NotionMismatch), dpsql.duckdb.typed_errors():
        con.execute("SELECT * FROM dp_ldp('readings', 't', 'v', partition_by := 'user', epsilon := 1, w := 6, "
                    "lower := 0, upper := 50)").fetchall()
    ldp_budget = dpsql.Budget.in_memory(epsilon=3.0, notion="w-event-ldp", w=W)
    con = connect(ldp_budget)
    con.execute("CREATE TABLE readings AS SELECT * FROM frame")
    with pytest.raises(InvalidParameter, match="accounting='paper'"), dpsql.duckdb.typed_errors():
        con.execute("SELECT * FROM dp_ldp('readings', 't', 'v', partition_by := 'user', epsilon := 1, w := 6, "
                    "lower := 0, upper := 50, accounting := 'paper')").fetchall()
    assert central.spent == ldp_budget.spent == (0.0, 0.0)


@pytest.mark.parametrize("method", ["app", "sampling"])
def test_polars_release_equals_per_user_releases(frame, method):
    budget = dpsql.Budget.in_memory(epsilon=3.0, notion="w-event-ldp", w=W)
    with seeded(3):
        out = frame.with_columns(pl.col("v").dpsql.ldp(method=method, order_by="t", partition_by="user",
                                                       budget=budget, **PARAMS).alias("dp")).unnest("dp")
    assert budget.spent == (1.0, 0.0)
    expected = per_user_releases(frame, method)
    ordered = out.sort("user", "t")
    assert np.array_equal(ordered["value"].to_numpy(), np.concatenate([r.values for r in expected]))
    assert np.array_equal(ordered["report"].to_numpy(), np.concatenate([ldp.slot_values(r) for r in expected]))
    # the collector's side, on the frame in its own (shuffled) row order
    smoothed = out.with_columns(pl_ldp.smoothed(partition_by="user", order_by="t", window=3).alias("s"))
    assert np.allclose(smoothed.sort("user", "t")["s"].to_numpy(), np.concatenate(
        [ldp.published_stream(r.reports, ldp.report_lengths(r), SLOTS, window=3) for r in expected]))
    means = pl_ldp.subsequence_means(out, partition_by="user", order_by="t", start=2, stop=14).sort("user")
    assert np.allclose(means["mean"].to_numpy(),
                       [ldp.subsequence_means(ldp.slot_values(r), [2], [14])[0] for r in expected])
    crowd = pl_ldp.crowd_distribution(means["mean"])
    assert crowd["cdf"].to_list()[-1] == 1.0 and crowd["mean"].is_sorted()


def test_polars_refuses_other_methods_and_bad_smoothers(frame):
    with pytest.raises(InvalidParameter, match="LDP user stream"):
        pl.col("v").dpsql.ldp(method="laplace", order_by="t", partition_by="user", epsilon=1.0, upper=1.0)
    with pytest.raises(InvalidParameter, match="align"):
        pl_ldp.smoothed(partition_by="user", order_by="t", align="left")
    with pytest.raises(InvalidParameter, match="odd"):
        pl_ldp.smoothed(partition_by="user", order_by="t", window=4, align="center")
    budget = dpsql.Budget.in_memory(epsilon=3.0, notion="w-event-ldp", w=W)
    with pytest.raises(dpsql.InvalidTimeKey):
        frame.with_columns(pl.col("v").dpsql.ldp(order_by=pl.lit(0), partition_by="user", budget=budget, **PARAMS))
    assert budget.spent == (0.0, 0.0)
