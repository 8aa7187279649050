"""Du et al.'s perturbation parameterisation under w-event local DP (docs/algorithms.md, "The w-event family"), as
machines: the public parameters (:mod:`.plan`), the device side (:mod:`.encoders`) and the
machines that :mod:`dpsql.methods` registers (:mod:`.machines`)."""

from dpsql.streams.du.machines import MACHINES

__all__ = ["MACHINES"]
