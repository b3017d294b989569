"""specpilot in the simulator: the real ``ControllerCore`` behind the engine plugin's own policy
module.

The adapter plays the plugin's part with the plugin's objects (``specpilot.engine_plugin.policy``;
nothing of the plugin or the controller is re-implemented): the policy reaches a ``PolicyView`` as
the message the server sends, each step is resolved through a ``StepPolicy`` (lookup, probes,
per-step re-picks, priced at the step's context), the requests scored counterfactually with the
n-gram draft are the ``CounterfactualPicks``, and what the simulated engine measured (its steps'
context among it) goes through a ``StatsAggregator`` into the report that every report interval of
simulated time is handed to ``ControllerCore.ingest``, followed by ``decide``, as the server does.
With a model draft first it reads the tokens' confidences (``reads_confidence``), as the plugin does
where the drafter reports them: it counts each verified token's confidence beside its acceptance
(``StatsAggregator.record_confidences``, censored after the first rejection) and cuts each request's
drafts with the policy's ``TokenCut`` (``PolicyLookup.cut``, ``cut_length``); the drafter's passes
are paid for the decided K, the cut ones only are verified. What is left here is the simulated
engine's side: its request ids as keys, its arrays, and its clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.sim.step import (
    NO_DRAFT,
    Assignment,
    BoolArray,
    EngineInfo,
    IntArray,
    StepOutcome,
    StepView,
    TokenSlots,
)
from benchmarks.sim.truth import StepCost
from specpilot.contract.engine_stream import policy_update_from_proto
from specpilot.contract.records import (
    CalibrationRows,
    DraftKind,
    DraftSpec,
    EngineHello,
    StepProfile,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.settings import core_config, load_settings, server_config
from specpilot.controller.wire import policy_update_to_proto
from specpilot.engine_plugin.config import PluginConfig
from specpilot.engine_plugin.policy.cut import DrafterStop, cut_length
from specpilot.engine_plugin.policy.picks import CounterfactualPicks
from specpilot.engine_plugin.policy.stats import StatsAggregator
from specpilot.engine_plugin.policy.step import StepPolicy
from specpilot.engine_plugin.policy.view import Choice, PolicyLookup, PolicyView
from specpilot.engine_plugin.profile import profile_plan

ENGINE_ID = "sim-engine-0"
_VOCAB = "simulated-vocabulary"
# The simulated target's context limit, tokens: longer than any profiled context.
_MAX_MODEL_LEN = 1 << 20


def start_up_profile(info: EngineInfo, cost: StepCost, max_tokens: int,
                     scale: tuple[float, float] = (1.0, 1.0),
                     by_context: bool = True) -> tuple[StepProfile, ...]:
    """What the plugin's start-up profile would send for this engine
    (``specpilot.engine_plugin.profile``: its ``profile_plan`` of uniform decode steps, the ends
    of K again over a long context, the first model draft running K passes), timed by the
    scenario's step cost without noise (the plugin keeps the fastest of five), times ``scale``
    (without speculation, with): a real profile's bias. ``by_context`` off: a runner that cannot
    time a context (no long-context points)."""
    model = next((d for d, m in enumerate(info.draft_is_model) if m), None)
    out = []
    max_k = info.max_k if model is not None else 0
    max_len = _MAX_MODEL_LEN if by_context else 0
    for b, k, context in profile_plan(info.max_batch, max_k, max_tokens, max_len):
        passes = np.zeros(len(info.drafts))
        draft_tokens = np.zeros(len(info.drafts))
        if k and model is not None:
            passes[model], draft_tokens[model] = k, k * b
        seconds = cost.seconds(b, b * (1 + k), passes, draft_tokens,
                               b * (1 + k) * context) * scale[1 if k else 0]
        out.append(StepProfile(b, b * (1 + k), info.drafts[model] if k and model is not None
                               else "", k, seconds, context))
    return tuple(out)


class SpecPilotPolicy:
    """``read_confidence``: the drafter reports its tokens' confidences (only a model draft,
    the engine's first, can; off: the plugin on a drafter that does not). ``read_context``
    off: an engine whose plugin reports no context (0, unknown: the cost model's context column
    stays at its prior) and composes its steps without one. ``name``: what its runs are
    called."""

    def __init__(self, info: EngineInfo, settings_overrides: dict[str, Any], seed: int,
                 report_interval_seconds: float,
                 step_profile: tuple[StepProfile, ...] = (),
                 read_confidence: bool = True, name: str = "specpilot",
                 read_context: bool = True) -> None:
        self.name = name
        self.info = info
        self.reads_context = read_context
        self.reads_confidence = read_confidence and info.draft_is_model[info.primary_draft]
        self._transformed = info.transformed or (False,) * len(info.classes)
        offline = [c for c, off in zip(info.classes, info.offline, strict=True) if off]
        overrides = dict(settings_overrides)
        overrides["offline_classes"] = sorted(set(overrides.get("offline_classes", [])) |
                                              set(offline))
        overrides.setdefault("seed", seed)
        self.settings = load_settings(None, **overrides)
        self.core = ControllerCore(core_config(self.settings),
                                   np.random.default_rng(self.settings.seed))
        self.interval = report_interval_seconds
        kinds = [DraftKind.MODEL if m else DraftKind.NGRAM for m in info.draft_is_model]
        self.ngram = kinds.index(DraftKind.NGRAM) if DraftKind.NGRAM in kinds else None
        self.core.connect_engine(EngineHello(
            engine_id=ENGINE_ID, model="simulated-target", target_vocab_hash=_VOCAB,
            drafts=tuple(DraftSpec(n, kind, info.max_k, _VOCAB)
                         for n, kind in zip(info.drafts, kinds, strict=True)),
            max_k=info.max_k, per_request_k=True, batch_wide_k=True,
            ngram_counterfactual=self.ngram is not None, step_probes=True,
            step_composition=True, engine_version="simulated",
            plugin_version="simulated", max_batch_size=info.max_batch,
            step_profile=step_profile), now=0.0)
        self._now = 0.0  # the simulated clock, for the plugin's objects
        self._fail_static = server_config(self.settings).fail_static_timeout_seconds
        drafter = info.drafts[info.primary_draft]
        # The plugin's objects, as specpilot.engine_plugin.pilot wires them, on the simulated clock;
        # the bucket bounds are the controller's, as its HelloAck announces them.
        self.view = PolicyView(
            static_k=info.max_k, static_draft=drafter,
            fail_static_timeout_seconds=self._fail_static,
            clock=self._clock, max_k=info.max_k,
            bucket_bounds=self.core.config.batch_bucket_upper_bounds,
            step_draw=np.random.default_rng([seed, 5]).random)
        self.step = StepPolicy(self.view, frozenset(info.drafts), drafter)
        self.picks = (CounterfactualPicks(PluginConfig().counterfactual_per_step)
                      if self.ngram is not None else None)
        self.stats = StatsAggregator(max_k=max(info.max_k, 1), drafts=info.drafts,
                                     clock=self._clock)
        self._draft_index = {n: i for i, n in enumerate(info.drafts)}
        self.core.decide(0.0)
        self.push_policy(0.0)
        self._last_report = 0.0
        self._sequence = 0
        self.reports = 0
        n_c, n_b = len(info.classes), self.core.config.n_buckets
        # When each class last decoded in each bucket, and when its decision there last changed:
        # a change with no decoding of the class in the bucket since the previous one is a
        # change without evidence of its own (counted in idle_decision_changes).
        self._decoded_at = np.full((n_c, n_b), -np.inf)
        self._changed_at = np.zeros((n_c, n_b))
        self._class_index = {c: i for i, c in enumerate(info.classes)}
        self.idle_decision_changes = 0

    def _clock(self) -> float:
        return self._now

    def push_policy(self, now: float) -> None:
        """The policy update the server sends for the core's current version, applied as the
        plugin's link applies it (the message made a record again)."""
        self.view.apply(policy_update_from_proto(
            policy_update_to_proto(self.core.snapshot(now), self._fail_static)))
        self._applied = self.core.version

    # --- applying the policy ---------------------------------------------------------------
    def assign(self, view: StepView) -> Assignment:
        """Every decoding request's choice, as the plugin's ``batch_k`` and ``_choice`` make it
        in a batch_max engine: one lookup for the step's batch size, the settled classes
        re-picked for the step's counts, then per class its choice and per request its probe."""
        self._now = view.now
        names, step = self.info.classes, self.step
        step.start()
        lookup = step.lookup(view.batch_size)
        counts = np.bincount(view.classes, minlength=len(names))
        present = np.flatnonzero(counts)
        context = view.context_tokens / view.batch_size if self.reads_context else 0.0
        step.compose(lookup, {names[c]: int(counts[c]) for c in present}, view.batch_size,
                     context)
        k = np.zeros(view.classes.size, dtype=np.int64)
        draft = np.full(view.classes.size, NO_DRAFT, dtype=np.int64)
        for c in present:
            resolved = step.resolve(lookup, names[c])
            mine = np.flatnonzero(view.classes == c)
            k[mine], draft[mine] = resolved.choice.k, self._index(resolved.choice)
            if resolved.probe_rate > 0.0:
                probed = [i for i in mine if resolved.probed(str(view.request_ids[i]))]
                k[probed] = resolved.probe_choice.k
                draft[probed] = self._index(resolved.probe_choice)
        if view.slots is None or not lookup.cuts():
            return Assignment(draft, k, self._scored(view, draft))
        verified, drafted = self._cut(view.slots, view.classes, lookup, draft, k)
        return Assignment(draft, verified, self._scored(view, draft), drafted=drafted)

    def _cut(self, slots: TokenSlots, classes: IntArray, lookup: PolicyLookup,
             draft: IntArray, k: IntArray) -> tuple[IntArray, IntArray]:
        """The verified and the drafted K of each request: the drafter stopped early where no
        request's tokens ahead pay for its next pass (the worker's ``DrafterStop``), then each
        request's drafts cut as the plugin's ``on_drafts`` cuts the drafter's tokens (those of
        the engine's drafter only, each request's first K of them), from the class's
        calibration and the bucket's ``min_survival``."""
        names, transformed = self.info.classes, self._transformed
        drafter = self.info.drafts[slots.draft]
        cut, drafted = k.copy(), k.copy()
        of_class: dict[int, tuple[CalibrationRows, float] | None] = {}
        mine = np.flatnonzero((draft == slots.draft) & (k > 0))
        for c in np.unique(classes[mine]).tolist():
            of_class[c] = lookup.cut(names[c], drafter, transformed[c])
        if (price := lookup.drafter_stop()) is not None and mine.size:
            stop = DrafterStop([(rows[0] if (rows := of_class[int(classes[i])]) else None,
                                 int(k[i])) for i in mine.tolist()], *price)
            confidence, most = slots.confidence[mine], int(k[mine].max())
            while stop.passes < most and stop.after_pass(confidence[:, stop.passes].tolist()):
                pass
            drafted[mine] = np.minimum(k[mine], stop.passes)
        for i in mine.tolist():
            if (rows := of_class[int(classes[i])]) is not None:
                cut[i] = cut_length(slots.confidence[i, :drafted[i]].tolist(), *rows)
        return np.minimum(cut, drafted), drafted

    def _index(self, choice: Choice) -> int:
        return self._draft_index[choice.draft] if choice.k else NO_DRAFT

    def _scored(self, view: StepView, draft: IntArray) -> BoolArray | None:
        """The decoding requests this step scores counterfactually with the n-gram draft (the
        plugin's picks; the requests are held from their first decoding step), but for those
        it serves: they are measured for real."""
        if self.picks is None:
            return None
        keys = [str(r) for r in view.request_ids.tolist()]
        for key, c in zip(keys, view.classes.tolist(), strict=True):
            if key not in self.picks:
                self.picks.add(key, self.info.classes[c])
        at = {key: i for i, key in enumerate(keys)}
        score = np.zeros(len(keys), dtype=np.bool_)
        score[[i for _, i in self.picks.pick(at.get, view.batch_size)]] = True
        score &= draft != self.ngram
        return score

    # --- the plugin's aggregation and the report lap -----------------------------------------
    def observe(self, o: StepOutcome) -> None:
        info, record = self.info, self.stats.record_verification
        names, drafts, cls = info.classes, info.drafts, o.view.classes
        spec = np.flatnonzero(o.assignment.k > 0)
        # Scored as K drafted (the plugin's ``on_output``, and its ``on_drafts`` for a request
        # cut to none): a cut tail counts as rejected; positions the drafter stopped before were
        # never drafted (counting them rejected fed the stop its own stops: the class's
        # acceptance ahead fell, and with it the next pass's worth).
        asked = o.assignment.k if o.assignment.drafted is None else o.assignment.drafted
        scored = np.flatnonzero(asked > 0)
        for c, d, k, verified, accepted in zip(
                cls[scored].tolist(), o.assignment.draft[scored].tolist(),
                asked[scored].tolist(), o.assignment.k[scored].tolist(),
                o.accepted[scored].tolist(), strict=True):
            record(names[c], drafts[d], k, accepted, drafted=verified)
        if o.view.slots is not None:
            self._record_confidences(o, o.view.slots, spec)
        if o.counterfactual_accepted is not None and self.ngram is not None:
            scored = np.flatnonzero(o.counterfactual_accepted >= 0)
            for c, accepted in zip(cls[scored].tolist(),
                                   o.counterfactual_accepted[scored].tolist(), strict=True):
                record(names[c], drafts[self.ngram], info.max_k, accepted, counterfactual=True)
        if not o.view.prefill_tokens:  # the plugin times decode steps only
            self._record_step(o)
        self._decoded_at[np.unique(cls), self.core.config.bucket_of(o.view.batch_size)] = (
            o.view.now)
        for f in o.finished:
            self.stats.record_finished(names[f.traffic_class], "", f.prompt_tokens,
                                       f.output_tokens, f.drafted_tokens, f.accepted_tokens,
                                       f.latency_seconds)
            if self.picks is not None:
                self.picks.forget(str(f.request_id))
        now = o.view.now + o.seconds
        if now - self._last_report >= self.interval:
            self._report(now, running=o.view.batch_size)

    def _record_confidences(self, o: StepOutcome, slots: TokenSlots, spec: IntArray) -> None:
        """As the plugin's ``on_output``: the drafter's confidence in each token a request
        verified, beside how many the target accepted (the stats censor after the first
        rejection); transformed requests apart."""
        names, transformed = self.info.classes, self._transformed
        drafter, record = self.info.drafts[slots.draft], self.stats.record_confidences
        mine = spec[o.assignment.draft[spec] == slots.draft]
        for i, c, k, accepted in zip(mine.tolist(), o.view.classes[mine].tolist(),
                                     o.assignment.k[mine].tolist(), o.accepted[mine].tolist(),
                                     strict=True):
            record(names[c], drafter, slots.confidence[i, :k].tolist(), accepted, transformed[c])

    def _record_step(self, o: StepOutcome) -> None:
        """The step under the model draft with the most passes, and its passes (the drafter's K)
        and proposed tokens."""
        info = self.info
        model = [d for d in range(len(info.drafts)) if info.draft_is_model[d] and o.draft_passes[d]]
        top = max(model, key=lambda d: o.draft_passes[d]) if model else None
        context = o.view.context_tokens if self.reads_context else None
        if top is None:
            self.stats.record_step(o.view.batch_size, o.verified_tokens, 0, "", 0, o.seconds,
                                   context)
        else:
            self.stats.record_step(o.view.batch_size, o.verified_tokens,
                                   int(o.draft_tokens[top]), info.drafts[top],
                                   int(o.draft_passes[top]), o.seconds, context)

    def _report(self, now: float, running: int) -> None:
        self._now = now
        self._sequence += 1
        report = self.stats.drain(running).report(self._sequence, self.view.version, 0,
                                                  self.view.bucket_bounds)
        self.core.ingest(ENGINE_ID, report, now)
        for event in self.core.decide(now):
            ci = self._class_index.get(event.decision.traffic_class)
            if ci is None or event.previous is None:
                continue
            b = event.decision.bucket
            if self._decoded_at[ci, b] <= self._changed_at[ci, b]:
                self.idle_decision_changes += 1
            self._changed_at[ci, b] = now
        self.view.heard_from_controller()  # the report's result
        if self.core.version != self._applied:
            self.push_policy(now)
        self._last_report = now
        self.reports += 1
