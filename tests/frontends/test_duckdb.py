"""DuckDB front end: releases from SQL equal the core's, are charged once per release,
refuse bad input without charging, and give exact error bars for window sums."""

from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pytest

import dpsql
import dpsql.duckdb
from dpsql.duckdb import context, macros, ordered
from dpsql.errors import BudgetExhausted, InvalidData, InvalidParameter, InvalidTimeKey, UnknownRelease
from dpsql.noise import Lane

RANGE_SUM = "SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', epsilon := 0.5, upper := 10)"


def _data(n: int, seed: int = 0) -> np.ndarray:
    """Test values in [0, 12) (some above the bound 10, so clipping is exercised)."""
    return np.round(dpsql.testing.draws(seed).lane(Lane.ROWS).uniform(0, n) * 12, 3)


@pytest.fixture
def budget():
    return dpsql.Budget.in_memory(epsilon=10.0, delta=1e-3)


@pytest.fixture
def con(budget):
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    n = 1000
    values = _data(n)
    # Physically shuffled: the release must follow ts, not storage order.
    order = np.argsort(_data(n, seed=1))
    con.from_arrow(pa.table({"ts": (np.arange(n) * 3600 * 10**6)[order].astype("datetime64[us]"),
                             "v": values[order], "g": (np.arange(n) % 3)[order]})).create("t")
    yield con
    con.close()


@pytest.fixture(params=["numpy", "duckdb"])
def ordering_path(request, monkeypatch):
    """Integer-like keys are ordered in numpy (dpsql.ordering); others by DuckDB's ORDER BY,
    validated batch by batch. Tests taking this fixture run on both paths."""
    if request.param == "duckdb":
        monkeypatch.setattr(macros, "orders_in_numpy", lambda order_type, partition_type: False)
    return request.param


#: The table's order keys (hourly from the epoch, in time order): SQL gives them to the core, which
#: derives from them the rows' time grid (calendar blocks) and a fleet's earliest rows.
TS = (np.arange(1000) * 3600 * 10**6).astype("datetime64[us]")


def _core(method, values, **params):
    """The release dpsql.publish gives (under the caller's seeded block: no budget needed)."""
    return dpsql.publish(method, values, **params)


def _releases(budget):
    """The ids of the charged releases (cache hits answer with an earlier one)."""
    history = budget.history(full=True)
    return history.filter(pl.col("kind") == "release")["release_id"].to_list()


def test_release_equals_the_core_release_in_time_order(con, budget, ordering_path):
    with dpsql.testing.seeded(5):
        out = con.sql(RANGE_SUM).pl()
    with dpsql.testing.seeded(5):
        expected = _core("laplace", _data(1000), epsilon=0.5, upper=10.0)
    assert out.columns == ["ts", "v", "dp_row"]
    assert out["ts"].is_sorted()
    np.testing.assert_array_equal(out["v"].to_numpy(), expected.values)
    rows = out["dp_row"].to_numpy()
    np.testing.assert_array_equal(rows, rows[0] + np.arange(1000))  # the ledger's first block
    assert rows[0] % 2**32 == 0 and 0 <= rows[0] < 2**63  # starting at its random base
    assert budget.spent == (0.5, 0.0)
    history = budget.history(full=True)
    release_id = con.execute(f"SELECT dp_release_id({out['dp_row'][0]})").fetchall()[0][0]
    assert history["release_id"].to_list() == [release_id]
    assert history["rows"].to_list() == [1000]


def test_every_registered_stream_method_matches_the_core(con):
    for method, params in [("tops", dict(m=100, r=256)), ("tops", dict(m=200, smoother="median", fanout=4)),
                           ("pak", dict(m=100, delta=1e-6)), ("binary_tree", {}), ("laplace", {})]:
        sql_params = "".join(f", {k} := {v!r}" for k, v in params.items())
        with dpsql.testing.seeded(9):
            out = con.sql(f"SELECT v FROM dp_range_sum('t', 'ts', 'v', method := '{method}', epsilon := 1, "
                          f"upper := 10{sql_params})").fetchnumpy()["v"]
        with dpsql.testing.seeded(9):
            expected = _core(method, _data(1000), epsilon=1.0, upper=10.0, order_values=TS, **params)
        np.testing.assert_array_equal(out, expected.values, err_msg=method)


def test_partitions_are_released_independently_and_charged_once_at_the_max(con, budget):
    with dpsql.testing.seeded(2):
        out = con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', epsilon := 0.5, "
                      "upper := 10, partition_by := 'g')").pl()
    values = _data(1000)
    groups = np.arange(1000) % 3
    sorted_values = np.concatenate([values[groups == k] for k in range(3)])
    sizes = [np.sum(groups == k) for k in range(3)]
    with dpsql.testing.seeded(2):  # the partitions' noise is addressed by their keys, 0, 1 and 2
        expected = _core("laplace", sorted_values, partition_offsets=np.concatenate([[0], np.cumsum(sizes)]),
                         partition_keys=[0, 1, 2], epsilon=0.5, upper=10.0)
    assert out.columns[:2] == ["g", "ts"]
    np.testing.assert_array_equal(out["v"].to_numpy(), expected.values)
    assert out["g"].to_list() == sorted(out["g"].to_list())
    # One block in output order: each partition owns a contiguous range of handles.
    rows = out["dp_row"].to_numpy()
    np.testing.assert_array_equal(rows, rows[0] + np.arange(1000))
    assert budget.spent == (0.5, 0.0)
    assert budget.history(full=True)["partitions"].to_list() == [3]


@pytest.mark.parametrize("method", ["binary_tree", "tops"])
@pytest.mark.parametrize("partitioned", [False, True])
def test_window_error_bars_equal_the_release_error_model(con, method, partitioned):
    """SQL windows over dp_row give the core release's exact range variances and
    intervals (correlated noise for both methods), per partition when partitioned."""
    by = "g" if partitioned else "NULL"
    params = {"m": 100} if method == "tops" else {}  # ToPS: a hold-out shorter than the partitions
    extra = "".join(f", {k} := {v}" for k, v in params.items())
    query = f"""
        WITH r AS (SELECT * FROM dp_range_sum('t', 'ts', 'v', method := '{method}', epsilon := 1, upper := 10,
                                              partition_by := {by}{extra}))
        SELECT {'g' if partitioned else '0'} AS g, ts, sum(v) OVER w AS total,
               min(dp_row) OVER w - min(dp_row) OVER whole AS i, max(dp_row) OVER w + 1 - min(dp_row) OVER whole AS j,
               dp_range_variance(min(dp_row) OVER w, max(dp_row) OVER w + 1) AS var,
               dp_range_margin(min(dp_row) OVER w, max(dp_row) OVER w + 1) AS margin,
               dp_range_margin(min(dp_row) OVER w, max(dp_row) OVER w + 1, 0.5) AS half
        FROM r
        WINDOW w AS ({'PARTITION BY g' if partitioned else ''} ORDER BY ts
                     RANGE BETWEEN INTERVAL 23 HOUR PRECEDING AND CURRENT ROW),
               whole AS ({'PARTITION BY g' if partitioned else ''})
        ORDER BY g, ts"""
    values, groups, ts = _data(1000), np.arange(1000) % 3, TS
    offsets = None
    if partitioned:
        values = np.concatenate([values[groups == k] for k in range(3)])
        ts = np.concatenate([TS[groups == k] for k in range(3)])
        offsets = np.searchsorted(np.sort(groups), np.arange(4))
    with dpsql.testing.seeded(3):
        out = con.sql(query).pl()
    with dpsql.testing.seeded(3):
        release = _core(method, values, epsilon=1.0, upper=10.0, partition_offsets=offsets, order_values=ts,
                        **params)
    parts = release.parts if partitioned else (release,)
    for k, part in enumerate(parts):
        rows = out.filter(pl.col("g") == k)
        i, j = rows["i"].to_numpy(), rows["j"].to_numpy()
        assert (j - i).max() == 24 if not partitioned else (j - i).max() == 8
        np.testing.assert_allclose(rows["total"].to_numpy(), part.range_sum(i, j), rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(rows["var"].to_numpy(), part.range_variance(i, j), rtol=1e-12)
        low, high = part.range_ci(i, j)
        np.testing.assert_allclose(rows["margin"].to_numpy(), (high - low) / 2, rtol=1e-9)
        low, high = part.range_ci(i, j, level=0.5)
        np.testing.assert_allclose(rows["half"].to_numpy(), (high - low) / 2, rtol=1e-9)


def test_daily_intervals_cover_the_true_sums(budget):
    """Disjoint daily windows of one Laplace release: the 95 % intervals cover the
    clipped true sums about 95 % of the time (binomial tolerance)."""
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=100.0))
    n = 24 * 400
    values = np.clip(_data(n, seed=4), 0, 10)
    con.from_arrow(pa.table({"ts": np.arange(n), "v": values})).create("t")
    with dpsql.testing.seeded(11):
        out = con.sql("""
            SELECT ts // 24 AS day, sum(v) AS total, min(dp_row) AS i, max(dp_row) + 1 AS j,
                   dp_range_margin(min(dp_row), max(dp_row) + 1) AS margin
            FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', epsilon := 0.5, upper := 10)
            GROUP BY day ORDER BY day""").pl()
    truth = values.reshape(-1, 24).sum(axis=1)
    covered = np.abs(out["total"].to_numpy() - truth) <= out["margin"].to_numpy()
    assert 0.92 <= covered.mean() <= 1.0


def test_register_is_idempotent_and_rebinds_the_budget(con, budget):
    other = dpsql.Budget.in_memory(epsilon=3.0)
    dpsql.duckdb.register(con, budget=other)
    dpsql.duckdb.register(con, budget=other)
    with dpsql.testing.seeded(0):
        con.sql(RANGE_SUM).fetchall()
    assert budget.spent == (0.0, 0.0)
    assert other.spent == (0.5, 0.0)


def test_register_refuses_a_missing_budget():
    with pytest.raises(InvalidParameter, match=r"budget must be a dpsql\.Budget"):
        dpsql.duckdb.register(duckdb.connect(), budget=None)


# -- engine safety --------------------------------------------------------------------------

def test_noise_functions_have_side_effects(con):
    rows = con.sql("SELECT function_name, has_side_effects FROM duckdb_functions() "
                   "WHERE function_name LIKE 'dp%' AND function_type = 'scalar'").fetchall()
    names = {name for name, _ in rows}
    assert {"dp__plan_dp_range_sum", "dp__plan_threshold", "dp_range_variance", "dp_release_id"} <= names
    assert all(flag for _, flag in rows)


def test_releases_run_when_the_query_executes_from_the_registered_result_slots(con, budget):
    """Binding plans and charges nothing; the release runs when DuckDB scans the slot, once
    per execution (an identical execution is answered from the ledger, free), and a query with
    as many macro calls as slots gets a plan for each."""
    slots = {name for (name,) in con.sql("SHOW TABLES").fetchall() if name.startswith("dp__result_")}
    assert slots == {f"dp__result_{i}" for i in range(context.RESULT_SLOTS)}
    relation = con.sql(RANGE_SUM)
    assert relation.columns == ["ts", "v", "dp_row"] and budget.spent == (0.0, 0.0)
    with dpsql.testing.seeded(3):
        first = relation.fetchall()
        again = relation.fetchall()
    assert first == again
    assert budget.history()["kind"].to_list() == ["release", "cache hit"] and budget.spent == (0.5, 0.0)
    calls = " UNION ALL ".join(f"SELECT {k} AS k, sum(v) AS s FROM dp_range_sum('t', 'ts', 'v', "
                               f"method := 'laplace', epsilon := {0.01 * (k + 1)}, upper := 10)"
                               for k in range(context.RESULT_SLOTS))
    with dpsql.testing.seeded(4):
        con.sql(calls).fetchall()
    epsilons = budget.history()["epsilon"].to_list()[2:]
    assert sorted(epsilons) == [0.01 * (k + 1) for k in range(context.RESULT_SLOTS)]


def test_rows_do_not_share_noise(con):
    con.execute("CREATE TABLE flat AS SELECT range AS ts, 5.0 AS v FROM range(500)")
    with dpsql.testing.seeded(1):
        values = con.sql("SELECT v FROM dp_range_sum('flat', 'ts', 'v', method := 'laplace', epsilon := 1, "
                         "upper := 10)").fetchnumpy()["v"]
    assert len(np.unique(values)) > 400


def test_two_identical_calls_in_one_query_are_one_release_answered_twice(con, budget):
    with dpsql.testing.seeded(1):
        out = con.sql(f"SELECT a.v AS a, b.v AS b, dp_release_id(a.dp_row) AS ra, dp_release_id(b.dp_row) AS rb "
                      f"FROM ({RANGE_SUM}) a JOIN ({RANGE_SUM}) b USING (ts) ORDER BY ts").pl()
    assert out.height == 1000 and out["ra"].n_unique() == 1 and out["ra"].equals(out["rb"])
    np.testing.assert_array_equal(out["a"].to_numpy(), out["b"].to_numpy())
    assert budget.history()["kind"].to_list() == ["release", "cache hit"] and budget.spent == (0.5, 0.0)


def test_two_fresh_calls_in_one_query_are_two_charged_releases(con, budget):
    fresh = RANGE_SUM.replace("upper := 10", "upper := 10, fresh := true")
    with dpsql.testing.seeded(1):
        out = con.sql(f"SELECT a.v AS a, b.v AS b, a.dp_row AS row_a, b.dp_row AS row_b, "
                      f"dp_release_id(a.dp_row) AS ra, dp_release_id(b.dp_row) AS rb "
                      f"FROM ({fresh}) a JOIN ({fresh}) b USING (ts) ORDER BY ts").pl()
    assert out.height == 1000
    assert out["ra"].n_unique() == out["rb"].n_unique() == 1
    assert {out["ra"][0], out["rb"][0]} == set(_releases(budget)) and out["ra"][0] != out["rb"][0]
    assert not np.array_equal(out["a"].to_numpy(), out["b"].to_numpy())
    # Two disjoint contiguous blocks, one per release, consecutive in time order.
    for rows in (out["row_a"].to_numpy(), out["row_b"].to_numpy()):
        np.testing.assert_array_equal(rows, rows[0] + np.arange(1000))
    first, second = sorted([out["row_a"][0], out["row_b"][0]])
    assert second - first == 1000
    assert budget.spent == (1.0, 0.0)


def test_a_cte_read_twice_is_one_release_or_charged_twice(con, budget):
    with dpsql.testing.seeded(1):
        out = con.sql(f"WITH r AS ({RANGE_SUM}) SELECT dp_release_id(a.dp_row) AS ra, "
                      f"dp_release_id(b.dp_row) AS rb "
                      f"FROM r a JOIN r b USING (ts)").pl()
    released = set(out["ra"]) | set(out["rb"])
    assert set(_releases(budget)) == released  # read twice, it would be answered twice from one release
    assert budget.spent == (0.5, 0.0)


def test_each_fresh_execution_is_a_new_charged_release_and_a_repeat_is_free(con, budget):
    relation = con.sql(RANGE_SUM.replace("upper := 10", "upper := 10, fresh := true"))
    with dpsql.testing.seeded(1):
        first = relation.fetchnumpy()
        second = relation.fetchnumpy()
        repeated = con.sql(RANGE_SUM).fetchnumpy()  # not fresh: the latest identical release's answer
    assert not np.array_equal(first["v"], second["v"])
    # Each charged execution takes the next block of handles.
    np.testing.assert_array_equal(first["dp_row"], first["dp_row"][0] + np.arange(1000))
    np.testing.assert_array_equal(second["dp_row"], first["dp_row"][0] + np.arange(1000, 2000))
    ids = con.execute(f"SELECT dp_release_id({first['dp_row'][0]}), "
                      f"dp_release_id({second['dp_row'][-1]})").fetchall()[0]
    assert list(ids) == _releases(budget)
    np.testing.assert_array_equal(repeated["v"], second["v"])
    np.testing.assert_array_equal(repeated["dp_row"], second["dp_row"])
    assert budget.history()["kind"].to_list() == ["release", "release", "cache hit"]
    assert budget.spent == (1.0, 0.0)


def test_exhausted_budget_charges_and_releases_nothing(con, budget):
    with pytest.raises(BudgetExhausted), dpsql.testing.seeded(1):
        con.sql(RANGE_SUM.replace("0.5", "11")).fetchall()
    assert budget.spent == (0.0, 0.0)
    with pytest.raises(BudgetExhausted), dpsql.duckdb.typed_errors(), dpsql.testing.seeded(1):
        con.sql(RANGE_SUM.replace("0.5", "11")).fetchall()
    assert budget.history().height == 0


def test_an_error_while_the_source_is_read_charges_nothing(con, budget, monkeypatch):
    monkeypatch.setattr(ordered, "BATCH_ROWS", 100)
    con.execute("CREATE VIEW failing AS SELECT ts, CASE WHEN ts > 500 THEN error('source broke') ELSE v END AS v "
                "FROM (SELECT range AS ts, 1.0 AS v FROM range(1000))")
    with pytest.raises(duckdb.Error, match="source broke"), dpsql.testing.seeded(1):
        con.sql(RANGE_SUM.replace("'t'", "'failing'")).fetchall()
    assert budget.spent == (0.0, 0.0)


def test_a_query_failing_after_the_release_is_not_refunded(con, budget):
    """Documented: the failure could depend on the private values, so the charge stands."""
    with pytest.raises(duckdb.Error, match="after release"), dpsql.testing.seeded(1):
        con.sql(f"SELECT CASE WHEN v > 1e9 THEN 0 ELSE error('after release') END FROM ({RANGE_SUM})").fetchall()
    assert budget.spent == (0.5, 0.0)


def test_error_bar_ranges_must_lie_in_one_partition_of_one_release(con):
    partitioned = ("SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', epsilon := 0.5, upper := 10, "
                   "partition_by := 'g')")
    with dpsql.testing.seeded(0):
        con.execute(f"CREATE TABLE a AS {partitioned}")  # handles b..b+999, partitions of 334, 333, 333 rows
        con.execute(f"CREATE TABLE b AS {RANGE_SUM}")    # handles b+1000..b+1999
    (b,) = con.execute("SELECT min(dp_row) FROM a").fetchall()[0]
    (variance,) = con.execute(f"SELECT dp_range_variance({b + 334}, {b + 667})").fetchall()[0]
    assert variance == pytest.approx(333 * 2 * (10 / 0.5) ** 2, rel=0.01)  # lattice rounding of the scale
    for start, stop, message in [
            (300, 400, f"rows start_row={b + 300} .. stop_row={b + 400} span two partitions of release"),
            (990, 1010, "span two releases"),
            (1990, 2010, "span two releases"),  # beyond the last handle issued
            (2000, 2001, f"dp_row {b + 2000} is not a row handle of any release recorded in ledger"),
            (-1, 3, f"dp_row {b - 1} is not a row handle"),
            (5, 5, "needs start_row < stop_row"),
            (6, 5, "needs start_row < stop_row")]:
        for function in ("dp_range_variance", "dp_range_margin"):
            with pytest.raises(InvalidParameter, match=message), dpsql.duckdb.typed_errors():
                con.sql(f"SELECT {function}({b + start}, {b + stop})").fetchall()
    with pytest.raises(UnknownRelease, match=f"dp_row {b + 2000} is not a row handle"), \
            dpsql.duckdb.typed_errors():
        con.sql(f"SELECT dp_release_id({b + 2000})").fetchall()
    nulls = con.execute("SELECT dp_range_variance(NULL, 5), dp_range_margin(1, NULL), dp_release_id(NULL)")
    assert nulls.fetchall() == [(None, None, None)]


def test_error_bars_of_every_release_stay_available(budget):
    """Round 1 kept the error models of a connection's last 32 releases only; handles now resolve
    through the ledger, so the first of many releases keeps its exact error bars."""
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=dpsql.Budget.in_memory(epsilon=1e3))
    con.execute("CREATE TABLE small AS SELECT range AS ts, 1.0 AS v FROM range(5)")
    query = ("SELECT * FROM dp_range_sum('small', 'ts', 'v', method := 'laplace', epsilon := 1, upper := 1, "
             "fresh := true)")
    with dpsql.testing.seeded(0):
        b = min(row for _, _, row in con.sql(query).fetchall())
        for _ in range(40):
            con.sql(query).fetchall()
    lattice = dpsql.mechanisms.LaplaceLattice(sensitivity=1.0, epsilon=1.0)
    first, last = con.execute(f"SELECT dp_range_variance({b}, {b + 5}), dp_range_variance({b + 200}, "
                              f"{b + 205})").fetchall()[0]
    assert first == last == pytest.approx(5 * lattice.variance)
    con.close()


def test_handles_of_a_saved_table_resolve_through_their_ledger_and_only_there(tmp_path):
    """A released table outlives its connection; its dp_row finds its release through the ledger
    from any connection registered with that ledger, and is refused by another ledger (each
    ledger's handles start at a random base), never mistaken for one of its releases."""
    path = str(tmp_path / "saved.duckdb")
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    old = duckdb.connect(path)
    dpsql.duckdb.register(old, budget=budget)
    old.execute("CREATE TABLE t AS SELECT range AS ts, 1.0 AS v FROM range(100)")
    old.execute("CREATE TABLE saved AS SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', "
                "epsilon := 1, upper := 1)")
    old.close()
    new = duckdb.connect(path)
    dpsql.duckdb.register(new, budget=budget)
    new.execute("CREATE TABLE fresh AS SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', "
                "epsilon := 1, upper := 1, fresh := true)")  # not the saved release's cached answer
    (saved_first,) = new.execute("SELECT min(dp_row) FROM saved").fetchall()[0]
    margin = "SELECT dp_range_margin(min(dp_row), max(dp_row) + 1) FROM {}"
    (saved_margin,) = new.execute(margin.format("saved")).fetchall()[0]
    (fresh_margin,) = new.execute(margin.format("fresh")).fetchall()[0]
    assert saved_margin == fresh_margin > 0  # the same method and parameters over 100 rows
    assert saved_first != new.execute("SELECT min(dp_row) FROM fresh").fetchall()[0][0]
    new.close()
    other = duckdb.connect(path)
    dpsql.duckdb.register(other, budget=dpsql.Budget.in_memory(epsilon=10.0))  # another ledger
    with pytest.raises(UnknownRelease, match=f"dp_row {saved_first} is not a row handle"), \
            dpsql.duckdb.typed_errors():
        other.sql(margin.format("saved")).fetchall()
    other.close()


# -- refusals: typed errors with the core's messages, nothing charged ---------------------------

def _refusal(con, query):
    with pytest.raises(dpsql.DPError) as info, dpsql.duckdb.typed_errors(), dpsql.testing.seeded(1):
        con.sql(query).fetchall()
    return info.value


def test_parameter_errors_are_the_cores(con, budget):
    for sql, core in [("epsilon := -1, upper := 10", dict(epsilon=-1.0, upper=10.0)),
                      ("epsilon := 1, upper := 0", dict(epsilon=1.0, upper=0.0)),
                      ("epsilon := 1", dict(epsilon=1.0))]:
        error = _refusal(con, f"SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'laplace', {sql})")
        with pytest.raises(type(error)) as expected:
            _core("laplace", np.ones(3), **core)
        assert str(error) == str(expected.value)
    error = _refusal(con, "SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'nope', epsilon := 1, upper := 1)")
    assert isinstance(error, InvalidParameter) and "unknown method 'nope'" in str(error)
    assert budget.history().height == 0


def test_bad_values_are_refused_naming_the_column(con, budget):
    con.execute("CREATE TABLE bad AS SELECT range AS ts, CASE WHEN range = 7 THEN {} ELSE 1.0 END AS x, "
                "range::VARCHAR AS s FROM range(20)".format("'nan'::DOUBLE"))
    con.execute("CREATE TABLE nulls AS SELECT range AS ts, CASE WHEN range = 7 THEN NULL ELSE 1.0 END AS x "
                "FROM range(20)")
    con.execute("CREATE TABLE empty AS SELECT range AS ts, 1.0 AS x FROM range(0)")
    for table, column, kind, text in [("bad", "x", InvalidData, "column 'x' contains NaN values"),
                                      ("nulls", "x", InvalidData, "column 'x' contains 1 null value(s)"),
                                      ("empty", "x", InvalidData, "column 'x' is empty"),
                                      ("bad", "s", InvalidData, "column 's' must be numeric, got VARCHAR"),
                                      ("bad", "zz", InvalidParameter, "value_col 'zz' is not a column of 'bad'")]:
        error = _refusal(con, f"SELECT * FROM dp_range_sum('{table}', 'ts', '{column}', method := 'laplace', "
                              "epsilon := 1, upper := 1)")
        assert isinstance(error, kind) and text in str(error), (table, column, str(error))
    assert budget.history().height == 0


def test_order_keys_must_be_unique_and_present_within_a_partition(con, budget, monkeypatch, ordering_path):
    monkeypatch.setattr(ordered, "BATCH_ROWS", 64)
    con.execute("CREATE TABLE dup AS SELECT range // 100 AS ts, range % 100 AS g, 1.0 AS v FROM range(1000) "
                "UNION ALL SELECT 5, 0, 2.0")
    con.execute("CREATE TABLE nullkey AS SELECT CASE WHEN range = 300 THEN NULL ELSE range END AS ts, 1.0 AS v "
                "FROM range(1000)")
    base = "SELECT * FROM dp_range_sum('{}', 'ts', 'v', method := 'laplace', epsilon := 1, upper := 1{})"
    error = _refusal(con, base.format("dup", ", partition_by := 'g'"))
    assert isinstance(error, InvalidTimeKey)
    assert str(error).startswith("order column 'ts' has duplicate value 5 within a partition of 'g'")
    error = _refusal(con, base.format("nullkey", ""))
    assert isinstance(error, InvalidTimeKey) and "order column 'ts' contains 1 NULL value(s)" in str(error)
    assert budget.history().height == 0
    con.execute("CREATE TABLE shared AS SELECT range % 100 AS ts, range // 100 AS g, 1.0 AS v FROM range(1000)")
    with dpsql.testing.seeded(0):  # equal keys in different partitions are fine
        out = con.sql(base.format("shared", ", partition_by := 'g'")).pl()
    assert out.height == 1000 and out["g"].n_unique() == 10


def test_keys_are_checked_across_batch_boundaries(con, budget, monkeypatch, ordering_path):
    monkeypatch.setattr(ordered, "BATCH_ROWS", 1)  # every adjacent pair straddles two batches
    con.execute("CREATE TABLE straddle AS SELECT range AS ts, 1.0 AS v FROM range(20) UNION ALL SELECT 9, 2.0")
    con.execute("CREATE TABLE nullpart AS SELECT range AS ts, CASE WHEN range = 3 THEN NULL ELSE 1 END AS g, "
                "1.0 AS v FROM range(20)")
    base = "SELECT * FROM dp_range_sum('{}', 'ts', 'v', method := 'laplace', epsilon := 1, upper := 1{})"
    error = _refusal(con, base.format("straddle", ""))
    assert isinstance(error, InvalidTimeKey) and str(error).startswith("order column 'ts' has duplicate value 9;")
    error = _refusal(con, base.format("nullpart", ", partition_by := 'g'"))
    assert isinstance(error, InvalidTimeKey) and "partition column 'g' contains 1 NULL value(s)" in str(error)
    con.execute("CREATE TABLE pdup AS SELECT range % 5 AS ts, range // 5 AS g, 1.0 AS v FROM range(20) "
                "UNION ALL SELECT 4, 2, 2.0")
    error = _refusal(con, base.format("pdup", ", partition_by := 'g'"))
    assert str(error).startswith("order column 'ts' has duplicate value 4 within a partition of 'g'")
    assert budget.history().height == 0
    # the same time key ending one partition and starting the next, in two batches: fine
    con.execute("CREATE TABLE pedge AS SELECT CASE WHEN range < 5 THEN range ELSE range - 1 END AS ts, "
                "range // 5 AS g, 1.0 AS v FROM range(10)")
    with dpsql.testing.seeded(0):
        out = con.sql(base.format("pedge", ", partition_by := 'g'")).pl()
    assert out["ts"].to_list() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8]


def test_partitions_are_split_correctly_across_batches(con, monkeypatch, ordering_path):
    con.execute("CREATE TABLE p AS SELECT range AS ts, range // 10 AS g, 1.0 AS v FROM range(70)")
    for batch_rows in (5, 7):  # partition starts on and off batch boundaries
        monkeypatch.setattr(ordered, "BATCH_ROWS", batch_rows)
        with dpsql.testing.seeded(0):
            con.execute("CREATE OR REPLACE TABLE released AS SELECT g, dp_row FROM dp_range_sum('p', 'ts', 'v', "
                        "method := 'laplace', epsilon := 1, upper := 1, partition_by := 'g')")
        out = con.sql("SELECT g, dp_row - min(dp_row) OVER () AS row, "
                      "dp_range_variance(min(dp_row) OVER part, max(dp_row) OVER part + 1) AS var "
                      "FROM released WINDOW part AS (PARTITION BY g) ORDER BY dp_row").pl()
        np.testing.assert_array_equal(out["g"].to_numpy(), np.arange(70) // 10)
        np.testing.assert_array_equal(out["row"].to_numpy(), np.arange(70))
        assert out["var"].n_unique() == 1  # every partition is a whole 10-row stream
        with pytest.raises(InvalidParameter, match="span two partitions"), dpsql.duckdb.typed_errors():
            con.sql("SELECT dp_range_variance(min(dp_row) + 9, min(dp_row) + 11) FROM released").fetchall()


def test_invisible_and_missing_sources_are_refused_clearly(con, budget):
    con.execute("CREATE TEMP TABLE tmp AS SELECT range AS ts, 1.0 AS v FROM range(10)")
    error = _refusal(con, RANGE_SUM.replace("'t'", "'tmp'"))
    assert isinstance(error, InvalidParameter)
    assert str(error).startswith("tbl 'tmp' is a TEMP table of this connection")
    error = _refusal(con, RANGE_SUM.replace("'ts'", "'when'"))
    assert str(error).startswith("order_by 'when' is not a column of 't'; columns are 'ts', 'v', 'g'")
    assert budget.history().height == 0


# -- sources and key types ------------------------------------------------------------------

def test_files_views_and_data_frames_by_name(con, tmp_path: Path):
    con.execute(f"COPY t TO '{tmp_path / 't.parquet'}' (FORMAT parquet)")
    con.execute(f"COPY t TO '{tmp_path / 't.csv'}' (FORMAT csv)")
    con.execute("CREATE VIEW tv AS SELECT * FROM t")
    frame = con.sql("SELECT * FROM t").pl()  # noqa: F841  (found by name, like DuckDB's replacement scan)
    arrow_table = con.sql("SELECT * FROM t").to_arrow_table()  # noqa: F841
    results = []
    for name in [str(tmp_path / "t.parquet"), str(tmp_path / "t.csv"), "tv", "frame", "arrow_table"]:
        with dpsql.testing.seeded(4):
            results.append(con.sql(RANGE_SUM.replace("'t'", f"'{name}'")).fetchnumpy()["v"])
    with dpsql.testing.seeded(4):
        expected = con.sql(RANGE_SUM).fetchnumpy()["v"]
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_order_and_partition_key_types_survive(con):
    con.execute("""CREATE TABLE typed AS SELECT DATE '2024-01-01' + range::INTEGER AS d,
                   TIMESTAMPTZ '2024-01-01 00:00:00+00' + INTERVAL (range) MINUTE AS tz,
                   (range * 1.5)::DECIMAL(10, 2) AS dec, 'k' || (range % 2)::VARCHAR AS name, 1.0 AS v
                   FROM range(10)""")
    for key in ["d", "tz", "dec"]:
        with dpsql.testing.seeded(0):
            got = con.sql(f"SELECT * FROM dp_range_sum('typed', '{key}', 'v', method := 'laplace', "
                          "epsilon := 1, upper := 1, partition_by := 'name')").to_arrow_table()
        expected = con.sql(f"SELECT name, {key} FROM typed ORDER BY name, {key}").to_arrow_table()
        assert got.select(["name", key]).equals(expected)


def test_releases_keyed_by_decimals_and_times_are_recognised_when_repeated(con, budget):
    """The answer cache fingerprints the order keys: DECIMAL and TIME keys (Python objects in
    numpy) by their Arrow storage, so a repeat is free and other keys are another release."""
    con.execute("CREATE TABLE dec AS SELECT (range * 1.5)::DECIMAL(10, 2) AS k, TIME '00:00:00' + "
                "INTERVAL (range) MINUTE AS tm, 1.0 AS v FROM range(50)")
    con.execute("CREATE TABLE dec_shifted AS SELECT k + 0.01 AS k, tm + INTERVAL 1 SECOND AS tm, v FROM dec")
    query = "SELECT * FROM dp_range_sum('{}', '{}', 'v', method := 'laplace', epsilon := 1, upper := 1)"
    with dpsql.testing.seeded(0):
        for key in ("k", "tm"):
            first = con.sql(query.format("dec", key)).fetchnumpy()["v"]
            np.testing.assert_array_equal(con.sql(query.format("dec", key)).fetchnumpy()["v"], first)
            con.sql(query.format("dec_shifted", key)).fetchall()
    assert budget.history()["kind"].to_list() == ["release", "cache hit", "release"] * 2
    assert budget.spent == (4.0, 0.0)


def test_integer_keys_keep_their_types_on_the_numpy_path(con):
    con.execute("""CREATE TABLE small AS SELECT (range % 3)::TINYINT AS g8, (range % 3)::UTINYINT AS gu,
                   range::INTEGER AS i, DATE '2024-01-01' + (range // 3)::INTEGER AS d,
                   TIMESTAMPTZ '2024-01-01 00:00:00+00' + INTERVAL (range) HOUR AS tz,
                   TIMESTAMP_NS '2024-01-01' + INTERVAL (range) SECOND AS ns, TIME '00:00:00' + INTERVAL (range) MINUTE
                   AS tm, 1.0 AS v FROM range(60) ORDER BY hash(range)""")
    for partition, key in [("g8", "d"), ("gu", "tz"), ("g8", "ns"), ("gu", "tm"), ("g8", "i")]:
        with dpsql.testing.seeded(0):
            got = con.sql(f"SELECT * FROM dp_range_sum('small', '{key}', 'v', method := 'laplace', epsilon := 1, "
                          f"upper := 1, partition_by := '{partition}')").to_arrow_table()
        expected = con.sql(f"SELECT {partition}, {key} FROM small ORDER BY {partition}, {key}").to_arrow_table()
        assert got.select([partition, key]).equals(expected)


def test_narrow_keys_spanning_beyond_their_type_and_time_zones_keep_their_order(con):
    con.execute("""CREATE TABLE wide AS SELECT * FROM (VALUES (100::TINYINT, 2000000000, DATE '5000000-01-01', 1.0),
                   (-100::TINYINT, -2000000000, DATE '-1000000-01-01', 2.0), (26::TINYINT, 0, DATE '2024-01-01', 3.0))
                   t(i8, i32, d, v)""")
    con.execute("""CREATE TABLE zones AS SELECT * FROM (VALUES ('10:00:00+02'::TIMETZ, 1.0),
                   ('09:30:00+00'::TIMETZ, 2.0)) t(tz, v)""")
    for table, key in [("wide", "i8"), ("wide", "i32"), ("wide", "d"), ("zones", "tz")]:
        with dpsql.testing.seeded(0):
            got = con.sql(f"SELECT * FROM dp_range_sum('{table}', '{key}', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 10)").to_arrow_table()
        expected = con.sql(f"SELECT {key}, v FROM {table} ORDER BY {key}").to_arrow_table()
        assert got.column(key).equals(expected.column(key))
        with dpsql.testing.seeded(0):
            oracle = _core("laplace", expected.column("v").to_numpy(), epsilon=1.0, upper=10.0)
        np.testing.assert_array_equal(got.column("v").to_numpy(), oracle.values)


def test_bad_values_are_named_by_their_row_in_time_order_after_the_keys_are_checked(con, budget, ordering_path):
    con.execute("CREATE TABLE nanv AS SELECT * FROM (VALUES (3, 1.0), (1, 'nan'::DOUBLE), (2, 1.0)) t(ts, v)")
    error = _refusal(con, "SELECT * FROM dp_range_sum('nanv', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 1)")
    assert isinstance(error, InvalidData) and "first at row 0" in str(error)
    for bad in ("'nan'::DOUBLE", "NULL"):
        con.execute(f"CREATE OR REPLACE TABLE baddup AS SELECT * FROM (VALUES (3, 1.0), (1, {bad}), (3, 1.0)) t(ts, v)")
        error = _refusal(con, "SELECT * FROM dp_range_sum('baddup', 'ts', 'v', method := 'laplace', epsilon := 1, "
                              "upper := 1)")
        assert isinstance(error, InvalidTimeKey)
    con.execute("CREATE TABLE nullv AS SELECT * FROM (VALUES (3, 1.0), (1, NULL), (2, 1.0)) t(ts, v)")
    error = _refusal(con, "SELECT * FROM dp_range_sum('nullv', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 1)")
    assert isinstance(error, InvalidData) and "column 'v' contains 1 null value(s)" in str(error)
    assert budget.history().height == 0


def test_a_method_releasing_one_value_per_stream_is_refused_by_the_stream_macro(con, budget):
    error = _refusal(con, "SELECT * FROM dp_range_sum('t', 'ts', 'v', method := 'threshold', epsilon := 1, "
                          "upper := 10)")
    assert isinstance(error, InvalidParameter)
    assert str(error).startswith("method 'threshold' releases 1 value(s) per stream, not one per row")
    assert budget.history().height == 0


def test_sparse_integer_keys_are_ordered_in_numpy_and_only_the_widest_by_duckdb(con, budget, monkeypatch):
    sorted_by_duckdb = []
    monkeypatch.setattr(ordered, "_ordered_by_duckdb",
                        lambda cur, select, plan, _f=ordered._ordered_by_duckdb: sorted_by_duckdb.append(select)
                        or _f(cur, select, plan))
    tables = {"sparse": ([0, 2**59, 3, 2**58, 7, 5], [1, 1, 1, 2, 2, 2]),  # two radix digits
              "sparse_parts": ([0, 1, 2, 0, 1, 2], [0, 0, 0, 10**12, 10**12, 10**12]),
              "widest": ([-2**62, 2**62, 0, 1, 2, 3], [1, 1, 1, 2, 2, 2])}  # times spanning 2**63
    for table, (ts, g) in tables.items():
        con.from_arrow(pa.table({"ts": ts, "g": g, "v": np.arange(6.0)})).create(table)
        with dpsql.testing.seeded(0):
            got = con.sql(f"SELECT * FROM dp_range_sum('{table}', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 10, partition_by := 'g')").pl()
        expected_order = con.sql(f"SELECT ts, g, v FROM {table} ORDER BY g, ts").pl()
        with dpsql.testing.seeded(0):
            expected = _core("laplace", expected_order["v"].to_numpy(), epsilon=1.0, upper=10.0,
                             partition_offsets=[0, 3, 6], partition_keys=sorted(set(g)))
        np.testing.assert_array_equal(got["v"].to_numpy(), expected.values)
        assert got.select("g", "ts").equals(expected_order.select("g", "ts"))
    # the widest keys are read unsorted, then again sorted by DuckDB
    assert sorted_by_duckdb == ["""SELECT "g", "ts", "v" FROM query_table('widest')"""]


def test_threshold_macro_is_one_charged_row(con, budget):
    with dpsql.testing.seeded(6):
        rows = con.sql("SELECT * FROM dp_threshold('t', 'v', epsilon := 1, upper := 10)").fetchall()
    with dpsql.testing.seeded(6):
        expected = _core("threshold", _data(1000)[np.argsort(_data(1000, seed=1))], epsilon=1.0, upper=10.0,
                         estimator="nm")
    assert len(rows) == 1
    threshold, epsilon, delta, release_id = rows[0]
    assert threshold == expected.threshold
    assert (epsilon, delta) == (1.0, 0.0) == budget.spent
    assert budget.history(full=True)["release_id"].to_list() == [release_id]
    with dpsql.testing.seeded(6):
        (pak,) = con.sql("SELECT * FROM dp_threshold('t', 'v', method := 'pak', epsilon := 1, upper := 10, "
                         "delta := 1e-6)").fetchall()
    assert pak[2] == 1e-6 and budget.spent == (2.0, 1e-6)


def test_keys_of_other_types_are_checked_too(con, budget, monkeypatch):
    """Text partition keys and date order keys (compared with Arrow compute, not in place)."""
    monkeypatch.setattr(ordered, "BATCH_ROWS", 7)
    con.execute("CREATE TABLE typed AS SELECT 'p' || (range // 10)::VARCHAR AS g, "
                "DATE '2024-01-01' + (range % 10)::INTEGER AS d, 1.0 AS v FROM range(40)")
    base = ("SELECT * FROM dp_range_sum('{}', 'd', 'v', method := 'laplace', epsilon := 1, upper := 1, "
            "partition_by := 'g')")
    with dpsql.testing.seeded(0):
        out = con.sql(base.format("typed")).pl()
    assert out.height == 40 and out["g"].n_unique() == 4
    con.execute("CREATE TABLE typed_dup AS SELECT * FROM typed UNION ALL SELECT 'p2', DATE '2024-01-04', 2.0")
    error = _refusal(con, base.format("typed_dup"))
    assert isinstance(error, InvalidTimeKey)
    assert str(error).startswith("order column 'd' has duplicate value datetime.date(2024, 1, 4) within a partition")
    assert budget.history().height == 1  # the good release only


def test_nan_keys_are_refused(con, budget):
    con.execute("CREATE TABLE nants AS SELECT CASE WHEN range IN (3, 7) THEN 'nan'::DOUBLE ELSE range::DOUBLE END "
                "AS ts, range % 2 AS g, 1.0 AS v FROM range(20)")
    base = "SELECT * FROM dp_range_sum('nants', '{}', 'v', method := 'laplace', epsilon := 1, upper := 1{})"
    error = _refusal(con, base.format("ts", ""))
    assert isinstance(error, InvalidTimeKey) and "order column 'ts' contains NaN" in str(error)
    con.execute("CREATE TABLE nanpart AS SELECT range AS ts, CASE WHEN range = 4 THEN 'nan'::DOUBLE ELSE 1 END AS g, "
                "1.0 AS v FROM range(20)")
    error = _refusal(con, "SELECT * FROM dp_range_sum('nanpart', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 1, partition_by := 'g')")
    assert isinstance(error, InvalidTimeKey) and "partition column 'g' contains NaN" in str(error)
    assert budget.history().height == 0


def test_the_smallest_timestamp_is_an_ordinary_key(con, budget, ordering_path):
    """Its raw value is numpy's NaT, which is unequal to itself: keys are compared as integers."""
    smallest = pa.array([np.iinfo(np.int64).min] * 3 + [5], pa.int64()).view(pa.timestamp("us"))
    con.from_arrow(pa.table({"g": smallest, "ts": [1, 2, 3, 1], "v": [1.0] * 4})).create("early_parts")
    with dpsql.testing.seeded(0):
        con.sql("SELECT * FROM dp_range_sum('early_parts', 'ts', 'v', method := 'laplace', epsilon := 1, "
                "upper := 1, partition_by := 'g')").to_arrow_table()
    assert budget.history(full=True)["partitions"].to_list() == [2]
    con.from_arrow(pa.table({"ts": smallest, "v": [1.0] * 4})).create("early_times")
    error = _refusal(con, "SELECT * FROM dp_range_sum('early_times', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 1)")
    assert isinstance(error, InvalidTimeKey)
    assert str(error).startswith("order column 'ts' has duplicate value -9223372036854775808 (raw timestamp[us])")


def test_keys_that_cannot_be_compared_are_refused_by_name(con, budget):
    con.execute("CREATE TABLE intervals AS SELECT to_seconds(range) AS ts, range % 2 AS g, 1.0 AS v FROM range(20)")
    error = _refusal(con, "SELECT * FROM dp_range_sum('intervals', 'ts', 'v', method := 'laplace', epsilon := 1, "
                          "upper := 1)")
    assert isinstance(error, InvalidTimeKey) and str(error).startswith("order column 'ts' has type month_day_nano")
    assert budget.history().height == 0
