"""The only place randomness comes from.

Every random draw in dpsql goes through a :class:`NoiseSource`. In private mode the
source is :class:`SystemNoise`, which reads the operating system's CSPRNG
(``os.urandom``, i.e. ``getrandom(2)``) and has no seed. A reproducible
:class:`SeededNoise` exists for tests only: it is installed by
:func:`dpsql.testing.seeded`, every release drawn from it is marked
``private=False``, and a persistent :class:`dpsql.Budget` refuses such releases.

Float safety
------------
Textbook ``x + laplace()`` on doubles leaks ``x`` through the rounding of the sum
(Mironov, CCS 2012): the set of reachable outputs depends on the input. dpsql never
adds continuous noise to a private float. Mechanisms snap the private quantity to a
lattice ``gamma * Z`` whose power-of-two spacing ``gamma`` depends only on public
parameters, add *integer* noise from :meth:`NoiseSource.discrete_laplace`, and
multiply back by ``gamma``. Every step is exact in int64 / float64, so the released
value is ``gamma * (round(x / gamma) + Z)``: the output lattice is the same for every
input and the noise is exactly input-independent (see
:class:`dpsql.mechanisms.LaplaceLattice`).

The discrete Laplace draw ``P(Z = k) ∝ exp(-|k| / scale)`` uses one 64-bit word per
candidate: one bit for the sign, 53 bits for a uniform ``U`` in (0, 1], and
``|Z| = floor(-scale * ln U)`` (a geometric variable); the pair (negative sign, 0)
is rejected and redrawn so that zero is not counted twice.

Resolution of ``U``: on a grid of spacing ``2^-53`` the magnitudes reachable near a
small ``U`` are ``scale * 2^-53 / U`` apart, so for large scales some integers in the
far tail could never be drawn, and which outputs are unreachable would then depend on
the input. Every ``U < 2^-20`` (one draw in a million) is therefore refined with 53
more random bits, ``U = (k + V) * 2^-53``: everywhere the relative spacing of ``U``
is then at most ``2^-33`` (``2^-53`` in the refined range), so every integer
magnitude is reachable for scales up to ``2^33`` lattice units; the mass where that
could fail is below ``scale * 2^-106``. What remains is the rounding of ``log``
(relative error about 1e-16 on each probability), computed from public quantities only.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from dpsql.errors import InvalidParameter

_TWO_POW_M53 = 2.0**-53
_MASK53 = np.uint64((1 << 53) - 1)
# Uniforms below 2^-20 (53-bit grid values below 2^33) get 53 more bits; see the module docstring.
_REFINE_BELOW = np.uint64(1 << 33)
_SIGN_BIT = np.uint64(1 << 63)
#: Every uniform the discrete Laplace draw inverts is at least ``2^-106`` (a refined
#: one's smallest value), so every draw has ``|Z| <= scale * MAX_NEG_LOG_UNIFORM``.
MAX_NEG_LOG_UNIFORM = 106 * math.log(2)
#: The largest scale :meth:`NoiseSource.discrete_laplace` accepts: up to it every integer
#: magnitude is reachable (see "Resolution of U" above); beyond it, which outputs are
#: unreachable would depend on the input the noise is added to.
MAX_SCALE = 2.0**33
# Words drawn per os.urandom call: large enough to amortise the syscall, small enough
# that the piece and its temporaries stay in L2 cache while it is turned into noise
# (2^18 words ran twice as slow: every temporary went through memory).
_PIECE = 1 << 14
# Draws from which SystemNoise splits a request between two threads.
_THREADED_FROM = 1 << 17
_THREADS = max(1, min(4, os.cpu_count() or 1))
# Words read ahead per background task, and at most in reserve (64 MiB).
_PREFETCH_PIECE = 1 << 20
_MAX_PREFETCHED = 1 << 23


class NoiseSource:
    """Base class: a stream of uniformly random 64-bit words plus the draws built on it.

    Subclasses implement :meth:`words`. Everything else is shared, so the seeded
    test source and the CSPRNG source produce identically distributed noise.
    """

    #: True only for the OS CSPRNG source. Releases inherit this flag.
    private: bool = False

    def words(self, n: int) -> np.ndarray:
        """``n`` independent uniform ``uint64`` words."""
        raise NotImplementedError

    def uniform(self, size: int) -> np.ndarray:
        """Uniform doubles in the open interval (0, 1), on the 2^-53 grid shifted by half a step."""
        w = self.words(size)
        return ((w >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_M53

    def discrete_laplace(self, scale: float | np.ndarray, size: int) -> np.ndarray:
        """Integers with ``P(Z = k) = (1-a)/(1+a) * a**|k|``, ``a = exp(-1/scale)``.

        Mean 0, variance ``2a / (1-a)**2`` (about ``2 * scale**2`` for large scale).
        ``scale = 0`` returns zeros. ``scale`` may also be an array of ``size`` scales, one
        per draw (partitions with their own lattices in one call): draw ``i`` then has scale
        ``scale[i]``, from the same words and arithmetic (elementwise) as a scalar scale.
        Scales above :data:`MAX_SCALE` are refused (:class:`~dpsql.errors.InvalidParameter`).
        """
        if np.ndim(scale):
            scale = np.asarray(scale, dtype=np.float64)
            if scale.shape != (size,) or not np.all((scale >= 0) & (scale <= MAX_SCALE)):
                raise InvalidParameter(f"discrete_laplace scales must be {size} values in [0, 2**33]")
            positive = scale > 0
            if not positive.all():
                out = np.zeros(size, dtype=np.int64)
                out[positive] = self.discrete_laplace(scale[positive], int(positive.sum()))
                return out
        elif scale == 0:
            return np.zeros(size, dtype=np.int64)
        elif not 0 < scale <= MAX_SCALE:
            raise InvalidParameter(f"discrete_laplace scale must be in (0, 2**33] (the sampler's resolution "
                                   f"limit), got {scale!r}")
        out = np.empty(size, dtype=np.int64)
        self._parallel(size, lambda a, b: self._discrete_laplace_into(_share(scale, a, b), out[a:b]))
        return out

    def _discrete_laplace_into(self, scale: float | np.ndarray, out: np.ndarray) -> None:
        for start in range(0, out.size, _PIECE):
            piece = out[start:start + _PIECE]
            piece_scale = _share(scale, start, start + _PIECE)
            rejected = self._fill_discrete_laplace(piece_scale, piece)
            while rejected.size:
                redraw = np.empty(rejected.size, dtype=np.int64)
                still = self._fill_discrete_laplace(_share(piece_scale, rejected), redraw)
                keep = np.ones(rejected.size, dtype=bool)
                keep[still] = False
                piece[rejected[keep]] = redraw[keep]
                rejected = rejected[still]

    def _fill_discrete_laplace(self, scale: float | np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` with signed geometric draws; return the indices to redraw."""
        w = self.words(out.size)
        bits = w & _MASK53
        u = np.add(bits, 1.0)
        if bits.min() < _REFINE_BELOW:
            coarse = np.flatnonzero(bits < _REFINE_BELOW)
            refinement = (self.words(coarse.size) & _MASK53).astype(np.float64)
            u[coarse] = bits[coarse].astype(np.float64) + (refinement + 1.0) * _TWO_POW_M53
        u *= _TWO_POW_M53
        np.log(u, out=u)
        u *= -scale
        # The word's top bit becomes the float's sign bit; the conversion to int64 then
        # truncates toward zero, i.e. gives -floor(x) for negative x: one pass fewer than
        # negating the integers afterwards.
        u.view(np.uint64)[:] |= w & _SIGN_BIT
        out[:] = u
        zeros = np.flatnonzero(out == 0)
        return zeros[w[zeros] >= _SIGN_BIT]

    def prefetch(self, count: int) -> None:
        """Hint that about ``count`` words will be drawn soon. Sources that can read
        them in the background start doing so; the others ignore the hint."""

    def _parallel(self, size: int, fill) -> None:
        """``fill(0, size)``; sources that can draw in parallel fill several ranges ``a:b`` at once."""
        fill(0, size)


class SystemNoise(NoiseSource):
    """The OS CSPRNG. No seed can be set. Large requests are filled by two threads
    (``os.urandom`` and numpy both release the GIL).

    :meth:`prefetch` reads words ahead on a background thread, e.g. while an engine is
    still handing over the rows the noise is for. Read-ahead words are OS CSPRNG output
    like any other, kept in memory only until drawn, and each is handed out once: a
    forked child forgets the words its parent read ahead (it would otherwise hand out
    the same ones) and the threads it did not inherit.
    """

    private = True
    _pool: ThreadPoolExecutor | None = None
    _reader: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self):
        self._forget_read_ahead()
        _SYSTEM_SOURCES.add(self)

    def _forget_read_ahead(self) -> None:
        self._lock = threading.Lock()
        self._ready: deque[np.ndarray] = deque()
        self._pending: deque[tuple[int, Future]] = deque()
        self._reserved = 0

    def words(self, n: int) -> np.ndarray:
        if not self._reserved:
            return _urandom_words(n)
        taken = []
        with self._lock:
            while n and (self._ready or self._pending):
                if not self._ready:
                    size, future = self._pending.popleft()
                    try:
                        self._ready.append(future.result())
                    except BaseException:
                        self._reserved -= size
                        raise
                head = self._ready.popleft()
                if len(head) > n:
                    self._ready.appendleft(head[n:])
                    head = head[:n]
                taken.append(head)
                self._reserved -= len(head)
                n -= len(head)
        if n:
            taken.append(_urandom_words(n))
        return taken[0] if len(taken) == 1 else np.concatenate(taken)

    def prefetch(self, count: int) -> None:
        with self._lock:
            count = min(int(count), _MAX_PREFETCHED - self._reserved)
            reader = self._executor("_reader", 1) if count > 0 else None
            for start in range(0, max(count, 0), _PREFETCH_PIECE):
                size = min(_PREFETCH_PIECE, count - start)
                self._pending.append((size, reader.submit(_urandom_words, size)))
                self._reserved += size

    def _parallel(self, size: int, fill) -> None:
        if size < _THREADED_FROM:
            fill(0, size)
            return
        # One contiguous share per thread, each worked through in cache-sized pieces.
        bounds = np.linspace(0, size, _THREADS + 1).astype(int).tolist()
        list(self._executor("_pool", _THREADS).map(fill, bounds[:-1], bounds[1:]))

    @classmethod
    def _executor(cls, name: str, workers: int) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if getattr(cls, name) is None:
                setattr(cls, name, ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"dpsql{name}"))
            return getattr(cls, name)


def _share(scale: float | np.ndarray, *where) -> float | np.ndarray:
    """The scales of the draws ``where`` selects (a slice ``a, b`` or an index array); a
    scalar scale is every draw's."""
    if not np.ndim(scale):
        return scale
    return scale[slice(*where)] if len(where) == 2 else scale[where[0]]


def _urandom_words(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(8 * n), dtype=np.uint64)


_SYSTEM_SOURCES: weakref.WeakSet[SystemNoise] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    SystemNoise._pool = SystemNoise._reader = None
    SystemNoise._pool_lock = threading.Lock()
    for source in list(_SYSTEM_SOURCES):
        source._forget_read_ahead()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SeededNoise(NoiseSource):
    """Reproducible, **non-private** noise for tests (numpy PCG64). Thread-safe."""

    private = False

    def __init__(self, seed: int):
        self._bits = np.random.PCG64(seed)
        self._lock = threading.Lock()

    def words(self, n: int) -> np.ndarray:
        with self._lock:
            return self._bits.random_raw(n).astype(np.uint64, copy=False)


_SYSTEM = SystemNoise()
_override: NoiseSource | None = None
_override_lock = threading.Lock()


def current() -> NoiseSource:
    """The noise source in force: the OS CSPRNG unless a test installed a seeded one."""
    return _override if _override is not None else _SYSTEM


@contextlib.contextmanager
def _installed(source: NoiseSource):
    """Install ``source`` process-wide (all threads, so engine worker threads see it too)."""
    global _override
    with _override_lock:
        previous, _override = _override, source
    try:
        yield source
    finally:
        with _override_lock:
            _override = previous
