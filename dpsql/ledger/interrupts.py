"""Signals held back while the ledger opens or ends a transaction, and only then.

A KeyboardInterrupt (or whatever a Python signal handler raises) can arrive between any two
bytecodes, ``finally`` blocks and ``__exit__`` included: one arriving while a transaction is
being opened, committed or rolled back would leave it open, and its lock held for as long as the
process lives. So the functions that do those things are marked :func:`critical`: while one of
them is on the main thread's stack, a signal is recorded, and its handler is called as soon as
the critical function is done (:func:`hold`, :func:`release`, :func:`deliver`): the transaction
then committed or rolled back, or open and its body about to run. A function marked :func:`interruptible`
and called from a critical one (connecting to a server, waiting for another process's lock) is
interrupted at once again, and the critical function that called it cleans up.

Everything else is interrupted at once, as without dpsql: the computation of a release, and
that of a continual stream's append, which runs inside its transaction; the interrupt then
reaches the transaction's ``__exit__``, which is critical and rolls back. The decision is made
from the interrupted frame and its callers when the signal arrives, so no instant falls between
two guards.

Only the main thread runs Python signal handlers, so only it holds signals back; a transaction
in another thread is never interrupted. Signals whose handler is not a Python function
(``SIG_DFL``, ``SIG_IGN``) are left alone: SIGTERM's default ends the process, leaving the
ledger to its backend's atomicity (committed or absent), as ``kill -9`` does. A handler the
program installed itself is honoured: called at once outside critical sections, held back
inside them, and restored afterwards.
"""

from __future__ import annotations

# _signal: the C module behind signal, whose getsignal and signal are the same functions without
# the wrappers that turn handler numbers into enums, 20 times the calls' own cost (30 us a block).
import _signal
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType

# The signals a program may handle in Python (SIGINT's default handler raises KeyboardInterrupt).
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM",
                                                    "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_CRITICAL: set[CodeType] = set()
_INTERRUPTIBLE: set[CodeType] = set()


class _Held:
    """The main thread's state: how many critical sections have called :func:`hold`, the
    handlers ours replaced, and the signals that arrived meanwhile (with their handlers)."""

    def __init__(self):
        self.depth = 0
        self.replaced: dict[int, Callable] = {}
        self.pending: list[tuple[int, Callable]] = []


_HELD = _Held()


def critical(function):
    """Mark ``function``: no signal handler runs while it (or anything it calls) runs."""
    _CRITICAL.add(function.__code__)
    return function


def interruptible(function):
    """Mark ``function``, called by a critical one: signals are handled at once inside it."""
    _INTERRUPTIBLE.add(function.__code__)
    return function


def hold() -> bool:
    """Start holding signals back (called first by a critical function; a no-op outside the
    main thread). Returns what :func:`release` must be given.

    A signal arriving before this has replaced the handler is handled as usual, raising here
    with nothing held yet; replacing is repeatable, so an interrupted call leaves nothing
    inconsistent."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if _HELD.depth == 0:
        for number in _SIGNALS:
            handler = _signal.getsignal(number)
            if callable(handler) and handler is not _on_signal:
                _HELD.replaced[number] = handler
                _signal.signal(number, _on_signal)
    _HELD.depth += 1
    return True


def release(held: bool) -> None:
    """End what :func:`hold` started (called last by a critical function, once everything is
    clean): the last release restores the program's handlers, then the signals held back are
    handled (SIGINT's handler raises KeyboardInterrupt here)."""
    if not held:
        return
    _HELD.depth -= 1
    if _HELD.depth == 0:
        for number, handler in _HELD.replaced.items():
            if _signal.getsignal(number) is _on_signal:  # unless the program installed another meanwhile
                _signal.signal(number, handler)
    deliver()


def deliver() -> None:
    """Handle the signals held back so far, now (their handlers may raise)."""
    if _HELD.pending:
        due, _HELD.pending = _HELD.pending, []
        frame = sys._getframe(1)
        for number, handler in due:
            handler(number, frame)


def _on_signal(number: int, frame: FrameType | None) -> None:
    handler = _HELD.replaced[number]
    if _in_critical(frame):
        _HELD.pending.append((number, handler))
    else:
        handler(number, frame)


def _in_critical(frame: FrameType | None) -> bool:
    """Is ``frame``, or the nearest of its callers that is marked, critical?"""
    while frame is not None:
        if frame.f_code in _CRITICAL:
            return True
        if frame.f_code in _INTERRUPTIBLE:
            return False
        frame = frame.f_back
    return False
