"""Mechanism primitives. Each module states the privacy cost of what it defines."""

from dpsql.mechanisms.laplace import LATTICE_BITS, LaplaceLattice
from dpsql.mechanisms.noisy_max import report_noisy_max

__all__ = ["LATTICE_BITS", "LaplaceLattice", "report_noisy_max"]
