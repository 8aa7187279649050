"""Local-DP primitives (docs/algorithms.md, "Local differential privacy"): the randomisers (:mod:`.randomisers`), Square
Wave density estimation (:mod:`.sw_estimation`), deviation feedback (:mod:`.feedback`) and
the linear post-processing of reports with its noise model (:mod:`.linear`).
"""

from dpsql.mechanisms.ldp.feedback import UNIT, FeedbackEncoder, Ranges, capp_ranges, capp_threshold
from dpsql.mechanisms.ldp.linear import ReportNoise, feedback_impulse, moving_average
from dpsql.mechanisms.ldp.randomisers import (
    EVENT_LDP_NEIGHBOUR,
    HYBRID,
    HYBRID_THRESHOLD,
    LDP_LATTICE_BITS,
    PIECEWISE,
    REPORT_UNIFORMS,
    SQUARE_WAVE,
    STOCHASTIC_ROUNDING,
    W_EVENT_LDP_NEIGHBOUR,
    Hybrid,
    Piecewise,
    Randomiser,
    SquareWave,
    StochasticRounding,
    SWConstants,
    lattice_spacing,
    report_uniforms,
)
from dpsql.mechanisms.ldp.sw_estimation import (
    SWKernel,
    sw_em,
    sw_histogram,
    sw_output_edges,
    sw_transition_matrix,
    sw_w_prune,
)

__all__ = [
    "EVENT_LDP_NEIGHBOUR",
    "HYBRID",
    "HYBRID_THRESHOLD",
    "LDP_LATTICE_BITS",
    "PIECEWISE",
    "REPORT_UNIFORMS",
    "SQUARE_WAVE",
    "STOCHASTIC_ROUNDING",
    "UNIT",
    "W_EVENT_LDP_NEIGHBOUR",
    "FeedbackEncoder",
    "Hybrid",
    "Piecewise",
    "Randomiser",
    "Ranges",
    "ReportNoise",
    "SWConstants",
    "SWKernel",
    "SquareWave",
    "StochasticRounding",
    "capp_ranges",
    "capp_threshold",
    "feedback_impulse",
    "lattice_spacing",
    "moving_average",
    "report_uniforms",
    "sw_em",
    "sw_histogram",
    "sw_output_edges",
    "sw_transition_matrix",
    "sw_w_prune",
]
