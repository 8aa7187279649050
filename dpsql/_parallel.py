"""Work cut in two, the halves computed on two threads (for functions that release the GIL:
hashing, compression), waited for on a plain lock.

Waiting on anything else is not safe from Ctrl-C: a future, a thread pool or
``threading.Thread.start`` waits on a condition variable, and a KeyboardInterrupt arriving just
as that lets go of its lock makes its ``with`` raise RuntimeError ("cannot release un-acquired
lock") or leaves the lock held, so that the pool's next call hangs for ever. A plain lock's
``acquire`` is interrupted cleanly: KeyboardInterrupt, and nothing held.
"""

from __future__ import annotations

import _thread
from collections.abc import Callable, Sequence
from typing import TypeVar

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def in_two_halves(function: Callable[[_In], _Out], items: Sequence[_In]) -> list[_Out]:
    """``[function(x) for x in items]``: the second half on a thread of its own (started for
    the call: nothing to restart after a fork) while this one computes the first.

    >>> in_two_halves(lambda x: x * x, [1, 2, 3])
    [1, 4, 9]
    """
    half = len(items) // 2
    done, outcome = _thread.allocate_lock(), []
    done.acquire()

    def second_half() -> None:
        try:
            outcome.append([function(x) for x in items[half:]])
        except BaseException as error:  # (MemoryError, ...): raised in the caller's thread
            outcome.append(error)
        finally:
            done.release()

    _thread.start_new_thread(second_half, ())
    first = [function(x) for x in items[:half]]
    done.acquire()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return first + outcome[0]
