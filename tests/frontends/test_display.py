"""Pictures and notebook views: post-processing of released values, honest bands, readable labels."""

import io

import matplotlib
import numpy as np
import polars as pl
import pyarrow.compute as pc
import pytest

import dpsql
from dpsql.display import bucketed, sparkline

matplotlib.use("Agg")


def _tops(n=20_000, seed=0, **params):
    values = 50 + 30 * np.sin(np.arange(n) * 2 * np.pi / 24)
    with dpsql.testing.seeded(seed):
        return values, dpsql.tops(values, epsilon=1.0, upper=500.0, budget=dpsql.Budget.in_memory(epsilon=5),
                                  **params)


def test_default_buckets_follow_the_release_blocks_so_bands_are_noise_only():
    _, release = _tops()
    series = bucketed(release)
    assert len(series["starts"]) <= 501 and series["starts"][0] == 0 and series["stops"][-1] == len(release)
    bias = release.error.range_bias_bound(series["starts"], series["stops"])
    assert np.all(bias == 0)  # no bucket cuts a released block
    boundaries = set(release.error.block_boundaries(len(release)).tolist())
    assert set(series["starts"].tolist()) <= boundaries


def test_bands_are_the_release_intervals_clipped_to_what_clipped_values_allow():
    _, release = _tops()
    series = bucketed(release, every=100)
    low, high = release.range_ci(series["starts"], series["stops"])
    length = series["stops"] - series["starts"]
    assert np.allclose(series["low"], np.maximum(low, 0.0) / length)
    assert np.allclose(series["high"], np.minimum(high, release.threshold * length) / length)
    assert np.allclose(series["mean"], release.range_sum(series["starts"], series["stops"]) / length)


def test_release_plot_labels_units_time_truth_and_the_holdout():
    values, release = _tops()
    time = np.datetime64("2024-01-01T00", "h") + np.arange(len(values))
    fig = release.plot(truth=values, time=time, unit="kWh", value="load", time_label="hour (UTC)")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "hour (UTC)" and ax.get_ylabel().startswith("load (kWh)")
    assert "tops: epsilon 1" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["95% interval", "released (tops)", "true (not released)"]
    assert any("hold-out (4,096 rows)" in t.get_text() for t in ax.texts)


def test_partitioned_release_draws_small_multiples_titled_by_key():
    values = np.tile(np.arange(500.0) % 7, 3)
    with dpsql.testing.seeded(1):
        release = dpsql.publish("hierarchy", values, partition_offsets=[0, 500, 1000, 1500],
                                partition_keys=["a", "b", "c"], epsilon=1.0, upper=10.0,
                                budget=dpsql.Budget.in_memory(epsilon=1))
    fig = release.plot()
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["a", "b", "c"]


def test_stream_and_budget_pictures_and_views():
    budget = dpsql.Budget.in_memory(epsilon=3)
    with dpsql.testing.seeded(2):
        stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", upper=10.0)
    assert "dpsql Stream" in stream._repr_html_()
    with pytest.raises(dpsql.InvalidParameter, match="released no rows"):
        stream.plot()
    stream.append(pl.DataFrame({"ts": np.arange(3000), "kwh": np.arange(3000) % 9 * 1.0}))
    fig = stream.plot()
    assert fig.axes[0].get_xlabel() == "ts" and fig.axes[0].get_ylabel().startswith("kwh")
    figure = budget.plot()
    assert figure.axes[0].get_ylabel() == "epsilon spent" and "1 of 3 spent" in figure.axes[0].get_title()
    view = budget._repr_html_()
    assert "1 of 3 spent" in view and "hierarchy" in view


def test_release_view_shows_cost_threshold_and_only_a_few_values():
    _, release = _tops()
    view = release._repr_html_()
    assert "tops" in view and "epsilon 1" in view and f"{release.threshold:.6g}" in view and "<svg" in view
    assert view.count(", ") < 40  # head and tail, not the stream
    assert "not charged" not in view


def test_sparkline_is_an_svg_polyline():
    svg = sparkline(np.sin(np.arange(1000) / 50))
    assert svg.startswith("<svg") and svg.count(",") == 120


def test_bad_plot_requests_are_typed_errors():
    _values, release = _tops()
    with pytest.raises(dpsql.InvalidParameter, match="truth has 5 rows"):
        release.plot(truth=np.ones(5))
    with pytest.raises(dpsql.InvalidParameter, match="every must be a positive"):
        release.plot(every=0)
    with pytest.raises(dpsql.InvalidParameter, match="time has 3 rows"):
        release.plot(time=np.arange(3))


def _shown_by_a_notebook(cell) -> list:
    """The figures a notebook shows for a cell whose last line is ``cell()``. IPython's display hook
    shows the cell's value (a Figure: as PNG, through matplotlib_inline's formatter); then, when the
    cell ends, matplotlib_inline's ``flush_figures`` shows every figure pyplot still holds and closes
    them. (IPython is not a test dependency: these are the two steps, as they run.)"""
    import matplotlib.pyplot as plt
    from matplotlib._pylab_helpers import Gcf
    from matplotlib.figure import Figure

    plt.close("all")
    value = cell()
    shown = [value] if isinstance(value, Figure) else []
    shown += [manager.canvas.figure for manager in Gcf.get_all_fig_managers()]
    plt.close("all")
    return shown


def _png(fig) -> bytes:
    import io

    buffer = io.BytesIO()
    fig.canvas.print_figure(buffer, format="png")
    return buffer.getvalue()


def test_a_plot_as_a_cell_s_last_line_is_shown_once():
    import matplotlib.pyplot as plt

    budget = dpsql.Budget.in_memory(epsilon=3)
    values = np.arange(3000) % 9 * 1.0
    with dpsql.testing.seeded(2):
        stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", upper=10.0)
        release = dpsql.hierarchy(values, epsilon=1.0, upper=10.0, budget=budget)
        parts = dpsql.publish("hierarchy", values, partition_offsets=[0, 1000, 3000], epsilon=0.5, upper=10.0,
                              budget=budget)
    stream.append(pl.DataFrame({"ts": np.arange(3000), "kwh": values}))
    with matplotlib.rc_context({"interactive": True}):  # as in a notebook
        for cell in (budget.plot, stream.plot, release.plot, parts.plot):
            shown = _shown_by_a_notebook(cell)
            assert len(shown) == 1, cell
            assert _png(shown[0]).startswith(b"\x89PNG")
        # a figure of the caller's own stays the caller's, held by pyplot
        fig, ax = plt.subplots()
        assert release.plot(ax=ax) is fig and plt.fignum_exists(fig.number)
        plt.close(fig)


def test_the_budget_s_time_axis_is_readable():
    import io
    import re
    import time

    budget = dpsql.Budget.in_memory(epsilon=3)
    with dpsql.testing.seeded(3):
        dpsql.laplace(np.ones(10), epsilon=0.5, upper=1.0, budget=budget)
        time.sleep(0.3)  # releases a fraction of a second apart: the axis spans less than a second
        dpsql.laplace(np.zeros(10), epsilon=0.5, upper=1.0, budget=budget)
    fig = budget.plot()
    fig.savefig(io.BytesIO(), format="png")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all(len(label) <= 5 for label in labels), labels  # seconds: "28.5", not "51:28.500000"
    assert not any(re.search(r"\d\.\d{4}", label) for label in labels), labels
    assert re.fullmatch(r"\d{4}-[A-Z][a-z]{2}-\d\d \d\d:\d\d", ax.xaxis.get_offset_text().get_text())


def _legend_line(ax, starts: str):
    """The line whose legend label starts with ``starts``."""
    lines = [line for line in ax.get_lines() if line.get_label().startswith(starts)]
    assert len(lines) == 1, [line.get_label() for line in ax.get_lines()]
    return lines[0]


def test_a_stream_plot_shows_final_and_provisional_rows_apart():
    budget = dpsql.Budget.in_memory(epsilon=3)
    hours = np.datetime64("2024-01-30T05:00", "us") + np.arange(100) * np.timedelta64(1, "h")
    values = np.arange(100) % 9 * 1.0
    with dpsql.testing.seeded(2):
        stream = budget.stream("s", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", upper=10.0)
        fleet = budget.stream("f", method="hierarchy", epsilon=1.0, order_by="ts", value="kwh", upper=10.0,
                              partition_by="meter")
    stream.append(pl.DataFrame({"ts": hours, "kwh": values}))
    fleet.append(pl.DataFrame({"meter": np.repeat([1, 2], 100), "ts": np.tile(hours, 2), "kwh": np.tile(values, 2)}))
    panels = [(stream.plot().axes[0], stream.released())]
    panels += [(ax, fleet.released(partition=meter)) for ax, meter in zip(fleet.plot().axes, (1, 2))]
    for ax, released in panels:
        final = released.filter(released["dp_final"])  # the days complete so far (calendar blocks): 19 + 72
        waiting = released.filter(pc.invert(released["dp_final"]))
        assert final.num_rows == 91 and waiting.num_rows == 9
        provisional = _legend_line(ax, "provisional (9 rows")
        assert provisional.get_linestyle() == "--" and provisional.get_markerfacecolor() == "none"
        np.testing.assert_array_equal(provisional.get_xdata(orig=True), waiting["ts"].to_numpy())
        np.testing.assert_array_equal(provisional.get_ydata(orig=True), waiting["kwh"].to_numpy())
        solid = _legend_line(ax, "final (hierarchy)")
        assert solid.get_linestyle() == "-"
        x = solid.get_xdata(orig=True)  # buckets of the final rows, first to last
        assert x[0] == final["ts"][0].as_py() and x[-1] == final["ts"][-1].as_py()
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[0] == "95% interval" and labels[1] == "final (hierarchy)" and labels[2].startswith("prov")
        ax.figure.savefig(io.BytesIO(), format="png")
        ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert ticks and all(len(t) <= 6 for t in ticks), ticks  # dates, concisely ("Feb", "02", "12:00")


def test_a_stream_with_no_final_row_yet_is_drawn_provisional():
    budget = dpsql.Budget.in_memory(epsilon=3)
    with dpsql.testing.seeded(2):
        stream = budget.stream("s", method="tops", epsilon=1.0, order_by="ts", value="kwh", upper=10.0, m=50)
    stream.append(pl.DataFrame({"ts": np.arange(30), "kwh": np.ones(30)}))  # in the hold-out: every row waits
    ax = stream.plot().axes[0]
    line = _legend_line(ax, "provisional (30 rows")
    assert list(line.get_xdata(orig=True)) == list(range(30)) and "still provisional" in ax.get_title()
    assert not [line for line in ax.get_lines() if line.get_label().startswith("final")]
