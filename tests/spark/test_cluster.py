"""Spark releases on a real standalone cluster started here (a master and a worker on loopback,
the executors' Python set): the fleet recipe of docs/cluster.md runs as written, with a
PostgreSQL ledger and spark-submit; executors whose Python cannot import dpsql are refused before
anything is charged."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import venv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ledger import conftest as ledger_conftest

import dpsql

#: The ledger tests' throw-away PostgreSQL server (a session fixture), for the recipe's ledger.
postgres = ledger_conftest.postgres

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'dpsql[spark]')")
spark_dp = pytest.importorskip("dpsql.spark")

ROOT = Path(__file__).resolve().parents[2]
SPARK_HOME = Path(pyspark.__file__).parent
RECIPE_TITLE = "## A fleet on Spark, end to end"


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(**extra) -> dict:
    """A child's environment: this Python's tools first, dpsql from this checkout, Spark on loopback."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(ROOT),
            "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1", "LANG": "C.UTF-8", **extra}


class Cluster:
    """A Spark standalone master and one worker (2 cores) on loopback, started with ``spark-class``;
    the worker's executors run with dpsql's checkout on their Python path (dpsql installed there)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen] = []
        environment = _environment(SPARK_LOG_DIR=str(directory), SPARK_WORKER_DIR=str(directory / "work"))
        self._start("master", environment, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(_free_port()))
        self._start("worker", environment, "org.apache.spark.deploy.worker.Worker", self.url, "--host",
                    "127.0.0.1", "--cores", "2", "--memory", "1536m", "--webui-port", str(_free_port()))
        self._wait_for("worker", "Successfully registered with master")

    def _start(self, name: str, environment: dict, *command: str) -> None:
        with open(self.directory / f"{name}.log", "wb") as log:
            self.processes.append(subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *command], stdout=log,
                                                   stderr=subprocess.STDOUT, env=environment,
                                                   cwd=self.directory))

    def _wait_for(self, name: str, line: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while line not in (self.directory / f"{name}.log").read_text(errors="replace"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"the Spark {name} did not start:\n"
                                   + (self.directory / f"{name}.log").read_text(errors="replace")[-3000:])
            time.sleep(0.5)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("java") is None:
        pytest.skip("no Java runtime on PATH: Spark cannot start")
    directory = Path(tempfile.mkdtemp(prefix="dpsql-spark-cluster-"))
    started = Cluster(directory)
    yield started
    started.stop()
    shutil.rmtree(directory, ignore_errors=True)


def _recipe() -> list[tuple[str, str]]:
    """The (language, code) blocks of docs/cluster.md's fleet recipe, in order."""
    section = (ROOT / "docs" / "cluster.md").read_text().split(RECIPE_TITLE, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(\w*)\n(.*?)^```", section, flags=re.S | re.M)


def test_the_fleet_recipe_runs_as_written_on_a_cluster_with_a_postgres_ledger(cluster, postgres, tmp_path):
    import psycopg

    with psycopg.connect(postgres.url_of("postgres"), autocommit=True) as conn:
        conn.execute("CREATE ROLE analyst LOGIN")
        conn.execute("CREATE DATABASE privacy OWNER analyst")
    ledger = f"postgresql://analyst@127.0.0.1:{postgres.port}/privacy"
    meters, hours = 500, 24
    start = dt.datetime(2026, 11, 24)
    readings = tmp_path / "readings"
    readings.mkdir()
    rng = np.random.default_rng(3)
    pq.write_table(pa.table({"meter": np.repeat(np.arange(meters), hours),
                             "ts": [start + dt.timedelta(hours=h) for h in np.tile(np.arange(hours), meters).tolist()],
                             "kwh": np.round(rng.gamma(2.0, 1.5, meters * hours), 3)}), readings / "part-0.parquet")
    places = {"postgresql://analyst@ledger.internal:5432/privacy": ledger, "spark://spark.internal:7077": cluster.url,
              "s3://meters/readings/2026-11-24/": f"{readings}/", "s3://meters/private/2026-11-24/":
              f"{tmp_path / 'private'}/", "/opt/dpsql/bin/python": sys.executable}
    blocks = _recipe()
    assert [language for language, _ in blocks] == ["python", "python", "bash"]
    for language, code in blocks:
        for written, here in places.items():
            code = code.replace(written, here)
        if language == "python":
            (tmp_path / code.splitlines()[0].removeprefix("# ").strip()).write_text(code)
        else:
            (tmp_path / "submit.sh").write_text("set -euo pipefail\n" + code)
    assert all(written in "".join(code for _, code in blocks) for written in places)
    # the site's Spark defaults (not the recipe's business): a small cluster, no web UI
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "spark-defaults.conf").write_text("spark.ui.enabled false\nspark.executor.memory 512m\n"
                                                           "spark.sql.shuffle.partitions 4\n")
    environment = _environment(HOME=str(tmp_path), SPARK_CONF_DIR=str(tmp_path / "conf"))
    for command in ([sys.executable, "create_scope.py"], ["bash", "submit.sh"]):
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=environment)
        assert run.returncode == 0, textwrap.shorten(run.stderr[-4000:], 4000)
    released = pq.read_table(tmp_path / "private")
    assert released.num_rows == meters * hours and set(released.column_names) == {"meter", "ts", "kwh"}
    assert "tops" in run.stdout  # the ledger's history, printed by the recipe's last command
    budget = dpsql.Budget.open(ledger, scope="meters")
    assert budget.spent == (1.0, 0.0) and budget.history()["method"].to_list() == ["tops"]


def test_executors_that_cannot_import_dpsql_are_refused_before_the_charge(cluster, tmp_path):
    """The executors' Python is an empty virtual environment: the release is refused with a typed
    error naming that Python, and nothing is charged (it used to be charged, then fail)."""
    from pyspark.sql import SparkSession

    empty = tmp_path / "empty"
    venv.create(empty, with_pip=False)
    python = str(empty / "bin" / "python")
    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python  # what a session made in Python gives its executors
    session = (SparkSession.builder.master(cluster.url).appName("dpsql-no-dpsql")
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
               .config("spark.sql.shuffle.partitions", "2").config("spark.task.maxFailures", "1").getOrCreate())
    try:
        budget = dpsql.Budget.in_memory(epsilon=1.0)
        df = session.createDataFrame([(m, t, 1.0) for m in range(3) for t in range(20)], "meter long, ts long, "
                                                                                         "kwh double")
        message = f"executors cannot import dpsql .* with the Python {re.escape(python)}: install dpsql"
        with pytest.raises(dpsql.EnvironmentUnusable, match=message):
            spark_dp.range_sum(df, order_by="ts", value="kwh", partition_by="meter", method="laplace", epsilon=0.5,
                               upper=1.0, budget=budget)
        assert budget.spent == (0.0, 0.0) and budget.history().height == 0
        with pytest.raises(dpsql.EnvironmentUnusable, match=message):
            spark_dp.check_executors(session)
    finally:
        session.stop()
        if previous is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = previous
