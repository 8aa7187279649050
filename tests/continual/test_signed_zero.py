"""A row re-appended with ``-0.0`` where ``0.0`` was recorded (or the other way round) is the same
row: ``-0.0 == 0.0``, so it is a repeat answered with its recorded value, not a ConflictingRow,
whether its tag was stored per row or in a dictionary, released or still pending."""

import numpy as np
import polars as pl
import pytest

import dpsql


@pytest.mark.parametrize("distinct", ["few", "many"])  # tags as a dictionary, or one per row
@pytest.mark.parametrize("recorded, again", [(0.0, -0.0), (-0.0, 0.0)])
def test_a_zero_re_appended_with_the_other_sign_is_a_repeat(distinct, recorded, again):
    n = 400
    values = np.arange(n) % 3 * 1.0 if distinct == "few" else np.random.default_rng(3).uniform(1.0, 9.0, n)
    values[::5] = recorded
    frame = pl.DataFrame({"ts": np.arange(n), "v": values})
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="v", upper=10.0, m=50,
                           smoother="recent")
    waiting = stream.append(frame.slice(0, 20))  # provisional: the hold-out is not full yet
    assert waiting.num_rows == 20 and not any(waiting["dp_final"].to_pylist())
    first = stream.append(frame.slice(0, 300))
    flipped = frame.with_columns(pl.when(pl.col("v") == 0.0).then(again).otherwise(pl.col("v")).alias("v"))
    assert (np.signbit(flipped["v"].to_numpy()[::5]) == np.signbit(again)).all()  # the zeros' signs flipped
    repeated = stream.append(flipped.slice(0, 350))  # 300 released rows again, 50 new
    assert repeated["ts"].to_pylist() == list(range(350))
    assert repeated["v"].to_pylist()[:300] == first["v"].to_pylist()
    assert repeated["dp_row"].to_pylist()[:300] == first["dp_row"].to_pylist()
    assert budget.spent == (1.0, 0.0)
