"""A discrete-event model of a continuous-batching engine with speculative decoding.

Each step: admit requests (closed loop: keep ``concurrency`` requests in the system; open loop:
Poisson arrivals), ask the policy for (draft, K) per decoding request, schedule decode tokens first
and prefill chunks in the token budget left (as vLLM's V1 scheduler does), draw how many drafts
each request gets accepted from its true per-position rates, charge the true step cost, and
advance the clock. Drafting follows the engine plugin's batch-wide mode: a model draft runs as
many sequential passes as the largest K asked of it in the step, and proposes sum(K) tokens.

Requests are drawn from their own random stream, so request i has the same class, lengths and
difficulty under every policy (in closed loop it arrives when a slot frees, so its arrival time
depends on the policy). Acceptance draws and step noise come from a second stream; per-token
confidence, for the policies that read it, from a third (benchmarks/sim/confidence.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time as wallclock
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.sim.confidence import ConfidenceModel, reads_confidence
from benchmarks.sim.scenario import Scenario
from benchmarks.sim.step import (
    NO_DRAFT,
    Assignment,
    BoolArray,
    EngineInfo,
    FinishedRequest,
    FloatArray,
    IntArray,
    Policy,
    StepOutcome,
    StepView,
    TokenSlots,
)
from benchmarks.sim.truth import AcceptanceTruth, StepCost


def engine_info(s: Scenario) -> EngineInfo:
    return EngineInfo(
        classes=tuple(c.name for c in s.classes),
        drafts=tuple(d.name for d in s.drafts),
        draft_is_model=tuple(d.kind == "model" for d in s.drafts),
        max_k=s.engine.max_k,
        max_batch=s.engine.max_batch,
        offline=tuple(c.offline for c in s.classes),
        transformed=tuple(c.confidence.transformed for c in s.classes),
    )


@dataclass
class _Request:
    rid: int
    cls: int
    prompt: int
    output: int
    offset: float  # logit offset: this request's difficulty
    arrived: float
    prefill_left: int = 0
    remaining: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def context(self) -> int:
        """The tokens its KV cache holds: the prompt prefilled so far, then every generated
        token but the newest (the next step computes its KV)."""
        if self.prefill_left:
            return self.prompt - self.prefill_left
        return self.prompt + max(self.output - self.remaining - 1, 0)


class _Traffic:
    """Request i's attributes, identical for every policy run on the same scenario and seed."""

    def __init__(self, s: Scenario, seed: int) -> None:
        self.s = s
        self.rng = np.random.default_rng([seed, 1])
        self.arrival_rng = np.random.default_rng([seed, 2])
        self.next_id = 0
        base = np.array([c.share for c in s.classes], dtype=np.float64)
        self.shares: list[np.ndarray] = []
        for p in s.load:
            if p.shares is None:
                w = base
            else:
                w = np.array([p.shares.get(c.name, 0.0) for c in s.classes], dtype=np.float64)
            self.shares.append(np.cumsum(w / w.sum()))

    def _length(self, spec: int | list[int], u: float) -> int:
        if isinstance(spec, int):
            return spec
        lo, hi = spec
        return lo + min(int(u * (hi - lo + 1)), hi - lo)

    def new(self, now: float, phase: int) -> _Request:
        # Four draws a request (the fourth, once a counterfactual point, unused): request i
        # stays the request i of earlier runs.
        u_cls, u_prompt, u_out, _ = self.rng.random(4)
        z = float(self.rng.standard_normal())
        ci = int(np.searchsorted(self.shares[phase], u_cls, side="right"))
        ci = min(ci, len(self.s.classes) - 1)
        c = self.s.classes[ci]
        req = _Request(self.next_id, ci, self._length(c.prompt_tokens, u_prompt),
                       self._length(c.output_tokens, u_out), c.spread * z, now)
        req.prefill_left, req.remaining = req.prompt, req.output
        self.next_id += 1
        return req

    def next_arrival(self, now: float, rate: float) -> float:
        return now + float(self.arrival_rng.exponential(1.0 / rate))


@dataclass
class RunResult:
    scenario: str
    policy: str
    duration_seconds: float
    tokens: int
    steps: int
    finished: int
    mean_latency_seconds: float
    phase_labels: list[str]
    phase_tokens: list[int]
    phase_seconds: list[float]
    class_tokens: dict[str, int]
    class_drafted: dict[str, int]
    class_accepted: dict[str, int]
    timeline_seconds: float
    # Per class, per timeline bin: mean K over the class's decoding request-steps (None: idle).
    k_timeline: dict[str, list[float | None]]
    batch_timeline: list[float | None]
    tokens_timeline: list[int]  # tokens emitted per timeline bin
    wall_seconds: float = 0.0
    # Decision changes for a (class, bucket) in which the class did not decode since the
    # previous change (policies that keep a decision log; None for the others).
    idle_decision_changes: int | None = None

    @property
    def throughput(self) -> float:
        return self.tokens / self.duration_seconds

    def phase_throughput(self) -> list[float]:
        return [t / s for t, s in zip(self.phase_tokens, self.phase_seconds, strict=True)]

    def class_throughput(self) -> dict[str, float]:
        return {c: t / self.duration_seconds for c, t in self.class_tokens.items()}

    def class_acceptance(self) -> dict[str, float | None]:
        return {c: (self.class_accepted[c] / d if (d := self.class_drafted[c]) else None)
                for c in self.class_tokens}


def pool_runs(runs: list[RunResult]) -> RunResult:
    """One policy's runs on several seeds as one: counts and times summed (throughputs are then
    pooled ratios), latency weighted by finished requests, timelines from the first run."""
    first = runs[0]
    if len(runs) == 1:
        return first
    finished = sum(r.finished for r in runs)

    def total(attr: str) -> dict[str, int]:
        return {c: sum(getattr(r, attr)[c] for r in runs) for c in getattr(first, attr)}

    return RunResult(
        scenario=first.scenario, policy=first.policy,
        duration_seconds=sum(r.duration_seconds for r in runs),
        tokens=sum(r.tokens for r in runs), steps=sum(r.steps for r in runs), finished=finished,
        mean_latency_seconds=(sum(r.mean_latency_seconds * r.finished for r in runs) / finished
                              if finished else 0.0),
        phase_labels=first.phase_labels,
        phase_tokens=[sum(x) for x in zip(*(r.phase_tokens for r in runs), strict=True)],
        phase_seconds=[sum(x) for x in zip(*(r.phase_seconds for r in runs), strict=True)],
        class_tokens=total("class_tokens"), class_drafted=total("class_drafted"),
        class_accepted=total("class_accepted"), timeline_seconds=first.timeline_seconds,
        k_timeline=first.k_timeline, batch_timeline=first.batch_timeline,
        tokens_timeline=first.tokens_timeline,
        wall_seconds=sum(r.wall_seconds for r in runs),
        idle_decision_changes=(None if first.idle_decision_changes is None
                               else sum(r.idle_decision_changes or 0 for r in runs)))


ProgressFn = Callable[[float], None]


def _phase_bounds(s: Scenario) -> list[float]:
    """Phase i runs from bounds[i] to bounds[i + 1]; the last bound is the run's end."""
    return [*s.phase_starts(), s.duration_seconds]


@dataclass
class _Tally:
    """What a run counts, added to after each step; ``result`` turns it into a RunResult.

    Counts are per class index (tokens emitted, drafts proposed and accepted) and per load phase
    (tokens); the timelines sum per bin of ``timeline_seconds`` (binned by the step's start):
    K and request-steps per class, batch size and steps, tokens emitted."""

    timeline_seconds: float
    phase_tokens: list[int]
    class_tokens: IntArray
    class_drafted: IntArray
    class_accepted: IntArray
    k_sum: FloatArray  # (classes, bins)
    k_n: FloatArray  # (classes, bins)
    batch_sum: FloatArray
    batch_n: FloatArray
    bin_tokens: IntArray
    steps: int = 0
    finished: int = 0
    latency_sum: float = 0.0

    @classmethod
    def empty(cls, s: Scenario) -> _Tally:
        n_cls, bins = len(s.classes), max(1, math.ceil(s.duration_seconds / s.timeline_seconds))
        def counts() -> IntArray:
            return np.zeros(n_cls, dtype=np.int64)

        return cls(s.timeline_seconds, [0] * len(s.load), counts(), counts(), counts(),
                   np.zeros((n_cls, bins)), np.zeros((n_cls, bins)),
                   np.zeros(bins), np.zeros(bins), np.zeros(bins, dtype=np.int64))

    def first_token(self, cls: int, phase: int) -> None:
        """A prefill's last chunk sampled its request's first token."""
        self.class_tokens[cls] += 1
        self.phase_tokens[phase] += 1

    def finish(self, latency: float) -> None:
        self.finished += 1
        self.latency_sum += latency

    def step(self, now: float, phase: int, batch: int, cls: IntArray, k: IntArray,
             accepted: IntArray, emitted: IntArray) -> None:
        """A step that started at ``now``; arrays are per decoding request."""
        np.add.at(self.class_tokens, cls, emitted)
        np.add.at(self.class_drafted, cls, k)
        np.add.at(self.class_accepted, cls, accepted)
        self.phase_tokens[phase] += int(emitted.sum())
        b = min(int(now / self.timeline_seconds), self.bin_tokens.size - 1)
        np.add.at(self.k_sum[:, b], cls, k)
        np.add.at(self.k_n[:, b], cls, 1)
        self.batch_sum[b] += batch
        self.bin_tokens[b] += int(emitted.sum())
        self.batch_n[b] += 1
        self.steps += 1

    def result(self, s: Scenario, policy: str, wall_seconds: float) -> RunResult:
        names = [c.name for c in s.classes]

        def per_class(counts: IntArray) -> dict[str, int]:
            return {c: int(counts[i]) for i, c in enumerate(names)}

        def mean(total: FloatArray, n: FloatArray) -> list[float | None]:
            return [float(total[j] / n[j]) if n[j] else None for j in range(n.size)]

        return RunResult(
            scenario=s.name, policy=policy, duration_seconds=s.duration_seconds,
            tokens=int(sum(self.phase_tokens)), steps=self.steps, finished=self.finished,
            mean_latency_seconds=self.latency_sum / self.finished if self.finished else 0.0,
            phase_labels=[s.phase_label(i) for i in range(len(s.load))],
            phase_tokens=self.phase_tokens,
            phase_seconds=[b - a for a, b in itertools.pairwise(_phase_bounds(s))],
            class_tokens=per_class(self.class_tokens),
            class_drafted=per_class(self.class_drafted),
            class_accepted=per_class(self.class_accepted),
            timeline_seconds=s.timeline_seconds,
            k_timeline={c: mean(self.k_sum[i], self.k_n[i]) for i, c in enumerate(names)},
            batch_timeline=mean(self.batch_sum, self.batch_n),
            tokens_timeline=self.bin_tokens.tolist(),
            wall_seconds=wall_seconds,
        )


class _Admission:
    """The requests in the system, waiting (``queue``) or ``running``, fed by the load phases:
    closed loop keeps ``concurrency`` in the system, open loop admits Poisson arrivals; a phase
    change restarts the arrival clock."""

    def __init__(self, s: Scenario, traffic: _Traffic, max_batch: int) -> None:
        self.s, self.traffic, self.max_batch = s, traffic, max_batch
        self.bounds = _phase_bounds(s)
        self.phase = 0
        self.next_arrival: float | None = None
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []

    def admit(self, now: float) -> None:
        """Enter the phase ``now`` is in, add the requests that arrived, and start what fits."""
        while now >= self.bounds[self.phase + 1]:
            self.phase += 1
            self.next_arrival = None
        p = self.s.load[self.phase]
        if p.concurrency is not None:
            while len(self.queue) + len(self.running) < p.concurrency:
                self.queue.append(self.traffic.new(now, self.phase))
        else:
            rate = float(p.arrival_rate_per_second or 0.0)
            if self.next_arrival is None:
                self.next_arrival = self.traffic.next_arrival(now, rate)
            while self.next_arrival <= now:
                self.queue.append(self.traffic.new(self.next_arrival, self.phase))
                self.next_arrival = self.traffic.next_arrival(self.next_arrival, rate)
        while self.queue and len(self.running) < self.max_batch:
            self.running.append(self.queue.popleft())

    def idle_until(self) -> float:
        """With nothing running (open loop only): the next arrival or phase change."""
        assert self.next_arrival is not None
        return min(self.next_arrival, self.bounds[self.phase + 1])

    def retire(self, t_end: float, tally: _Tally) -> tuple[FinishedRequest, ...]:
        """Remove the requests done by ``t_end`` (all tokens out, prefill complete)."""
        done: list[FinishedRequest] = []
        keep = []
        for r in self.running:
            if r.remaining <= 0 and r.prefill_left == 0:
                tally.finish(t_end - r.arrived)
                done.append(FinishedRequest(r.rid, r.cls, r.prompt, r.output, r.drafted,
                                            r.accepted, t_end - r.arrived))
            else:
                keep.append(r)
        self.running = keep
        return tuple(done)


@dataclass(frozen=True)
class _Plan:
    """A step's batch: the decoding requests (``view``'s arrays follow their order) and the
    prefill chunks scheduled in the token budget they leave."""

    decoding: list[_Request]
    prefill: list[tuple[_Request, int]]
    view: StepView


@dataclass(frozen=True)
class _Charge:
    """What a step costs: its seconds (noise included), target tokens, and per draft the
    sequential passes and proposed tokens."""

    seconds: float
    verified: int
    passes: IntArray
    draft_tokens: IntArray


class SimEngine:
    def __init__(self, scenario: Scenario, seed: int | None = None) -> None:
        self.s = scenario
        self.seed = scenario.seed if seed is None else seed
        self.info = engine_info(scenario)
        self.truth = AcceptanceTruth(scenario)
        self.cost = StepCost.from_scenario(scenario)
        self.ngram = next((i for i, m in enumerate(self.info.draft_is_model) if not m), None)
        self.confidence = ConfidenceModel([c.confidence for c in scenario.classes])

    def run(self, policy: Policy, progress: ProgressFn | None = None) -> RunResult:
        """Run ``policy`` for the scenario's duration; ``progress`` gets the simulated time about
        once per simulated second and at the end."""
        started = wallclock.perf_counter()
        rng = np.random.default_rng([self.seed, 3])
        # Counterfactual draws have their own stream: scoring them must not shift the others.
        cf_rng = np.random.default_rng([self.seed, 4])
        conf_rng = np.random.default_rng([self.seed, 5]) if reads_confidence(policy) else None
        reqs = _Admission(self.s, _Traffic(self.s, self.seed), self.info.max_batch)
        tally = _Tally.empty(self.s)
        now, last_progress = 0.0, 0.0
        while now < self.s.duration_seconds:
            reqs.admit(now)
            if not reqs.running:
                now = reqs.idle_until()
                continue
            now = self._step(policy, now, reqs, tally, rng, cf_rng, conf_rng)
            if progress is not None and now - last_progress >= 1.0:
                last_progress = now
                progress(min(now, self.s.duration_seconds))
        if progress is not None:
            progress(self.s.duration_seconds)
        return dataclasses.replace(
            tally.result(self.s, policy.name, wallclock.perf_counter() - started),
            idle_decision_changes=getattr(policy, "idle_decision_changes", None))

    def _step(self, policy: Policy, now: float, reqs: _Admission, tally: _Tally,
              rng: np.random.Generator, cf_rng: np.random.Generator,
              conf_rng: np.random.Generator | None) -> float:
        """One engine step from ``now`` on the running requests: plan, assign, verify, charge,
        emit, retire, count, tell the policy. Returns the time the step ends."""
        plan = self._plan(now, reqs.running, conf_rng)
        draft, k, score, drafted = self._assign(policy, plan.view)
        decoding, cls = plan.decoding, plan.view.classes
        accepted = np.zeros(len(decoding), dtype=np.int64)
        spec = np.flatnonzero(k > 0)
        if spec.size:
            accepted[spec] = self._accepted(rng, now, plan, spec, draft[spec], k[spec],
                                            plan.view.slots)
        cf: IntArray | None = None
        if score is not None and self.ngram is not None:
            cf = self._counterfactual(cf_rng, now, plan, score, self.ngram)
        charge = self._charge(rng, plan, draft, k, drafted)
        t_end = now + charge.seconds
        emitted = self._emit(plan, k, accepted, reqs.phase, tally)
        done = reqs.retire(t_end, tally)
        tally.step(now, reqs.phase, plan.view.batch_size, cls, k, accepted, emitted)
        policy.observe(StepOutcome(plan.view, Assignment(draft, k, drafted=drafted[1]),
                                   charge.seconds, accepted,
                                   emitted, charge.verified, charge.passes, charge.draft_tokens,
                                   done, cf))
        return t_end

    def _plan(self, now: float, running: list[_Request],
              conf_rng: np.random.Generator | None = None) -> _Plan:
        """Decode first, prefill chunks in the budget left (as vLLM's V1 scheduler does); token
        slots of the engine's first draft when ``conf_rng`` is given."""
        decoding = [r for r in running if r.prefill_left == 0]
        ids = np.fromiter((r.rid for r in decoding), dtype=np.int64, count=len(decoding))
        cls = np.fromiter((r.cls for r in decoding), dtype=np.int64, count=len(decoding))
        # Prefill chunks fill what decode leaves; decode asks for at most 1 + max_k each.
        prefill_room = self.s.engine.max_batched_tokens - len(decoding) * (1 + self.info.max_k)
        prefill: list[tuple[_Request, int]] = []
        for r in running:
            if r.prefill_left and prefill_room > 0:
                chunk = min(r.prefill_left, prefill_room)
                prefill.append((r, chunk))
                prefill_room -= chunk
        prefill_tokens = sum(c for _, c in prefill)
        contexts = np.fromiter((r.context for r in decoding), dtype=np.int64,
                               count=len(decoding))
        context_tokens = int(contexts.sum()) + sum(r.context for r, _ in prefill)
        slots = None
        if conf_rng is not None:
            draft = self.info.primary_draft
            offsets = np.array([r.offset for r in decoding])
            rates = self.truth.request_rates(now, cls, np.full(cls.size, draft), offsets)
            slots = self.confidence.draw(conf_rng, draft, cls, rates)
        view = StepView(now, len(decoding) + len(prefill), prefill_tokens, ids, cls, slots,
                        contexts, context_tokens)
        return _Plan(decoding, prefill, view)

    def _assign(self, policy: Policy, view: StepView
                ) -> tuple[IntArray, IntArray, BoolArray | None, tuple[IntArray, IntArray]]:
        """The policy's (draft, K) per decoding request, K clipped to [0, max_k], the
        requests it scores counterfactually, and what was drafted (draft, tokens proposed, at
        least K): RuntimeError for K > 0 without a draft."""
        a = policy.assign(view)
        k = np.clip(a.k, 0, self.info.max_k)
        draft = np.where(k > 0, a.draft, NO_DRAFT)
        if np.any((draft == NO_DRAFT) & (k > 0)):
            raise RuntimeError(f"policy {policy.name}: K > 0 without a draft")
        if a.drafted is None:
            return draft, k, a.score, (draft, k)
        proposed = np.clip(a.drafted, k, self.info.max_k)
        return draft, k, a.score, (np.where(proposed > 0, a.draft, NO_DRAFT), proposed)

    def _accepted(self, gen: np.random.Generator, now: float, plan: _Plan, idx: IntArray,
                  draft: IntArray, k: IntArray | None, slots: TokenSlots | None = None
                  ) -> IntArray:
        """Drafts accepted for decoding requests ``idx`` (each with ``draft``, proposing ``k``;
        None: max_k), drawn position by position from their true rates until the first miss;
        with ``slots``, from their tokens' own acceptance where they use the slots' draft."""
        offsets = np.array([plan.decoding[i].offset for i in idx])
        rates = self.truth.request_rates(now, plan.view.classes[idx], draft, offsets)
        if slots is not None:
            rates = np.where((draft == slots.draft)[:, None], slots.acceptance[idx], rates)
        ok = gen.random(rates.shape) < rates
        if k is not None:
            ok &= np.arange(self.info.max_k)[None, :] < k[:, None]
        return np.asarray(np.cumprod(ok, axis=1).sum(axis=1), dtype=np.int64)

    def _counterfactual(self, gen: np.random.Generator, now: float, plan: _Plan,
                        score: BoolArray, ngram: int) -> IntArray:
        """What the n-gram draft would have had accepted at max K, for the decoding requests
        the policy scores (``score``); -1 for the others."""
        cf = np.full(len(plan.decoding), -1, dtype=np.int64)
        idx = np.flatnonzero(score)
        if idx.size:
            cf[idx] = self._accepted(gen, now, plan, idx, np.full(idx.size, ngram), None)
        return cf

    def _charge(self, rng: np.random.Generator, plan: _Plan, draft: IntArray,
                k: IntArray, drafted: tuple[IntArray, IntArray]) -> _Charge:
        """The true step cost: a model draft runs as many sequential passes as the most tokens it
        proposed to one sequence (``drafted``: per request the draft and its tokens) and
        proposes their sum; the target verifies 1 + K per decoding request plus the prefill
        chunks, each token over its sequence's context."""
        passes = np.zeros(len(self.info.drafts), dtype=np.int64)
        dtok = np.zeros(len(self.info.drafts), dtype=np.int64)
        for d in range(len(self.info.drafts)):
            mine = drafted[1][drafted[0] == d]
            if mine.size:
                passes[d], dtok[d] = int(mine.max()), int(mine.sum())
        verified = int(len(plan.decoding) + k.sum()) + plan.view.prefill_tokens
        reads = 0.0
        if self.cost.per_context_token:
            assert plan.view.contexts is not None
            reads = float(np.dot(1 + k, plan.view.contexts)
                          + sum(chunk * r.context for r, chunk in plan.prefill))
        seconds = self.cost.seconds(plan.view.batch_size, verified, passes, dtok, reads)
        if self.cost.noise:
            seconds *= float(np.exp(self.cost.noise * rng.standard_normal()))
        return _Charge(seconds, verified, passes, dtok)

    @staticmethod
    def _emit(plan: _Plan, k: IntArray, accepted: IntArray, phase: int,
              tally: _Tally) -> IntArray:
        """Advance the requests: decoding ones emit their accepted drafts plus one (up to what
        they have left), prefilling ones consume their chunk. Returns tokens emitted per decoding
        request; a completed prefill's first token is counted here."""
        remaining = np.fromiter((r.remaining for r in plan.decoding), dtype=np.int64,
                                count=len(plan.decoding))
        emitted = np.minimum(accepted + 1, remaining)
        for i, r in enumerate(plan.decoding):
            r.remaining -= int(emitted[i])
            r.drafted += int(k[i])
            r.accepted += int(accepted[i])
        for r, chunk in plan.prefill:
            r.prefill_left -= chunk
            if r.prefill_left == 0:  # the prefill's last chunk samples the first token
                r.remaining -= 1
                tally.first_token(r.cls, phase)
        return emitted
