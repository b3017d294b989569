"""The core's read model: frozen records of its state at one instant, for everything that reads it.

``ControllerCore.snapshot(now)`` builds a ``CoreSnapshot``; the JSON views, the policy API, the
engines' PolicyUpdate, the Prometheus collector and the dashboard read that instead of the core's
private state, so they never disagree and the core can change how it keeps its state. Every
record here is frozen and holds plain values (tuples, not arrays): a snapshot compares with
``==``, and nothing a reader does to one reaches the core. Derived figures (means, credible
intervals, E(K) curves) are computed on demand from the stored Beta parameters, so a snapshot
costs a few posteriors to build, whatever its readers ask of it later.

``Explanation`` is the data behind one (class, bucket) decision; the server renders its text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specpilot.contract.pricing import Composition
from specpilot.contract.records import Decision, DecisionEvent, DraftSpec, Override, TokenCut
from specpilot.controller.core.acceptance import Posterior
from specpilot.controller.core.goodput import expected_tokens_curve
from specpilot.controller.core.policy import ArmValue

FloatArray = npt.NDArray[np.float64]


def concerns(event: DecisionEvent, traffic_class: str) -> bool:
    """Whether ``event`` is about ``traffic_class`` ("" = every class)."""
    return not traffic_class or event.decision.traffic_class == traffic_class


@dataclass(frozen=True)
class AcceptanceEstimate:
    """The acceptance posterior of one (class, draft): Beta(alpha_i, beta_i) for every position
    the estimator tracks, of which the first ``positions`` (the draft's max K) are shown."""

    traffic_class: str
    draft: str
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    prior_alpha: float
    prior_beta: float
    positions: int
    # Times the change detector flagged a shift of this (class, draft).
    changes_detected: int
    # False: no report has named this (class, draft) yet; the posterior is the bare prior.
    has_evidence: bool
    # Drafts a step verifies for K = 0..max K asked (a deterministic draft's proposals run
    # short); empty: the engines counted none.
    verified_drafts: tuple[float, ...] = ()

    @property
    def posterior(self) -> Posterior:
        """Every tracked position, as the estimator holds it."""
        return Posterior(np.array(self.alpha), np.array(self.beta), self.prior_alpha,
                         self.prior_beta)

    def _shown(self) -> Posterior:
        n = self.positions
        return Posterior(np.array(self.alpha[:n]), np.array(self.beta[:n]), self.prior_alpha,
                         self.prior_beta)

    @property
    def mean(self) -> FloatArray:
        """Posterior mean acceptance rate by position 1..positions."""
        return self._shown().mean

    @property
    def effective_tries(self) -> FloatArray:
        """Tries by position after forgetting."""
        return self._shown().effective_tries

    def credible_interval(self, level: float) -> tuple[FloatArray, FloatArray]:
        """Equal-tailed credible interval by position 1..positions."""
        return self._shown().credible_interval(level)

    @property
    def expected_tokens(self) -> FloatArray:
        """E(K) for K = 0..positions from the posterior means."""
        return expected_tokens_curve(self.mean)

    @property
    def per_token_rate(self) -> float:
        """Share of tried draft tokens that were accepted, all positions pooled, with the prior
        of one position (positions after a rejection are not tried)."""
        post = self.posterior
        accepts = float(np.sum(post.alpha)) - post.prior_alpha * post.alpha.size
        tries = float(np.sum(post.effective_tries))
        return (accepts + post.prior_alpha) / (tries + post.prior_alpha + post.prior_beta)


@dataclass(frozen=True)
class ClassView:
    """One tracked traffic class."""

    name: str
    # The decision per batch bucket, by bucket; empty until the first decide round.
    decisions: tuple[Decision, ...]
    # Drafts of the connected engines, then any other draft the class has evidence for.
    estimates: tuple[AcceptanceEstimate, ...]
    # Overrides that cover it, the one in force first: its own before "*", the pod's before the
    # fleet's at each level.
    overrides: tuple[Override, ...]
    offline: bool
    # Its share of the batch (decode request-steps); None before any of its traffic was measured.
    share: float | None
    # While it speculates (specpilot.controller.core.mix.ServedSpeedup): tokens per served
    # verification step, and the measured speedup; None before any served speculative step.
    measured_tokens_per_step: float | None = None
    measured_speedup: float | None = None

    @property
    def speculating(self) -> bool:
        """Whether it speculates in at least one batch bucket."""
        return any(d.k > 0 for d in self.decisions)


@dataclass(frozen=True)
class EngineView:
    """One connected engine as of its last report."""

    engine_id: str
    model: str
    # The drafts the controller accepted from its hello.
    drafts: tuple[DraftSpec, ...]
    running_requests: int
    last_report_at: float
    # Seconds from its last report (or its hello) to the snapshot.
    report_age_seconds: float
    # Sequence number of its last accepted report; None before the first.
    last_sequence: int | None
    # The policy version it said it ran in its last report.
    policy_version_applied: int
    hardware: str = ""  # what it runs on, as its hello said
    # Policy versions of this epoch it has not applied yet (all of them while it runs its static
    # configuration or a previous controller's policy).
    versions_behind: int = 0


@dataclass(frozen=True)
class CoreSnapshot:
    """The controller's state at ``at``."""

    at: float
    # Version of the policy the engines are sent.
    version: int
    classes: tuple[ClassView, ...]  # by name
    engines: tuple[EngineView, ...]  # by engine id
    overrides: tuple[Override, ...]  # pod ones by class, then fleet ones by class
    # What an engine applies to a class the controller has not seen yet.
    default_decisions: tuple[Decision, ...]
    # The recent decision log, oldest first.
    log: tuple[DecisionEvent, ...]
    batch_bucket_upper_bounds: tuple[int, ...]
    offline_classes: frozenset[str]
    max_classes: int
    # What engines that re-pick arms per step price a step with (None: no engine can).
    composition: Composition | None = None
    # What engines cut each request's drafts with, token by token (None: the cut is off).
    cut: TokenCut | None = None
    # The batch buckets in which an engine has timed a decode step; the others' decisions come
    # from the priors alone.
    measured_buckets: tuple[int, ...] = ()
    # The smallest and largest ratio of a timed speculative step to a plain step at its batch
    # size (``StepCostModel.measured_ratio_range``): no figure prices an arm's step beyond it.
    # None before any speculative step was timed.
    step_ratio_range: tuple[float, float] | None = None

    @property
    def n_buckets(self) -> int:
        return len(self.batch_bucket_upper_bounds) + 1

    def class_view(self, name: str) -> ClassView:
        """The class called ``name``; KeyError("unknown class ...") if it is not tracked."""
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(f"unknown class {name!r}")

    def events(self, traffic_class: str = "") -> tuple[DecisionEvent, ...]:
        """The log's events about ``traffic_class`` ("" = all), oldest first."""
        return tuple(e for e in self.log if concerns(e, traffic_class))


@dataclass(frozen=True)
class Explanation:
    """Why one class runs what it runs at one batch bucket, in numbers (the text is rendered at
    the edge): the decision, every arm scored by posterior means at the bucket's batch size as
    figures show them (``policy.shown_arms``), the mean acceptance by position per draft, and
    the override in force. The probe is part of the decision."""

    traffic_class: str
    decision: Decision | None
    batch_size: int
    arms: tuple[ArmValue, ...]
    # (draft, mean acceptance rate by position 1..its max K) per draft of the connected engines.
    rates: tuple[tuple[str, tuple[float, ...]], ...]
    override: Override | None
    # Whether the posteriors rank the best arm by means against the decision's arm
    # (``policy.ShownArms.ranked``); False: the figures cannot tell the two apart.
    best_ranked: bool = True
