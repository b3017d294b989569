"""A discrete-event model of a continuous-batching engine with speculative decoding.

Each step: admit requests (closed loop: keep ``concurrency`` requests in the system; open loop:
Poisson arrivals), ask the policy for (draft, K) per decoding request, schedule decode tokens first
and prefill chunks in the token budget left (as vLLM's V1 scheduler does), draw how many drafts
each request gets accepted from its true per-position rates, charge the true step cost, and
advance the clock. Drafting follows the engine plugin's batch-wide mode: a model draft runs as
many sequential passes as the largest K asked of it in the step, and proposes sum(K) tokens.

Requests are drawn from their own random stream, so request i has the same class, lengths and
difficulty under every policy (in closed loop it arrives when a slot frees, so its arrival time
depends on the policy). Acceptance draws and step noise come from a second stream.
"""

from __future__ import annotations

import itertools
import math
import time as wallclock
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.sim.scenario import Scenario
from benchmarks.sim.step import (
    NO_DRAFT,
    Assignment,
    EngineInfo,
    FinishedRequest,
    IntArray,
    Policy,
    StepOutcome,
    StepView,
)
from benchmarks.sim.truth import AcceptanceTruth, StepCost

# Share of requests scored counterfactually with the n-gram draft (the plugin's default).
COUNTERFACTUAL_SHARE = 0.25


def engine_info(s: Scenario) -> EngineInfo:
    return EngineInfo(
        classes=tuple(c.name for c in s.classes),
        drafts=tuple(d.name for d in s.drafts),
        draft_is_model=tuple(d.kind == "model" for d in s.drafts),
        max_k=s.engine.max_k,
        max_batch=s.engine.max_batch,
        offline=tuple(c.offline for c in s.classes),
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
    counterfactual: bool = False


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
        u_cls, u_prompt, u_out, u_cf = self.rng.random(4)
        z = float(self.rng.standard_normal())
        ci = int(np.searchsorted(self.shares[phase], u_cls, side="right"))
        ci = min(ci, len(self.s.classes) - 1)
        c = self.s.classes[ci]
        req = _Request(self.next_id, ci, self._length(c.prompt_tokens, u_prompt),
                       self._length(c.output_tokens, u_out), c.spread * z, now,
                       counterfactual=bool(u_cf < COUNTERFACTUAL_SHARE))
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
        wall_seconds=sum(r.wall_seconds for r in runs))


ProgressFn = Callable[[float], None]


class SimEngine:
    def __init__(self, scenario: Scenario, seed: int | None = None) -> None:
        self.s = scenario
        self.seed = scenario.seed if seed is None else seed
        self.info = engine_info(scenario)
        self.truth = AcceptanceTruth(scenario)
        self.cost = StepCost.from_scenario(scenario)

    def run(self, policy: Policy, progress: ProgressFn | None = None) -> RunResult:
        s, info, truth, cost = self.s, self.info, self.truth, self.cost
        started = wallclock.perf_counter()
        rng = np.random.default_rng([self.seed, 3])
        # Counterfactual draws have their own stream: scoring them must not shift the others.
        cf_rng = np.random.default_rng([self.seed, 4])
        traffic = _Traffic(s, self.seed)
        starts = [*s.phase_starts(), s.duration_seconds]
        n_cls, n_drafts, max_k = len(info.classes), len(info.drafts), info.max_k
        ngram = next((i for i, m in enumerate(info.draft_is_model) if not m), None)
        bins = max(1, math.ceil(s.duration_seconds / s.timeline_seconds))
        k_sum, k_n = np.zeros((n_cls, bins)), np.zeros((n_cls, bins))
        b_sum, b_n = np.zeros(bins), np.zeros(bins)
        tok_bins = np.zeros(bins, dtype=np.int64)
        phase_tokens = [0] * len(s.load)
        class_tokens, class_drafted, class_accepted = (np.zeros(n_cls, dtype=np.int64)
                                                       for _ in range(3))
        queue: deque[_Request] = deque()
        running: list[_Request] = []
        now, steps, finished, latency_sum = 0.0, 0, 0, 0.0
        next_arrival: float | None = None
        phase = 0
        last_progress = 0.0

        while now < s.duration_seconds:
            while now >= starts[phase + 1]:
                phase += 1
                next_arrival = None
            p = s.load[phase]
            # --- admission ---
            if p.concurrency is not None:
                while len(queue) + len(running) < p.concurrency:
                    queue.append(traffic.new(now, phase))
            else:
                rate = float(p.arrival_rate_per_second or 0.0)
                if next_arrival is None:
                    next_arrival = traffic.next_arrival(now, rate)
                while next_arrival <= now:
                    queue.append(traffic.new(next_arrival, phase))
                    next_arrival = traffic.next_arrival(next_arrival, rate)
            while queue and len(running) < info.max_batch:
                running.append(queue.popleft())
            if not running:  # idle: jump to the next arrival or phase
                assert next_arrival is not None
                now = min(next_arrival, starts[phase + 1])
                continue

            # --- the policy's choice for decoding requests ---
            decoding = [r for r in running if r.prefill_left == 0]
            budget = s.engine.max_batched_tokens
            ids = np.fromiter((r.rid for r in decoding), dtype=np.int64, count=len(decoding))
            cls = np.fromiter((r.cls for r in decoding), dtype=np.int64, count=len(decoding))
            # Prefill chunks fill what decode leaves; decode asks for at most 1 + max_k each.
            prefill_room = budget - len(decoding) * (1 + max_k)
            prefill_plan: list[tuple[_Request, int]] = []
            for r in running:
                if r.prefill_left and prefill_room > 0:
                    chunk = min(r.prefill_left, prefill_room)
                    prefill_plan.append((r, chunk))
                    prefill_room -= chunk
            prefill_tokens = sum(c for _, c in prefill_plan)
            batch = len(decoding) + len(prefill_plan)
            view = StepView(now, batch, prefill_tokens, ids, cls)
            a = policy.assign(view)
            k = np.clip(a.k, 0, max_k)
            draft = np.where(k > 0, a.draft, NO_DRAFT)
            if np.any((draft == NO_DRAFT) & (k > 0)):
                raise RuntimeError(f"policy {policy.name}: K > 0 without a draft")

            # --- verification draws ---
            accepted = np.zeros(len(decoding), dtype=np.int64)
            spec = np.flatnonzero(k > 0)
            if spec.size:
                offsets = np.array([decoding[i].offset for i in spec])
                rates = truth.request_rates(now, cls[spec], draft[spec], offsets)
                ok = rng.random(rates.shape) < rates
                ok &= np.arange(max_k)[None, :] < k[spec, None]
                accepted[spec] = np.cumprod(ok, axis=1).sum(axis=1)
            cf: IntArray | None = None
            if policy.wants_counterfactual and ngram is not None and len(decoding):
                cf = np.full(len(decoding), -1, dtype=np.int64)
                pick = np.array([r.counterfactual for r in decoding]) & (draft != ngram)
                idx = np.flatnonzero(pick)
                if idx.size:
                    offsets = np.array([decoding[i].offset for i in idx])
                    rates = truth.request_rates(now, cls[idx], np.full(idx.size, ngram), offsets)
                    ok = cf_rng.random(rates.shape) < rates
                    cf[idx] = np.cumprod(ok, axis=1).sum(axis=1)

            # --- cost ---
            passes = np.zeros(n_drafts, dtype=np.int64)
            dtok = np.zeros(n_drafts, dtype=np.int64)
            for d in range(n_drafts):
                mine = k[draft == d]
                if mine.size:
                    passes[d], dtok[d] = int(mine.max()), int(mine.sum())
            verified = int(len(decoding) + k.sum()) + prefill_tokens
            seconds = cost.seconds(batch, verified, passes, dtok)
            if cost.noise:
                seconds *= float(np.exp(cost.noise * rng.standard_normal()))

            # --- advance ---
            t_end = now + seconds
            remaining = np.fromiter((r.remaining for r in decoding), dtype=np.int64,
                                    count=len(decoding))
            emitted = np.minimum(accepted + 1, remaining)
            done: list[FinishedRequest] = []
            for i, r in enumerate(decoding):
                r.remaining -= int(emitted[i])
                r.drafted += int(k[i])
                r.accepted += int(accepted[i])
            for r, chunk in prefill_plan:
                r.prefill_left -= chunk
                if r.prefill_left == 0:  # the prefill's last chunk samples the first token
                    r.remaining -= 1
                    class_tokens[r.cls] += 1
                    phase_tokens[phase] += 1
            keep = []
            for r in running:
                if r.remaining <= 0 and r.prefill_left == 0:
                    finished += 1
                    latency_sum += t_end - r.arrived
                    done.append(FinishedRequest(r.rid, r.cls, r.prompt, r.output, r.drafted,
                                                r.accepted, t_end - r.arrived))
                else:
                    keep.append(r)
            running = keep
            np.add.at(class_tokens, cls, emitted)
            np.add.at(class_drafted, cls, k)
            np.add.at(class_accepted, cls, accepted)
            phase_tokens[phase] += int(emitted.sum())
            b = min(int(now / s.timeline_seconds), bins - 1)
            np.add.at(k_sum[:, b], cls, k)
            np.add.at(k_n[:, b], cls, 1)
            b_sum[b] += batch
            tok_bins[b] += int(emitted.sum())
            b_n[b] += 1
            steps += 1
            policy.observe(StepOutcome(view, Assignment(draft, k), seconds, accepted, emitted,
                                       verified, passes, dtok, tuple(done), cf))
            now = t_end
            if progress is not None and now - last_progress >= 1.0:
                last_progress = now
                progress(min(now, s.duration_seconds))
        if progress is not None:
            progress(s.duration_seconds)

        phase_seconds = [b - a for a, b in itertools.pairwise(starts)]
        names = list(info.classes)
        return RunResult(
            scenario=s.name, policy=policy.name, duration_seconds=s.duration_seconds,
            tokens=int(sum(phase_tokens)), steps=steps, finished=finished,
            mean_latency_seconds=latency_sum / finished if finished else 0.0,
            phase_labels=[s.phase_label(i) for i in range(len(s.load))],
            phase_tokens=phase_tokens, phase_seconds=phase_seconds,
            class_tokens={c: int(class_tokens[i]) for i, c in enumerate(names)},
            class_drafted={c: int(class_drafted[i]) for i, c in enumerate(names)},
            class_accepted={c: int(class_accepted[i]) for i, c in enumerate(names)},
            timeline_seconds=s.timeline_seconds,
            k_timeline={c: [float(k_sum[i, j] / k_n[i, j]) if k_n[i, j] else None
                            for j in range(bins)] for i, c in enumerate(names)},
            batch_timeline=[float(b_sum[j] / b_n[j]) if b_n[j] else None for j in range(bins)],
            tokens_timeline=tok_bins.tolist(),
            wall_seconds=wallclock.perf_counter() - started,
        )
