"""The step-anatomy benchmark's pure parts: how a step is classified, and the replay of timed
steps into the controller's step-cost model."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.step_anatomy import StepLog, replay


def _output(scheduled: dict[str, int], drafts: dict[str, list[int]],
            cached_context: list[int]) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts,
                           scheduled_cached_reqs=SimpleNamespace(
                               num_computed_tokens=cached_context),
                           scheduled_new_reqs=[])


def test_a_step_that_prefills_a_chunk_is_mixed_and_one_that_verifies_drafts_is_not() -> None:
    log = StepLog("suffix:4", 0)
    # r1 verifies its token and 3 drafts; r2 decodes one token.
    log.start(_output({"r1": 4, "r2": 1}, {"r1": [7, 8, 9]}, [100, 50]))
    log.end()
    # r3 prefills a 300-token chunk beside r1's decode.
    log.start(_output({"r1": 1, "r3": 300}, {}, [104, 0]))
    log.end()
    assert (log.decode_steps, log.decode_tokens, log.mixed_steps) == (1, 5, 1)
    assert (log.mixed_prefill_tokens, log.mixed_decode_tokens, log.drafts) == (300, 1, 3)
    assert [s[:5] for s in log.steps] == [(2, 5, 0, 3, 150), (2, 1, 300, 0, 104)]


def test_the_replay_prices_steps_of_a_linear_engine_closely_once_it_has_seen_them() -> None:
    """Steps whose time is exactly 20 ms + 1.5 ms per verified token + 0.25 ms per prefilled
    token, every tenth one prefilling a 300-token chunk: the model, fed them one report at a
    time, prices the bulk of them, decode-only and mixed, within a few percent; a control whose
    times jump past what it learnt (the last quarter three times dearer) is priced far off."""
    def log(name: str, jump: bool) -> StepLog:
        out = StepLog(name, 0)
        for i in range(800):
            batch = 12
            drafts = 18 if i % 2 else 0
            tokens = batch + drafts
            prefill = 300 if i % 10 == 3 else 0
            seconds = 0.020 + 0.0015 * tokens + 0.00025 * prefill
            if jump and i >= 600:
                seconds *= 3
            decode = tokens - (1 if prefill else 0)  # the prefilling request's chunk is apart
            out.steps.append((batch, decode, prefill + (1 if prefill else 0), drafts,
                              batch * 500, seconds))
        return out

    def errors(jump: bool) -> dict[tuple[int, str], float]:
        rows = replay([log("suffix:4", jump)], {"suffix:4": 4})
        return {(k, kind): predicted / measured - 1
                for _, _, k, kind, _, predicted, measured in rows}

    steady = errors(False)
    assert set(steady) == {(0, "decode"), (4, "decode"), (4, "mixed")}
    assert all(abs(e) < 0.05 for e in steady.values())
    assert any(abs(e) > 0.2 for e in errors(True).values())
