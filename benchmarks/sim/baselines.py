"""The field's K policies, each the published rule as its source states it, adapted only as far as
a continuous-batching engine with per-request K requires (said in each docstring).

All of them use the engine's configured draft (the scenario's first) and never switch drafts:
engines configure one speculative method.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from benchmarks.sim.step import NO_DRAFT, Assignment, EngineInfo, StepOutcome, StepView
from specpilot.contract.buckets import bucket_of

# Power-of-two batch-size slots shared by the per-batch-size policies (the controller's default).
BATCH_SLOTS = (1, 2, 4, 8, 16, 32, 64, 128)


class _Base:
    name = ""
    wants_counterfactual = False

    def __init__(self, info: EngineInfo) -> None:
        self.info = info

    def observe(self, outcome: StepOutcome) -> None:
        return None


class Off(_Base):
    """No speculation: every step verifies one token per sequence."""

    name = "off"

    def assign(self, view: StepView) -> Assignment:
        return Assignment.uniform(view.request_ids.size, NO_DRAFT, 0)


class Static(_Base):
    """A fixed K with one draft, as vLLM's ``num_speculative_tokens`` configures it."""

    def __init__(self, info: EngineInfo, k: int, draft: int = 0) -> None:
        super().__init__(info)
        if not 0 <= k <= info.max_k:
            raise ValueError(f"static K={k} outside 0..{info.max_k}")
        self.k, self.draft = k, draft
        suffix = "" if draft == info.primary_draft else f"@{info.drafts[draft]}"
        self.name = f"static:{k}{suffix}"

    def assign(self, view: StepView) -> Assignment:
        return Assignment.uniform(view.request_ids.size, self.draft, self.k)


class BatchTable(_Base):
    """A static K by batch size: vLLM's ``num_speculative_tokens_per_batch_size``, inclusive
    ``(start, end, K)`` ranges expanded as ``build_dynamic_sd_schedule_lookup`` does
    (vllm/v1/spec_decode/dynamic/utils.py: a gap or the sizes past the last range carry the
    previous range's K; sizes below the first range get 0), and TensorRT-LLM's
    ``draft_len_schedule`` (batch size -> draft length)."""

    name = "batch-table"

    def __init__(self, info: EngineInfo, table: Sequence[Sequence[int]]) -> None:
        super().__init__(info)
        self.table = sorted((int(a), int(b), min(int(k), info.max_k)) for a, b, k in table)
        if not self.table:
            raise ValueError("batch table is empty")

    def k_for(self, batch: int) -> int:
        k = 0
        for start, _, range_k in self.table:
            if start > batch:
                break
            k = range_k
        return k

    def assign(self, view: StepView) -> Assignment:
        return Assignment.uniform(view.request_ids.size, self.info.primary_draft,
                                  self.k_for(view.batch_size))


class HFHeuristic(_Base):
    """Hugging Face transformers' assisted generation, ``num_assistant_tokens_schedule=
    "heuristic_transient"`` (transformers/generation/candidate_generator.py,
    ``update_candidate_strategy``): after a step where every candidate was accepted K += 2, else
    K = max(1, K - 1); K starts at ``num_assistant_tokens`` (default 20) for each generate call.
    Here each request is one generate call, so K is per request; it is capped at the engine's
    max K (transformers caps only by the remaining length)."""

    name = "hf-heuristic"
    INITIAL = 20

    def __init__(self, info: EngineInfo) -> None:
        super().__init__(info)
        self.k: dict[int, int] = {}

    def assign(self, view: StepView) -> Assignment:
        start = min(self.INITIAL, self.info.max_k)
        k = np.fromiter((self.k.get(int(r), start) for r in view.request_ids), dtype=np.int64,
                        count=view.request_ids.size)
        return Assignment(np.full(k.size, self.info.primary_draft, dtype=np.int64), k)

    def observe(self, outcome: StepOutcome) -> None:
        ks, acc = outcome.assignment.k, outcome.accepted
        for i, rid in enumerate(outcome.view.request_ids):
            k = int(ks[i])
            if k == 0:
                continue
            self.k[int(rid)] = min(k + 2, self.info.max_k) if acc[i] == k else max(1, k - 1)
        for f in outcome.finished:
            self.k.pop(f.request_id, None)


class SGLangAdaptive(_Base):
    """SGLang's adaptive ``speculative_num_steps`` (sgl-project/sglang PRs #21599, #24055,
    #27508): an exponential moving average of the accepted length per verify round; the steps
    come from a ladder of candidates (default [1, 3, 7]) with target_steps ~ round(ema) + 1, i.e.
    the pivot between rungs r and r+1 is at ema = ladder[r] - 0.5. Shift up one rung when the
    average is at least the pivot plus ``up_hysteresis``, down one rung when it falls below the
    lower pivot minus ``down_hysteresis`` (a dead zone in between); one state per batch-size
    slot (#24055). It never turns speculation off."""

    name = "sglang-adaptive"

    def __init__(self, info: EngineInfo, candidates: Sequence[int] = (1, 3, 7),
                 alpha: float = 0.2, up_hysteresis: float = 0.0,
                 down_hysteresis: float = 0.25) -> None:
        super().__init__(info)
        ladder = sorted({min(c, info.max_k) for c in candidates})
        self.ladder, self.alpha = ladder, alpha
        self.up, self.down = up_hysteresis, down_hysteresis
        start = len(ladder) // 2
        self.rung = {slot: start for slot in range(len(BATCH_SLOTS) + 1)}
        self.ema: dict[int, float | None] = {slot: None for slot in self.rung}

    def slot(self, batch: int) -> int:
        return bucket_of(BATCH_SLOTS, batch)

    def assign(self, view: StepView) -> Assignment:
        k = self.ladder[self.rung[self.slot(view.batch_size)]]
        return Assignment.uniform(view.request_ids.size, self.info.primary_draft, k)

    def observe(self, outcome: StepOutcome) -> None:
        ks = outcome.assignment.k
        if not ks.size or ks.max() == 0:
            return
        slot = self.slot(outcome.view.batch_size)
        mean_accepted = float(outcome.accepted[ks > 0].mean())
        old = self.ema[slot]
        ema = mean_accepted if old is None else (1 - self.alpha) * old + self.alpha * mean_accepted
        self.ema[slot] = ema
        rung = self.rung[slot]
        if rung + 1 < len(self.ladder) and ema >= self.ladder[rung] - 0.5 + self.up:
            self.rung[slot] = rung + 1
        elif rung > 0 and ema < self.ladder[rung - 1] - 0.5 - self.down:
            self.rung[slot] = rung - 1


class BanditSpecUCB(_Base):
    """BanditSpec's UCBSpec (Hou et al., ICML 2025, arXiv 2505.15141; sail-sg/BanditSpec
    ``ucb_length_spec_generate``): arms are the draft lengths K = 1..max K, each round plays the
    arm with the highest mean reward plus sqrt(c log t / n_arm), the reward being the round's
    throughput (tokens emitted per second of step time). One bandit for the engine, every step a
    round; rewards are scaled by the largest seen so that the bonus is on their scale."""

    name = "banditspec-ucb"

    def __init__(self, info: EngineInfo, c: float = 2.0) -> None:
        super().__init__(info)
        self.arms = list(range(1, info.max_k + 1))
        self.c = c
        self.n = np.zeros(len(self.arms))
        self.sum = np.zeros(len(self.arms))
        self.t = 0
        self.scale = 0.0
        self.current = 0

    def choose(self) -> int:
        untried = np.flatnonzero(self.n == 0)
        if untried.size:
            return int(untried[0])
        mean = self.sum / self.n / max(self.scale, 1e-12)
        bonus = np.sqrt(self.c * math.log(max(self.t, 1)) / self.n)
        return int(np.argmax(mean + bonus))

    def assign(self, view: StepView) -> Assignment:
        self.current = self.choose()
        return Assignment.uniform(view.request_ids.size, self.info.primary_draft,
                                  self.arms[self.current])

    def observe(self, outcome: StepOutcome) -> None:
        if not outcome.view.request_ids.size:
            return
        reward = float(outcome.emitted.sum()) / outcome.seconds
        self.scale = max(self.scale, reward)
        self.n[self.current] += 1
        self.sum[self.current] += reward
        self.t += 1


class TRTLLMThreshold(_Base):
    """TensorRT-LLM's ``acceptance_rate_window_size`` / ``acceptance_rate_threshold``
    (DecodingBaseConfig, TensorRT-LLM 1.3): with a static K, "speculation will be disabled
    permanently once the rolling average [accepted / drafted] over the last N speculation-enabled
    decoding iterations drops below" the threshold. Also its ``max_concurrency``: speculation is
    skipped in steps with more requests than that (unset here unless given)."""

    name = "trtllm-threshold"

    def __init__(self, info: EngineInfo, k: int, threshold: float, window: int,
                 max_concurrency: int | None = None) -> None:
        super().__init__(info)
        self.k, self.threshold, self.window = min(k, info.max_k), threshold, window
        self.max_concurrency = max_concurrency
        self.rates: deque[float] = deque(maxlen=window)
        self.disabled = False

    def assign(self, view: StepView) -> Assignment:
        busy = self.max_concurrency is not None and view.batch_size > self.max_concurrency
        k = 0 if self.disabled or busy else self.k
        return Assignment.uniform(view.request_ids.size, self.info.primary_draft, k)

    def observe(self, outcome: StepOutcome) -> None:
        drafted = int(outcome.assignment.k.sum())
        if self.disabled or drafted == 0:
            return
        self.rates.append(float(outcome.accepted.sum()) / drafted)
        if len(self.rates) == self.window and sum(self.rates) / self.window < self.threshold:
            self.disabled = True
