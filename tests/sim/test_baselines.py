"""Each baseline follows its published rule, checked on small hand-made traces."""

from __future__ import annotations

import numpy as np

from benchmarks.sim.baselines import (
    BanditSpecUCB,
    BatchTable,
    HFHeuristic,
    Off,
    SGLangAdaptive,
    Static,
    TRTLLMThreshold,
)
from benchmarks.sim.step import NO_DRAFT, Assignment, EngineInfo, StepOutcome, StepView

INFO = EngineInfo(classes=("a", "b"), drafts=("small", "ngram"), draft_is_model=(True, False),
                  max_k=16, max_batch=64, offline=(False, False))


def view(batch: int = 1, ids: tuple[int, ...] = (0,), now: float = 0.0) -> StepView:
    return StepView(now, batch, 0, np.array(ids, dtype=np.int64),
                    np.zeros(len(ids), dtype=np.int64))


def outcome(v: StepView, a: Assignment, accepted: list[int], seconds: float = 0.02,
            finished: tuple[int, ...] = ()) -> StepOutcome:
    from benchmarks.sim.step import FinishedRequest

    acc = np.array(accepted, dtype=np.int64)
    return StepOutcome(v, a, seconds, acc, acc + 1, int(len(acc) + a.k.sum()),
                       np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                       tuple(FinishedRequest(r, 0, 1, 1, 0, 0, 1.0) for r in finished))


def play(policy, accepted_for_k, steps: int, batch: int = 1) -> list[int]:
    """Run ``steps`` single-request steps; accepted_for_k(k) is the accepted count; return Ks."""
    ks = []
    for _ in range(steps):
        v = view(batch)
        a = policy.assign(v)
        k = int(a.k[0])
        ks.append(k)
        policy.observe(outcome(v, a, [accepted_for_k(k)]))
    return ks


def test_off_and_static() -> None:
    assert Off(INFO).assign(view(ids=(1, 2))).k.tolist() == [0, 0]
    a = Static(INFO, 3).assign(view(ids=(1, 2)))
    assert a.k.tolist() == [3, 3] and a.draft.tolist() == [0, 0]
    s = Static(INFO, 2, draft=1)
    assert s.name == "static:2@ngram" and s.assign(view()).draft.tolist() == [1]
    assert Static(INFO, 0).assign(view()).draft.tolist() == [NO_DRAFT]


def test_batch_table_expands_like_vllm() -> None:
    # vLLM's build_dynamic_sd_schedule_lookup: gaps and sizes past the end carry the previous K.
    t = BatchTable(INFO, [[1, 4, 4], [8, 16, 2], [33, 64, 0]])
    assert [t.k_for(b) for b in (1, 4, 5, 7, 8, 16, 17, 32, 33, 64, 100)] == [
        4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0]
    assert BatchTable(INFO, [[4, 8, 3]]).k_for(2) == 0  # below the first range: no speculation
    assert t.assign(view(batch=10, ids=(1, 2))).k.tolist() == [2, 2]


def test_hf_heuristic_plus_two_minus_one_per_request() -> None:
    hf = HFHeuristic(INFO)
    # Starts at num_assistant_tokens=20, capped by the engine's max K (16).
    trace = [False, False, True, False, True, True]  # all accepted?
    ks = []
    for full in trace:
        v = view(ids=(7,))
        a = hf.assign(v)
        k = int(a.k[0])
        ks.append(k)
        hf.observe(outcome(v, a, [k if full else k - 1]))
    assert ks == [16, 15, 14, 16, 15, 16]  # 14 + 2 = 16; 15 + 2 = 17 capped at 16
    # Minimum 1, and per request: another request starts fresh.
    ks = play(hf, lambda k: 0, 20)
    assert ks[-1] == 1 and min(ks) == 1
    assert int(hf.assign(view(ids=(99,))).k[0]) == 16
    # A finished request's state is dropped.
    v = view(ids=(7,))
    hf.observe(outcome(v, hf.assign(v), [0], finished=(7,)))
    assert 7 not in hf.k


def test_sglang_ema_ladder_with_hysteresis_per_batch_slot() -> None:
    sg = SGLangAdaptive(INFO)  # ladder [1, 3, 7], starts on the middle rung
    assert sg.ladder == [1, 3, 7]
    # All drafts accepted at 3 steps: the EMA (3) reaches the 3|7 pivot 2.5: up to 7.
    ks = play(sg, lambda k: k, 3)
    assert ks == [3, 7, 7]
    # EMA after accepting [3, 7, 7]: 3 -> 3.8 -> 4.44. Nothing accepted from here: it decays by
    # 0.8 per round: 3.55, 2.84, 2.27, 1.82 < 2.5 - 0.25: down to 3 (the dead zone held 2.27);
    # then 1.45 ... 0.305, 0.244 < 0.5 - 0.25: down to 1, where it stays (no flapping).
    ks = play(sg, lambda k: 0, 20)
    assert ks == [7] * 4 + [3] * 9 + [1] * 7
    # Another batch-size slot keeps its own state.
    assert int(sg.assign(view(batch=40)).k[0]) == 3


def test_banditspec_tries_every_arm_then_exploits_the_best_throughput() -> None:
    ucb = BanditSpecUCB(INFO)
    seconds = {k: 0.02 + 0.004 * k for k in range(1, 17)}
    accepted = {k: min(k, 3) for k in range(1, 17)}  # tokens/s peaks at K = 3
    plays = []
    for _ in range(600):
        v = view()
        a = ucb.assign(v)
        k = int(a.k[0])
        plays.append(k)
        ucb.observe(outcome(v, a, [accepted[k]], seconds=seconds[k]))
    assert plays[:16] == list(range(1, 17))  # each arm once, in order
    counts = np.bincount(plays, minlength=17)
    others = np.delete(counts, 3)
    assert int(np.argmax(counts)) == 3 and counts[3] > 1.5 * others.max()


def test_trtllm_threshold_turns_off_for_good() -> None:
    trt = TRTLLMThreshold(INFO, k=4, threshold=0.5, window=4)
    ks = play(trt, lambda k: 3, 4)  # rate 0.75: stays on
    assert ks == [4, 4, 4, 4] and not trt.disabled
    # Rolling rate over the last 4 rounds: (3 x 0.75 + 0) / 4 = 0.56, then 0.375 < 0.5: off.
    ks = play(trt, lambda k: 0, 6)
    assert ks == [4, 4, 0, 0, 0, 0] and trt.disabled
    assert play(trt, lambda k: k, 5) == [0] * 5  # permanently
    busy = TRTLLMThreshold(INFO, k=4, threshold=0.5, window=4, max_concurrency=8)
    assert int(busy.assign(view(batch=9)).k[0]) == 0
    assert int(busy.assign(view(batch=8)).k[0]) == 4
