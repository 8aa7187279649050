"""Test doubles shared by the tests: noise sources and randomisers whose outputs are known."""

import numpy as np

from dpsql import noise


class Noiseless(noise.Draws):
    """Draws whose every keystream block is the uniform 1: every discrete Laplace draw is exactly 0.
    Runs a machine noise-free, to compare it with the paper's worked examples."""

    def __init__(self):
        self.private = False

    def _blocks(self, header, start, count, out=None):
        out = np.empty((count, 2), dtype=np.uint64) if out is None else out
        out[:, 0], out[:, 1] = (1 << 53) - 1, 0
        return out

    def _blocks_at(self, header, indices):
        return self._blocks(header, 0, len(indices))


class Scripted:
    """A randomiser stub: returns scripted outputs and records the inputs it saw."""

    uniforms = 1

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.inputs = []

    def perturb(self, z, eps, u):
        self.inputs.append(np.array(z, dtype=float))
        return np.full(np.shape(z), self.outputs.pop(0), dtype=float)
