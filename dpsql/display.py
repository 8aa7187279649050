"""Pictures and notebook views of releases, streams and budgets.

Everything here is post-processing of released values and public descriptions: drawing a
release costs nothing. Figures need matplotlib (``pip install 'dpsql[plot]'``); the notebook
views (``_repr_html_``) need nothing.

A figure drawn here is returned, not shown: pyplot does not hold it (:func:`_new_figure`), so a
notebook shows it once, as the value of a cell, and never again when the cell ends (which a
figure pyplot holds would be: twice). Save it with ``fig.savefig``; to draw into a figure of
your own (shown by ``plt.show()``), pass ``ax=``. Time axes name instants concisely
(``ConciseDateFormatter``: the hour, then the day below it, never ``35:35.400000``).

A stream is drawn bucket by bucket: consecutive rows are summed into buckets and each bucket
is shown as its mean per row with the 95 % interval :meth:`dpsql.Release.range_ci` gives,
intersected with what the clipped values allow (a mean per row lies between the release's
lower bound and its bound or threshold). By default the buckets follow the blocks the release
was made of (merged to at most about 500), so that no bucket cuts a block and the band shows
the noise alone: the resolution at which the release says something; ``every`` asks for
buckets of that many rows instead. Rows of a hold-out are shaded and labelled.

A continual stream (:meth:`dpsql.Stream.plot`) draws its final rows so, as a solid line with its
band, and its provisional rows (predictions from released values, waiting for their block or
hold-out to complete: ``dp_final`` false) apart, as hollow markers on a dashed line, each named in
the legend: a provisional value has no noise interval of its own, only the bound it lies within.
"""

from __future__ import annotations

import html
import math

import numpy as np

from dpsql.accounting import Neighbour
from dpsql.errors import InvalidParameter

#: Buckets drawn across a stream when ``every`` is not given.
_BUCKETS = 500
#: Points of a notebook sparkline.
_SPARK_POINTS = 120
#: Partitions drawn as small multiples at most.
_MAX_PANELS = 12


def _new_figure(size: tuple[float, float], rows: int = 1, columns: int = 1, **options):
    """A figure with ``rows`` x ``columns`` axes (an array of them, as ``plt.subplots`` gives) that
    pyplot does not hold: made by pyplot, so that a notebook's matplotlib integration is on and
    draws it, then closed there, so that the notebook does not draw it a second time when the cell ends."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise InvalidParameter("plots need matplotlib: pip install 'dpsql[plot]'") from error
    fig, axes = plt.subplots(rows, columns, figsize=size, layout="constrained", **options)
    plt.close(fig)
    return fig, axes


def _dates(ax) -> None:
    """Name the instants of ``ax``'s datetime x axis concisely (``35:35.400000`` becomes ``35.4``
    under the minute it belongs to)."""
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


def bucketed(release, *, every: int | None = None, level: float = 0.95) -> dict[str, np.ndarray]:
    """Bucket starts and stops, each bucket's released mean per row and its interval (clipped to
    what the clipped values allow), as arrays."""
    n = len(release.values)
    if n == 0:
        raise InvalidParameter(f"release {release.method!r} has no rows to draw")
    if every is None:
        edges = release.error.block_boundaries(n)
        edges = np.arange(n + 1) if edges is None else np.unique(np.concatenate([[0], edges, [n]]))
        wanted = np.searchsorted(edges, np.linspace(0, n, _BUCKETS + 1))
        edges = np.unique(edges[np.clip(wanted, 0, len(edges) - 1)])
    else:
        if not isinstance(every, int) or every < 1:
            raise InvalidParameter(f"every must be a positive number of rows, got {every!r}")
        edges = np.unique(np.r_[np.arange(0, n, every), n])
    starts, stops = edges[:-1].astype(np.int64), edges[1:].astype(np.int64)
    length = (stops - starts).astype(np.float64)
    low, high = release.range_ci(starts, stops, level)
    floor, ceiling = _value_limits(release)
    low = np.maximum(low, floor * length) if floor is not None else low
    high = np.minimum(high, ceiling * length) if ceiling is not None else high
    return {"starts": starts, "stops": stops, "mean": release.range_sum(starts, stops) / length,
            "low": np.asarray(low) / length, "high": np.asarray(high) / length}


def _value_limits(release) -> tuple[float | None, float | None]:
    """The range the clipped values of a release lie in (None where it has no bound)."""
    params = release.params
    if str(release.neighbour) in (Neighbour.ADD_REMOVE_EVENT, Neighbour.ADD_REMOVE_UNIT):  # counts
        return 0.0, None
    lower = params.get("lower")
    ceiling = release.threshold if release.threshold is not None else params.get("upper")
    return lower, ceiling


def _holdout_rows(release) -> int:
    return int(release.params.get("m") or 0) if release.threshold is not None else 0


def plot_release(release, *, ax=None, truth=None, time=None, every: int | None = None, level: float = 0.95,
                 value: str = "value", unit: str | None = None, time_label: str | None = None,
                 label: str | None = None):
    """Draw ``release`` (module docstring) on ``ax`` (a new figure if None), its values named
    ``label`` in the legend (``released (method)`` by default); returns the figure."""
    if ax is None:
        _, ax = _new_figure((9, 3.2))
    series = bucketed(release, every=every, level=level)
    x = _axis(time, len(release.values), np.r_[series["starts"], series["stops"][-1] - 1])
    def closed(y):  # a step plot's last bucket needs its right edge
        return np.r_[y, y[-1]]

    ax.fill_between(x, closed(series["low"]), closed(series["high"]), step="post", color="tab:blue", alpha=0.2,
                    lw=0, label=f"{level:.0%} interval")
    ax.step(x, closed(series["mean"]), where="post", color="tab:blue", lw=1.0,
            label=label or f"released ({release.method})")
    if truth is not None:
        truth = np.asarray(truth, dtype=np.float64)
        if len(truth) != len(release.values):
            raise InvalidParameter(f"truth has {len(truth)} rows; the release has {len(release.values)}")
        cumulative = np.concatenate([[0.0], np.cumsum(truth)])
        means = (cumulative[series["stops"]] - cumulative[series["starts"]]) / (series["stops"] - series["starts"])
        ax.step(x, closed(means), where="post", color="black", lw=0.8, alpha=0.7, label="true (not released)")
    m = _holdout_rows(release)
    if m:
        end = _axis(time, len(release.values), np.array([min(m, len(release.values) - 1)]))[0]
        ax.axvspan(x[0], end, color="0.85", zorder=0, lw=0)
        ax.text(x[0], 0.98, f" hold-out ({m:,} rows): threshold {release.threshold:.4g} chosen here",
                transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="0.3")
    widths = series["stops"] - series["starts"]
    ax.set_ylabel(f"{value}{f' ({unit})' if unit else ''}" + ("" if widths.max() == 1 else ", mean per row"))
    ax.set_xlabel(time_label or ("time" if time is not None else "row"))
    if time is not None and np.issubdtype(np.asarray(time).dtype, np.datetime64):
        _dates(ax)
    cost = f"epsilon {release.epsilon:g}" + (f", delta {release.delta:g}" if release.delta else "")
    buckets = "" if widths.max() == 1 else f"; buckets of {_widths(widths)} rows"
    ax.set_title(f"{release.method}: {cost}{buckets}", fontsize=10)
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    ax.margins(x=0)
    return ax.figure


def _widths(widths: np.ndarray) -> str:
    low, high = int(widths.min()), int(widths.max())
    return f"{low:,}" if low == high else f"{low:,} to {high:,}"


def _axis(time, n: int, rows: np.ndarray):
    if time is None:
        return rows
    time = np.asarray(time)
    if len(time) != n:
        raise InvalidParameter(f"time has {len(time)} rows; the release has {n}")
    return time[rows]


def plot_partitions(release, *, truth=None, time=None, titles=None, **options):
    """One small panel per partition (the first twelve), sharing the x axis; returns the figure."""
    parts = min(len(release.parts), _MAX_PANELS)
    columns = 1 if parts < 4 else 2
    rows = math.ceil(parts / columns)
    fig, axes = _new_figure((9 if columns == 1 else 12, 2.3 * rows), rows, columns, squeeze=False,
                            sharex=time is None)
    offsets = release.offsets
    for k, ax in enumerate(axes.ravel()):
        if k >= parts:
            ax.set_visible(False)
            continue
        a, b = int(offsets[k]), int(offsets[k + 1])
        plot_release(release.part(k), ax=ax, truth=None if truth is None else np.asarray(truth)[a:b],
                     time=None if time is None else np.asarray(time)[a:b], **options)
        ax.set_title(f"{titles[k] if titles is not None else k}", fontsize=9)
    if len(release.parts) > parts:
        fig.suptitle(f"first {parts} of {len(release.parts)} partitions", fontsize=9)
    return fig


def plot_stream(stream, *, partition=None, ax=None, **options):
    """A stream's released rows against their order keys: one panel, or one per partition
    (the first twelve, or the one given), final and provisional rows apart; returns the figure."""
    released = stream.released()
    if released.num_rows == 0:
        raise InvalidParameter(f"stream {stream.name!r} has released no rows yet")
    options.setdefault("value", stream._value_column())
    options.setdefault("time_label", stream.spec.order_by)
    if not stream.spec.partition_by:
        if ax is None:
            _, ax = _new_figure((9, 3.2))
        _plot_stream_rows(stream, None, released, ax, options)
        return ax.figure
    columns = list(stream.spec.partition_by)
    keys = released.select(columns).group_by(columns).aggregate([]).sort_by([(c, "ascending") for c in columns])
    keys = [row[0] if len(columns) == 1 else tuple(row) for row in zip(*(keys[c].to_pylist() for c in columns))]
    if partition is not None:
        keys = [partition]
    keys = keys[:_MAX_PANELS]
    fig, axes = _new_figure((9, 2.3 * len(keys)), len(keys), 1, squeeze=False)
    for ax, part in zip(axes[:, 0], keys):
        _plot_stream_rows(stream, part, stream.released(partition=part), ax, options)
        ax.set_title(f"{', '.join(columns)} = {part}", fontsize=9)
    return fig


def _plot_stream_rows(stream, partition, rows, ax, options: dict) -> None:
    """One partition's released ``rows`` (sorted by order key) on ``ax``: its final rows (the first
    ones: a row's value is final once every row before it is) as a release, the rest as hollow
    markers on a dashed line."""
    import dataclasses

    release = stream.release(partition)
    time = rows[stream.spec.order_by].to_numpy()
    final = int(np.asarray(rows["dp_final"]).sum())
    if final:
        plot_release(dataclasses.replace(release, values=release.values[:final]), ax=ax, time=time[:final],
                     label=f"final ({release.method})", **options)
    if final < len(time):
        waiting = len(time) - final
        ax.plot(time[final:], release.values[final:], ls="--", lw=0.8, marker="o", ms=3, mfc="none",
                color="tab:orange", label=f"provisional ({waiting:,} row{'s' * (waiting > 1)}, final later)")
        ax.legend(loc="best", fontsize=8, frameon=False)
        if not final:
            ax.set_xlabel(options["time_label"])
            ax.set_ylabel(options["value"])
            ax.set_title(f"{release.method}: every row still provisional", fontsize=10)
        if np.issubdtype(time.dtype, np.datetime64):
            _dates(ax)


def plot_budget(budget, *, ax=None):
    """The budget's burn-down: epsilon spent over time, stacked by method, under its total."""
    history = budget.history(full=True)
    if ax is None:
        _, ax = _new_figure((9, 3.2))
    total = budget.total[0]
    if history.height:
        import datetime as dt

        # the burn-down runs to now: the last release's level holds until the next one
        times = np.r_[history["time"].dt.replace_time_zone(None).to_numpy(),
                      np.datetime64(dt.datetime.now(dt.UTC).replace(tzinfo=None), "us")]
        methods = sorted(set(history["method"].to_list()))
        spent = np.zeros((len(methods), len(times)))
        for k, method in enumerate(methods):
            mine = np.where(history["method"].to_numpy() == method, history["epsilon"].to_numpy(), 0.0)
            spent[k] = np.cumsum(np.r_[mine, 0.0])
        ax.stackplot(times, spent, labels=methods, step="post", alpha=0.8)
        _dates(ax)
    ax.axhline(total, color="black", ls="--", lw=1, label=f"total epsilon {total:g}")
    ax.set_ylim(0, total * 1.08 if total else 1)
    ax.set_ylabel("epsilon spent")
    ax.set_xlabel("time (UTC)")
    ax.set_title(f"budget {budget.scope!r}: {budget.spent[0]:g} of {total:g} spent", fontsize=10)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    return ax.figure


# -- notebook views -------------------------------------------------------------------------------


def sparkline(values: np.ndarray, width: int = 240, height: int = 36) -> str:
    """An inline SVG line of ``values`` (bucket means), without matplotlib."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) > _SPARK_POINTS:
        edges = np.linspace(0, len(values), _SPARK_POINTS + 1).astype(np.int64)
        values = np.add.reduceat(values, edges[:-1]) / np.diff(edges)
    if len(values) < 2:
        return ""
    low, high = float(values.min()), float(values.max())
    span = high - low or 1.0
    xs = np.linspace(1, width - 1, len(values))
    ys = height - 2 - (values - low) / span * (height - 4)
    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
    return (f'<svg width="{width}" height="{height}" role="img"><polyline fill="none" stroke="#1f77b4" '
            f'stroke-width="1.2" points="{points}"/></svg>')


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                               f"{v}</td></tr>" for k, v in rows) + "</table>"


def release_html(release) -> str:
    n = len(release.values)
    rows = [("method", html.escape(release.method)), ("rows", f"{n:,}"),
            ("cost", f"epsilon {release.epsilon:g}, delta {release.delta:g} ({html.escape(str(release.notion))})")]
    if release.threshold is not None:
        rows.append(("threshold", f"{release.threshold:.6g}"))
    if n:
        series = bucketed(release)
        rows.append(("stream", sparkline(series["mean"])))
        width = float(np.median(series["high"] - series["low"])) / 2
        rows.append(("95 % interval", f"± {width:.4g} per row, over buckets of "
                                      f"{_widths(series['stops'] - series['starts'])} rows"))
        head = ", ".join(f"{v:.4g}" for v in release.values[:3])
        tail = ", ".join(f"{v:.4g}" for v in release.values[-3:])
        rows.append(("values", f"{head}, ..., {tail}" if n > 6 else ", ".join(f"{v:.4g}" for v in release.values)))
    rows.append(("release id", html.escape(str(release.release_id)) if release.release_id else "not charged"))
    if not release.private:
        rows.append(("private", "<b>no</b>: test noise"))
    return "<div><b>dpsql Release</b>" + _table(rows) + "</div>"


def partitioned_html(release) -> str:
    rows = [("method", html.escape(release.method)), ("partitions", f"{len(release.parts):,}"),
            ("rows", f"{len(release.values):,}"),
            ("cost", f"epsilon {release.epsilon:g}, delta {release.delta:g} (the largest over partitions)"),
            ("release id", html.escape(str(release.release_id)) if release.release_id else "not charged")]
    return "<div><b>dpsql PartitionedRelease</b>" + _table(rows) + "</div>"


def budget_html(budget) -> str:
    (total, total_delta), (spent, spent_delta) = budget.total, budget.spent
    share = 0.0 if not total else min(1.0, spent / total)
    bar = (f'<div style="width:240px;height:10px;background:#ddd"><div style="width:{240 * share:.0f}px;height:10px;'
           f'background:#1f77b4"></div></div>')
    rows = [("scope", html.escape(budget.scope)), ("ledger", html.escape(budget.location)),
            ("epsilon", f"{spent:g} of {total:g} spent, {budget.remaining[0]:g} left {bar}"),
            ("delta", f"{spent_delta:g} of {total_delta:g} spent")]
    history = budget.history()
    last = history.tail(5)
    if last.height:
        columns = ["time", "kind", "method", "epsilon", "source", "note"]

        def cell(name, value) -> str:
            shown = "" if value is None else f"{value:%Y-%m-%d %H:%M}" if name == "time" else f"{value:g}" \
                if name == "epsilon" else str(value)
            return f"<td>{html.escape(shown)}</td>"

        cells = "".join("<tr>" + "".join(cell(name, value) for name, value in zip(columns, row)) + "</tr>"
                        for row in last.select(columns).iter_rows())
        rows.append(("last releases", "<table><tr>" + "".join(f"<th>{name}</th>" for name in columns) + "</tr>"
                                      f"{cells}</table>"))
    return "<div><b>dpsql Budget</b>" + _table(rows) + "</div>"


def stream_html(stream) -> str:
    info = stream.info()
    rows = [("stream", html.escape(stream.name)), ("method", html.escape(stream.method)),
            ("cost", f"epsilon {info['epsilon']:g}, delta {info['delta']:g}, charged once"),
            ("rows released", f"{info['rows']:,}"), ("partitions", f"{info['partitions']:,}"),
            ("watermark", html.escape(str(info["watermark"])))]
    released = stream.released()
    if released.num_rows > 1 and not stream.spec.partition_by:
        rows.append(("released", sparkline(released.column(stream._value_column()).to_numpy())))
    return "<div><b>dpsql Stream</b>" + _table(rows) + "</div>"
