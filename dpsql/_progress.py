"""Progress bars for long releases.

Work that can run for seconds (the sequential device loops of local-DP methods on long
streams, PAK's smooth-sensitivity search on a large hold-out) estimates its duration
before it starts, from its size and a pace measured on the reference machine, and asks
:func:`bar` for a bar. A bar is shown only when that estimate is at least
:data:`MIN_SECONDS` and progress is enabled: :func:`dpsql.publishing.publish` enables it by
default and ``progress=False`` silences it (:func:`shown`). Bars come from ``tqdm.auto``:
a widget in a notebook, text on standard error elsewhere; they disappear when done.

Examples
--------
>>> with shown(False):
...     quiet = bar(10**9, seconds=60.0, desc="long")
>>> quiet.update(5); quiet.close(); quiet.step > 10**9
True
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

#: Work expected to take at least this long (seconds) shows a bar.
MIN_SECONDS = 2.0
#: A shown bar is updated about this often (seconds), so the work is cut into pieces that long.
UPDATE_SECONDS = 0.25

_SHOWN: contextvars.ContextVar[bool] = contextvars.ContextVar("dpsql_progress_shown", default=True)


@contextlib.contextmanager
def shown(enabled: bool = True):
    """Show (or, with ``enabled=False``, silence) the bars of the work done inside the block."""
    token = _SHOWN.set(bool(enabled))
    try:
        yield
    finally:
        _SHOWN.reset(token)


class Bar:
    """Progress over ``total`` units of work: ``update(units)`` as they are done, ``close()``
    at the end. ``step`` is how many units to do between updates (everything at once when
    the bar is not shown, so silent work is never cut into pieces)."""

    def __init__(self, total: int, seconds: float, display=None):
        self._display = display
        self.step = sys.maxsize if display is None else max(1, int(total * UPDATE_SECONDS / seconds))

    def update(self, units: int) -> None:
        if self._display is not None:
            self._display.update(units)

    def close(self) -> None:
        if self._display is not None:
            self._display.close()
            self._display = None


def bar(total: int, *, seconds: float, desc: str, unit: str = "it") -> Bar:
    """A :class:`Bar` over ``total`` units expected to take ``seconds``: shown when progress is
    enabled and ``seconds >= MIN_SECONDS``, silent otherwise."""
    if total <= 0 or seconds < MIN_SECONDS or not _SHOWN.get():
        return Bar(total, seconds)
    from tqdm.auto import tqdm

    return Bar(total, seconds, tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False))
