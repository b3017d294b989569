"""How well the draft's confidence in a token predicts its acceptance, per (class, draft):
P(accept | confidence bucket, position), learnt from the engines' counts (``ConfidenceRecord``).

Each (position, confidence bucket) cell is a Bernoulli rate of the tokens that reached that
position (censored positions are never counted), estimated like the class-level acceptance
(``acceptance.AcceptanceEstimator`` over the cells: the same forgetting, change detection and
recovery). The prior of a cell is centred on the class's own acceptance at that position, with
``calibration_prior_tries`` of weight: before any confidence is counted, or in buckets the draft
rarely reaches, the calibration says what the class-level posterior says, and per-token
decisions fall back to today's class-level ones. Requests whose sampling the target transforms
are calibrated apart (``transformed``): their drafts' confidence overstates acceptance, and
pooling them would poison the calibration of the class's other requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import ConfidenceRecord
from specpilot.controller.core.acceptance import AcceptanceEstimator, EstimatorConfig

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class CalibrationTable:
    """P(accept) per position (rows, 1..max_k) and confidence bucket (columns), for one (class,
    draft, transformed or not) at one instant; ``tries``: the decayed tokens counted per cell;
    ``changes_detected``: how often the calibration was found to have changed."""

    accept: FloatArray
    tries: FloatArray
    changes_detected: int

    def mean_accept(self) -> FloatArray:
        """P(accept) per position whatever the confidence: the cells' rates weighted by the
        tokens counted in them (a position never counted: its cells' mean, the prior). The
        tokens counted are those verified, as the ones a drafter's early stop weighs."""
        counted = self.tries.sum(axis=1)
        weighted = (self.accept * self.tries).sum(axis=1) / np.maximum(counted, 1e-12)
        return np.asarray(np.clip(np.where(counted > 1e-9, weighted, self.accept.mean(axis=1)),
                                  0.0, 1.0), dtype=np.float64)


class ConfidenceCalibration:
    """Calibrations for every (class, draft) seen, plain and transformed apart. Time is passed
    in; nothing here reads a clock."""

    def __init__(self, estimator: EstimatorConfig) -> None:
        self._prior_tries = estimator.calibration_prior_tries
        self._max_k = estimator.max_k
        cells = replace(estimator, max_k=estimator.max_k * N_CONFIDENCE_BUCKETS,
                        prior_alpha=1e-9, prior_beta=1e-9)  # the prior is added by ``table``
        self._plain = AcceptanceEstimator(cells)
        self._transformed = AcceptanceEstimator(cells)

    def _cells(self, transformed: bool) -> AcceptanceEstimator:
        return self._transformed if transformed else self._plain

    def observe(self, record: ConfidenceRecord, traffic_class: str, now: float) -> bool:
        """Add a validated record, counted under ``traffic_class`` (its class as tracked);
        return True when it flagged a change of the calibration."""
        first = (record.position - 1) * N_CONFIDENCE_BUCKETS
        end = first + N_CONFIDENCE_BUCKETS
        tries = np.zeros(end)
        accepts = np.zeros(end)
        tries[first:] = record.tried_by_bucket
        accepts[first:] = record.accepted_by_bucket
        return self._cells(record.transformed).observe_tries(traffic_class, record.draft, tries,
                                                              accepts, now)

    def table(self, traffic_class: str, draft: str, class_accept: FloatArray, now: float,
              transformed: bool = False) -> CalibrationTable:
        """The calibration as of ``now``, each cell's prior centred on ``class_accept`` (the
        class's posterior mean acceptance per position, 1..max_k)."""
        cells = self._cells(transformed)
        post = cells.posterior(traffic_class, draft, now)
        shape = (self._max_k, N_CONFIDENCE_BUCKETS)
        accepts = (post.alpha - post.prior_alpha).reshape(shape)
        tries = accepts + (post.beta - post.prior_beta).reshape(shape)
        prior = np.asarray(class_accept, dtype=np.float64)[:self._max_k, None]
        weight = self._prior_tries
        return CalibrationTable((accepts + weight * prior) / (tries + weight), tries,
                                cells.changes_detected(traffic_class, draft))

    def has_data(self, traffic_class: str, draft: str, transformed: bool = False) -> bool:
        return self._cells(transformed).has_data(traffic_class, draft)

    def forget_class(self, traffic_class: str) -> None:
        for cells in (self._plain, self._transformed):
            cells.forget_class(traffic_class)

    def forget_draft(self, draft: str) -> None:
        for cells in (self._plain, self._transformed):
            cells.forget_draft(draft)
