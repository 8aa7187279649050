"""Local-DP streams: each value is perturbed on its owner's device; the server only post-processes.

Releases (:mod:`dpsql.ldp.api`): ToPL (:func:`topl`, event-level LDP) and DU's
``pm_direct`` baseline; Du et al.'s methods under w-event LDP (:func:`sw_direct`,
:func:`sampling`, :func:`ba_sw`, :func:`ipp`, :func:`app`, :func:`capp`, :func:`pp_s`).
The device side: :class:`DeviceEncoder` and :class:`ToplDevice`. The collector's side
(:mod:`dpsql.ldp.collector`, free post-processing): ToPL's estimators and DU's smoothing,
estimators and metrics. Primitives live in :mod:`dpsql.mechanisms.ldp`, the machines in
:mod:`dpsql.streams.du` and :mod:`dpsql.streams.topl`.
"""

from dpsql.ldp.api import DeviceEncoder, app, ba_sw, capp, ipp, pm_direct, pp_s, sampling, sw_direct, topl
from dpsql.ldp.collector import (
    cosine_distance,
    cosine_similarity,
    crowd_distribution,
    debias,
    debiased_slot_values,
    published_stream,
    report_lengths,
    report_view,
    slot_values,
    subsequence_mean_mse,
    subsequence_means,
    wasserstein_1,
)
from dpsql.streams.topl import ToplDevice, estimate_holdout, estimate_stream, estimate_threshold

__all__ = ["DeviceEncoder", "ToplDevice", "app", "ba_sw", "capp", "cosine_distance", "cosine_similarity",
           "crowd_distribution", "debias", "debiased_slot_values", "estimate_holdout", "estimate_stream",
           "estimate_threshold", "ipp", "pm_direct", "pp_s", "published_stream", "report_lengths", "report_view",
           "sampling", "slot_values", "subsequence_mean_mse", "subsequence_means", "sw_direct", "topl",
           "wasserstein_1"]
