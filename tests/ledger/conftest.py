"""A throw-away PostgreSQL server for the ledger tests, started from the system's binaries."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``initdb`` + ``pg_ctl`` in a temporary directory, as the ``postgres`` user when run as root
    (the server refuses root); ``url(database)`` to connect, ``restart()`` for fault tests."""

    def __init__(self, directory):
        self.data = directory / "data"
        self.port = _free_port()
        self.data.mkdir()
        self.as_user = []
        if os.geteuid() == 0:
            shutil.chown(directory, "postgres")
            shutil.chown(self.data, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    def _run(self, *command):
        subprocess.run([*self.as_user, *command], check=True, capture_output=True, timeout=120)

    def start(self):
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=on"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.data / "log"), "-w", "start")

    def stop(self, mode: str = "fast"):
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self):
        self.stop()
        self.start()

    def url(self, database: str) -> str:
        import psycopg

        with psycopg.connect(self.url_of("postgres"), autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{database}"')
        return self.url_of(database)

    def url_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="session")
def postgres():
    """The session's PostgreSQL server; the test is skipped, saying why, only when none can run."""
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed (pip install 'dpsql[postgres]')")
    missing = [b for b in ("initdb", "pg_ctl", "postgres") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"no PostgreSQL server binaries on PATH ({', '.join(missing)} missing)")
    # not under pytest's temporary directory, which only root may enter
    directory = Path(tempfile.mkdtemp(prefix="dpsql-postgres-"))
    try:
        server = PostgresServer(directory)
        yield server
        with contextlib.suppress(subprocess.CalledProcessError):
            server.stop("immediate")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres, request):
    """A fresh database of the session's server for one test."""
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower() + f"_{time.time_ns()}"
    return postgres.url(name)
