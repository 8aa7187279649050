"""examples/continual.py (issue 12, item 8) runs as documented: 60 daily appends, one charge, a plot."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import dpsql

ROOT = Path(__file__).resolve().parents[2]


def test_the_continual_example_charges_once_for_sixty_daily_appends(tmp_path):
    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples" / "data", examples / "data")
    shutil.copy(ROOT / "examples" / "continual.py", examples)
    environment = {"MPLBACKEND": "Agg", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                   "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "examples/continual.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (examples / "output" / "continual.png").stat().st_size > 10_000
    budget = dpsql.Budget.open(examples / "output" / "continual-ledger.sqlite", scope="traffic")
    assert budget.spent == (1.0, 0.0) and budget.history()["kind"].to_list() == ["stream"]
    stream = budget.stream("i94")
    assert stream.info()["rows"] == stream.released().num_rows and 1000 < stream.released().num_rows <= 24 * 60
    assert f"released {stream.released().num_rows} of 1440 hours" in run.stdout
