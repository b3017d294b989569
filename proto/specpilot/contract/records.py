"""The wire's records: plain data the engine plugin sends and receives and the controller's core
consumes and produces. No I/O, no protobuf: the edges convert (``specpilot.contract.
engine_stream``, ``specpilot.controller.wire``), the simulator and the tests build these
directly."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The reserved class names are defined with the folding rule; re-exported here for the core.
from specpilot.contract.classes import DEFAULT_CLASS as DEFAULT_CLASS
from specpilot.contract.classes import OTHER_CLASS as OTHER_CLASS
from specpilot.contract.pricing import Composition

ALL_CLASSES = "*"


def arm_key(draft: str, k: int) -> tuple[str, int]:
    """Canonical (draft, K) of an arm: with K = 0 no draft runs, whatever is named."""
    return (draft if k else "", k)


class Reason(enum.Enum):
    """Why a decision was taken. Values are the metric label and match DecisionReason in proto."""

    WARMUP = "warmup"
    GOODPUT = "goodput"
    EXPLORE = "explore"
    CHANGE_DETECTED = "change_detected"
    OVERRIDE = "override"
    OFFLINE = "offline"
    # Bounded by the choices of neighbouring batch ranges with more evidence: no longer arm
    # than at a smaller batch, no shorter one than at a larger (``policy.follow_neighbours``).
    NEIGHBOURS = "neighbours"


class DraftKind(enum.Enum):
    MODEL = "model"
    NGRAM = "ngram"
    SUFFIX = "suffix"  # deterministic like n-gram: suffix trees over prompts and past responses


@dataclass(frozen=True)
class DraftSpec:
    name: str
    kind: DraftKind
    max_k: int
    vocab_hash: str = ""
    # A deterministic draft the engine substitutes into its model drafter's proposals: that
    # model's name, whose K passes this draft's K costs (the drafter runs, then its tokens are
    # replaced). Empty: the draft costs no model passes.
    carrier: str = ""

    @property
    def pass_draft(self) -> str:
        """The model draft whose passes K of this draft runs ("" when none)."""
        return self.name if self.kind is DraftKind.MODEL else self.carrier


@dataclass(frozen=True)
class StepProfile:
    """One step shape timed at engine start-up: ``batch_size`` sequences, ``verified_tokens``
    verified by the target over the step, ``draft_passes`` sequential passes of model draft
    ``draft`` ("" = none), ``seconds`` its wall time (the fastest of a few repeats),
    ``context_tokens`` what each sequence's KV cache held before the step (0: not profiled by
    context)."""

    batch_size: int
    verified_tokens: int
    draft: str
    draft_passes: int
    seconds: float
    context_tokens: int = 0
    # Prompt tokens the step prefilled beside its decoding (0: a decode step).
    prefill_tokens: int = 0


@dataclass(frozen=True)
class EngineHello:
    engine_id: str
    model: str
    target_vocab_hash: str
    drafts: tuple[DraftSpec, ...]
    max_k: int
    per_request_k: bool = True
    batch_wide_k: bool = False
    ngram_substitution: bool = False
    ngram_counterfactual: bool = False
    engine_version: str = ""
    plugin_version: str = ""
    max_batch_size: int = 0
    step_profile: tuple[StepProfile, ...] = ()
    hardware: str = ""  # what the engine runs on; "" = unknown (its step costs are not shared)
    # The plugin can probe whole steps (Decision.probe_steps); older plugins probe requests.
    step_probes: bool = False
    # The plugin re-picks settled classes' arms per step from the policy's Composition
    # (specpilot.contract.pricing); older plugins and other K modes apply the decisions.
    step_composition: bool = False


@dataclass(frozen=True)
class AcceptanceRecord:
    """Verification steps of one (class, draft, K asked), by number of accepted drafts (len
    K+1), and where counted by number of drafts verified (len K+1; a deterministic drafter may
    propose fewer than K; empty: not counted)."""

    traffic_class: str
    draft: str
    k: int
    steps_by_accepted: tuple[int, ...]
    counterfactual: bool = False
    steps_by_drafted: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestSummaryRecord:
    traffic_class: str
    draft: str
    prompt_tokens: int
    output_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    latency_seconds: float


@dataclass(frozen=True)
class StepTimingRecord:
    """Sums over ``steps`` engine steps of one batch bucket and one (draft, K)."""

    batch_bucket: int
    draft: str
    k: int
    steps: int
    sum_batch_size: int
    sum_verified_tokens: int
    sum_draft_tokens: int
    sum_step_seconds: float
    # Over the steps' sequences, the tokens each one's KV cache held before the step (what the
    # step's attention reads); 0 = unknown (older plugins), never a real step's.
    sum_context_tokens: int = 0
    # The prompt tokens the steps prefilled beside their decoding (chunked prefill): a step's
    # tokens beyond one per sequence and its drafts. 0 from older plugins, which timed decode-only
    # steps alone.
    sum_prefill_tokens: int = 0


@dataclass(frozen=True)
class ConfidenceRecord:
    """The drafted tokens of one (class, draft) at one position that the target verified (every
    earlier position accepted: later ones are censored, never counted as rejected), by the
    draft's confidence bucket (``specpilot.contract.confidence``), and how many it accepted.
    ``transformed``: tokens of requests whose sampling the target transforms (penalties, logit
    bias, structured output), whose acceptance the draft's confidence does not predict alike:
    calibrated apart from the class's other requests."""

    traffic_class: str
    draft: str
    position: int  # 1-based
    tried_by_bucket: tuple[int, ...]
    accepted_by_bucket: tuple[int, ...]
    transformed: bool = False


@dataclass(frozen=True)
class EngineReport:
    sequence: int
    interval_seconds: float
    policy_version: int
    acceptance: tuple[AcceptanceRecord, ...] = ()
    finished: tuple[RequestSummaryRecord, ...] = ()
    step_timings: tuple[StepTimingRecord, ...] = ()
    records_dropped: int = 0
    running_requests: int = 0
    confidence: tuple[ConfidenceRecord, ...] = ()


@dataclass(frozen=True)
class Decision:
    """The choice for one (class, batch bucket). k == 0 means speculation off."""

    traffic_class: str
    bucket: int
    draft: str
    k: int
    reason: Reason
    expected_speedup: float = 1.0
    probe_rate: float = 0.0
    probe_k: int = 0
    probe_draft: str = ""
    # probe_rate is a share of steps, in each of which every request of the class probes
    # (engines that announced step probes); else a share of the class's requests.
    probe_steps: bool = False
    # The posteriors cannot tell whether the arm gains over no speculation: expected_speedup
    # ranks nothing, and readers show "too little evidence" instead (for a bounded figure,
    # also where the arm's price lies beyond the step costs measured).
    too_little_evidence: bool = False

    @property
    def arm(self) -> tuple[str, int]:
        """(draft, K) actually run; the draft is "" when K is 0."""
        return arm_key(self.draft, self.k)

    def same_choice(self, other: Decision | None) -> bool:
        """True when ``other`` runs the same (draft, K); reasons and estimates may differ."""
        return other is not None and self.arm == other.arm


@dataclass(frozen=True)
class HelloAck:
    """The controller's answer to a hello: the drafts it took and those it refused (name, why),
    how often to report, the bucket bounds reports use, the class limit, and its epoch (a new
    one: the controller restarted)."""

    controller_version: str
    accepted_drafts: tuple[str, ...]
    rejected_drafts: tuple[tuple[str, str], ...]
    report_interval_seconds: float
    batch_bucket_upper_bounds: tuple[int, ...]
    max_classes: int
    policy_epoch: int


@dataclass(frozen=True)
class ReportResult:
    """The controller's answer to one report (``code``: a gRPC status code's value)."""

    sequence: int
    accepted: bool
    code: int
    reason: str = ""
    folded_classes: tuple[str, ...] = ()
    retry_after_seconds: float = 0.0


@dataclass(frozen=True)
class EngineDecision:
    """A ``Decision`` as an engine receives it: ``reason`` None where the engine does not know
    it (unset, or a newer controller's), and the decision applies all the same."""

    traffic_class: str
    bucket: int
    draft: str
    k: int
    reason: Reason | None = None
    probe_rate: float = 0.0
    probe_k: int = 0
    probe_draft: str = ""
    probe_steps: bool = False


@dataclass(frozen=True)
class CalibrationRows:
    """P(accept) of the tokens of one (class, draft), requests with transformed sampling or the
    others, by position (rows, 1..``positions``) and the draft's confidence bucket (columns,
    ``specpilot.contract.confidence``), row-major."""

    traffic_class: str
    draft: str
    transformed: bool
    positions: int
    accept: tuple[float, ...]
    # The class's mean acceptance by position, whatever the confidence: what the next token is
    # expected to be accepted at before it is drafted (empty: unknown; the drafter then never
    # stops early for it).
    mean_accept: tuple[float, ...] = ()


@dataclass(frozen=True)
class TokenCut:
    """What an engine cuts each request's drafts with, token by token: it verifies a drafted
    token only while the chance that it and every token before it are accepted (its survival,
    by the calibration of the request's class and draft) reaches the step's ``min_survival``:
    the seconds one more verified token adds to a step at the bucket's batch size, times the
    tokens per second such a step yields. Per batch bucket; ``calibrations`` for the (class,
    draft) pairs whose confidences were counted (the others are never cut). ``pass_tokens``,
    per batch bucket: the seconds one more drafter pass adds to such a step times its tokens per
    second, the tokens a pass must be expected to add for the drafter to run it (empty: it runs
    every pass its decisions ask for)."""

    min_survival: tuple[float, ...]
    calibrations: tuple[CalibrationRows, ...] = ()
    pass_tokens: tuple[float, ...] = ()


@dataclass(frozen=True)
class PolicyUpdate:
    """A policy as an engine receives it: every (class, bucket) decision, the defaults per
    bucket, the fail-static timeout, and the per-step pricing (None: not sent, or unusable,
    and then ``composition_error`` says why)."""

    version: int
    decisions: tuple[EngineDecision, ...] = ()
    default_decisions: tuple[EngineDecision, ...] = ()
    fail_static_timeout_seconds: float = 0.0
    composition: Composition | None = None
    composition_error: str = ""
    cut: TokenCut | None = None


@dataclass(frozen=True)
class ArmFigures:
    """One arm as a decision priced it: by posterior means and the cost model's mean step times,
    at the batch size the decision was taken for."""

    draft: str  # "" with speculation off
    k: int
    expected_tokens: float  # per verification step of a sequence (1 with speculation off)
    # The class's tokens per second. In a batch shared with other classes it is attributed (the
    # class's own rate without speculation plus what the arm adds to the batch's), so it falls
    # below zero where the arm slows the rest of the batch more than it gains.
    goodput: float
    speedup: float  # ratio to no speculation, never below 0
    # Position 1 of the draft: (posterior mean, half-width of the credible interval at
    # specpilot.controller.core.acceptance.CREDIBLE_LEVEL); None with speculation off, and while the
    # draft has no acceptance evidence (the arm is priced on the prior).
    acceptance: tuple[float, float] | None = None
    # The posteriors cannot rank this arm's goodput against the chosen arm's (for the chosen
    # arm: its speedup against no speculation), or its price was bounded by the step costs
    # measured: lines say "too little evidence" instead of a ratio.
    too_little_evidence: bool = False

    @property
    def arm(self) -> tuple[str, int]:
        return arm_key(self.draft, self.k)


@dataclass(frozen=True)
class DecisionFigures:
    """The figures a decision was taken on, kept with it: a decision log read later shows what
    the controller knew then, not what it knows when the line is read (estimates move, and a
    line recomputed from them could call the arm just left the better one)."""

    batch_size: int  # the batch size the arms were priced at (full load for offline classes)
    # None: no estimate (the connected engines no longer offer the arm, or a broken cost priced
    # it).
    chosen: ArmFigures | None
    previous: ArmFigures | None
    # The best arm by posterior means, where it is not the chosen one (None: it is, or it has
    # no estimate).
    best: ArmFigures | None = None
    # What set the choice when no goodput comparison did: an operator override's action ("pin
    # K=2", "force draft d", "force off") or "offline" (offline classes pinned off by
    # configuration); "" otherwise.
    pinned_by: str = ""


OFFLINE_PIN = "offline"  # DecisionFigures.pinned_by of offline classes pinned off


@dataclass(frozen=True)
class DecisionEvent:
    policy_version: int
    at: float
    decision: Decision
    previous: Decision | None
    # None: not recorded (events stored before decisions kept their figures).
    figures: DecisionFigures | None = None


class OverrideScope(enum.Enum):
    """Where an override is in force. Values match OverrideScope in proto (lower case)."""

    POD = "pod"  # this controller only
    FLEET = "fleet"  # every controller of the model that shares the state store


@dataclass(frozen=True)
class Override:
    """An operator override for one class or for all ("*"). Exactly one action is set.

    In force, a class's own override beats "*", and at each of those levels a pod override
    beats a fleet one (an operator pins one pod to differ from its fleet)."""

    traffic_class: str
    pin_k: int | None = None
    force_draft: str | None = None
    force_off: bool = False
    note: str = ""
    set_at: float = 0.0
    scope: OverrideScope = OverrideScope.POD
    set_by: str = ""  # the sidecar whose policy API took it ("": set in-process, no API)

    def __post_init__(self) -> None:
        actions = (self.pin_k is not None) + (self.force_draft is not None) + self.force_off
        if actions != 1:
            raise ValueError("override: set exactly one of pin_k, force_draft, force_off")
        if self.pin_k is not None and self.pin_k < 0:
            raise ValueError("override: pin_k must be >= 0")

    @property
    def action(self) -> str:
        """The action in words: "pin K=2", "force draft d" or "force off"."""
        if self.pin_k is not None:
            return f"pin K={self.pin_k}"
        return f"force draft {self.force_draft}" if self.force_draft is not None else "force off"


@dataclass(frozen=True)
class StepPrediction:
    """One step-timing record of a report against what the cost model predicted for its mean
    shape just before the report was learnt (a one-step-ahead check of the cost model)."""

    batch_bucket: int
    k: int
    steps: int
    predicted_seconds: float
    measured_seconds: float


@dataclass(frozen=True)
class IngestResult:
    """What happened to an accepted report."""

    folded_classes: tuple[str, ...] = ()
    changes_detected: tuple[tuple[str, str], ...] = ()
    step_predictions: tuple[StepPrediction, ...] = ()
    # The report's step timings moved the cost model's change test past its threshold: the
    # hardware's step costs changed, and most of their evidence was forgotten.
    step_costs_changed: bool = False


class ReportRejected(ValueError):
    """A report failed validation; nothing of it was applied. The message names the field."""


class ImplausibleInput(ReportRejected):
    """Well-formed, but outside what the engine it describes can physically do (a step of
    hours, more drafts than sequences x K, a sequence number that jumps by billions): counted
    apart from malformed input (``specpilot_reports_rejected_total{reason="implausible"}``)."""


class BeyondRate(ImplausibleInput):
    """More verification steps, tried tokens or timed steps in one report than its engine can
    have run in the interval the report covers (``validation.interval_bound``): counted apart
    (``specpilot_reports_rejected_total{reason="beyond_rate"}``)."""
