"""ToPL through the ordinary stream front ends, charged to a local-DP ledger scope."""

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql
from dpsql.errors import NotionMismatch

PARAMS = dict(epsilon=1.0, upper=100.0, m=2000)


@pytest.fixture
def frame() -> pl.DataFrame:
    ts = np.random.default_rng(1).permutation(8000)
    return pl.DataFrame({"ts": ts, "v": (ts % 50).astype(float)})


def test_sql_and_polars_topl_equal_the_core_release_and_charge_an_ldp_scope(frame):
    ordered = frame.sort("ts")["v"].to_numpy()
    with dpsql.testing.seeded(3):
        core = dpsql.ldp.topl(ordered, **PARAMS)
    budget = dpsql.Budget.in_memory(epsilon=2.0, notion="ldp")
    with dpsql.testing.seeded(3):
        polars_out = frame.with_columns(pl.col("v").dpsql.range_sum(
            method="topl", order_by="ts", budget=budget, **PARAMS).alias("dp")).sort("ts")["dp"].to_numpy()
    con = duckdb.connect()
    dpsql.register(con, budget=budget)
    con.execute("CREATE TABLE t AS SELECT * FROM frame")
    with dpsql.testing.seeded(3):
        sql_out = con.sql("SELECT v FROM dp_range_sum('t', 'ts', 'v', method := 'topl', epsilon := 1, "
                          "upper := 100, m := 2000) ORDER BY ts").fetchnumpy()["v"]
    con.close()
    np.testing.assert_array_equal(polars_out, core.values)
    np.testing.assert_array_equal(sql_out, core.values)
    # the SQL call asks for the same release of the same data: the ledger's answer, no charge
    assert budget.spent == (1.0, 0.0)
    assert budget.history()["kind"].to_list() == ["release", "cache hit"]


def test_topl_into_a_central_scope_is_refused_and_charges_nothing(frame):
    budget = dpsql.Budget.in_memory(epsilon=5.0)
    with pytest.raises(NotionMismatch, match="ldp"):
        frame.with_columns(pl.col("v").dpsql.range_sum(method="topl", order_by="ts", budget=budget, **PARAMS))
    assert budget.spent == (0.0, 0.0)
