"""Releases stay explainable after their process is gone, and identical repeats cost nothing."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

import dpsql


@pytest.fixture
def ledger(tmp_path):
    return tmp_path / "ledger.sqlite"


def test_release_ids_are_uuids_with_their_description_recorded(ledger):
    budget = dpsql.Budget.open(ledger, epsilon=2.0)
    values = np.arange(20_000) % 50.0
    release = dpsql.tops(values, epsilon=0.5, upper=100.0, m=2000, budget=budget)
    record = dpsql.Budget.open(ledger).release(release.release_id)
    assert len(release.release_id) == 36 and release.release_id.count("-") == 4
    assert (record.method, record.epsilon, record.params["m"]) == ("tops", 0.5, 2000)
    starts, stops = np.array([0, 10, 2500, 19_000]), np.array([20_000, 3000, 2600, 19_001])
    np.testing.assert_allclose(record.range_variance(starts, stops), release.range_variance(starts, stops))
    assert "values" not in record.description and record.first_handle == release.first_handle
    with pytest.raises(dpsql.UnknownRelease):
        budget.release("00000000-0000-0000-0000-000000000000")


def test_a_release_saved_to_parquet_restores_its_error_bars_in_another_process(ledger, tmp_path):
    budget = dpsql.Budget.open(ledger, epsilon=2.0)
    release = dpsql.binary_tree(np.arange(3000) % 9.0, epsilon=1.0, upper=10.0, budget=budget)
    pq.write_table(release.to_arrow(), tmp_path / "release.parquet")
    expected = release.range_ci(17, 2900)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import dpsql, pyarrow.parquet as pq
        budget = dpsql.Budget.open({str(ledger)!r})
        restored = dpsql.Release.from_arrow(pq.read_table({str(tmp_path / 'release.parquet')!r}), budget=budget)
        print(repr(restored.range_ci(17, 2900)), restored.method, restored.release_id)
    """)], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] + out[1] == repr(expected).replace(" ", "")
    assert out[2:] == ["binary_tree", release.release_id]


def test_a_partitioned_release_round_trips_through_arrow(ledger):
    budget = dpsql.Budget.open(ledger, epsilon=2.0)
    values = np.arange(9000) % 13.0
    release = dpsql.publish("hierarchy", values, budget=budget, partition_offsets=[0, 4000, 9000],
                            partition_keys=["north", "south"], epsilon=1.0, upper=20.0, r=4096)
    restored = dpsql.Release.from_arrow(release.to_arrow(), budget=budget)
    assert isinstance(restored, dpsql.PartitionedRelease) and restored.keys == ["north", "south"]
    assert restored.part(1).range_variance(100, 4000) == release.part(1).range_variance(100, 4000)


def test_dp_row_handles_resolve_through_the_ledger_from_a_new_process(ledger, tmp_path):
    database = tmp_path / "work.duckdb"
    con = duckdb.connect(str(database))
    dpsql.register(con, budget=dpsql.Budget.open(ledger, epsilon=10.0))
    con.execute("CREATE TABLE readings AS SELECT range AS ts, range % 4 AS meter, (range % 23)::DOUBLE AS kwh "
                "FROM range(40000)")
    for k in range(40):  # far more than a connection ever kept in memory
        con.execute(f"CREATE TABLE rel{k} AS SELECT * FROM dp_range_sum('readings', 'ts', 'kwh', "
                    f"method := 'laplace', partition_by := 'meter', epsilon := 0.1, upper := {25 + k})")
    query = ("SELECT meter, dp_range_margin(min(dp_row), max(dp_row) + 1) AS margin, "
             "dp_release_id(min(dp_row)) AS id FROM rel0 GROUP BY meter ORDER BY meter")
    here = con.sql(query).fetchall()
    con.close()
    there = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import duckdb, dpsql
        con = duckdb.connect({str(database)!r})
        dpsql.register(con, budget=dpsql.Budget.open({str(ledger)!r}))
        print(con.sql({query!r}).fetchall())
    """)], capture_output=True, text=True, check=True).stdout.strip()
    assert there == repr(here)
    other = duckdb.connect(str(database))
    dpsql.register(other, budget=dpsql.Budget.in_memory(epsilon=1.0))  # another ledger
    with pytest.raises(dpsql.UnknownRelease, match="not a row handle"), dpsql.duckdb.typed_errors():
        other.sql(query).fetchall()


def test_identical_repeats_are_free_and_recorded_as_cache_hits(ledger):
    budget = dpsql.Budget.open(ledger, epsilon=1.0)
    values = np.arange(10_000) % 31.0
    first = dpsql.tops(values, epsilon=0.25, upper=50.0, m=1000, budget=budget)
    again = dpsql.tops(values, epsilon=0.25, upper=50.0, m=1000, budget=budget)
    assert again.release_id == first.release_id and np.array_equal(again.values, first.values)
    assert budget.spent == (0.25, 0.0)
    changed = values.copy()
    changed[5000] += 1
    other = dpsql.tops(changed, epsilon=0.25, upper=50.0, m=1000, budget=budget)  # different data
    fresh = dpsql.tops(values, epsilon=0.25, upper=50.0, m=1000, budget=budget, fresh=True)
    assert len({first.release_id, other.release_id, fresh.release_id}) == 3
    assert budget.spent == (0.75, 0.0)
    history = budget.history(full=True)
    assert history["kind"].to_list() == ["release", "cache hit", "release", "release"]
    assert history["answers"][1] == first.release_id and history["epsilon"][1] == 0.0
    assert budget.clear_cache() == 2  # the fresh release's answer replaced the first's
    dpsql.tops(values, epsilon=0.25, upper=50.0, m=1000, budget=budget)
    assert budget.spent == (1.0, 0.0)


def test_re_executing_a_duckdb_relation_and_a_lazy_frame_costs_nothing(ledger):
    budget = dpsql.Budget.open(ledger, epsilon=1.0)
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.execute("CREATE TABLE t AS SELECT range AS ts, (range % 7)::DOUBLE AS v FROM range(5000)")
    relation = con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', epsilon := 0.25, upper := 10, m := 500)")
    rows = relation.fetchall()
    assert relation.pl()["v"].to_list() == [r[1] for r in rows]
    assert relation.to_arrow_table().num_rows == 5000 and str(relation)
    assert budget.spent == (0.25, 0.0)
    con.sql("SELECT * FROM dp_range_sum('t', 'ts', 'v', epsilon := 0.25, upper := 10, m := 500, "
            "fresh := true)").fetchall()
    assert budget.spent == (0.5, 0.0)
    lazy = pl.LazyFrame({"ts": range(5000), "v": [float(i % 7) for i in range(5000)]}).with_columns(
        pl.col("v").dpsql.range_sum(epsilon=0.25, upper=10.0, order_by="ts", m=500, budget=budget).alias("dp"))
    assert lazy.collect()["dp"].to_list() == lazy.collect()["dp"].to_list()
    # the same data, method and parameters as the SQL release: its answer, from the ledger
    assert budget.spent == (0.5, 0.0)
    assert budget.history()["kind"].to_list().count("cache hit") == 5


def test_the_cache_never_answers_another_scope_or_method(ledger):
    a = dpsql.Budget.open(ledger, scope="a", epsilon=1.0)
    b = dpsql.Budget.open(ledger, scope="b", epsilon=1.0)
    values = np.ones(1000)
    first = dpsql.laplace(values, epsilon=0.5, upper=1.0, budget=a)
    assert dpsql.laplace(values, epsilon=0.5, upper=1.0, budget=b).release_id != first.release_id
    assert dpsql.laplace(values, epsilon=0.5, upper=2.0, budget=a).release_id != first.release_id
    assert a.spent == (1.0, 0.0) and b.spent == (0.5, 0.0)
    uncached = dpsql.Budget.open(ledger, scope="c", epsilon=1.0, cache=False)
    dpsql.laplace(values, epsilon=0.5, upper=1.0, budget=uncached)
    dpsql.laplace(values, epsilon=0.5, upper=1.0, budget=uncached)
    assert uncached.spent == (1.0, 0.0)


def test_a_release_is_found_by_any_of_its_row_handles_and_rebuilt_with_its_values():
    budget = dpsql.Budget.in_memory(epsilon=2.0)
    frame = pl.DataFrame({"ts": np.arange(3000), "v": np.arange(3000) % 11 * 1.0})
    with dpsql.testing.seeded(3):
        out = frame.with_columns(pl.col("v").dpsql.range_sum(order_by="ts", method="hierarchy", epsilon=1.0,
                                                             upper=20.0, errors=True, budget=budget).alias("dp"))
    handles = out["dp"].struct.field("dp_row")
    record = budget.release(dp_row=handles[1234])
    assert record.release_id == budget.release(dp_row=handles[0]).release_id and record.method == "hierarchy"
    release = record.with_values(out["dp"].struct.field("value").to_numpy())
    assert release.range_ci(0, 1000) == pytest.approx(
        (release.range_sum(0, 1000) - release.error.range_margin(np.array([0]), np.array([1000]), 0.95)[0],
         release.range_sum(0, 1000) + release.error.range_margin(np.array([0]), np.array([1000]), 0.95)[0]))
    with pytest.raises(dpsql.UnknownRelease, match="dp_row 99"):
        dpsql.Budget.in_memory(epsilon=1.0).release(dp_row=99)
    with pytest.raises(dpsql.InvalidParameter, match="release_id or a dp_row"):
        budget.release()
    stream = budget.stream("s", method="laplace", epsilon=0.5, order_by="ts", value="v", upper=20.0)
    rows = stream.append(frame.head(10))
    with pytest.raises(dpsql.UnknownRelease, match="continual stream"):
        budget.release(dp_row=rows["dp_row"][0].as_py())
    assert len(stream.release()) == 10 and stream.release().method == "laplace"


def test_the_same_release_asked_in_sql_and_in_polars_is_one_charge():
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    frame = pl.DataFrame({"ts": np.arange(6000), "v": (np.arange(6000) % 13) * 1.0})
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.register("readings", frame.to_arrow())
    con.execute("CREATE TABLE t AS FROM readings")
    sql = con.sql("SELECT v FROM dp_range_sum('t', 'ts', 'v', epsilon := 1, upper := 20, m := NULL)").fetchnumpy()
    polars = frame.select(pl.col("v").dpsql.range_sum(order_by="ts", method="tops", epsilon=1.0, upper=20.0,
                                                      budget=budget))
    assert np.array_equal(sql["v"], polars["v"].to_numpy())  # integer and float parameters, NULL and absent: equal
    assert budget.history()["kind"].to_list() == ["release", "cache hit"] and budget.spent == (1.0, 0.0)
    con.sql("SELECT v FROM dp_range_sum('t', 'ts', 'v', epsilon := 1, upper := 21)").fetchall()
    assert budget.spent == (2.0, 0.0)  # another bound is another release


def test_the_fingerprint_covers_the_order_key_partition_and_value_columns():
    """The same rows in another row order are the identical release (a cache hit); another order
    key, another partition key or another value is new data (charged)."""
    budget = dpsql.Budget.in_memory(epsilon=10.0)
    n = 3000
    frame = pl.DataFrame({"meter": np.arange(n) % 3, "ts": np.arange(n), "v": (np.arange(n) % 11) * 1.0})

    def release(data):
        return data.select("meter", "ts", pl.col("v").dpsql.range_sum(
            order_by="ts", partition_by="meter", method="laplace", epsilon=0.5, upper=20.0, budget=budget)).sort(
            "meter", "ts")

    first = release(frame)
    shuffled = release(frame.sample(fraction=1.0, shuffle=True, seed=5))
    assert shuffled.equals(first) and budget.spent == (0.5, 0.0)
    changed = {
        "order key": frame.with_columns(pl.when(pl.col("ts") == 0).then(-1).otherwise(pl.col("ts")).alias("ts")),
        "partition key": frame.with_columns(pl.when(pl.col("ts") == 5).then(1).otherwise(pl.col("meter"))
                                            .alias("meter")),
        "value": frame.with_columns(pl.when(pl.col("ts") == 7).then(3.0).otherwise(pl.col("v")).alias("v")),
    }
    for k, (what, data) in enumerate(changed.items()):
        release(data)
        assert budget.spent == (0.5 * (k + 2), 0.0), f"another {what} was answered from the cache"
    assert budget.history()["kind"].to_list() == ["release", "cache hit", "release", "release", "release"]


def test_a_reordered_release_table_is_restored_in_order_and_bad_tables_are_refused(ledger, tmp_path):
    import pyarrow as pa

    budget = dpsql.Budget.open(ledger, epsilon=2.0)
    values = np.arange(6000) % 13.0
    release = dpsql.publish("hierarchy", values, budget=budget, partition_offsets=[0, 2500, 6000],
                            partition_keys=["north", "south"], epsilon=1.0, upper=20.0, r=4096)
    table = release.to_arrow()
    shuffled = table.take(np.random.default_rng(0).permutation(table.num_rows))  # e.g. sorted by a query
    pq.write_table(shuffled, tmp_path / "shuffled.parquet")
    restored = dpsql.Release.from_arrow(pq.read_table(tmp_path / "shuffled.parquet"), budget=budget)
    assert np.array_equal(restored.values, release.values)
    assert restored.part(1).range_ci(10, 3000) == release.part(1).range_ci(10, 3000)
    with dpsql.use_budget(budget):  # the default budget's ledger
        assert np.array_equal(dpsql.Release.from_arrow(table, budget=None).values, release.values)
    value_at = table.schema.get_field_index("value")
    bad = {
        "pyarrow.Table": table.to_pandas(),
        "lacks its 'row' or 'value'": table.drop_columns(["row"]),
        "1 null value": table.set_column(value_at, "value", pa.array([None, *values[1:].tolist()], pa.float64())),
        "has 6000 values; the table has 5999": table.slice(1),
        "do not name each of its rows once": table.set_column(table.schema.get_field_index("row"), "row",
                                                              pa.array(np.zeros(6000, dtype=np.int64))),
        "outside 0 .. 1": table.set_column(0, "partition", pa.array(np.full(6000, 2, dtype=np.int64))),
    }
    for message, data in bad.items():
        with pytest.raises(dpsql.DPError, match=re.escape(message)):
            dpsql.Release.from_arrow(data, budget=budget)
    with pytest.raises(dpsql.InvalidParameter, match=r"pass budget=dpsql\.Budget\.open"):
        dpsql.Release.from_arrow(table, budget=None)
    assert budget.spent == (1.0, 0.0)
