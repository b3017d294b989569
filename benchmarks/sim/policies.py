"""Policy names on the command line and how each is built for a scenario.

    off                 no speculation
    static:K[@DRAFT]    fixed K (default draft: the scenario's first)
    static:all          static:1..max_k for every draft
    batch-table         static K by batch size (scenario's table, or tuned offline at t=0)
    hf-heuristic        transformers' +2/-1 schedule per request
    sglang-adaptive     EMA of accepted length, ladder of steps, per batch-size slot
    banditspec-ucb      UCB over K with a tokens/s reward
    trtllm-threshold    static K, off for good below a rolling acceptance threshold
    specpilot           the real controller core behind the plugin's report path
    specpilot-cut       specpilot with its per-token cut on (``token_cut``), whatever the
                        scenario or the default says; ``specpilot-nocut``: with it off
    oracle              the ground-truth ceiling (per class)
    vllm-adaptive[:K]   vLLM's adaptive verification: draft K (default max K), verify the
                        slots of highest survival under a profiled budget, calibrated online
    per-token-oracle    the ceiling with per-token confidence: each token's true acceptance
"""

from __future__ import annotations

import numpy as np

from benchmarks.sim.baselines import (
    BATCH_SLOTS,
    BanditSpecUCB,
    BatchTable,
    HFHeuristic,
    Off,
    SGLangAdaptive,
    Static,
    TRTLLMThreshold,
)
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.oracle import Oracle
from benchmarks.sim.specpilot_policy import SpecPilotPolicy, start_up_profile
from benchmarks.sim.step import Policy
from benchmarks.sim.token_oracle import PerTokenOracle
from benchmarks.sim.vllm_adaptive import VLLMAdaptive

ADAPTIVE = ("batch-table", "hf-heuristic", "sglang-adaptive", "banditspec-ucb",
            "trtllm-threshold", "specpilot")
DEFAULT_POLICIES = ("off", "static:all", *ADAPTIVE, "oracle")
# specpilot's spellings: its token cut as the scenario or the default sets it, forced on, off.
_SPECPILOT_CUT = {"specpilot": None, "specpilot-cut": True, "specpilot-nocut": False}


def expand(names: list[str] | tuple[str, ...], engine: SimEngine) -> list[str]:
    """Policy names with ``static:all`` spelled out, duplicates dropped, order kept."""
    info = engine.info
    out: list[str] = []
    for name in names:
        if name == "static:all":
            for d, draft in enumerate(info.drafts):
                suffix = "" if d == info.primary_draft else f"@{draft}"
                out.extend(f"static:{k}{suffix}" for k in range(1, info.max_k + 1))
        else:
            out.append(name)
    return list(dict.fromkeys(out))


def tuned_table(engine: SimEngine) -> list[list[int]]:
    """What an operator would configure after profiling: for each power-of-two batch range, the K
    of the engine's draft that is best for the scenario's traffic mix as it is at t=0 (the
    share-weighted mean E(K) curve, true step costs, no prefill)."""
    s, info = engine.s, engine.info
    shares = np.array([c.share for c in s.classes], dtype=np.float64)
    curve = (shares[:, None] * engine.truth.expected_curves(0.0)[:, info.primary_draft]).sum(
        axis=0) / shares.sum()
    passes_cost = float(engine.cost.draft_per_pass[info.primary_draft])
    token_cost = float(engine.cost.draft_per_token[info.primary_draft])
    table, start = [], 1
    for end in [*BATCH_SLOTS, 2 * BATCH_SLOTS[-1]]:
        if start > info.max_batch:
            break
        batch = round(np.sqrt(start * min(end, info.max_batch)))
        ks = np.arange(info.max_k + 1)
        seconds = (engine.cost.target_seconds(batch, batch * (1 + ks))
                   + np.where(ks > 0, passes_cost * ks + token_cost * batch * ks, 0.0))
        table.append([start, min(end, info.max_batch), int(np.argmax(curve / seconds))])
        start = end + 1
    return table


def build(name: str, engine: SimEngine) -> Policy:
    """The policy called ``name`` for this scenario; ValueError names what is wrong."""
    s, info = engine.s, engine.info
    if name == "off":
        return Off(info)
    if name.startswith("static:"):
        spec = name.removeprefix("static:")
        k_text, _, draft_name = spec.partition("@")
        if not k_text.isdigit():
            raise ValueError(f"policy {name!r}: expected static:K or static:K@DRAFT")
        draft = info.drafts.index(draft_name) if draft_name in info.drafts else -1
        if draft_name and draft < 0:
            raise ValueError(f"policy {name!r}: unknown draft {draft_name!r}; "
                             f"drafts: {', '.join(info.drafts)}")
        return Static(info, int(k_text), max(draft, 0))
    table = s.baselines.batch_table or tuned_table(engine)
    if name == "batch-table":
        return BatchTable(info, table)
    if name == "hf-heuristic":
        return HFHeuristic(info)
    if name == "sglang-adaptive":
        return SGLangAdaptive(info)
    if name == "banditspec-ucb":
        return BanditSpecUCB(info)
    if name == "trtllm-threshold":
        # The static K it guards: what the tuned table gives a single request.
        return TRTLLMThreshold(info, max(1, BatchTable(info, table).k_for(1)),
                               s.baselines.acceptance_threshold, s.baselines.acceptance_window)
    if name in _SPECPILOT_CUT:
        settings = dict(s.specpilot)
        if (cut := _SPECPILOT_CUT[name]) is not None:
            settings["token_cut"] = cut
        return SpecPilotPolicy(info, settings, engine.seed, s.engine.report_interval_seconds,
                               start_up_profile(info, engine.cost, s.engine.profile_scale),
                               name=name)
    if name == "oracle":
        return Oracle(info, engine.truth, engine.cost)
    if name == "per-token-oracle":
        return PerTokenOracle(info, engine.cost)
    if name == "vllm-adaptive" or name.startswith("vllm-adaptive:"):
        k_text = name.removeprefix("vllm-adaptive").removeprefix(":") or str(info.max_k)
        if not k_text.isdigit() or not 1 <= int(k_text) <= info.max_k:
            raise ValueError(f"policy {name!r}: expected vllm-adaptive:K, K in 1..{info.max_k}")
        return VLLMAdaptive(info, engine.cost, int(k_text), s.engine.max_batched_tokens,
                            s.engine.profile_scale[1])
    raise ValueError(f"unknown policy {name!r}; see `specpilot simulate --help`")
