"""Progress bars: shown for work expected to take more than ``dpsql._progress.MIN_SECONDS``
(local-DP device loops, PAK's smooth-sensitivity search), silenced by ``progress=False``."""

import numpy as np
import pytest

import dpsql
from dpsql import _progress
from dpsql.testing import seeded

DU = dict(epsilon=1.0, w=10, lower=0.0, upper=100.0)
PAK = dict(epsilon=1.0, delta=1e-6, upper=100.0, m=2000)


@pytest.fixture
def everything_is_long(monkeypatch):
    """Every piece of work counts as long enough for a bar (so short tests can show one)."""
    monkeypatch.setattr(_progress, "MIN_SECONDS", 0.0)


def test_a_long_release_shows_a_bar_and_progress_false_silences_it(everything_is_long, capsys):
    x = np.linspace(0.0, 100.0, 3000)
    with seeded(0):
        shown = dpsql.ldp.capp(x, **DU)
    assert "capp" in capsys.readouterr().err
    with seeded(0):
        silent = dpsql.ldp.capp(x, progress=False, **DU)
    assert capsys.readouterr().err == ""
    np.testing.assert_array_equal(shown.values, silent.values)  # a bar cuts the work in pieces: same release


def test_partitioned_front_end_releases_forward_progress(everything_is_long, capsys):
    import polars as pl

    frame = pl.DataFrame({"user": np.repeat([1, 2], 500), "t": np.tile(np.arange(500), 2), "v": 50.0})
    with seeded(0):
        frame.with_columns(pl.col("v").dpsql.ldp(method="ipp", order_by="t", partition_by="user", **DU))
    assert "ipp" in capsys.readouterr().err
    with seeded(0):
        frame.with_columns(pl.col("v").dpsql.ldp(method="ipp", order_by="t", partition_by="user", progress=False,
                                                 **DU))
    assert capsys.readouterr().err == ""


def test_short_releases_show_no_bar(capsys):
    with seeded(0):
        dpsql.ldp.app(np.full(2000, 30.0), **DU)
        dpsql.publish("pak", np.full(5000, 30.0), **PAK)
    assert capsys.readouterr().err == ""


def test_ten_million_slots_of_feedback_are_expected_to_take_long(monkeypatch):
    """The estimate is made before any work: a 10^7-slot feedback release asks for a bar."""
    asked = []
    real = _progress.bar

    def spy(total, *, seconds, desc, unit="it"):
        asked.append((total, seconds))
        return real(total, seconds=seconds, desc=desc, unit=unit)

    monkeypatch.setattr(_progress, "bar", spy)
    with seeded(0):
        dpsql.ldp.capp(np.full(4000, 30.0), progress=False, **DU)
    ((total, seconds),) = asked
    assert total == 4000 and seconds * 10**7 / total >= _progress.MIN_SECONDS


def test_pak_smooth_sensitivity_search_shows_a_bar(everything_is_long, capsys):
    with seeded(0):
        dpsql.publish("pak", np.full(5000, 30.0), **PAK)
    assert "smooth sensitivity" in capsys.readouterr().err
    with seeded(0):
        dpsql.publish("pak", np.full(5000, 30.0), progress=False, **PAK)
    assert capsys.readouterr().err == ""
