"""Work shared by two threads (for functions that release the GIL: hashing, compression, array
encodings), waited for on a plain lock.

Waiting on anything else is not safe from Ctrl-C: a future, a thread pool or
``threading.Thread.start`` waits on a condition variable, and a KeyboardInterrupt arriving just
as that lets go of its lock makes its ``with`` raise RuntimeError ("cannot release un-acquired
lock") or leaves the lock held, so that the pool's next call hangs for ever. A plain lock's
``acquire`` is interrupted cleanly: KeyboardInterrupt, and nothing held.
"""

from __future__ import annotations

import _thread
import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def on_two_threads(function: Callable[[_In], _Out], items: Sequence[_In]) -> list[_Out]:
    """``[function(x) for x in items]``, computed by this thread and one of its own (started for
    the call: nothing to restart after a fork), each taking the next item not yet taken: so the
    items that cost the most should come first.

    >>> on_two_threads(lambda x: x * x, [1, 2, 3])
    [1, 4, 9]
    """
    results: list = [None] * len(items)
    taken = itertools.count()  # its next() is atomic: each item is taken once
    done, failure = _thread.allocate_lock(), []
    done.acquire()

    def work() -> None:
        while (at := next(taken)) < len(items):
            results[at] = function(items[at])

    def helper() -> None:
        try:
            work()
        except BaseException as error:  # (MemoryError, ...): raised in the caller's thread
            failure.append(error)
        finally:
            done.release()

    _thread.start_new_thread(helper, ())
    work()
    done.acquire()
    if failure:
        raise failure[0]
    return results
