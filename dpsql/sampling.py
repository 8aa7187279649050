"""How keystream blocks become numbers: the discrete Laplace sampler and uniforms.

Every draw of :mod:`dpsql.noise` is a 128-bit block (two little-endian 64-bit words) at its
address; the functions here turn blocks into noise, using nothing but the block.

Float safety
------------
Textbook ``x + laplace()`` on doubles leaks ``x`` through the rounding of the sum
(Mironov, CCS 2012). dpsql never adds continuous noise to a private float: mechanisms
snap the private quantity to a lattice ``gamma * Z`` whose power-of-two spacing depends
only on public parameters and add *integer* noise from :meth:`dpsql.noise.LaneDraws.discrete_laplace`
(see :class:`dpsql.mechanisms.LaplaceLattice`).

The discrete Laplace draw ``P(Z = k) ∝ exp(-|k| / scale)`` takes one 128-bit block: one
bit of its first word for the sign, 53 bits for a uniform ``U`` in (0, 1], and
``|Z| = floor(-scale * ln U)`` (a geometric variable); the pair (negative sign, 0) is
rejected and redrawn from the same address with the next *attempt*, so that zero is not
counted twice. Every ``U < 2^-20`` (one draw in a million) is refined with the 53 bits of
the block's second word, ``U = (k + V) * 2^-53``: the relative spacing of ``U`` is then
at most ``2^-33`` everywhere, so every integer magnitude is reachable for scales up to
``2^33`` lattice units (:data:`MAX_SCALE`); which outputs are unreachable could otherwise
depend on the input. What remains is the rounding of ``log`` (relative error about
1e-16 on each probability), computed from public quantities only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dpsql.errors import InvalidParameter

_TWO_POW_M53 = 2.0**-53
_MASK53 = np.uint64((1 << 53) - 1)
# Uniforms below 2^-20 (53-bit grid values below 2^33) are refined; see the module docstring.
_REFINE_BELOW = np.uint64(1 << 33)
_SIGN_BIT = np.uint64(1 << 63)
#: Every uniform the discrete Laplace draw inverts is at least ``2^-106`` (a refined
#: one's smallest value), so every draw has ``|Z| <= scale * MAX_NEG_LOG_UNIFORM``.
MAX_NEG_LOG_UNIFORM = 106 * math.log(2)
#: The largest scale :meth:`LaneDraws.discrete_laplace` accepts: up to it every integer
#: magnitude is reachable (see "Float safety" above).
MAX_SCALE = 2.0**33
#: Indices must stay below this (the counter block's index field, with room to spare).
MAX_INDEX = 1 << 62
_MAX_ATTEMPTS = 1 << 31


def fill_discrete_laplace(blocks: np.ndarray, scale, out: np.ndarray) -> np.ndarray:
    """Signed geometric draws from ``blocks`` (``(n, 2)`` words) into ``out``; the indices
    to redraw (negative zeros). ``scale`` is one value or one per draw (all positive)."""
    first = blocks[:, 0]
    bits = first & _MASK53
    u = np.add(bits, 1.0)
    if bits.min(initial=_REFINE_BELOW) < _REFINE_BELOW:
        coarse = np.flatnonzero(bits < _REFINE_BELOW)
        refinement = (blocks[coarse, 1] & _MASK53).astype(np.float64)
        u[coarse] = bits[coarse].astype(np.float64) + (refinement + 1.0) * _TWO_POW_M53
    u *= _TWO_POW_M53
    np.log(u, out=u)
    u *= -np.asarray(scale)
    # The word's top bit becomes the float's sign bit; the conversion to int64 then truncates
    # toward zero, i.e. gives -floor(x) for negative x.
    u.view(np.uint64)[:] |= first & _SIGN_BIT
    out[:] = u
    zeros = np.flatnonzero(out == 0)
    return zeros[first[zeros] >= _SIGN_BIT]


def uniform_of(blocks: np.ndarray) -> np.ndarray:
    return ((blocks[:, 0] >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_M53


def check_range(start: int, count: int) -> None:
    if not (start >= 0 and count >= 0 and start + count <= MAX_INDEX):
        raise ValueError(f"draw indices {start}..{start + count} out of range")


def check_indices(indices) -> np.ndarray:
    indices = np.asarray(indices, dtype=np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= MAX_INDEX):
        raise ValueError("draw indices out of range")
    return indices


def check_scale(scale: float) -> None:
    if not 0 <= scale <= MAX_SCALE:
        raise InvalidParameter(f"discrete_laplace scale must be in [0, 2**33] (the sampler's resolution limit), "
                               f"got {scale!r}")


def redraw(blocks_of: Callable[[int, np.ndarray], np.ndarray], scale, out: np.ndarray, where: np.ndarray) -> None:
    """Redraw ``out[where]`` (rejected draws) until none is rejected: ``blocks_of(attempt, chosen)``
    gives the blocks of attempt ``attempt`` for the rejected draws ``chosen`` (positions in
    ``where``); ``scale`` is one value or one per position of ``where``."""
    chosen = np.arange(len(where))
    attempt = 1
    while chosen.size:
        if attempt >= _MAX_ATTEMPTS:  # probability below 2**-(2**31): never
            raise RuntimeError("discrete Laplace: too many rejections")
        redraw = np.empty(len(chosen), dtype=np.int64)
        still = fill_discrete_laplace(blocks_of(attempt, chosen), scale if np.ndim(scale) == 0 else scale[chosen],
                                       redraw)
        keep = np.ones(len(chosen), dtype=bool)
        keep[still] = False
        out[where[chosen[keep]]] = redraw[keep]
        chosen = chosen[still]
        attempt += 1
