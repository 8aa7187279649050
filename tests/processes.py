"""Running a piece of a test in another real process: a forked child, or a fresh interpreter
running one of the programs below (:func:`program`), driven through its stdin and stdout."""

import os
import pwd
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def in_forked_child(action) -> str:
    """Run ``action()`` in a forked child: the string it returned, or ``"<ErrorType>: <message>"``
    of what it raised. The parent reads the child's answer to the end before reaping it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            try:
                message = str(action())
            except BaseException as error:
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def as_user(name: str, action) -> str:
    """:func:`in_forked_child` as the OS user ``name`` (a test running as root gives its
    privileges up in the child): what ``action()`` returned, or the error it raised."""
    user = pwd.getpwnam(name)

    def unprivileged():
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
        return action()

    return in_forked_child(unprivileged)


def program(name: str, *args) -> subprocess.Popen:
    """A fresh interpreter running ``name(*args)`` of this module, talking line by line
    through pipes (text), with this directory importable. SIGUSR1 makes it write where each of
    its threads is to stderr."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    code = f"import faulthandler, processes, signal; faulthandler.register(signal.SIGUSR1); processes.{name}(*{args!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)


def answer(process: subprocess.Popen, timeout: float) -> str:
    """The next line ``process`` writes, waiting at most ``timeout`` seconds; raises
    AssertionError (with the process's stderr when it died) if none comes."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line:
        alive = process.poll() is None
        if alive:  # where it is stuck, then gone
            process.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            process.kill()
        raise AssertionError(f"no answer within {timeout} s (process {'stuck' if alive else 'died'}): "
                             f"{process.communicate()[1][-3000:]}")
    return line.strip()


def say(process: subprocess.Popen, line: str) -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _lock_timeouts(seconds: float) -> None:
    """Make a stuck ledger lock fail this process's calls after ``seconds`` (not the default minute)."""
    from dpsql.ledger import postgres, sqlite

    sqlite.LOCK_TIMEOUT = seconds
    postgres.LOCK_TIMEOUT_MS = int(seconds * 1000)


def releasing_until_killed(location: str, stream: str, seed: int) -> None:
    """Release on the ledger at ``location`` in a loop until killed: the same publish call again
    (answered from the ledger after the first, through its answer lookup), a fresh one (charged)
    and an append to stream ``stream``, opening the budget anew after some interrupts. Each
    KeyboardInterrupt is caught and answered on stdout: ``idle`` (the loop then waits for a line
    on stdin before going on) or ``busy`` (it goes on at once); or ``lost <handler>`` if the
    SIGINT handler this program installed is no longer installed. After each, the program's
    handler is either Python's default or its own (which raises KeyboardInterrupt too)."""
    import numpy as np
    import polars as pl

    import dpsql

    def own_handler(number, frame):
        raise KeyboardInterrupt("the program's own handler")

    rng = random.Random(seed)
    values = np.arange(200.0) % 7
    hour, idle, handler = 0, False, signal.default_int_handler
    budget = dpsql.Budget.open(location)
    appends = budget.stream(stream)

    def release_and_append():
        nonlocal hour
        dpsql.laplace(values, epsilon=1e-6, upper=10.0, budget=budget)
        dpsql.laplace(values, epsilon=1e-6, upper=10.0, budget=budget, fresh=True)
        hour += 10  # past whatever an interrupted append may have committed
        appends.append(pl.DataFrame({"hour": [hour, hour + 1], "kwh": [1.0, 2.5]}))

    release_and_append()  # warm: the first call of each kind imports and compiles, for a second or more
    report = "ready"
    # The answer to an interrupt is written at the top of the inner loop, inside its try: the
    # next SIGINT (sent once it is read) finds the loop inside the try or at its back edge, also
    # inside. The outer loop's back edge is only reached before the answer is written.
    while True:
        try:
            while True:
                if report:
                    print(report, flush=True)
                    report = ""
                if idle:
                    idle = False
                    sys.stdin.readline()
                if appends is None:
                    budget = dpsql.Budget.open(location)
                    appends = budget.stream(stream)
                release_and_append()
        except KeyboardInterrupt:
            idle = rng.random() < 0.5
            if rng.random() < 0.3:
                budget = appends = None
            report = "idle" if idle else "busy"
            if signal.getsignal(signal.SIGINT) is not handler:
                report = f"lost {handler}: {signal.getsignal(signal.SIGINT)} is installed"
            handler = rng.choice([signal.default_int_handler, own_handler])
            signal.signal(signal.SIGINT, handler)


def releasing_on_request(location: str, lock_timeout: float) -> None:
    """For each line on stdin, release once (fresh, charged) on the ledger at ``location`` and
    answer ``<seconds it took> released`` or ``<seconds> <error>``."""
    import numpy as np

    import dpsql

    _lock_timeouts(lock_timeout)
    budget = dpsql.Budget.open(location)
    dpsql.laplace(np.ones(10), epsilon=1e-6, upper=1.0, budget=budget, fresh=True)  # warm
    print("ready", flush=True)
    for _ in sys.stdin:
        started = time.monotonic()
        try:
            dpsql.laplace(np.ones(10), epsilon=1e-6, upper=1.0, budget=budget, fresh=True)
            outcome = "released"
        except dpsql.DPError as error:
            outcome = f"{type(error).__name__}: {error}"
        print(f"{time.monotonic() - started:.3f} {outcome}", flush=True)


def appending_once(location: str, stream: str, rows: int) -> None:
    """Append ``rows`` rows (50 partitions) to stream ``stream`` once, saying ``appending``
    first; answer ``interrupted`` when a KeyboardInterrupt ends it, then wait for stdin to close."""
    import numpy as np
    import polars as pl

    import dpsql

    appends = dpsql.Budget.open(location).stream(stream)
    frame = pl.DataFrame({"meter": np.arange(rows) % 50, "hour": np.arange(rows) // 50, "kwh": np.ones(rows)})
    try:
        print("appending", flush=True)
        appends.append(frame)
        print("appended", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    sys.stdin.read()
