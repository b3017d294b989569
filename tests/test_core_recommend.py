"""specpilot.controller.core.recommend: the options of every sidecar compared at the fleet's
load."""

from __future__ import annotations

from specpilot.controller.core.recommend import (
    PLAIN,
    SPECULATIVE,
    DraftCurve,
    EngineOptions,
    compared_bucket,
    recommend,
)

SIZES = (1, 8, 64)


def _spec(sidecar: str, load: float, off: tuple[float, ...], *curves: DraftCurve,
          sizes: tuple[int, ...] = SIZES) -> EngineOptions:
    return EngineOptions(sidecar, 1.0, SPECULATIVE, load, sizes, off, 1000.0, curves)


def _plain(sidecar: str, load: float, off: tuple[float, ...]) -> EngineOptions:
    return EngineOptions(sidecar, 1.0, PLAIN, load, SIZES, off, 500.0)


def _curve(cls: str, draft: str, goodput: tuple[float, ...], tries: float = 1000.0,
           ks: tuple[int, ...] = (4, 3, 1)) -> DraftCurve:
    return DraftCurve(cls, draft, ks, goodput, tries)


def test_the_compared_bucket_is_the_mean_load_of_sidecars_with_engines_busy() -> None:
    fleet = [_spec("a", 6.0, (1, 1, 1)), _plain("b", 10.0, (1, 1, 1)), _plain("c", 0.0, (1, 1, 1))]
    assert compared_bucket(fleet) == 1  # mean 8 -> the bucket up to 8, c's idle engine left out
    assert compared_bucket([_spec("a", 100.0, (1, 1, 1))]) == 2  # beyond the last: the last
    assert compared_bucket([_spec("a", 0.0, (1, 1, 1))]) == 0


def test_options_are_ranked_by_goodput_at_the_load_with_their_evidence() -> None:
    fleet = [
        _spec("a", 8.0, (90, 400, 3000), _curve("code", "big", (200, 900, 2500)),
              _curve("chat", "big", (150, 450, 2900))),
        _spec("b", 8.0, (100, 420, 3100), _curve("code", "small", (180, 700, 2600), tries=300),
              _curve("chat", "small", (160, 600, 2950), tries=50)),  # below min_tries
        _plain("p", 8.0, (110, 480, 3300)),
    ]
    by_class = {r.traffic_class: r for r in recommend(fleet, min_tries=100)}
    code = by_class["code"]
    assert (code.batch_bucket, code.batch_size, code.pool, code.draft) == (1, 8, SPECULATIVE,
                                                                           "big")
    assert [(o.pool, o.draft, o.goodput) for o in code.options] == [
        (SPECULATIVE, "big", 900), (SPECULATIVE, "small", 700), (PLAIN, "", 480),
        (SPECULATIVE, "", 410)]  # off: the mean of the two speculative sidecars
    off = code.options[-1]
    assert (off.sidecars, off.tries, off.cost_steps, off.k) == (2, 0.0, 2000.0, 0)
    assert (code.options[0].k, code.options[1].tries) == (3, 300)
    # Chat: small's estimate is too thin to count; big loses to the plain pool at batch 8,
    # so the plain pool is recommended and big stays the speculative engines' best draft.
    chat = by_class["chat"]
    assert (chat.pool, chat.draft) == (PLAIN, "big")
    assert "small" not in {o.draft for o in chat.options}


def test_speculation_off_is_the_draft_when_no_draft_beats_it() -> None:
    fleet = [_spec("a", 1.0, (100, 400, 3000), _curve("docs", "big", (60, 300, 2000)))]
    (docs,) = recommend(fleet, min_tries=0)
    assert (docs.pool, docs.draft) == (SPECULATIVE, "")


def test_the_same_draft_on_two_sidecars_is_averaged_and_its_tries_not_summed() -> None:
    # Each posterior already holds the fleet's evidence: summing tries would count it twice.
    fleet = [_spec("a", 8.0, (1, 100, 1), _curve("code", "big", (1, 500, 1), tries=900)),
             _spec("b", 8.0, (1, 100, 1), _curve("code", "big", (1, 700, 1), tries=1000))]
    (code,) = recommend(fleet, min_tries=0)
    big = code.options[0]
    assert (big.goodput, big.tries, big.sidecars) == (600, 1000, 2)


def test_sidecars_with_other_buckets_are_left_out_and_no_evidence_gives_nothing() -> None:
    odd = _spec("z", 8.0, (1, 1, 1, 1), _curve("code", "big", (9, 9, 9, 9), ks=(1, 1, 1, 1)),
                sizes=(1, 2, 4, 8))
    fleet = [_spec("a", 8.0, (100, 100, 100), _curve("code", "big", (50, 50, 50))), odd]
    (code,) = recommend(fleet, min_tries=0)
    assert [o.goodput for o in code.options] == [100, 50]
    assert recommend([], min_tries=0) == ()
    assert recommend([_plain("p", 8.0, (1, 1, 1))], min_tries=0) == ()
