"""specpilot in the simulator: the real ``ControllerCore`` behind the engine plugin's report path.

The adapter plays the plugin's part (nothing of the controller is re-implemented): it applies the
pushed decisions per (class, batch bucket) with stable per-request probing, aggregates per-step
counts into the plugin's report records (acceptance histograms per (class, draft, K),
counterfactual n-gram histograms for a share of requests, step timings per (batch bucket, model
draft, passes), finished-request summaries), and every report interval of simulated time hands an
``EngineReport`` to ``ControllerCore.ingest`` and then ``decide``, as the server does.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from benchmarks.sim.step import NO_DRAFT, Assignment, EngineInfo, IntArray, StepOutcome, StepView
from benchmarks.sim.truth import StepCost
from controller.core.controller import ControllerCore
from controller.settings import core_config, load_settings
from engine_plugin.policy_view import PROBE_EPOCH_SECONDS
from engine_plugin.profile import PROFILE_BATCH_SIZES, PROFILE_KS
from specpilot.contract.pricing import StepComposer, adjustable
from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    RequestSummaryRecord,
    StepProfile,
    StepTimingRecord,
)

ENGINE_ID = "sim-engine-0"
_VOCAB = "simulated-vocabulary"


def _probe_u(request_ids: np.ndarray, epoch: int) -> np.ndarray:
    """A uniform per request and probe epoch (Knuth's multiplicative hash), as the plugin draws
    it (``engine_plugin.policy_view``: stable within an epoch, redrawn every epoch)."""
    keys = request_ids.astype(np.uint64) * np.uint64(1_000_003) + np.uint64(epoch)
    return ((keys * np.uint64(2654435761)) % np.uint64(2**32)).astype(np.float64) / 2**32


def start_up_profile(info: EngineInfo, cost: StepCost,
                     scale: tuple[float, float] = (1.0, 1.0)) -> tuple[StepProfile, ...]:
    """What the plugin's start-up profile would send for this engine (``engine_plugin.profile``:
    the same batch sizes and K, uniform decode steps, the first model draft running K passes),
    timed by the scenario's step cost without noise (the plugin keeps the fastest of five),
    times ``scale`` (without speculation, with): a real profile's bias."""
    model = next((d for d, m in enumerate(info.draft_is_model) if m), None)
    out = []
    for b in (b for b in PROFILE_BATCH_SIZES if b <= info.max_batch):
        for k in (k for k in PROFILE_KS if k <= info.max_k and (k == 0 or model is not None)):
            passes = np.zeros(len(info.drafts))
            draft_tokens = np.zeros(len(info.drafts))
            if k and model is not None:
                passes[model], draft_tokens[model] = k, k * b
            seconds = cost.seconds(b, b * (1 + k), passes, draft_tokens) * scale[1 if k else 0]
            out.append(StepProfile(b, b * (1 + k), info.drafts[model] if k and model is not None
                                   else "", k, seconds))
    return tuple(out)


class SpecPilotPolicy:
    name = "specpilot"

    def __init__(self, info: EngineInfo, settings_overrides: dict[str, Any], seed: int,
                 report_interval_seconds: float,
                 step_profile: tuple[StepProfile, ...] = ()) -> None:
        self.info = info
        offline = [c for c, off in zip(info.classes, info.offline, strict=True) if off]
        overrides = dict(settings_overrides)
        overrides["offline_classes"] = sorted(set(overrides.get("offline_classes", [])) |
                                              set(offline))
        overrides.setdefault("seed", seed)
        self.settings = load_settings(None, **overrides)
        self.core = ControllerCore(core_config(self.settings),
                                   np.random.default_rng(self.settings.seed))
        self.interval = report_interval_seconds
        self._step_rng = np.random.default_rng([seed, 5])  # whole-step probe draws
        kinds = [DraftKind.MODEL if m else DraftKind.NGRAM for m in info.draft_is_model]
        self.has_ngram = DraftKind.NGRAM in kinds
        self.wants_counterfactual = self.has_ngram
        self.ngram = kinds.index(DraftKind.NGRAM) if self.has_ngram else None
        self.core.connect_engine(EngineHello(
            engine_id=ENGINE_ID, model="simulated-target", target_vocab_hash=_VOCAB,
            drafts=tuple(DraftSpec(n, kind, info.max_k, _VOCAB)
                         for n, kind in zip(info.drafts, kinds, strict=True)),
            max_k=info.max_k, per_request_k=True, batch_wide_k=True,
            ngram_counterfactual=self.has_ngram, step_probes=True, step_composition=True,
            engine_version="simulated",
            plugin_version="simulated", max_batch_size=info.max_batch,
            step_profile=step_profile), now=0.0)
        self.core.decide(0.0)
        self._draft_index = {n: i for i, n in enumerate(info.drafts)}
        n_c, n_d, k1 = len(info.classes), len(info.drafts), info.max_k + 1
        n_b = self.core.config.n_buckets
        self._tables = {name: np.zeros((n_c, n_b), dtype=dtype) for name, dtype in (
            ("k", np.int64), ("draft", np.int64), ("probe_rate", np.float64),
            ("probe_k", np.int64), ("probe_draft", np.int64), ("probe_steps", np.bool_))}
        self._refresh()
        self._hist = np.zeros((n_c, n_d, k1, k1), dtype=np.int64)
        self._cf = np.zeros((n_c, k1), dtype=np.int64)
        self._steps: dict[tuple[int, str, int], list[float]] = defaultdict(lambda: [0.0] * 5)
        self._finished: list[RequestSummaryRecord] = []
        self._last_report = 0.0
        self._sequence = 0
        self.reports = 0
        # When each class last decoded in each bucket, and when its decision there last changed:
        # a change with no decoding of the class in the bucket since the previous one is a
        # change without evidence of its own (counted in idle_decision_changes).
        self._decoded_at = np.full((n_c, n_b), -np.inf)
        self._changed_at = np.zeros((n_c, n_b))
        self._class_index = {c: i for i, c in enumerate(info.classes)}
        self.idle_decision_changes = 0

    # --- applying the policy ---------------------------------------------------------------
    def _refresh(self) -> None:
        """Dense (class, bucket) tables of the decisions in force, like the plugin's view, and
        the composition sent with them."""
        defaults = {d.bucket: d for d in self.core.default_decisions()}
        t = self._tables
        # Per (class, bucket): the decision's class and whether it is re-picked per step.
        self._decided: dict[tuple[int, int], tuple[str, bool]] = {}
        composition = self.core.composition()
        self._composer = StepComposer(composition) if composition is not None else None
        for ci, name in enumerate(self.info.classes):
            for b in range(self.core.config.n_buckets):
                d = self.core.decision(name, b) or defaults[b]
                self._decided[ci, b] = (d.traffic_class, adjustable(d.reason, d.probe_rate > 0))
                t["k"][ci, b] = d.k
                t["draft"][ci, b] = self._draft_index.get(d.draft, NO_DRAFT)
                t["probe_rate"][ci, b] = d.probe_rate
                t["probe_k"][ci, b] = d.probe_k
                t["probe_draft"][ci, b] = self._draft_index.get(d.probe_draft, NO_DRAFT)
                t["probe_steps"][ci, b] = d.probe_steps
        self._version = self.core.version

    def assign(self, view: StepView) -> Assignment:
        b = self.core.config.bucket_of(view.batch_size)
        t, cls = self._tables, view.classes
        k, draft = t["k"][cls, b].copy(), t["draft"][cls, b].copy()
        epoch = int(view.now // PROBE_EPOCH_SECONDS)
        # Per request and probe epoch, or (probe_steps) one draw per class and step for all
        # of its requests, as the plugin's PolicyLookup draws them.
        u = np.where(t["probe_steps"][cls, b],
                     self._step_rng.random(len(self.info.classes))[cls],
                     _probe_u(view.request_ids, epoch))
        probe = (t["probe_k"][cls, b] > 0) & (u < t["probe_rate"][cls, b])
        k[probe], draft[probe] = t["probe_k"][cls, b][probe], t["probe_draft"][cls, b][probe]
        if self._composer is not None:
            self._compose(self._composer, view, b, k, draft)
        return Assignment(np.where(k > 0, draft, NO_DRAFT), k)

    def _compose(self, composer: StepComposer, view: StepView, b: int, k: IntArray,
                 draft: IntArray) -> None:
        """The plugin's per-step re-pick (``PolicyLookup.compose``): the settled classes' arms
        for the classes and counts of this step, in place."""
        counts = np.bincount(view.classes, minlength=len(self.info.classes))
        present = np.flatnonzero(counts)
        t, drafts = self._tables, self.info.drafts
        step = []
        for ci in present:
            name, movable = self._decided[ci, b]
            arm = (drafts[t["draft"][ci, b]] if t["k"][ci, b] else "", int(t["k"][ci, b]))
            step.append((name, arm, movable, int(counts[ci])))
        changed = composer.repick(step, view.batch_size)
        for ci in present:
            if (new := changed.get(self._decided[ci, b][0])) is not None:
                mine = view.classes == ci
                k[mine], draft[mine] = new[1], self._draft_index[new[0]] if new[1] else NO_DRAFT

    # --- the plugin's aggregation and the report lap -----------------------------------------
    def observe(self, o: StepOutcome) -> None:
        info, cls = self.info, o.view.classes
        k, draft = o.assignment.k, o.assignment.draft
        spec = k > 0
        np.add.at(self._hist, (cls[spec], draft[spec], k[spec], o.accepted[spec]), 1)
        if o.counterfactual_accepted is not None:
            scored = o.counterfactual_accepted >= 0
            np.add.at(self._cf, (cls[scored], o.counterfactual_accepted[scored]), 1)
        if not o.view.prefill_tokens:  # the plugin times decode steps only
            self._record_step(o)
        self._decoded_at[np.unique(cls), self.core.config.bucket_of(o.view.batch_size)] = (
            o.view.now)
        for f in o.finished:
            self._finished.append(RequestSummaryRecord(
                info.classes[f.traffic_class], "", f.prompt_tokens, f.output_tokens,
                f.drafted_tokens, f.accepted_tokens, f.latency_seconds))
        now = o.view.now + o.seconds
        if now - self._last_report >= self.interval:
            self._report(now, running=o.view.batch_size)

    def _record_step(self, o: StepOutcome) -> None:
        """Step sums per (batch bucket, model draft with the most passes, passes)."""
        info = self.info
        model = [d for d in range(len(info.drafts)) if info.draft_is_model[d] and o.draft_passes[d]]
        top = max(model, key=lambda d: o.draft_passes[d]) if model else None
        key = (self.core.config.bucket_of(o.view.batch_size),
               info.drafts[top] if top is not None else "",
               int(o.draft_passes[top]) if top is not None else 0)
        s = self._steps[key]
        s[0] += 1
        s[1] += o.view.batch_size
        s[2] += o.verified_tokens
        s[3] += int(o.draft_tokens[top]) if top is not None else 0
        s[4] += o.seconds

    def _report(self, now: float, running: int) -> None:
        info = self.info
        acceptance = []
        for ci, di, k in zip(*np.nonzero(self._hist.sum(axis=3)), strict=True):
            acceptance.append(AcceptanceRecord(
                info.classes[ci], info.drafts[di], int(k),
                tuple(int(x) for x in self._hist[ci, di, k, : k + 1])))
        if self.ngram is not None:
            for ci in np.flatnonzero(self._cf.sum(axis=1)):
                acceptance.append(AcceptanceRecord(
                    info.classes[ci], info.drafts[self.ngram], info.max_k,
                    tuple(int(x) for x in self._cf[ci]), counterfactual=True))
        timings = tuple(
            StepTimingRecord(b, d, k, int(s[0]), int(s[1]), int(s[2]), int(s[3]), s[4])
            for (b, d, k), s in sorted(self._steps.items()))
        self._sequence += 1
        report = EngineReport(self._sequence, now - self._last_report, self.core.version,
                              tuple(acceptance), tuple(self._finished), timings,
                              running_requests=running)
        self.core.ingest(ENGINE_ID, report, now)
        for event in self.core.decide(now):
            ci = self._class_index.get(event.decision.traffic_class)
            if ci is None or event.previous is None:
                continue
            b = event.decision.bucket
            if self._decoded_at[ci, b] <= self._changed_at[ci, b]:
                self.idle_decision_changes += 1
            self._changed_at[ci, b] = now
        if self.core.version != self._version:
            self._refresh()
        self._hist[:] = 0
        self._cf[:] = 0
        self._steps.clear()
        self._finished.clear()
        self._last_report = now
        self.reports += 1
