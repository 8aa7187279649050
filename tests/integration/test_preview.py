"""dpsql.preview: the cost and error a release would have, with nothing charged and no data read."""

import numpy as np
import pytest

import dpsql

CASES = [
    ("laplace", {"epsilon": 0.5, "upper": 10.0}),
    ("binary_tree", {"epsilon": 1.0, "upper": 10.0}),
    ("hierarchy", {"epsilon": 1.0, "upper": 10.0}),
    ("tops", {"epsilon": 1.0, "upper": 10.0}),
    ("pak", {"epsilon": 1.0, "upper": 10.0, "delta": 1e-8}),
    ("count_laplace", {"epsilon": 0.5}),
    ("count_smoothed", {"epsilon": 0.5}),
    ("pegasus", {"epsilon": 1.0}),
    ("ipp", {"epsilon": 1.0, "w": 10, "lower": 0.0, "upper": 1.0}),
]


@pytest.mark.parametrize(("method", "params"), CASES, ids=[c[0] for c in CASES])
def test_the_preview_cost_is_what_the_release_is_charged(method, params):
    preview = dpsql.preview(method, n=20_000, **params)
    notion = "w-event-ldp" if method == "ipp" else "central"
    budget = dpsql.Budget.in_memory(epsilon=5.0, delta=1e-6, notion=notion, w=10 if method == "ipp" else None)
    values = np.random.default_rng(0).uniform(0, 1, 20_000)
    values = values * params["upper"] if "upper" in params else np.rint(values * 20)
    with dpsql.testing.seeded(1):
        dpsql.publish(method, values, budget=budget, **params)
    assert (preview.epsilon, preview.delta) == budget.spent
    assert preview.notion == notion


def test_nothing_is_charged_and_no_budget_is_needed():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    with dpsql.use_budget(budget):
        dpsql.preview("tops", n=10_000, epsilon=1.0, upper=100.0)
    assert budget.spent == (0.0, 0.0) and budget.history().height == 0


def test_laplace_errors_are_the_analytic_ones():
    preview = dpsql.preview("laplace", n=5000, epsilon=0.5, upper=10.0, lengths=(1, 24, 6000))
    scale = 10.0 / 0.5
    for length in (1, 24):
        assert preview.sd[length] ** 2 == pytest.approx(2 * length * scale**2, rel=2e-3)
        assert preview.margin[length] == pytest.approx(max(1.959964, np.log(20) / np.sqrt(2)) * preview.sd[length],
                                                       rel=1e-9)
    assert 6000 not in preview.sd  # longer than the stream
    assert preview.to_polars()["length"].to_list() == [1, 24]


def test_a_preview_is_an_upper_bound_for_data_dependent_methods():
    values = np.random.default_rng(3).poisson(5.0, 50_000).astype(float)
    preview = dpsql.preview("tops", n=len(values), epsilon=1.0, upper=100.0, lengths=(4096,))
    assert preview.assumption == "the private threshold at its largest value (upper)"
    with dpsql.testing.seeded(4):
        release = dpsql.tops(values, epsilon=1.0, upper=100.0, budget=dpsql.Budget.in_memory(epsilon=1))
    starts = np.arange(0, len(values) - 4096, 997)
    actual = np.sqrt(np.mean(release.range_variance(starts, starts + 4096)))
    assert release.threshold < 100.0 and actual < preview.sd[4096]
    groups = dpsql.preview("pegasus", n=10_000, epsilon=1.0, lengths=(1,))
    share = groups.params["grouper_share"]
    assert share == 0.004  # every count alone, at eps_p = (1 - share) eps
    assert groups.sd[1] ** 2 == pytest.approx(2 / (1 - share) ** 2, rel=2e-3)


def test_preview_shows_in_a_notebook():
    preview = dpsql.preview("hierarchy", n=10_000, epsilon=1.0, upper=10.0)
    assert "Nothing charged" in preview._repr_html_() and "Preview(hierarchy, n=10000" in repr(preview)


@pytest.mark.parametrize(("kwargs", "error", "word"), [
    ({"method": "nope", "n": 10, "epsilon": 1.0, "upper": 1.0}, dpsql.InvalidParameter, "nope"),
    ({"method": "laplace", "n": 0, "epsilon": 1.0, "upper": 1.0}, dpsql.InvalidParameter, "n"),
    ({"method": "laplace", "n": 10, "epsilon": -1.0, "upper": 1.0}, dpsql.InvalidParameter, "epsilon"),
    ({"method": "laplace", "n": 10, "epsilon": 1.0}, dpsql.InvalidParameter, "upper"),
    ({"method": "laplace", "n": 10, "epsilon": 1.0, "upper": 1.0, "level": 2.0}, dpsql.InvalidParameter, "level"),
    ({"method": "laplace", "n": 10, "epsilon": 1.0, "upper": 1.0, "lengths": (0,)}, dpsql.InvalidParameter,
     "lengths"),
    ({"method": "laplace", "n": 10, "epsilon": 1.0, "upper": 1.0, "depth": 2}, dpsql.InvalidParameter, "depth"),
])
def test_bad_previews_are_typed_errors_naming_the_parameter(kwargs, error, word):
    with pytest.raises(error, match=word):
        dpsql.preview(**kwargs)


def test_the_margin_shows_its_noise_and_spreading_parts():
    """Row-count blocks: a day's window cuts blocks, and most of its margin is spreading; on a grid
    a day is a block: its margin is the noise alone, far below (the issue's 'GROUP BY day' case)."""
    rows = dpsql.preview("tops", n=48_204, epsilon=1.0, upper=8000.0)
    grid = dpsql.preview("tops", n=48_204, epsilon=1.0, upper=8000.0, grid=("2012-10-02T09:00", "1h"))
    for p in (rows, grid):
        for length in p.sd:
            assert p.margin[length] == pytest.approx(p.noise[length] + p.spreading[length])
            assert p.noise[length] == pytest.approx(2.1213 * p.sd[length], rel=0.05)  # sd: rms; noise: mean
    assert rows.spreading[24] > 10 * rows.noise[24] and rows.margin[24] > 24 * 8000.0 * 0.5
    assert grid.spreading[24] == grid.spreading[168] == 0.0 and grid.margin[24] < rows.margin[24] / 4
    assert grid.to_polars().columns == ["length", "sd", "margin", "noise", "spreading"]
    assert "spreading ±0" in repr(grid) and "of which spreading" in grid._repr_html_()


def test_on_a_grid_the_default_lengths_are_a_row_a_day_and_a_week_of_its_rows():
    quarter_hours = dpsql.preview("hierarchy", n=100_000, epsilon=1.0, upper=5.0, grid=("2024-01-01T00:07", "15m"))
    assert list(quarter_hours.sd) == [1, 96, 672] and quarter_hours.spreading[96] == 0.0
    assert list(dpsql.preview("hierarchy", n=100_000, epsilon=1.0, upper=5.0).sd) == [1, 24, 168]
