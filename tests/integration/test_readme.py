"""The README runs as written: its first block is the two commands a newcomer types; every
Python block after it runs, in order, as one session, in a fresh directory holding the shipped
data, and then every later shell block (the ledger command line)."""

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_starts_with_exactly_the_demo_and_the_test_commands():
    language, first = BLOCKS[0]
    commands = [line for line in first.splitlines() if line.strip()]
    assert language == "bash" and len(commands) == 2
    assert "examples/demo.py" in commands[0] and "pytest" in commands[1]
    assert README.index("```") < README.index("\n## ")  # before any section


def test_every_block_runs_as_written(tmp_path):
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "examples" / "data")
    python = [code for language, code in BLOCKS if language == "python"]
    shell = [code for language, code in BLOCKS[1:] if language == "bash"]
    assert len(python) >= 6 and shell
    (tmp_path / "readme.py").write_text("\n\n".join(f"# --- README block {k}\n{code}" for k, code in enumerate(python)))
    (tmp_path / "readme.sh").write_text("set -euo pipefail\n" + "\n".join(shell))
    environment = {"MPLBACKEND": "Agg", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                   "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    for command in ([sys.executable, "readme.py"], ["bash", "readme.sh"]):
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment)
        assert run.returncode == 0, textwrap.shorten(run.stderr[-3000:], 3000)


def test_every_block_is_python_or_shell():
    assert all(language in {"bash", "python"} for language, _ in BLOCKS)
