"""ControllerCore: the state of one controller and the lap report -> estimates -> policy.

Pure: time is passed in, randomness comes from the injected Generator, nothing here does I/O. The
gRPC server, the simulator and the tests all drive this same object.

Writes (``connect_engine``, ``ingest``, ``set_override``, ``clear_override``) change state only;
``decide`` turns the state into decisions. Readers use ``snapshot`` (the read model in
``controller.core.snapshot``), ``decision``, ``explain`` and ``version``, never the state itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from controller.core.acceptance import AcceptanceEstimator, EstimatorConfig
from controller.core.cost_model import CostPrior, PricedCosts, StepCostModel, StepShape, SunkDraft
from controller.core.fleet import (
    CostExport,
    EvidenceEntry,
    EvidenceKey,
    FloatArray,
    add_evidence,
    entries_of,
    fleet_costs,
)
from controller.core.goodput import expected_tokens_curve, goodput
from controller.core.mix import (
    Arm,
    BatchOthers,
    ClassMix,
    JointClass,
    OtherClass,
    ServedSpeedup,
    joint_arms,
    other_class,
)
from controller.core.policy import (
    BucketState,
    ClassContext,
    PolicyConfig,
    arm_values,
    decide_class,
    decision_figures,
    offered,
    runs,
)
from controller.core.recommend import PLAIN, SPECULATIVE, DraftCurve, EngineOptions
from controller.core.snapshot import (
    AcceptanceEstimate,
    ClassView,
    CoreSnapshot,
    EngineView,
    Explanation,
)
from controller.core.tunable import tunable
from specpilot.contract.buckets import (
    DEFAULT_BUCKET_BOUNDS,
    BucketLoads,
    bucket_of,
    bucket_upper_size,
)
from specpilot.contract.classes import fold_class, fold_classes
from specpilot.contract.pricing import Composition, moved
from specpilot.contract.records import (
    ALL_CLASSES,
    DEFAULT_CLASS,
    OTHER_CLASS,
    Decision,
    DecisionEvent,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    IngestResult,
    Override,
    OverrideScope,
    Reason,
    ReportRejected,
    StepPrediction,
)
from specpilot.contract.validation import (
    check_class_name,
    check_hello,
    check_report,
    valid_class_name,
)

# An override's note is a sentence for the audit log, not a document.
MAX_NOTE_CHARS = 1000
# Buckets the joint search may refresh in one decide round (it costs ~10-50 ms per bucket with
# many classes; the rest wait for later rounds).
_JOINT_BUCKETS_PER_DECIDE = 2
# A probe share that moved by less than this factor is not worth a new policy version.
_PROBE_RATE_MATERIAL_FACTOR = 1.25
# Classes whose E(K) curves a policy carries for the engines' per-step re-picks (the largest
# shares of the mix): bounds a policy update at ~30 KiB with 16 drafts of K 8.
COMPOSITION_MAX_CLASSES = 32
# Relative move of an E(K) or of a priced step time that makes a new composition worth a policy
# version (the engines' re-picks follow what the controller learns, not each round's noise).
_COMPOSITION_TOLERANCE = 0.01


@dataclass(frozen=True)
class CoreConfig:
    """Core: traffic classes, batch buckets, the step-cost model's shape and the decision log.

    The nested configs are concerns of their own, each with its own settings."""

    estimator: EstimatorConfig
    """The acceptance estimator's settings."""
    policy: PolicyConfig
    """The decision rule's settings."""
    cost_prior: CostPrior
    """The step-cost model's prior."""
    cost_knots_tokens: tuple[int, ...] = tunable((16, 32, 64, 128, 256, 512, 1024),
                                                 increasing=True)
    """Verified-token counts where the step-cost slope may change (hinge knots)."""
    cost_half_life_seconds: float = tunable(600.0, gt=0)
    """Half-life of step-timing evidence, seconds."""
    batch_bucket_upper_bounds: tuple[int, ...] = tunable(DEFAULT_BUCKET_BOUNDS, increasing=True)
    """Inclusive upper bounds of batch-size buckets, sequences; one open bucket follows the
    last."""
    traffic_half_life_seconds: float = tunable(30.0, gt=0)
    """Half-life of what the controller knows of the traffic running now: the class mix of the
    batch and each bucket's mean batch size (a bucket's decisions are priced at it), seconds.
    Short, so that decisions follow a mix or load that moves within minutes."""
    max_classes: int = tunable(16, ge=1, le=256)
    """Distinct class names tracked ('default' and declared classes included); more fold into
    'other'. With several engines connected, each may bring new classes only while it holds
    fewer than its share of the slots left after the declared ones and 'other' (those slots
    over the engines, rounded up), so one engine cannot take them all."""
    max_model_drafts: int = tunable(32, ge=1, le=64)
    """Model drafts the step-cost model prices at once, across engines and reconnects (three
    cost columns each, and its prior grows with their square). A hello naming a new model
    draft when this many are held gives back the columns and estimates of drafts no connected
    engine announces, the longest-held first; when every one is in use the new draft is
    refused (HelloAck.rejected_drafts says why). One engine announces at most MAX_DRAFTS."""
    offline_classes: frozenset[str] = tunable(frozenset())
    """Classes of prefill-dominated batch work (declared: they hold a slot from the start)."""
    declared_classes: frozenset[str] = tunable(frozenset())
    """Classes known before any traffic: each holds a slot from the start and never gives it
    back, and operators may override them before an engine reports them (an override must name
    a declared class or one an engine has reported)."""
    declared_drafts: frozenset[str] = tunable(frozenset())
    """Drafts operators may force (an override's force_draft) beside those the connected engines
    offer, e.g. before any engine has connected; a forced draft the engines do not offer runs
    the class without speculation. Any other draft name is refused."""
    class_idle_seconds: float = tunable(900.0, gt=0)
    """A class no engine has reported for this long, neither declared nor under an override of
    its own, gives its slot back and its estimates are forgotten, seconds. A class whose every
    reporting engine disconnected gives its slot to a new class at once when the table is
    full."""
    decision_log_size: int = tunable(1000, ge=1, le=10_000)
    """Decisions kept for watch/replay. At most 10,000: a decision held costs ~0.35 KiB, and
    answering a read of the whole log (/api/decisions without a limit) ~2.6 KiB more each
    (benchmarks/sidecar_memory.py: 100,000 peaked at 368 MiB)."""

    @property
    def n_buckets(self) -> int:
        return len(self.batch_bucket_upper_bounds) + 1

    def bucket_batch_size(self, bucket: int) -> int:
        """Upper batch size of a bucket: its upper bound (twice the last for the open bucket);
        the cost prior's design points, and a bucket's price until steps were seen in it."""
        return bucket_upper_size(self.batch_bucket_upper_bounds, bucket)

    def bucket_of(self, batch_size: int) -> int:
        return bucket_of(self.batch_bucket_upper_bounds, batch_size)


@dataclass(frozen=True)
class HelloOutcome:
    accepted_drafts: tuple[str, ...]
    rejected_drafts: tuple[tuple[str, str], ...]


@dataclass
class _EngineState:
    hello: EngineHello
    drafts: dict[str, DraftSpec]
    last_report_at: float
    last_sequence: int | None = None
    running_requests: int = 0
    policy_version_applied: int = 0


@dataclass
class _ClassState:
    decisions: dict[int, Decision] = field(default_factory=dict)
    changed_at: dict[int, float] = field(default_factory=dict)
    # When each bucket was last decided, and when acceptance evidence for the class last came.
    decided_at: dict[int, float] = field(default_factory=dict)
    evidence_at: float = -math.inf
    change_pending: bool = False
    # Connected engines that reported the class, and when each last did; when anyone last did.
    holders: dict[str, float] = field(default_factory=dict)
    reported_at: float = -math.inf


# A policy version is epoch x 2^EPOCH_SHIFT + the rounds that changed the policy since start, so a
# restarted controller (a later epoch: its start time in tenths of a second, EPOCHS_PER_SECOND)
# never sends a version below one its predecessor sent, unless that one made over 2^16 versions
# per tenth of a second of uptime (a round changes the policy at most ~100 times a second).
# 2^16 keeps versions below 2^53 until the year 6000: exact in JSON and JavaScript.
EPOCH_SHIFT = 16
EPOCHS_PER_SECOND = 10


def epoch_at(unix_seconds: float) -> int:
    """The policy epoch of a controller started at ``unix_seconds``."""
    return int(unix_seconds * EPOCHS_PER_SECOND)


class ControllerCore:
    def __init__(self, config: CoreConfig, rng: np.random.Generator, epoch: int = 0) -> None:
        """``epoch``: the first part of every policy version (``EPOCH_SHIFT``); the server
        passes its start time (``epoch_at``), the simulator and tests 0."""
        if not 0 <= epoch < 2 ** (63 - EPOCH_SHIFT):
            raise ValueError(f"epoch: {epoch} outside 0..2^{63 - EPOCH_SHIFT}")
        self.config = config
        self.epoch = epoch
        self._rng = rng
        self._estimator = AcceptanceEstimator(config.estimator)
        self._mix = ClassMix(config.traffic_half_life_seconds)
        self._served = ServedSpeedup(config.traffic_half_life_seconds)
        # Per bucket: the arms of the best whole batch (the joint search), and when it ran.
        self._joint: dict[int, dict[str, Arm]] = {}
        self._joint_at: dict[int, float] = {}
        self._cost = StepCostModel(
            config.cost_knots_tokens,
            config.cost_prior,
            config.cost_half_life_seconds,
            [config.bucket_batch_size(b) for b in range(config.n_buckets)],
            config.policy.max_k,
        )
        self._engines: dict[str, _EngineState] = {}
        self._drafts: tuple[DraftSpec, ...] | None = None  # drafts(), cached
        # Per bucket: when an engine last reported decode steps at its batch sizes, and the
        # batch size those steps ran at (what the bucket's decisions are priced at).
        self._bucket_seen: dict[int, float] = {}
        self._loads = BucketLoads(config.batch_bucket_upper_bounds,
                                  config.traffic_half_life_seconds)
        self._classes: dict[str, _ClassState] = {DEFAULT_CLASS: _ClassState()}
        # Declared and offline classes are known before their first request (offline ones are
        # pinned off from the first policy on instead of running the warm-up K until a report
        # names them); they hold their slots for good.
        self._declared = frozenset({DEFAULT_CLASS}) | frozenset(
            sorted(config.offline_classes | config.declared_classes)[: config.max_classes - 1])
        for name in sorted(self._declared):
            self._classes.setdefault(name, _ClassState())
        # By scope, then class: this pod's own and the fleet's (set_fleet_overrides).
        self._overrides: dict[OverrideScope, dict[str, Override]] = {
            scope: {} for scope in OverrideScope}
        self._version = epoch << EPOCH_SHIFT
        self._forgotten = False  # a class was forgotten since the last version
        self._log: deque[DecisionEvent] = deque(maxlen=config.decision_log_size)
        # The composition the current policy version carries (``composition``).
        self._composition: Composition | None = None

    # --- engines ----------------------------------------------------------------------------
    def connect_engine(self, hello: EngineHello, now: float) -> HelloOutcome:
        """Register (or re-register) an engine; refuse drafts whose tokenizer differs, model
        drafts beyond ``max_model_drafts`` (``_make_room``) and drafts substituted into a
        refused one's proposals."""
        check_hello(hello)
        accepted: dict[str, DraftSpec] = {}
        rejected: list[tuple[str, str]] = []
        for d in hello.drafts:
            if d.kind is DraftKind.MODEL and d.vocab_hash != hello.target_vocab_hash:
                rejected.append((d.name, (
                    f"tokenizer vocabulary hash {d.vocab_hash[:16] or '(none)'} differs from the "
                    f"target's {hello.target_vocab_hash[:16] or '(none)'}: acceptance would be "
                    "meaningless, draft refused")))
                continue
            if hello.max_k < 1:
                rejected.append((d.name, "engine max_k is 0: speculation not configured"))
                continue
            accepted[d.name] = DraftSpec(d.name, d.kind, min(d.max_k, hello.max_k), d.vocab_hash)
        no_room = self._make_room(hello.engine_id, accepted)
        rejected.extend(no_room)
        # vLLM runs one drafter: next to a model draft, an n-gram draft is substituted into its
        # proposals. With one K for the whole step (batch-wide, not per request) the n-gram
        # requests' K sets the drafter's passes too, so it costs that model's passes.
        models = [n for n, d in accepted.items() if d.kind is DraftKind.MODEL]
        if hello.batch_wide_k and not hello.per_request_k:
            if models:
                accepted = {n: (replace(d, carrier=models[0])
                                if d.kind is not DraftKind.MODEL else d)
                            for n, d in accepted.items()}
            elif no_room:  # their drafter found no cost column: they cannot be priced
                carrier = no_room[0][0]
                rejected.extend((n, f"substituted into model draft {carrier}'s proposals "
                                    "(one K per step), which was refused: its passes cannot "
                                    "be priced, draft refused") for n in accepted)
                accepted = {}
        self._drafts = None
        self._cost.ensure_drafts(n for n, d in accepted.items() if d.kind is DraftKind.MODEL)
        self._seed_costs(hello, accepted, now)
        # The profile is learnt now; kept, it would cost up to 0.3 MiB an engine for nothing.
        self._engines[hello.engine_id] = _EngineState(replace(hello, step_profile=()), accepted,
                                                      last_report_at=now)
        return HelloOutcome(tuple(accepted), tuple(rejected))

    def _make_room(self, engine_id: str, accepted: dict[str, DraftSpec]
                   ) -> list[tuple[str, str]]:
        """Cost columns for the model drafts in ``accepted`` that have none, within
        ``max_model_drafts``: drafts no other connected engine announces (nor this one again)
        are forgotten, the longest-held first; new drafts that still find no room are removed
        from ``accepted`` and returned refused, with the reason."""
        held = self._cost.drafts
        new = [n for n, d in accepted.items() if d.kind is DraftKind.MODEL and n not in held]
        room = self.config.max_model_drafts - len(held)
        if len(new) <= room:
            return []
        in_use = set(accepted) | {n for e_id, e in self._engines.items() if e_id != engine_id
                                  for n in e.drafts}
        free = [d for d in held if d not in in_use]  # column order: the longest-held first
        self._forget_drafts(free[:len(new) - room])
        room += min(len(free), len(new) - room)
        refused = new[room:]
        for name in refused:
            del accepted[name]
        return [(name, f"the controller prices at most {self.config.max_model_drafts} model "
                       "drafts at once (max_model_drafts) and connected engines use them all: "
                       "draft refused") for name in refused]

    def _forget_drafts(self, names: list[str]) -> None:
        """Forget model drafts no connected engine announces: cost columns and estimates."""
        self._cost.forget_drafts(names)
        for name in names:
            self._estimator.forget_draft(name)
        for arms in self._joint.values():
            for cls in [c for c, arm in arms.items() if arm[0] in names]:
                del arms[cls]

    def _seed_costs(self, hello: EngineHello, accepted: dict[str, DraftSpec], now: float) -> None:
        """The engine's start-up profile centres the cost prior (``profile_center_steps``) and
        enters the cost model as observed steps of stated weight (``profile_weight_steps``), so
        the model starts from this hardware and live timings still take over. Points timing a
        draft the controller refused are skipped (their passes have no cost column)."""
        points = [(StepShape(p.batch_size, p.verified_tokens, p.draft, p.draft_passes,
                             p.batch_size * p.draft_passes), p.seconds)
                  for p in hello.step_profile
                  if not p.draft or (p.draft in accepted
                                     and accepted[p.draft].kind is DraftKind.MODEL)]
        if not points:
            return
        self._cost.set_profile(points)
        weight = self.config.cost_prior.profile_weight_steps
        if weight > 0:
            for shape, seconds in points:
                self._cost.observe(shape, seconds, weight, now)

    def _observe_served(self, report: EngineReport, mapping: Mapping[str, str],
                        now: float) -> None:
        """Served speculative steps for the measured speedup, priced by the costs as they were
        before the report (its timings are learnt after)."""
        n = max(report.running_requests, 1)
        ratios: dict[tuple[str, int], float] = {}  # a report's records share a few arms
        for rec in report.acceptance:
            steps = sum(rec.steps_by_accepted)
            if rec.counterfactual or rec.k == 0 or steps == 0:
                continue
            arm = (rec.draft, rec.k)
            if arm not in ratios:
                ratios[arm] = (self.predicted_step_seconds(n, rec.draft, rec.k)
                               / self.predicted_step_seconds(n, "", 0))
            tokens = sum((1 + a) * h for a, h in enumerate(rec.steps_by_accepted))
            self._served.observe(mapping[rec.traffic_class], steps, tokens,
                                 steps * ratios[arm], now)

    def first_engine_model(self) -> str:
        """The model of the first connected engine ("" with none): the fleet a sidecar joins
        when no model is configured (cheaper than a snapshot)."""
        return next((e.hello.model for e in self._engines.values() if e.hello.model), "")

    def heard_from(self, engine_id: str, now: float) -> None:
        """The engine sent something (a report the server shed): not silent."""
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.last_report_at = max(engine.last_report_at, now)

    def disconnect_engine(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)
        self._drafts = None
        for state in self._classes.values():
            state.holders.pop(engine_id, None)

    def drafts(self) -> tuple[DraftSpec, ...]:
        """Drafts every connected engine accepted (union; first-seen order). Kept until an
        engine connects or leaves: decisions ask for it per bucket, and a controller of
        hundreds of engines spent most of its decide rounds merging them again."""
        if self._drafts is None:
            merged: dict[str, DraftSpec] = {}
            for engine in self._engines.values():
                for name, spec in engine.drafts.items():
                    merged.setdefault(name, spec)
            self._drafts = tuple(merged.values())
        return self._drafts

    # --- reports ----------------------------------------------------------------------------
    def canonical_class(self, name: str) -> str:
        """The tracked class for ``name`` now (unknown names beyond the limit map to "other")."""
        return fold_class(name, self._classes, self.config.max_classes)

    # --- class slots ------------------------------------------------------------------------
    def _evictable(self, name: str, state: _ClassState) -> bool:
        """Whether the class may give its slot back: not declared, not "other", no override
        of its own (an override pins what its traffic runs once it comes)."""
        return (name not in self._declared and name != OTHER_CLASS
                and not any(name in layer for layer in self._overrides.values()))

    def _admit(self, engine_id: str, names: Iterable[str]
               ) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
        """The class each of a report's names counts under, the names it admits and the
        classes it evicts for them; nothing changes (``ingest`` applies it). A new name takes a
        free slot, else the slot of the least recently reported class no connected engine
        holds; it folds into "other" when there is none, or when the engine holds its share of
        the slots already (``CoreConfig.max_classes``)."""
        mapping, admitted = fold_classes(names, self._classes, self.config.max_classes)
        folded = [n for n, v in mapping.items() if v == OTHER_CLASS and n != OTHER_CLASS]
        held = sum(engine_id in s.holders for n, s in self._classes.items()
                   if n not in self._declared and n != OTHER_CLASS)
        # With several engines: the slots left after the declared classes and "other" (one
        # slot, as the plugin's classifier counts it), over the engines, rounded up. Alone, an
        # engine may fill the table.
        free = self.config.max_classes - len(self._declared) - 1
        n = len(self._engines)
        share = -(-free // n) if n > 1 else self.config.max_classes
        kept = []
        for name in admitted:  # free slots
            if held < share:
                kept.append(name)
                held += 1
            else:
                mapping[name] = OTHER_CLASS
        named = set(mapping.values())  # never evict a class this report names
        vacant = sorted((s.reported_at, n) for n, s in self._classes.items()
                        if not s.holders and n not in named and self._evictable(n, s))
        evicted = []
        for name in folded:  # slots of departed engines' classes
            if held >= share or not vacant:
                break
            evicted.append(vacant.pop(0)[1])
            mapping[name] = name
            kept.append(name)
            held += 1
        return mapping, tuple(kept), tuple(evicted)

    def forget_class(self, name: str) -> None:
        """Free the class's slot: its decisions, estimates, share of the mix and measured
        speedup are forgotten (the decision log keeps its history)."""
        if self._classes.pop(name, None) is not None:
            self._forgotten = True  # the next round's policy no longer lists it
        self._estimator.forget_class(name)
        self._mix.forget(name)
        self._served.forget(name)
        for arms in self._joint.values():
            arms.pop(name, None)

    def forget_idle_classes(self, now: float) -> tuple[str, ...]:
        """Free the slots of classes no engine reported for ``class_idle_seconds`` (except
        declared ones and those under an override of their own); returns their names."""
        limit = now - self.config.class_idle_seconds
        for state in self._classes.values():
            for engine_id in [e for e, at in state.holders.items() if at < limit]:
                del state.holders[engine_id]
        idle = tuple(sorted(n for n, s in self._classes.items()
                            if s.reported_at < limit and not s.holders
                            and self._evictable(n, s)))
        for name in idle:
            self.forget_class(name)
        return idle

    def ingest(self, engine_id: str, report: EngineReport, now: float) -> IngestResult:
        """Validate, then apply a report. On ReportRejected nothing has changed."""
        engine = self._engines.get(engine_id)
        if engine is None:
            raise ReportRejected(f"engine {engine_id!r}: report before hello")
        check_report(report, engine.drafts, engine.hello.max_k, self.config.n_buckets,
                     engine.last_sequence, engine.hello.max_batch_size)
        # Class mapping is decided before any state changes, in report order.
        names = [r.traffic_class for r in report.acceptance] + [
            r.traffic_class for r in report.finished]
        mapping, pending_new, evicted = self._admit(engine_id, names)
        # --- apply (nothing below can fail) ---
        for name in evicted:
            self.forget_class(name)
        for name in [*pending_new, *(v for v in mapping.values() if v == OTHER_CLASS)]:
            self._classes.setdefault(name, _ClassState())
        for cls in set(mapping.values()):
            self._classes[cls].holders[engine_id] = now
            self._classes[cls].reported_at = now
        changes: list[tuple[str, str]] = []
        for rec in report.acceptance:
            cls = mapping[rec.traffic_class]
            if self._estimator.observe(cls, rec.draft, rec.steps_by_accepted, now):
                self._classes[cls].change_pending = True
                changes.append((cls, rec.draft))
            if sum(rec.steps_by_accepted):
                self._classes[cls].evidence_at = now
        # The batch mix in decode request-steps: verification steps as they happen for classes
        # that speculate, finished requests' output - accepted (each step emits its accepted
        # drafts plus one token) for classes that do not.
        verified: dict[str, int] = {}
        for rec in report.acceptance:
            if not rec.counterfactual:
                cls = mapping[rec.traffic_class]
                verified[cls] = verified.get(cls, 0) + sum(rec.steps_by_accepted)
        for cls, steps in verified.items():
            self._mix.observe(cls, steps, now)
        self._observe_served(report, mapping, now)
        for req in report.finished:
            cls = mapping[req.traffic_class]
            self._classes[cls].evidence_at = now  # traffic, even with no drafts to count
            if cls not in verified:
                self._mix.observe(cls, max(req.output_tokens - req.accepted_tokens, 1), now)
        # Predicted by the costs as they were before the report (one solve per report, not
        # per record), then learnt.
        predictions = []
        learnt: list[tuple[StepShape, float, int]] = []
        for st in report.step_timings:
            if st.steps <= 0:
                continue
            spec = engine.drafts.get(st.draft)
            is_model = spec is not None and spec.kind is DraftKind.MODEL
            shape = StepShape(
                batch_size=st.sum_batch_size / st.steps,
                verified_tokens=st.sum_verified_tokens / st.steps,
                draft=st.draft if is_model else "",
                draft_passes=float(st.k) if is_model and st.sum_draft_tokens > 0 else 0.0,
                draft_tokens=st.sum_draft_tokens / st.steps if is_model else 0.0,
            )
            measured = st.sum_step_seconds / st.steps
            self._bucket_seen[st.batch_bucket] = now
            self._loads.observe(st.batch_bucket, st.steps, st.sum_batch_size, now)
            predictions.append(StepPrediction(st.batch_bucket, st.k, st.steps,
                                              self._cost.predict(shape), measured))
            learnt.append((shape, measured, st.steps))
        for shape, measured, steps in learnt:
            self._cost.observe(shape, measured, steps, now)
        engine.last_sequence = report.sequence
        engine.running_requests = report.running_requests
        engine.last_report_at = now
        engine.policy_version_applied = report.policy_version
        folded = tuple(sorted(n for n, v in mapping.items() if v != n))
        return IngestResult(folded_classes=folded, changes_detected=tuple(changes),
                            step_predictions=tuple(predictions))

    # --- decisions --------------------------------------------------------------------------
    def _overrides_for(self, traffic_class: str) -> list[Override]:
        """Every override that covers ``traffic_class``, the one in force first: its own before
        "*", and at each level the pod's before the fleet's."""
        return [layer[c] for c in (traffic_class, ALL_CLASSES)
                for layer in (self._overrides[OverrideScope.POD],
                              self._overrides[OverrideScope.FLEET]) if c in layer]

    def _override_for(self, traffic_class: str) -> Override | None:
        covering = self._overrides_for(traffic_class)
        return covering[0] if covering else None


    def _mean_curve(self, name: str, draft: str, now: float,
                    cache: dict[tuple[str, str], np.ndarray]) -> np.ndarray:
        curve = cache.get((name, draft))
        if curve is None:
            curve = expected_tokens_curve(self._estimator.posterior(name, draft, now).mean)
            cache[(name, draft)] = curve
        return curve

    def _others(self, name: str, drafts: tuple[DraftSpec, ...], now: float,
                cache: dict[tuple[str, str], np.ndarray],
                running: dict[int, dict[str, OtherClass]] | None = None,
                ) -> dict[int, BatchOthers]:
        """Per bucket batch size: the rest of a batch as the other classes run now (empty while
        the mix is unknown: every batch is then scored as if it were all this class).
        ``running``: per bucket, every class as it runs (``_running``), kept by a decide round
        for all its classes so each is priced once a round, not once per deciding class (at
        256 classes that was most of a round)."""
        shares = self._mix.shares()
        if not shares:
            return {}
        running = {} if running is None else running
        out: dict[int, BatchOthers] = {}
        for b in range(self.config.n_buckets):
            if b not in running:
                running[b] = {other: o for other, share in shares.items()
                              if (o := self._running(other, share, b, drafts, now, cache))}
            batch = self._loads.batch_size(b)
            out[batch] = BatchOthers.build(batch, shares.get(name, 0.0),
                                           (o for other, o in running[b].items()
                                            if other != name))
        return out

    def _running(self, name: str, share: float, bucket: int, drafts: tuple[DraftSpec, ...],
                 now: float, cache: dict[tuple[str, str], np.ndarray]) -> OtherClass | None:
        """Class ``name`` at the arm it runs in ``bucket`` (the joint search's where it has
        one), as another class in the batch; None when it has no share or state."""
        state = self._classes.get(name)
        if share <= 0 or state is None:
            return None
        d = state.decisions.get(bucket)
        draft, k = d.arm if d is not None and runs(drafts, *d.arm) else ("", 0)
        target = self._joint.get(bucket, {}).get(name)
        if target is not None and runs(drafts, *target):
            draft, k = target
        e = float(self._mean_curve(name, draft, now, cache)[k]) if k else 1.0
        return other_class(share, (draft, k), e, drafts)

    def refresh_joint(self, now: float, max_buckets: int) -> None:
        """Rerun the joint search for at most ``max_buckets`` of the stalest buckets (the
        server spreads it over its own loop turns, so no report waits behind it)."""
        self._refresh_joint(self.drafts(), now, {}, max_buckets)

    def _refresh_joint(self, drafts: tuple[DraftSpec, ...], now: float,
                       cache: dict[tuple[str, str], np.ndarray],
                       max_buckets: int | None = None) -> None:
        """Per bucket, the arms that make the expected batch fastest (the joint search). Each
        class then scores its own arms with the others at these arms, so the per-class decisions
        (with their Thompson draws, hysteresis and dwell) land on the batch optimum instead of
        stalling where only a joint move gains.

        A bucket is refreshed when its result is older than joint_interval_seconds, at most
        ``_JOINT_BUCKETS_PER_DECIDE`` per call (stalest first) so no decide round stalls the
        server; every bucket at once after a detected change, unless ``max_buckets`` bounds
        the call. Batch size 1 has no others."""
        shares = self._mix.shares()
        if not shares or self._sunk_draft() is not None:
            return
        interval = self.config.policy.joint_interval_seconds
        buckets = [b for b in range(self.config.n_buckets)
                   if self._loads.batch_size(b) > 1]
        changed = any(s.change_pending for s in self._classes.values())
        if changed and max_buckets is None:
            due = buckets
        else:
            stale = [b for b in buckets
                     if changed or now - self._joint_at.get(b, -np.inf) >= interval]
            stale.sort(key=lambda b: self._joint_at.get(b, -np.inf))
            due = stale[:_JOINT_BUCKETS_PER_DECIDE if max_buckets is None else max_buckets]
        if not due:
            return
        classes = []
        for name, share in shares.items():
            state = self._classes.get(name)
            if state is None or share <= 0:
                continue
            free = (name not in self.config.offline_classes
                    and self._override_for(name) is None
                    and any(self._estimator.has_data(name, d.name) for d in drafts))
            curves = {d.name: self._mean_curve(name, d.name, now, cache) for d in drafts}
            classes.append((name, share, curves, state, free))
        if sum(free for *_, free in classes) < 2:
            return  # one class alone: its own decision is already the batch's best
        for b in due:
            self._joint_at[b] = now
            joint = []
            for name, share, curves, state, free in classes:
                d = state.decisions.get(b)
                # A decision from before an engine left or reconnected with a smaller max K
                # may name an arm no engine offers: the search starts that class off.
                arm = d.arm if d is not None and runs(drafts, *d.arm) else ("", 0)
                joint.append(JointClass(name, share, curves, arm, free))
            self._joint[b] = joint_arms(self._loads.batch_size(b), joint, drafts,
                                       self.config.policy.max_k, self._cost.predict_mixed)

    def _context(self, name: str, state: _ClassState, drafts: tuple[DraftSpec, ...],
                 now: float, cache: dict[tuple[str, str], np.ndarray] | None = None,
                 drawn: PricedCosts | None = None,
                 running: dict[int, dict[str, OtherClass]] | None = None,
                 ) -> ClassContext:
        """``drawn``: the decide round's draw of the cost weights (None: sampled goodput is
        priced by the mean costs, as explanations are). ``running``: see ``_others``."""
        cache = {} if cache is None else cache
        sunk = self._sunk_draft()
        sampled, mean, position1 = {}, {}, {}
        for d in drafts:
            post = self._estimator.posterior(name, d.name, now)
            sampled[d.name] = post.sample(self._rng)
            mean[d.name] = post.mean
            position1[d.name] = (float(post.alpha[0]), float(post.beta[0]))
        evidence = frozenset(d.name for d in drafts if self._estimator.has_data(name, d.name))
        buckets = tuple(
            BucketState(b, self._loads.batch_size(b), state.decisions.get(b),
                        state.changed_at.get(b),
                        fresh=self._fresh(state, b))
            for b in range(self.config.n_buckets)
        )
        return ClassContext(
            traffic_class=name,
            now=now,
            drafts=drafts,
            sampled_rates=sampled,
            mean_rates=mean,
            has_data=bool(evidence),
            change_detected=state.change_pending,
            recovering=any(self._estimator.recovering(name, d.name, now) for d in drafts),
            offline=name in self.config.offline_classes,
            override=self._override_for(name),
            buckets=buckets,
            step_seconds=partial(self._cost.predict_curve, sunk_draft=sunk),
            # Per-request engines draft max K for everyone anyway: the homogeneous view is exact.
            others=self._others(name, drafts, now, cache, running) if sunk is None else {},
            mixed_seconds=self._cost.predict_mixed,
            drawn_step_seconds=(None if drawn is None
                                else partial(drawn.predict_curve, sunk_draft=sunk)),
            drawn_mixed_seconds=None if drawn is None else drawn.predict_mixed,
            position1=position1,
            drafter_sunk=sunk is not None,
            whole_step_probes=bool(self._engines) and all(
                e.hello.step_probes for e in self._engines.values()),
            evidence=evidence,
        )

    def _holds(self, name: str, state: _ClassState, drafts: tuple[DraftSpec, ...]) -> bool:
        """Whether deciding the class would keep every bucket's decision as it is (what
        ``decide_bucket`` does for a settled bucket without new evidence): no override, no
        detected change, not offline, and each bucket settled (on an arm the connected engines
        offer) and not fresh."""
        if (state.change_pending or not drafts or name in self.config.offline_classes
                or self._override_for(name) is not None):
            return False
        for b in range(self.config.n_buckets):
            d = state.decisions.get(b)
            if (d is None or d.reason in (Reason.WARMUP, Reason.OVERRIDE)
                    or self._fresh(state, b) or not offered(drafts, d)):
                return False
        return True

    def _fresh(self, state: _ClassState, bucket: int) -> bool:
        """Whether the class's decision for ``bucket`` has new evidence behind it: acceptance
        data for the class and decode steps in the bucket since the bucket was last decided."""
        decided = state.decided_at.get(bucket, -math.inf)
        return (state.evidence_at > decided
                and self._bucket_seen.get(bucket, -math.inf) > decided)

    def _sunk_draft(self) -> SunkDraft | None:
        """The model drafter that runs every step whatever K is chosen, if any: engines in
        per-request K mode draft the configured K and only then cut. (With several engines the
        first such one stands for all.) Batch-wide engines draft only the K chosen."""
        for engine in self._engines.values():
            if engine.hello.batch_wide_k:
                continue
            for spec in engine.drafts.values():
                if spec.kind is DraftKind.MODEL:
                    return (spec.name, spec.max_k)
        return None

    def decide(self, now: float, joint: bool = True) -> list[DecisionEvent]:
        """Re-decide what new evidence, an override or time may have changed; return the events
        for choices that changed. A class whose every bucket is settled and has no new evidence
        keeps its decisions without being scored (incremental: a round costs what the evidence
        since the last one touched). ``joint=False`` leaves the joint search's refresh to
        ``refresh_joint`` (the server's rounds, so that a report's policy never waits behind
        it)."""
        drafts = self.drafts()
        if not drafts and not self._engines:
            return []
        events: list[DecisionEvent] = []
        material = False
        cache: dict[tuple[str, str], np.ndarray] = {}
        if joint:
            self._refresh_joint(drafts, now, cache)
        drawn = self._cost.draw(self._rng)  # one cost draw per round, before acceptance draws
        # The classes as they run, per bucket (``_others``); a decision the round changes is
        # priced again, so later classes see it, as they always did.
        running: dict[int, dict[str, OtherClass]] = {}
        for name, state in self._classes.items():
            if self._holds(name, state, drafts):
                # Its draws are still taken, so that what the other classes draw does not depend
                # on which classes held (runs stay comparable, draw for draw, across versions).
                for d in drafts:
                    self._estimator.posterior(name, d.name, now).sample(self._rng)
                continue
            ctx = self._context(name, state, drafts, now, cache, drawn, running)
            for new, bucket in zip(decide_class(ctx, self.config.policy), ctx.buckets,
                                   strict=True):
                old = state.decisions.get(new.bucket)
                if bucket.fresh:
                    # Decided on this evidence, even where hysteresis or the dwell kept the
                    # arm: the next draw needs new evidence again.
                    state.decided_at[new.bucket] = now
                if new is old:
                    continue
                material |= _material(old, new)
                state.decisions[new.bucket] = new
                state.decided_at[new.bucket] = now
                if name in running.get(new.bucket, {}):
                    o = self._running(name, running[new.bucket][name].share, new.bucket,
                                      drafts, now, cache)
                    if o is not None:
                        running[new.bucket][name] = o
                if new.same_choice(old):
                    continue
                state.changed_at[new.bucket] = now
                events.append(DecisionEvent(
                    0, now, new, old, decision_figures(ctx, self.config.policy, bucket, new, old)))
            state.change_pending = False
        composition = self._compose(now)
        if moved(self._composition, composition, self._priced_batch_sizes(),
                 self.config.policy.max_k, _COMPOSITION_TOLERANCE):
            self._composition = composition
            material = True
        if material or self._forgotten:
            self._version += 1
            self._forgotten = False
        stamped = [replace(e, policy_version=self._version) for e in events]
        self._log.extend(stamped)
        return stamped

    def default_decisions(self) -> list[Decision]:
        """What an engine applies to a class the controller has not seen yet: the warm-up K."""
        drafts = self.drafts()
        k = min(self.config.policy.warmup_k, drafts[0].max_k) if drafts else 0
        return [Decision("", b, drafts[0].name if k else "", k, Reason.WARMUP)
                for b in range(self.config.n_buckets)]

    # --- the fleet (controller.core.fleet) -----------------------------------------------------
    @property
    def evidence_half_life(self) -> float:
        """Half-life of acceptance evidence, seconds: the fleet decays exports with it too."""
        return self.config.estimator.half_life_seconds

    def export_evidence(self, now: float) -> tuple[EvidenceEntry, ...]:
        """This controller's own acceptance evidence, decayed to ``now`` (never the fleet's)."""
        return entries_of(self._estimator.export(now))

    def restore_evidence(self, entries: Iterable[EvidenceEntry], at: float, now: float) -> None:
        """Take back this controller's own evidence as of ``at`` (its last flush before a
        restart). Classes are tracked as a report's would be; invalid class names are skipped."""
        valid = []
        for e in entries:
            try:
                check_class_name(e.traffic_class, "evidence.traffic_class")
            except ValueError:
                continue
            valid.append(e)
        mapping, new = fold_classes([e.traffic_class for e in valid], self._classes,
                                    self.config.max_classes)
        for name in [*new, *(v for v in mapping.values() if v == OTHER_CLASS)]:
            self._classes.setdefault(name, _ClassState())
        evidence: dict[EvidenceKey, tuple[FloatArray, FloatArray]] = {}
        for e in valid:  # names folded into "other" add up
            add_evidence(evidence, (mapping[e.traffic_class], e.draft), e.accepts, e.rejects)
        self._estimator.restore(evidence, at, now)
        for cls, _ in evidence:
            self._classes[cls].evidence_at = now

    def set_fleet_evidence(self, evidence: Mapping[EvidenceKey, tuple[FloatArray, FloatArray]],
                           now: float) -> None:
        """The other sidecars' evidence (``controller.core.fleet.fleet_evidence``), as of
        ``now``: it adds to this controller's posteriors, replacing the previous fleet view."""
        self._estimator.set_fleet(evidence, now)

    def hardware(self) -> str:
        """What the first connected engine runs on ("" with none, or from an older plugin): the
        engine type whose step costs this controller shares."""
        return next((e.hello.hardware for e in self._engines.values()), "")

    def export_costs(self, sidecar: str, now: float) -> CostExport | None:
        """This controller's own step-cost evidence, decayed to ``now`` (never the fleet's);
        None while the hardware is not known (nothing to share it with)."""
        hardware = self.hardware()
        if not hardware:
            return None
        return CostExport(sidecar, now, hardware, self._cost.export(now))

    def restore_costs(self, export: CostExport, now: float) -> bool:
        """Take back this controller's own step-cost evidence (its last flush before a
        restart); False when it was made for other hardware or other drafts."""
        if export.hardware != self.hardware():
            return False
        return self._cost.restore(export.evidence, export.at, now)

    def set_fleet_costs(self, exports: Iterable[CostExport], me: str, now: float,
                        max_age_seconds: float) -> int:
        """The other sidecars' step-cost evidence of this engine type
        (``controller.core.fleet.fleet_costs``) replaces the previous fleet view; returns how
        many sidecars it came from."""
        hardware = self.hardware()
        if not hardware:
            self._cost.set_fleet(None, now)
            return 0
        evidence, count = fleet_costs(exports, me, hardware, self._cost.drafts,
                                      self._cost.knot_tokens, now,
                                      self.config.cost_half_life_seconds, max_age_seconds)
        self._cost.set_fleet(evidence, now)
        return count

    def engine_options(self, sidecar: str, now: float) -> EngineOptions | None:
        """What this controller's engines achieve, for the fleet's recommendations
        (``controller.core.recommend``); None while no engine is connected. Posterior means and
        mean costs, the class alone in the batch; draws nothing, so deciding is unaffected."""
        if not self._engines:
            return None
        drafts = self.drafts()
        sunk = self._sunk_draft()
        sizes = tuple(self.config.bucket_batch_size(b) for b in range(self.config.n_buckets))
        off = tuple(float(n / self._cost.predict_curve(n, "", False, 0, sunk_draft=sunk)[0])
                    for n in sizes)
        curves = []
        for name in sorted(self._classes):
            for d in drafts:
                if not self._estimator.has_data(name, d.name):
                    continue
                post = self._estimator.posterior(name, d.name, now)
                k_max = min(self.config.policy.max_k, d.max_k)
                expected = expected_tokens_curve(post.mean[:k_max])[1:]
                best = []
                for n in sizes:
                    seconds = self._cost.predict_curve(n, d.pass_draft, bool(d.pass_draft),
                                                       k_max, sunk_draft=sunk)[1:]
                    values = goodput(expected, n, seconds)
                    k = int(np.argmax(values))
                    best.append((k + 1, float(values[k])))
                curves.append(DraftCurve(name, d.name, tuple(k for k, _ in best),
                                         tuple(g for _, g in best),
                                         float(post.effective_tries[0])))
        load = float(np.mean([e.running_requests for e in self._engines.values()]))
        return EngineOptions(sidecar, now, SPECULATIVE if drafts else PLAIN, load, sizes, off,
                             self._cost.observed_steps, tuple(curves))

    # --- overrides --------------------------------------------------------------------------
    def set_override(self, override: Override) -> None:
        """Put ``override`` in force (in its scope's layer) from the next ``decide``. Raise
        ValueError (naming the field), changing nothing, for a class that cannot be tracked."""
        self._track_override_class(override)
        self._overrides[override.scope][override.traffic_class] = override

    def check_override(self, override: Override) -> None:
        """ValueError (naming the field) when ``override`` names a class that cannot be
        tracked; changes nothing."""
        name = override.traffic_class
        if name == ALL_CLASSES:
            return
        check_class_name(name, "override.traffic_class")
        if self.canonical_class(name) != name:
            raise ValueError(
                f"override.traffic_class: {name!r} is new and the class limit "
                f"(max_classes={self.config.max_classes}) is reached, so its traffic is "
                f"folded into {OTHER_CLASS!r}: override {OTHER_CLASS!r} instead")

    def check_operator_override(self, override: Override) -> None:
        """What an operator's override must also satisfy (the policy API's bounds; overrides
        the core is given directly, as in tests, skip them): K at most the policy's max K, a
        forced draft one of the connected engines offers or a declared one (declared_drafts;
        the same rule with or without engines), a note of at most MAX_NOTE_CHARS, and a class
        that is declared or that an engine has reported (else any client could take the class
        slots with overrides). ValueError naming the field and how to declare what it lacks."""
        self.check_override(override)
        if override.pin_k is not None and not 0 <= override.pin_k <= self.config.policy.max_k:
            raise ValueError(f"override.pin_k: {override.pin_k} outside 0..max_k "
                             f"{self.config.policy.max_k}")
        offered = [d.name for d in self.drafts()]
        known = offered + sorted(self.config.declared_drafts.difference(offered))
        if (draft := override.force_draft) is not None and draft not in known:
            named = draft if valid_class_name(draft) else "NAME"
            raise ValueError(
                f"override.force_draft: {draft[:80]!r} is neither a draft a connected engine "
                f"offers nor a declared one (known: {', '.join(known) or 'none'}); declare it "
                f"in the controller's settings and restart it (declared_drafts: [\"{named}\"] "
                f"in the settings file, or SPECPILOT_DECLARED_DRAFTS='[\"{named}\"]'), or "
                "connect an engine that offers it")
        if len(override.note) > MAX_NOTE_CHARS:
            raise ValueError(f"override.note: {len(override.note)} characters, at most "
                             f"{MAX_NOTE_CHARS}")
        name = override.traffic_class
        if name != ALL_CLASSES and name not in self._classes:
            raise ValueError(
                f"override.traffic_class: {name[:80]!r} is neither a class an engine has "
                "reported nor a declared one; declare it in the controller's settings and "
                f"restart it (declared_classes: [\"{name}\"] in the settings file, or "
                f"SPECPILOT_DECLARED_CLASSES='[\"{name}\"]'), or send a request of that class "
                "first")

    def _track_override_class(self, override: Override) -> None:
        self.check_override(override)
        if override.traffic_class != ALL_CLASSES:
            self._classes.setdefault(override.traffic_class, _ClassState())

    def clear_override(self, traffic_class: str,
                       scope: OverrideScope = OverrideScope.POD) -> bool:
        """Lift the override of ``scope`` on ``traffic_class`` from the next ``decide``; False
        if none was set."""
        return self._overrides[scope].pop(traffic_class, None) is not None

    def set_fleet_overrides(self, overrides: Iterable[Override]) -> list[tuple[Override, str]]:
        """The fleet's overrides as the state store holds them, replacing the previous fleet
        layer. Returns those that could not be taken, each with the reason (a class this
        controller cannot track); the rest are in force from the next ``decide``."""
        layer: dict[str, Override] = {}
        refused = []
        for ov in overrides:
            try:
                self._track_override_class(ov)
            except ValueError as exc:
                refused.append((ov, str(exc)))
                continue
            layer[ov.traffic_class] = replace(ov, scope=OverrideScope.FLEET)
        self._overrides[OverrideScope.FLEET] = layer
        return refused

    def fleet_overrides(self) -> tuple[Override, ...]:
        """The fleet layer as last set, by class."""
        layer = self._overrides[OverrideScope.FLEET]
        return tuple(layer[c] for c in sorted(layer))

    # --- read side --------------------------------------------------------------------------
    def composition(self) -> Composition | None:
        """The composition the current policy version carries (``_compose``, renewed by a
        decide round when it moved by more than ``_COMPOSITION_TOLERANCE``)."""
        return self._composition

    def _priced_batch_sizes(self) -> list[int]:
        return sorted({max(1, round(self._loads.batch_size(b)))
                       for b in range(self.config.n_buckets)})

    def _compose(self, now: float) -> Composition | None:
        """What engines that re-pick arms per step price a step with (``step_composition``):
        the cost model's mean weights and the posterior-mean E(K) of the classes with the
        largest shares, per draft they have evidence for. None when no connected engine can
        use it, or when a per-request engine's drafter runs whatever K is chosen (a per-step
        re-pick then saves verification only)."""
        if (not any(e.hello.step_composition for e in self._engines.values())
                or self._sunk_draft() is not None):
            return None
        shares = self._mix.shares()
        names = sorted(self._classes, key=lambda c: (-shares.get(c, 0.0), c))
        curves: dict[tuple[str, str], tuple[float, ...]] = {}
        cache: dict[tuple[str, str], np.ndarray] = {}
        for name in names[:COMPOSITION_MAX_CLASSES]:
            for d in self.drafts():
                if self._estimator.has_data(name, d.name):
                    k = min(self.config.policy.max_k, d.max_k)
                    curve = self._mean_curve(name, d.name, now, cache)[: k + 1]
                    curves[(name, d.name)] = tuple(float(x) for x in curve)
        return Composition(self._cost.mean.pricing(), curves,
                           self.config.policy.composition_margin)

    @property
    def version(self) -> int:
        """Version of the policy: moves when a decide round changed what engines must apply."""
        return self._version

    @property
    def engines_connected(self) -> int:
        """Engines registered now (what a health check reports: cheaper than a snapshot)."""
        return len(self._engines)

    def _versions_behind(self, applied: int) -> int:
        start = self.epoch << EPOCH_SHIFT
        if applied < start:  # its static configuration, or a previous controller's policy
            return self._version - start + 1
        return max(self._version - applied, 0)  # above ours: a later controller's, not behind

    def decision(self, traffic_class: str, bucket: int) -> Decision | None:
        state = self._classes.get(traffic_class)
        return state.decisions.get(bucket) if state else None

    def snapshot(self, now: float) -> CoreSnapshot:
        """The whole state as of ``now``, frozen (posteriors decay with time, so ``now``
        matters for the estimates and the engines' report ages)."""
        drafts = self.drafts()
        with_evidence = self._estimator.keys()
        shares = self._mix.shares()
        classes = tuple(
            ClassView(
                name=name,
                decisions=tuple(d for _, d in sorted(self._classes[name].decisions.items())),
                estimates=self._estimates(name, drafts, with_evidence, now),
                overrides=tuple(self._overrides_for(name)),
                offline=name in self.config.offline_classes,
                share=shares.get(name),
                measured_tokens_per_step=self._served.tokens_per_step(name),
                measured_speedup=self._served.speedup(name),
            )
            for name in sorted(self._classes)
        )
        engines = tuple(
            EngineView(
                engine_id=engine_id,
                model=e.hello.model,
                drafts=tuple(e.drafts.values()),
                running_requests=e.running_requests,
                last_report_at=e.last_report_at,
                report_age_seconds=now - e.last_report_at,
                last_sequence=e.last_sequence,
                policy_version_applied=e.policy_version_applied,
                hardware=e.hello.hardware,
                versions_behind=self._versions_behind(e.policy_version_applied),
            )
            for engine_id, e in sorted(self._engines.items())
        )
        return CoreSnapshot(
            at=now,
            version=self._version,
            classes=classes,
            engines=engines,
            overrides=tuple(ov for scope in OverrideScope
                            for _, ov in sorted(self._overrides[scope].items())),
            default_decisions=tuple(self.default_decisions()),
            log=tuple(self._log),
            batch_bucket_upper_bounds=self.config.batch_bucket_upper_bounds,
            offline_classes=self.config.offline_classes,
            max_classes=self.config.max_classes,
            composition=self._composition,
        )

    def predicted_step_seconds(self, batch_size: int, draft: str, k: int) -> float:
        """The cost model's mean step time for ``batch_size`` sequences each verifying K drafts
        of ``draft`` ("" or K=0: no speculation), as decisions price it (a per-request engine's
        drafter runs its passes whatever K is). KeyError for a draft no engine offers."""
        spec = next((d for d in self.drafts() if d.name == draft), None)
        if draft and spec is None:
            raise KeyError(f"unknown draft {draft!r}")
        pass_draft = spec.pass_draft if spec is not None and k > 0 else ""
        return self._cost.predict_arm(batch_size, k, pass_draft, bool(pass_draft),
                                      self._sunk_draft())

    def estimate(self, traffic_class: str, draft: str, now: float,
                 positions: int | None = None) -> AcceptanceEstimate:
        """The acceptance posterior of (class, draft) as of ``now``: the bare prior when no
        report named it. ``positions`` shown: the estimator's max K unless given, never more
        than it tracks (a draft may announce a longer K than the controller considers)."""
        post = self._estimator.posterior(traffic_class, draft, now)
        tracked = post.alpha.size
        return AcceptanceEstimate(
            traffic_class=traffic_class,
            draft=draft,
            alpha=tuple(post.alpha.tolist()),
            beta=tuple(post.beta.tolist()),
            prior_alpha=post.prior_alpha,
            prior_beta=post.prior_beta,
            positions=tracked if positions is None else min(positions, tracked),
            changes_detected=self._estimator.changes_detected(traffic_class, draft),
            has_evidence=self._estimator.has_data(traffic_class, draft),
        )

    def _estimates(self, name: str, drafts: tuple[DraftSpec, ...],
                   with_evidence: list[tuple[str, str]], now: float
                   ) -> tuple[AcceptanceEstimate, ...]:
        # Drafts of connected engines, plus any the class has evidence for from earlier engines.
        positions = {d.name: d.max_k for d in drafts}
        for cls, draft in with_evidence:
            if cls == name:
                positions.setdefault(draft, self.config.estimator.max_k)
        return tuple(self.estimate(name, draft, now, k) for draft, k in positions.items())

    def explain(self, traffic_class: str, bucket: int, now: float) -> Explanation:
        """The numbers behind the decision of one (class, bucket). KeyError naming what is
        unknown."""
        if traffic_class not in self._classes:
            raise KeyError(f"unknown class {traffic_class!r}")
        if not 0 <= bucket < self.config.n_buckets:
            raise KeyError(f"batch bucket {bucket} outside 0..{self.config.n_buckets - 1}")
        state = self._classes[traffic_class]
        ctx = self._context(traffic_class, state, self.drafts(), now)
        batch = self._loads.batch_size(bucket)
        arms = tuple(arm_values(ctx, batch, ctx.mean_rates, self.config.policy.max_k))
        rates = tuple((d.name, tuple(float(r) for r in ctx.mean_rates[d.name][: d.max_k]))
                      for d in ctx.drafts)
        return Explanation(traffic_class, state.decisions.get(bucket), batch, arms, rates,
                           ctx.override)


def _material(old: Decision | None, new: Decision) -> bool:
    """Whether the engine needs to hear about this change."""
    if old is None or not new.same_choice(old):
        return True
    if (old.probe_k, old.probe_draft) != (new.probe_k, new.probe_draft):
        return True
    lo, hi = sorted((old.probe_rate, new.probe_rate))
    return hi > 0 and (lo == 0 or hi / lo > _PROBE_RATE_MATERIAL_FACTOR)
