"""The policy in force: which (draft, K) each request runs with.

The sender thread writes (``apply``, ``set_bucket_bounds``, ``heard_from_controller``), the
scheduler thread reads (``choice``, ``lookup``, ``version``). Writers build a new immutable
snapshot and assign it to one attribute; an attribute assignment is atomic under the GIL, so
readers need no lock and always see either the old or the new policy, never a mix.

Fail-static: before the first policy, and whenever nothing was heard from the controller for
longer than the fail-static timeout, ``choice`` returns the engine's static configuration and
``version`` is 0. The last policy is kept: the next message from the controller brings it back
(on a reconnect the controller sends its current policy right after the HelloAck).

Batch buckets: the view holds the plugin's one copy of the bucket bounds, the defaults until a
HelloAck announces the controller's (``set_bucket_bounds``). Decisions are looked up and reports
are bucketed (``specpilot.engine_plugin.link``) with these bounds, through
``specpilot.contract.buckets``.

Probing: while a class runs no model draft (off, or on n-gram or suffix drafts) the controller
may ask for a share ``probe_rate`` of its requests to run at ``probe_k`` with ``probe_draft``, so
a recovery of the model draft's acceptance is noticed. Which
requests probe is decided by a hash of the request key and the probe epoch (blake2b, uniform in
[0, 1); epochs of PROBE_EPOCH_SECONDS), so the subset is deterministic, stable for a request
within an epoch, and its size tracks ``probe_rate``. A fresh subset every epoch spreads the
probes over many requests for a few steps each rather than over a few requests for their whole
life: the same cost, and a recovery shows within a few epochs instead of after the first probed
request of a small share arrives.

Whole-step probes (``Decision.probe_steps``, asked of engines that announce step probes): the
share is of steps, and in a probed step every request of the class probes. One draw per class
per ``PolicyLookup`` (the plugin makes one lookup per step and batch size). In a batch-wide
engine the drafter's pass costs a step the same for one probed request as for all of them, so
probing whole steps learns as many times more per cost as the class has requests in the batch.

Per-step composition (``PolicyUpdate.composition``, asked of engines that announce it): the
decisions are priced for the class mix the controller expects; ``PolicyLookup.compose`` re-picks,
for the classes and counts of one step, the arms of the classes whose decision is a settled
goodput choice, where that beats the decisions by the policy's margin
(``specpilot.engine_plugin.policy.compose.StepComposer``, its answers remembered per policy and
step).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from specpilot.contract.buckets import DEFAULT_BUCKET_BOUNDS, bucket_of, check_bucket_bounds
from specpilot.contract.classes import OTHER_CLASS
from specpilot.contract.pricing import Composition
from specpilot.contract.records import CalibrationRows, EngineDecision, PolicyUpdate
from specpilot.engine_plugin.policy.compose import StepComposer, adjustable
from specpilot.engine_plugin.policy.cut import CutTable
from specpilot.engine_plugin.policy.points import probe_point

log = logging.getLogger(__name__)


class Choice(NamedTuple):
    """What one request runs with: the draft and K (0 = no speculation), and whether this is a
    probe of a class that runs no model draft."""

    draft: str
    k: int
    probe: bool


class _Entry(NamedTuple):
    """One decision, with its answers built once so ``choice`` allocates nothing."""

    choice: Choice
    probe_rate: float
    probe_choice: Choice
    probe_steps: bool  # probe_rate is a share of steps (all of the class's requests in each)
    traffic_class: str  # the decision's own ("" for a default), as the composition names it
    adjustable: bool  # a settled goodput choice that probes nothing: re-picked per step


@dataclass(frozen=True)
class _Policy:
    version: int
    decisions: dict[tuple[str, int], _Entry]
    defaults: dict[int, _Entry]
    # The policy's per-step pricing with the re-picks it answered (None: not sent, or unusable).
    composer: StepComposer | None = None
    # What each request's drafts are cut with, token by token (None: not sent, or unusable).
    cut: CutTable | None = None


# Probed requests are redrawn this often, seconds (a few dozen verification steps of a request).
PROBE_EPOCH_SECONDS = 2.0


class ClassChoice(NamedTuple):
    """What the requests of one class run with in one lookup: ``choice``, or ``probe_choice``
    for a request whose point in this probe epoch is below ``probe_rate`` (0: none probes)."""

    choice: Choice
    probe_rate: float
    probe_choice: Choice
    epoch: int

    def probed(self, request_key: str) -> bool:
        """Whether the request keyed ``request_key`` probes."""
        return (self.probe_rate > 0.0
                and probe_point(request_key + f"#{self.epoch}") < self.probe_rate)

    def of(self, request_key: str) -> Choice:
        """The choice of the request keyed ``request_key``."""
        return self.probe_choice if self.probed(request_key) else self.choice


class PolicyView:
    """``static_k``/``static_draft``: the engine's own configuration, used when fail-static.
    ``max_k``: largest K the engine can run (default ``static_k``); decisions above it are cut to
    it, never lengthened past what the engine drafts."""

    def __init__(
        self,
        static_k: int,
        static_draft: str,
        fail_static_timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_k: int | None = None,
        bucket_bounds: Iterable[int] = DEFAULT_BUCKET_BOUNDS,
        step_draw: Callable[[], float] = random.random,
    ) -> None:
        if static_k < 0:
            raise ValueError(f"static_k: must be >= 0, got {static_k}")
        if not math.isfinite(fail_static_timeout_seconds) or fail_static_timeout_seconds <= 0:
            raise ValueError("fail_static_timeout_seconds: must be a finite number > 0, got "
                             f"{fail_static_timeout_seconds}")
        self.max_k = static_k if max_k is None else max_k
        self._static = Choice(static_draft if static_k else "", static_k, False)
        self._clock = clock
        self._timeout = float(fail_static_timeout_seconds)
        self._bounds = check_bucket_bounds(bucket_bounds)
        self._policy: _Policy | None = None
        self._heard_at = -math.inf
        self._folded: frozenset[str] = frozenset()
        self._step_draw = step_draw
        self._composition_refused = False  # logged once
        self._cut_refused = False  # logged once

    # --- writers (sender thread) ---------------------------------------------------------------
    def apply(self, update: PolicyUpdate) -> None:
        """Put a policy update in force (and count it as hearing from the controller)."""
        decisions = {(d.traffic_class, d.bucket): self._entry(d) for d in update.decisions}
        defaults = {d.bucket: self._entry(d) for d in update.default_decisions}
        timeout = update.fail_static_timeout_seconds
        if math.isfinite(timeout) and timeout > 0:
            self._timeout = timeout
        composition = self._composition(update)
        self._policy = _Policy(update.version, decisions, defaults,
                               StepComposer(composition) if composition is not None else None,
                               self._cut(update))
        self.heard_from_controller()

    def _composition(self, update: PolicyUpdate) -> Composition | None:
        """The update's per-step pricing, or None (not sent, or unusable: logged, and the
        decisions apply as they are)."""
        if update.composition_error and not self._composition_refused:
            log.warning("specpilot: the policy's composition is unusable (%s); applying its "
                        "decisions as they are", update.composition_error)
            self._composition_refused = True
        return update.composition

    def _cut(self, update: PolicyUpdate) -> CutTable | None:
        """The update's token cut, or None (not sent, or unusable: logged once, and drafts are
        cut to the decisions' K only)."""
        if update.cut is None:
            return None
        try:
            return CutTable(update.cut)
        except ValueError as exc:
            if not self._cut_refused:
                log.warning("specpilot: the policy's token cut is unusable (%s); cutting drafts "
                            "to the decisions' K only", exc)
                self._cut_refused = True
            return None

    def set_bucket_bounds(self, bounds: Iterable[int]) -> None:
        """Bucket bounds from the HelloAck; ValueError (and no change) if bad."""
        self._bounds = check_bucket_bounds(bounds)

    def set_folded_classes(self, names: Iterable[str]) -> None:
        """Classes the controller folded into "other": they follow "other"'s decisions."""
        folded = self._folded.union(names)
        if folded != self._folded:
            self._folded = folded

    @property
    def folded_classes(self) -> frozenset[str]:
        """Classes that follow "other"'s decisions, as the controller said."""
        return self._folded

    def forget_folded_classes(self) -> None:
        """A new controller (another epoch) folds afresh: every class follows its own
        decisions again until the controller says otherwise."""
        self._folded = frozenset()

    def heard_from_controller(self) -> None:
        self._heard_at = self._clock()

    def _entry(self, d: EngineDecision) -> _Entry:
        k = min(d.k, self.max_k)
        probe_k = min(d.probe_k, self.max_k)
        # The controller asks for probes only where the class runs no model draft.
        rate = d.probe_rate if probe_k > 0 and d.probe_draft else 0.0
        rate = min(max(rate, 0.0), 1.0) if math.isfinite(rate) else 0.0
        return _Entry(Choice(d.draft if k else "", k, False), rate,
                      Choice(d.probe_draft, probe_k, True), d.probe_steps, d.traffic_class,
                      adjustable(d.reason, rate > 0.0))

    # --- readers (scheduler thread) ------------------------------------------------------------
    @property
    def fail_static(self) -> bool:
        """True while the engine's static configuration is in force."""
        return self._policy is None or self._clock() - self._heard_at > self._timeout

    @property
    def version(self) -> int:
        """Version of the policy in force; 0 when the static configuration is."""
        policy = self._policy
        if policy is None or self._clock() - self._heard_at > self._timeout:
            return 0
        return policy.version

    @property
    def static_choice(self) -> Choice:
        """The engine's own configuration (what fail-static returns)."""
        return self._static

    @property
    def static_k(self) -> int:
        return self._static.k

    @property
    def static_draft(self) -> str:
        return self._static.draft

    @property
    def fail_static_timeout_seconds(self) -> float:
        return self._timeout

    @property
    def bucket_bounds(self) -> tuple[int, ...]:
        return self._bounds

    def bucket_of(self, batch_size: int) -> int:
        return bucket_of(self._bounds, batch_size)

    def choice(self, traffic_class: str, batch_size: int, request_key: str) -> Choice:
        """The (draft, K) for a request of ``traffic_class`` in a batch of ``batch_size``.

        Never raises: on any unexpected input it returns the static configuration.
        """
        return self.lookup(batch_size).choice(traffic_class, request_key)

    def lookup(self, batch_size: int) -> PolicyLookup:
        """The policy in force now for a batch of ``batch_size``, as an object that resolves each
        class once (what the plugin uses within one step: one lookup per class and bucket).
        Never raises."""
        policy = self._policy
        now = self._clock()
        if policy is None or now - self._heard_at > self._timeout:
            return PolicyLookup(self._static, None, 0, self._folded)
        try:
            bucket = bucket_of(self._bounds, batch_size)
        except Exception:
            log.debug("bucket lookup failed; static configuration", exc_info=True)
            return PolicyLookup(self._static, None, 0, self._folded)
        return PolicyLookup(self._static, policy, bucket, self._folded,
                            int(now // PROBE_EPOCH_SECONDS), self._step_draw)


class PolicyLookup:
    """One policy snapshot at one batch bucket: ``resolve`` answers a class on its first call
    and remembers it; the probe draw is per request and probe epoch (``ClassChoice.probed``),
    or for whole-step probes one per class and lookup (``step_draw``). Read it on one thread
    (the scheduler's); it never sees a later policy."""

    __slots__ = ("_bucket", "_entries", "_epoch", "_folded", "_policy", "_static", "_step_draw")

    def __init__(self, static: Choice, policy: _Policy | None, bucket: int,
                 folded: frozenset[str], epoch: int = 0,
                 step_draw: Callable[[], float] = random.random) -> None:
        self._static = static
        self._policy = policy
        self._bucket = bucket
        self._folded = folded
        self._epoch = epoch
        self._step_draw = step_draw
        # Per class: its decision, and what its requests run with in this lookup.
        self._entries: dict[str, tuple[_Entry | None, ClassChoice]] = {}

    def choice(self, traffic_class: str, request_key: str) -> Choice:
        """The (draft, K) for a request of ``traffic_class`` whose probe key is ``request_key``.
        Never raises: on any unexpected input it returns the static configuration."""
        try:
            return self.resolve(traffic_class).of(request_key)
        except Exception:
            log.debug("policy lookup failed; static configuration", exc_info=True)
            return self._static

    def resolve(self, traffic_class: str) -> ClassChoice:
        """What the requests of ``traffic_class`` run with in this lookup (with whole-step
        probes, drawn once for all of them). Never raises: on any unexpected input, the static
        configuration."""
        try:
            return self._entry(traffic_class)[1]
        except Exception:
            log.debug("policy lookup failed; static configuration", exc_info=True)
            return ClassChoice(self._static, 0.0, self._static, self._epoch)

    def probes(self, traffic_class: str) -> bool:
        """Whether the class's decision probes a draft (a share of its requests or of whole
        steps), whatever this lookup's draw. Never raises: False on unexpected input."""
        try:
            entry = self._entry(traffic_class)[0]
            return entry is not None and entry.probe_rate > 0.0 and entry.probe_choice.k > 0
        except Exception:
            log.debug("policy lookup failed", exc_info=True)
            return False

    def uniform(self, classes: Iterable[str]) -> Choice | None:
        """The one choice every request of ``classes`` gets, or None where they differ or a
        class probes requests (its requests then differ by their keys). Never raises."""
        try:
            first: Choice | None = None
            for traffic_class in classes:
                resolved = self._entry(traffic_class)[1]
                if resolved.probe_rate > 0.0:
                    return None
                if first is None:
                    first = resolved.choice
                elif resolved.choice != first:
                    return None
            return first
        except Exception:
            log.debug("policy lookup failed", exc_info=True)
            return None

    def cuts(self) -> bool:
        """Whether the policy cuts any request's drafts token by token."""
        policy = self._policy
        return policy is not None and policy.cut is not None and policy.cut.any_rows

    def cut(self, traffic_class: str, draft: str, transformed: bool
            ) -> tuple[CalibrationRows, float] | None:
        """The calibration rows of a request's (class, draft) and the survival its tokens must
        reach in this lookup's bucket; None where the policy cuts nothing for them. A class
        folded into "other" is cut as "other". Never raises."""
        try:
            policy = self._policy
            if policy is None or policy.cut is None:
                return None
            name = OTHER_CLASS if traffic_class in self._folded else traffic_class
            rows = policy.cut.rows(name, draft, transformed)
            if rows is None or self._bucket >= len(policy.cut.min_survival):
                return None
            return rows, policy.cut.min_survival[self._bucket]
        except Exception:
            log.debug("token cut lookup failed; no cut", exc_info=True)
            return None

    def drafter_stop(self) -> tuple[float, float] | None:
        """The (min_survival, pass_tokens) the drafter's early stop prices this lookup's bucket
        at (``DrafterStop``); None where the policy sends no pass price (the drafter runs every
        pass asked). Never raises."""
        try:
            policy = self._policy
            cut = None if policy is None else policy.cut
            if cut is None or self._bucket >= min(len(cut.pass_tokens), len(cut.min_survival)):
                return None
            return cut.min_survival[self._bucket], cut.pass_tokens[self._bucket]
        except Exception:
            log.debug("drafter stop lookup failed; no stop", exc_info=True)
            return None

    def compose(self, counts: Mapping[str, int], batch_size: int,
                context_tokens: float = 0.0) -> dict[str, Choice]:
        """For a step whose decoding sequences number ``counts`` per traffic class, over
        ``context_tokens`` of context each on average: the classes whose arm the policy's
        composition re-picks for this step, with their choice (empty without a composition, or
        where the decisions stand). Never raises."""
        try:
            policy = self._policy
            if policy is None or policy.composer is None:
                return {}
            entries = {c: e for c in counts if (e := self._entry(c)[0]) is not None}
            changed = policy.composer.repick(
                ((e.traffic_class, (e.choice.draft, e.choice.k), e.adjustable, counts[c])
                 for c, e in entries.items()), batch_size, context_tokens)
            out = {}
            for c, e in entries.items():
                if (arm := changed.get(e.traffic_class)) is not None:
                    draft, k = arm
                    out[c] = Choice(draft if k else "", k, False)
            return out
        except Exception:
            log.debug("composition failed; the decisions apply", exc_info=True)
            return {}

    def _entry(self, traffic_class: str) -> tuple[_Entry | None, ClassChoice]:
        """The class's decision, and what its requests run with in this lookup (with
        whole-step probes, drawn once)."""
        try:
            return self._entries[traffic_class]
        except KeyError:
            entry = self._resolve(traffic_class)
            epoch = self._epoch
            if entry is None:
                resolved = ClassChoice(self._static, 0.0, self._static, epoch)
            elif entry.probe_steps and entry.probe_rate > 0.0:
                probed = self._step_draw() < entry.probe_rate
                whole_step = entry.probe_choice if probed else entry.choice
                resolved = ClassChoice(whole_step, 0.0, whole_step, epoch)
            else:
                resolved = ClassChoice(entry.choice, entry.probe_rate, entry.probe_choice, epoch)
            pair = self._entries[traffic_class] = (entry, resolved)
            return pair

    def _resolve(self, traffic_class: str) -> _Entry | None:
        policy = self._policy
        if policy is None:
            return None
        bucket = self._bucket
        entry = policy.decisions.get((traffic_class, bucket))
        if entry is None and traffic_class in self._folded:
            entry = policy.decisions.get((OTHER_CLASS, bucket))
        if entry is None:
            entry = policy.defaults.get(bucket)
        return entry
