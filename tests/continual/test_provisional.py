"""Provisional values (issue 22): every appended row gets a value from the append that brings it, and where the
algorithm still waits for later rows that value is a prediction from what was released before, in the same
partition, and public parameters (docs/algorithms.md, "Provisional and final values"). Checked here through the
public path against an oracle that reads only the released rows and the public parameters, for every method and
several ways of cutting the table into appends; a provisional row is recorded as released (``released()``,
``dp_stream``, a retried append, another process: the same value until its final value replaces it) and its
interval adds the public bound."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import duckdb
import numpy as np
import polars as pl
import pytest

import dpsql

HOUR = np.timedelta64(1, "h")
START = np.datetime64("2024-03-04T05:00", "us")  # not midnight: a partition's first day block is short
#: The partition joining a fleet after its pooled hold-out is full (it has no pooled rows), and when it does:
#: a pool of ``m = 40`` rows takes the first 10 order keys of four meters.
LATE, LATE_START = 99, 12


@dataclass(frozen=True)
class Case:
    """A stream to append and what the oracle needs to know of it: public parameters only."""

    method: str
    params: dict
    meters: int = 0  # 0: one stream; else a fleet of this many meters from the first hour, and a late one
    max_delay: object = None
    hourly: bool = False  # order keys on an hourly grid (calendar day blocks) instead of integers
    epsilon: float = 1.0
    #: which rules of :func:`expected` the appends must exercise (so that a case cannot pass vacuously)
    rules: frozenset = field(default_factory=frozenset)

    @property
    def lower(self) -> float:
        return float(self.params.get("lower", 0.0))

    @property
    def upper(self) -> float:
        return float(self.params["upper"])

    def holdout(self, meter) -> int:
        """How many of the partition's first rows are its hold-out (0: none). A fleet's pooled hold-out
        takes every regular meter's first ``m / meters`` rows (they share their order keys) and none of
        the late meter's, which arrive after it is full."""
        if self.method not in ("tops", "pak") or "threshold" in self.params:
            return 0
        m = int(self.params["m"])
        if self.meters and self.params.get("threshold_by", "fleet") == "fleet":
            return 0 if meter == LATE else m // self.meters
        return m

    def at_bound(self, meter) -> bool:
        """Is the partition's hold-out released as it comes, clipped at the public bound (longer than
        ``max_delay`` rows: a fleet's pool by its own length ``m``)?"""
        return isinstance(self.max_delay, int) and self.holdout(meter) > 0 and self.params["m"] > self.max_delay

    @property
    def streams_wait(self) -> bool:
        """Do rows after the hold-out wait for their block (the flat spread) or are they final at once?"""
        return self.method in ("hierarchy", "tops") and self.params.get("smoother", "none") == "none"


def expected(case: Case, meter, finals: np.ndarray, index: int, threshold: float | None) -> tuple[float, str]:
    """The documented provisional value of row ``index`` of partition ``meter``, from the partition's final
    values released so far (``finals``: its rows ``0 .. len(finals) - 1``, in order) and public parameters
    (``threshold``: the partition's released threshold, where it has one); and which rule gave it."""
    lower, upper, m = case.lower, case.upper, case.holdout(meter)
    if index < m:  # a hold-out row
        if case.at_bound(meter) and len(finals):
            return min(max(finals[-1], lower), upper), "hold-out at the bound: last block"
        return lower + (upper - lower) / 2, "middle of the bounds"
    assert case.streams_wait, f"row {index} of {meter!r} waits, but {case.method} releases it when it arrives"
    top = upper if threshold is None else threshold
    if len(finals) > m:
        return min(max(finals[-1], lower), top), "last block"
    if m and not case.at_bound(meter):
        assert len(finals) == m
        return min(max(float(np.mean(finals)), lower), top), "hold-out mean"
    return lower + (top - lower) / 2, "middle below the threshold" if threshold is not None else "middle of the bounds"


def _frame(case: Case, hours: int, seed: int) -> pl.DataFrame:
    """Readings in time order: one stream, or ``case.meters`` meters sharing their order keys and a late
    one from ``LATE_START``; gamma values with spikes far above any threshold."""
    rng = np.random.default_rng(seed)
    if case.meters:
        meter = np.concatenate([np.tile(np.arange(case.meters), hours), np.full(hours - LATE_START, LATE)])
        step = np.concatenate([np.repeat(np.arange(hours), case.meters), np.arange(LATE_START, hours)])
    else:
        meter, step = None, np.arange(hours)
    values = np.round(rng.gamma(2.0, 6.0, len(step)) * np.where(rng.random(len(step)) < 0.05, 20.0, 1.0), 2)
    ts = START + step * HOUR if case.hourly else step
    frame = pl.DataFrame({"ts": ts, "kwh": values})
    if meter is not None:
        frame = frame.with_columns(pl.Series("meter", meter)).sort(["ts", "meter"]).select("meter", "ts", "kwh")
    return frame


def _pieces(frame: pl.DataFrame, cut: str, rng) -> list[pl.DataFrame]:
    """The frame cut into appends: one row at a time, sevens, random sizes, or whole days (24 order keys)."""
    if cut == "days":
        day = (pl.col("ts") - pl.col("ts").min()).dt.total_hours() // 24 if frame["ts"].dtype.is_temporal() else \
            pl.col("ts") // 24
        return list(frame.with_columns(day.alias("__day")).partition_by("__day", maintain_order=True,
                                                                      include_key=False))
    pieces, at = [], 0
    while at < frame.height:
        step = {"ones": 1, "sevens": 7}.get(cut) or int(rng.integers(1, 60))
        pieces.append(frame.slice(at, step))
        at += step
    return pieces


class Ledger:
    """What the appends returned, row by row (partition, order key) -> (value, final): what the stream must
    hold; and the checks of every append against it and the oracle."""

    def __init__(self, case: Case, stream: dpsql.Stream):
        self.case, self.stream = case, stream
        self.rows: dict[tuple, tuple[float, bool]] = {}
        self.thresholds: dict = {}
        self.rules: set[str] = set()

    def _meters(self, table: pl.DataFrame) -> pl.Series:
        return table["meter"] if self.case.meters else pl.Series("meter", [None] * table.height)

    def _threshold(self, meter) -> float | None:
        if self.case.method == "hierarchy":
            return None
        if meter not in self.thresholds:
            release = self.stream.release(**({"partition": meter} if self.case.meters else {}))
            assert release.threshold is not None, f"{meter!r}: rows after its hold-out, but no threshold released"
            self.thresholds[meter] = release.threshold
        return self.thresholds[meter]

    def check_append(self, piece: pl.DataFrame, out: pl.DataFrame) -> None:
        """``out`` (what appending ``piece`` returned) holds every new row; a row seen before comes back only
        to be final, and every provisional row is new and has the oracle's value."""
        keys = list(zip(self._meters(out), out["ts"]))
        assert set(zip(self._meters(piece), piece["ts"])) <= set(keys), "a new row got no value"
        for key, value, final in zip(keys, out["kwh"], out["dp_final"]):
            before = self.rows.get(key)
            assert before is None or (not before[1] and final), f"{key}: released again as {value}, was {before}"
            self.rows[key] = (value, final)
        touched = {meter for meter, _ in keys}
        for meter in touched:
            mine = sorted((ts, *self.rows[(m, ts)]) for m, ts in self.rows if m == meter)
            flags = np.array([final for _, _, final in mine])
            final_rows = int(flags.sum())
            assert flags[:final_rows].all(), f"{meter!r}: final rows are not a prefix of the partition"
            finals = np.array([value for _, value, _ in mine[:final_rows]])
            new = {ts for m, ts in keys if m == meter}
            for index, (ts, value, final) in enumerate(mine):
                if final or ts not in new:
                    continue
                want, rule = expected(self.case, meter, finals, index,
                                      self._threshold(meter) if index >= self.case.holdout(meter) else None)
                self.rules.add(rule)
                assert value == pytest.approx(want, rel=1e-12, abs=1e-12), (meter, ts, index, rule)

    def check_recorded(self, released: pl.DataFrame) -> None:
        """``released`` (a stream's ``released()``, SQL ``dp_stream``) holds every row at the value the
        appends last returned for it."""
        held = {(m, ts): (value, final) for m, ts, value, final in
                zip(self._meters(released), released["ts"], released["kwh"], released["dp_final"])}
        assert held == self.rows


def _register(budget, case: Case, name: str = "s"):
    return budget.stream(name, method=case.method, epsilon=case.epsilon, order_by="ts", value="kwh",
                         partition_by="meter" if case.meters else None, max_delay=case.max_delay, **case.params)


PREDICTED = frozenset({"last block", "middle of the bounds"})
HOLDOUT = frozenset({"middle of the bounds", "hold-out mean", "last block"})
POOLED = HOLDOUT | {"middle below the threshold"}  # a fleet's late partition has no pooled rows to average
CASES = [
    Case("hierarchy", {"upper": 60.0, "block": 7}, rules=PREDICTED),
    Case("hierarchy", {"upper": 60.0, "block": 7}, meters=3, rules=PREDICTED),
    # noisy block sums far outside the bounds: the prediction is clipped to them
    Case("hierarchy", {"lower": -10.0, "upper": 30.0, "block": 5}, epsilon=0.2, rules=PREDICTED),
    Case("hierarchy", {"upper": 60.0}, meters=3, hourly=True, rules=PREDICTED),  # calendar day blocks
    Case("hierarchy", {"upper": 60.0}, meters=2, hourly=True, max_delay="6h", rules=PREDICTED),
    Case("tops", {"upper": 200.0, "m": 40, "block": 8}, rules=HOLDOUT),
    Case("tops", {"upper": 200.0, "lower": -5.0, "m": 40, "block": 8}, meters=4, rules=POOLED),
    Case("tops", {"upper": 200.0, "m": 20, "block": 8, "threshold_by": "partition"}, meters=4, rules=HOLDOUT),
    Case("tops", {"upper": 200.0, "threshold": 40.0, "block": 8}, meters=2,
         rules=frozenset({"middle below the threshold", "last block"})),
    Case("tops", {"upper": 200.0, "m": 40, "block": 8}, max_delay=10,  # the hold-out released at the bound
         rules=frozenset({"middle of the bounds", "hold-out at the bound: last block", "middle below the threshold",
                          "last block"})),
    Case("tops", {"upper": 200.0, "m": 40, "block": 4}, meters=4, max_delay=6,
         rules=frozenset({"middle of the bounds", "hold-out at the bound: last block", "middle below the threshold",
                          "last block"})),
    Case("tops", {"upper": 200.0, "m": 40, "block": 8}, meters=4, max_delay=60, rules=POOLED),  # fed while it fills
    Case("tops", {"upper": 200.0, "m": 40}, meters=4, hourly=True, rules=POOLED),
    Case("tops", {"upper": 200.0, "m": 40, "smoother": "recent"}, meters=4,
         rules=frozenset({"middle of the bounds"})),
    Case("pak", {"upper": 200.0, "m": 40, "delta": 1e-6}, rules=frozenset({"middle of the bounds"})),
    Case("pak", {"upper": 200.0, "m": 40, "delta": 1e-6}, meters=4, max_delay=6,
         rules=frozenset({"middle of the bounds", "hold-out at the bound: last block"})),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.method}-{c.meters}m-{c.max_delay}-{c.params}")
def test_provisional_values_are_the_documented_prediction_from_released_values(case):
    rng = np.random.default_rng(5)
    rules: set[str] = set()
    for cut in ("ones", "sevens", "random", "days"):
        frame = _frame(case, 72 if case.hourly else 40 if case.meters else 100, seed=2)
        if cut == "ones":  # (the first rows only: a hold-out's, a few blocks')
            frame = frame.head(48)
        budget = dpsql.Budget.in_memory(epsilon=2.0, delta=1e-5)
        with dpsql.testing.seeded(17):
            stream = _register(budget, case)
        ledger = Ledger(case, stream)
        for count, piece in enumerate(_pieces(frame, cut, rng)):
            out = stream.append(piece, to_polars=True)
            ledger.check_append(piece, out)
            if cut == "random":  # delivered again: the rows come back as recorded, nothing recomputed
                again = stream.append(piece, to_polars=True)
                assert again.equals(out.join(piece.select(again.columns[:-3]), on=again.columns[:-3], how="semi"))
            if cut != "ones" or count % 10 == 0:
                ledger.check_recorded(pl.from_arrow(stream.released()))
        ledger.check_recorded(pl.from_arrow(budget.stream("s").released()))  # another object reads the same rows
        rules |= ledger.rules
    assert rules == case.rules


def test_provisional_rows_are_recorded_for_other_processes_and_retries(tmp_path):
    """A private stream in a ledger file: another process reads every row at the value the appends returned, and
    its retry of the last append gets the recorded values back."""
    case = Case("tops", {"upper": 200.0, "m": 40}, meters=3, hourly=True)
    path = tmp_path / "ledger.sqlite"
    stream = _register(dpsql.Budget.open(path, epsilon=1.0), case)
    ledger = Ledger(case, stream)
    pieces = _pieces(_frame(case, 70, seed=3), "days", None)
    for piece in pieces:
        ledger.check_append(piece, stream.append(piece, to_polars=True))
    last = pieces[-1]
    assert not all(final for _, final in ledger.rows.values()), "nothing provisional left to read"
    last.write_parquet(tmp_path / "last.parquet")
    code = f"""
        import dpsql, polars as pl
        stream = dpsql.Budget.open({str(path)!r}).stream("s")
        pl.from_arrow(stream.released()).write_parquet({str(tmp_path / "released.parquet")!r})
        stream.append(pl.read_parquet({str(tmp_path / "last.parquet")!r}), to_polars=True).write_parquet(
            {str(tmp_path / "again.parquet")!r})
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True)
    released = pl.read_parquet(tmp_path / "released.parquet")
    assert {(m, ts): (v, f) for m, ts, v, f in released.select("meter", "ts", "kwh", "dp_final").iter_rows()} == \
        ledger.rows
    again = pl.read_parquet(tmp_path / "again.parquet")
    assert {(m, ts): (v, f) for m, ts, v, f in again.select("meter", "ts", "kwh", "dp_final").iter_rows()} == \
        {key: ledger.rows[key] for key in zip(last["meter"], last["ts"])}


def _block_predictions(smoother: str, sums: np.ndarray, first: float, block: int) -> np.ndarray:
    """ToPS App. D's per-row prediction for each block from the block sums released before it (``first``
    for the first block): ``window=8``, ``alpha=0.6`` (the defaults)."""
    def level(past: np.ndarray) -> float:
        if smoother == "exponential":
            value = past[0]
            for u in past[1:]:
                value = 0.6 * u + 0.4 * value
            return value
        return {"recent": past[-1], "mean": np.mean(past), "median": np.median(past),
                "moving": np.mean(past[-8:])}[smoother]

    return np.array([first, *(level(sums[:t]) / block for t in range(1, len(sums) + 1))])


@pytest.mark.parametrize("smoother", ["recent", "mean", "median", "moving", "exponential"])
@pytest.mark.parametrize("cut", ["sevens", "random"])
def test_predictive_smoothers_release_every_row_final_at_a_prediction_from_released_block_sums(smoother, cut):
    """A predictive smoother has nothing provisional: every row is final when it arrives, and every row of a
    block but its last is the prediction from the block sums released before (sums of released rows)."""
    block, upper = 5, 60.0
    frame = _frame(Case("hierarchy", {"upper": upper}), 36, seed=4)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.testing.seeded(9):
        stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", upper=upper,
                               smoother=smoother, block=block)
    for piece in _pieces(frame, cut, np.random.default_rng(1)):
        out = stream.append(piece, to_polars=True)
        assert out["ts"].to_list() == piece["ts"].to_list() and out["dp_final"].all()
    values = stream.released()["kwh"].to_numpy()
    whole = len(values) // block
    sums = values[:whole * block].reshape(whole, block).sum(axis=1)
    predicted = np.repeat(_block_predictions(smoother, sums, upper / 2, block), block)[:len(values)]
    not_last = (np.arange(len(values)) % block != block - 1) | (np.arange(len(values)) >= whole * block)
    # the sums are read back from the released rows: equal to the released sums up to rounding
    np.testing.assert_allclose(values[not_last], predicted[not_last], rtol=1e-10, atol=1e-10)
    assert len(np.unique(predicted)) > 5  # (the predictions move with the released sums)


@pytest.mark.parametrize(("method", "params"), [
    ("laplace", {"upper": 60.0}), ("binary_tree", {"upper": 60.0}), ("pak", {"upper": 200.0, "threshold": 40.0}),
    ("tops", {"upper": 200.0, "threshold": 40.0, "smoother": "mean"})])
def test_per_row_methods_release_every_row_final_when_it_arrives(method, params):
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("s", method=method, epsilon=1.0, order_by="ts", value="kwh", partition_by="meter",
                           **params)
    for piece in _pieces(_frame(Case(method, params, meters=3), 30, seed=1), "sevens", None):
        out = stream.append(piece)
        assert out.num_rows == piece.height and all(out["dp_final"].to_pylist())


def test_count_buckets_are_released_once_final_when_they_close():
    start = np.datetime64("2024-03-04T00:00", "us")
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    stream = budget.stream("c", method="count_smoothed", epsilon=1.0, order_by="ts", partition_by="ap",
                           every="1h", start=start.astype(object))
    events = pl.DataFrame({"ap": np.arange(60) % 3, "ts": start + np.arange(60) * np.timedelta64(7, "m")})
    seen = set()
    for piece in _pieces(events, "sevens", None):
        out = stream.append(piece, until=piece["ts"].max())
        assert all(out["dp_final"].to_pylist())
        keys = set(zip(out["ap"].to_pylist(), out["ts"].to_pylist()))
        assert not keys & seen  # a closed bucket is released once
        seen |= keys
    assert len(seen) == 3 * 6  # every bucket closed so far: 6 hours, 3 access points


def _margins(release, i, j):
    low, high, noise, spreading = release.range_ci(i, j, parts=True)
    return (low + high) / 2, high - (low + high) / 2, noise, spreading


@pytest.mark.parametrize(("method", "params", "rows", "final"), [
    ("hierarchy", {"upper": 10.0, "block": 16}, 40, 32),
    ("tops", {"upper": 10.0, "m": 20, "block": 8}, 32, 28),  # after the threshold: bounded by it
    ("tops", {"upper": 10.0, "m": 40}, 30, 0),  # the hold-out waits for its threshold: bounded by the bound
])
def test_intervals_add_the_bound_per_provisional_row_and_cover_the_clipped_truth(method, params, rows, final):
    """A range's interval adds the public bound (or the threshold) per provisional row to the margin of its final
    rows, no noise; over many seeds it covers the sum of the clipped values at least at its level."""
    rng = np.random.default_rng(0)
    truth = np.round(rng.uniform(0.0, 12.0, rows), 2)  # some above the bound
    covered = []
    for seed in range(40):
        budget = dpsql.Budget.in_memory(epsilon=1.0)
        with dpsql.testing.seeded(seed):
            stream = budget.stream("s", method=method, epsilon=1.0, order_by="ts", value="kwh", **params)
        out = stream.append(pl.DataFrame({"ts": np.arange(rows), "kwh": truth}))
        assert int(np.sum(out["dp_final"].to_numpy())) == final
        release = stream.release()
        bound = (release.threshold or params["upper"]) - 0.0
        waiting = rows - final
        centre, margin, noise, spreading = _margins(release, final, rows)  # the provisional rows alone
        assert noise == 0.0 and spreading == pytest.approx(bound * waiting, rel=1e-12)
        if final:
            start = final // 2 + 1  # from inside a final block, through the provisional rows
            _, _, noise_final, spreading_final = _margins(release, start, final)
            _, margin, noise, spreading = _margins(release, start, rows)
            assert noise == pytest.approx(noise_final, rel=1e-12)
            assert spreading == pytest.approx(spreading_final + bound * waiting, rel=1e-12)
            low, high = release.range_ci(start, rows)
            clipped = np.clip(truth[start:], 0.0, bound).sum()
            covered.append(low <= clipped <= high)
        else:
            covered.append(abs(centre - np.clip(truth, 0.0, bound).sum()) <= margin)
    assert np.mean(covered) >= 0.95


def test_sql_dp_stream_holds_provisional_rows_at_their_prediction():
    case = Case("tops", {"upper": 200.0, "m": 40, "block": 8}, meters=4)
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    with dpsql.testing.seeded(3):
        con.sql("SELECT * FROM dp_stream_create('s', 'ts', 'kwh', method := 'tops', epsilon := 1.0, "
                "partition_by := 'meter', upper := 200, m := 40, block := 8)").fetchall()
    ledger = Ledger(case, budget.stream("s"))
    for piece in _pieces(_frame(case, 40, seed=6), "sevens", None):
        con.register("piece", piece.to_arrow())
        ledger.check_append(piece, con.sql("SELECT * FROM dp_stream_append('s', 'piece')").pl())
        ledger.check_recorded(con.sql("SELECT * FROM dp_stream('s')").pl())
    assert ledger.rules == POOLED
