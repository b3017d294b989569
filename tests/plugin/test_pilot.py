"""The pilot without vLLM: the hello after the tokenizer guard (``announce``), a constructor that
does no I/O, and ``Pilot.create`` that reads the rules and starts the link."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.demo.engine import put_policy
from specpilot.contract.engine_stream import policy_update_from_proto
from specpilot.contract.records import (
    AcceptanceRecord,
    CalibrationRows,
    ConfidenceRecord,
    DraftKind,
    DraftSpec,
    EngineDecision,
    PolicyUpdate,
    TokenCut,
)
from specpilot.engine_plugin import pilot as pilot_module
from specpilot.engine_plugin.classify import Classifier
from specpilot.engine_plugin.config import KMode, PluginConfig
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from specpilot.engine_plugin.pilot import EngineSpec, Pilot, announce
from specpilot.engine_plugin.policy.picks import COUNTERFACTUAL_CLASS_PICKS, score_point
from specpilot.engine_plugin.policy.view import Choice
from specpilot.engine_plugin.suffix import SUFFIX_DRAFT
from specpilot.engine_plugin.vocab import TokenizerLike, vocab_hash
from specpilot.v1 import engine_pb2


class FakeTokenizer:
    def __init__(self, vocab: Mapping[str, int]) -> None:
        self._vocab = dict(vocab)

    def get_vocab(self) -> Mapping[str, int]:
        return self._vocab

    @property
    def all_special_tokens(self) -> Sequence[str]:
        return ()


TOKENIZERS = {"target": FakeTokenizer({"a": 0, "b": 1}), "same": FakeTokenizer({"a": 0, "b": 1}),
              "other": FakeTokenizer({"a": 0, "c": 1})}


def load(path: str) -> TokenizerLike:
    return TOKENIZERS[path]


def engine(draft_tokenizer: str = "same", async_scheduling: bool = False) -> EngineSpec:
    return EngineSpec(model="m", tokenizer="target", drafter="draft", drafter_kind=DraftKind.MODEL,
                      drafter_tokenizer=draft_tokenizer, max_k=4,
                      async_scheduling=async_scheduling, greedy_draft_sampling=True, ngram_min=2,
                      ngram_max=4, max_model_len=128, max_num_seqs=8)


def test_matching_draft_is_offered_with_ngram_and_suffix_substitution() -> None:
    a = announce(engine(), PluginConfig(engine_id="e1", suffix_drafts=True), load)
    target_hash = vocab_hash(TOKENIZERS["target"])
    assert a.drafts_allowed == {"draft", NGRAM_DRAFT, SUFFIX_DRAFT}
    assert a.hello.drafts == (DraftSpec("draft", DraftKind.MODEL, 4, target_hash),
                              DraftSpec(NGRAM_DRAFT, DraftKind.NGRAM, 4),
                              DraftSpec(SUFFIX_DRAFT, DraftKind.SUFFIX, 4))
    h = a.hello
    assert (h.engine_id, h.model, h.target_vocab_hash, h.max_k) == ("e1", "m", target_hash, 4)
    assert (h.per_request_k, h.batch_wide_k, h.ngram_substitution, h.ngram_counterfactual,
            h.step_probes) == (True, False, True, True, True)
    assert h.max_batch_size == 8


def test_each_deterministic_draft_can_be_left_out(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def names(config: PluginConfig) -> list[str]:
        return [d.name for d in announce(engine(), config, load).hello.drafts]

    assert names(PluginConfig()) == ["draft", NGRAM_DRAFT]  # suffix drafts are opt-in
    assert names(PluginConfig(ngram_drafts=False, suffix_drafts=True)) == ["draft", SUFFIX_DRAFT]
    monkeypatch.setattr(pilot_module, "suffix_available", lambda: False)  # not installed
    caplog.set_level(logging.INFO, logger="specpilot.plugin")
    assert names(PluginConfig(suffix_drafts=True)) == ["draft", NGRAM_DRAFT]
    assert "arctic-inference is not installed" in caplog.text


def test_mismatched_draft_is_announced_but_refused(caplog: pytest.LogCaptureFixture) -> None:
    a = announce(engine("other"), PluginConfig(), load)
    assert a.drafts_allowed == frozenset()
    (d,) = a.hello.drafts  # no n-gram substitution into a refused draft
    assert d.name == "draft" and d.vocab_hash == vocab_hash(TOKENIZERS["other"])
    assert "tokenizer differs" in caplog.text


def test_constructor_does_no_io_and_create_starts_the_link(tmp_path: Path) -> None:
    config = PluginConfig(controller="127.0.0.1:1", reconnect_initial_seconds=5.0)
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    try:
        assert not pilot.link._thread.is_alive()  # no thread until create (or link.start)
        assert pilot.view.static_choice == Choice("draft", 4, False)
    finally:
        pilot.close()
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - class: everything\n")
    config = PluginConfig(controller="127.0.0.1:1", reconnect_initial_seconds=5.0,
                          class_rules=str(rules))
    created = Pilot.create(engine(), config, load)
    try:
        assert created.link._thread.is_alive()
        assert created.classifier.classify(None, None, 1, None) == "everything"
    finally:
        created.close()


class _Request:
    """The parts of a vLLM request that ``on_drafts`` reads."""

    def __init__(self, i: int) -> None:
        self.request_id = f"r{i}"
        self.sampling_params = None
        self.lora_request = None
        self.num_prompt_tokens, self.max_tokens = 4, 16
        self.all_token_ids = [1, 2, 3, 4]
        self.spec_token_ids = [5, 6, 7, 8]
        self.is_prefill_chunk = self.use_structured_output = False
        self.num_computed_tokens = 4

    def is_finished(self) -> bool:
        return False


def test_the_policy_is_looked_up_once_per_batch_size_and_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = PluginConfig()
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    lookups: list[int] = []
    real = pilot.view.lookup

    def counted(batch_size: int) -> object:
        lookups.append(batch_size)
        return real(batch_size)

    monkeypatch.setattr(pilot.view, "lookup", counted)
    requests = {r.request_id: r for r in map(_Request, range(8))}
    for r in requests.values():
        pilot.on_add_request(r)  # type: ignore[arg-type]
    for _ in range(3):
        pilot.on_schedule_start()
        pilot.on_drafts(requests, list(requests), 8, None)  # type: ignore[arg-type]
        pilot.on_drafts(requests, list(requests), 8, None)  # type: ignore[arg-type]
    assert lookups == [8, 8, 8]
    assert all(r.spec_token_ids == [5, 6, 7, 8] for r in requests.values())  # static: K=4
    pilot.close()


class _Params:
    """vLLM's SamplingParams as far as the pilot reads them: a class, the rest at defaults."""

    presence_penalty = frequency_penalty = 0.0
    repetition_penalty = 1.0
    min_tokens = 0
    logit_bias = allowed_token_ids = bad_words = None

    def __init__(self, traffic_class: str) -> None:
        self.extra_args = {"traffic_class": traffic_class}


def _policy(pilot: Pilot, ks: Mapping[str, tuple[str, int]]) -> None:
    put_policy(pilot.view, ks)


def _batch(pilot: Pilot, classes: Sequence[str]) -> dict[str, _Request]:
    requests = {}
    for i, cls in enumerate(classes):
        r = _Request(i)
        r.sampling_params = _Params(cls)  # type: ignore[assignment]
        requests[r.request_id] = r
        pilot.on_add_request(r)  # type: ignore[arg-type]
    return requests


def _drafted(pilot: Pilot, requests: dict[str, _Request], batch: int) -> dict[str, list[int]]:
    """One step in batch_max mode: the drafter's K, its drafts of that length, then the cut."""
    pilot.on_schedule_start()
    k = pilot.batch_k(requests.values())  # type: ignore[arg-type]
    pilot._drafter_k = k  # what mark_step reads from the step's SchedulerOutput
    for r in requests.values():
        r.spec_token_ids = [5, 6, 7, 8][:k]
    pilot.on_drafts(requests, list(requests), batch, None)  # type: ignore[arg-type]
    return {i: r.spec_token_ids for i, r in requests.items()}


def _cuts_looked_up(pilot: Pilot, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The requests whose choice ``on_drafts`` looks up (none when it skips its loop)."""
    seen: list[str] = []
    choice = pilot._choice
    in_cut = [False]

    def counted(req_id: str, lookup: object) -> Choice:
        if in_cut[0]:
            seen.append(req_id)
        return choice(req_id, lookup)  # type: ignore[arg-type]

    on_drafts = pilot.on_drafts

    def cut(*args: object) -> None:
        in_cut[0] = True
        try:
            on_drafts(*args)  # type: ignore[arg-type]
        finally:
            in_cut[0] = False

    monkeypatch.setattr(pilot, "_choice", counted)
    monkeypatch.setattr(pilot, "on_drafts", cut)
    return seen


def test_a_step_on_one_k_leaves_the_drafts_and_a_mixed_step_cuts_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = PluginConfig(k_mode="batch_max")
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    looked_up = _cuts_looked_up(pilot, monkeypatch)
    requests = _batch(pilot, ["a", "b", "a"])
    _policy(pilot, {"a": ("draft", 3), "b": ("draft", 3)})
    assert _drafted(pilot, requests, 3) == {"r0": [5, 6, 7], "r1": [5, 6, 7], "r2": [5, 6, 7]}
    assert looked_up == []  # every class at the K drafted: the loop is skipped
    _policy(pilot, {"a": ("draft", 3), "b": ("draft", 1)})
    assert _drafted(pilot, requests, 3) == {"r0": [5, 6, 7], "r1": [5], "r2": [5, 6, 7]}
    assert looked_up == ["r0", "r1", "r2"]
    looked_up.clear()
    # One K for every class present, but the drafter drafted more than it (the batch shrank
    # between drafting and the cut, and the new bucket's K is lower): cut.
    _policy(pilot, {"a": ("draft", 2), "b": ("draft", 2)})
    pilot._drafter_k = 3
    for r in requests.values():
        r.spec_token_ids = [5, 6, 7]
    pilot.on_drafts(requests, list(requests), 2, None)  # type: ignore[arg-type]
    assert all(r.spec_token_ids == [5, 6] for r in requests.values())
    # A class that probes while off: its requests differ by key, so no shortcut.
    update = engine_pb2.PolicyUpdate(version=2, fail_static_timeout_seconds=1e6)
    for bucket in range(len(pilot.view.bucket_bounds) + 1):
        update.decisions.add(traffic_class="a", batch_bucket=bucket, draft="draft", k=2)
        update.decisions.add(traffic_class="b", batch_bucket=bucket, k=0, probe_k=2,
                             probe_draft="draft", probe_rate=0.5)
    pilot.view.apply(policy_update_from_proto(update))
    looked_up.clear()
    _drafted(pilot, requests, 3)
    assert looked_up == ["r0", "r1", "r2"]
    pilot.close()


def test_ngram_drafts_stay_marked_until_a_step_schedules_them() -> None:
    config = PluginConfig(k_mode="batch_max", skip_idle_drafter=False)
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    requests = _batch(pilot, ["a", "b"])
    for r in requests.values():
        r.all_token_ids = [1, 2, 3, 1, 2, 3, 1, 2]
    _policy(pilot, {"a": (NGRAM_DRAFT, 2), "b": ("draft", 2)})
    _drafted(pilot, requests, 2)
    assert requests["r0"].spec_token_ids == [3, 1] and requests["r1"].spec_token_ids == [5, 6]

    class Output:
        def __init__(self, scheduled: Sequence[str]) -> None:
            self.num_scheduled_tokens = {i: 3 for i in scheduled}
            self.scheduled_spec_decode_tokens = {i: requests[i].spec_token_ids for i in scheduled}
            self.num_spec_tokens_to_schedule = 2

    skipped = Output(["r1"])  # r0 is running but this step had no room for it
    pilot.mark_step(skipped, 2)  # type: ignore[arg-type]
    assert pilot._verifying_deterministic == frozenset()
    later = Output(["r0", "r1"])
    pilot.mark_step(later, 2)  # type: ignore[arg-type]
    assert pilot._verifying_deterministic == {"r0"}  # verified as n-gram (one-hot) when it does run
    pilot.mark_step(Output(["r0", "r1"]), 2)  # type: ignore[arg-type]
    assert pilot._verifying_deterministic == frozenset()  # consumed by the step that verified them
    # The drafter's own tokens replace a request's n-gram drafts: no mark any more.
    _drafted(pilot, requests, 2)
    _policy(pilot, {"a": ("draft", 2), "b": ("draft", 2)})
    _drafted(pilot, requests, 2)
    pilot.mark_step(Output(["r0", "r1"]), 2)  # type: ignore[arg-type]
    assert pilot._verifying_deterministic == frozenset()
    pilot.close()


def test_about_the_configured_number_of_requests_is_scored_counterfactually_per_step() -> None:
    config = PluginConfig(k_mode="batch_max", counterfactual_per_step=2.0, suffix_drafts=False)
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    assert list(pilot.counterfactual) == [NGRAM_DRAFT]
    steps: list[str] = []
    pilot.counterfactual[NGRAM_DRAFT].step = (  # type: ignore[method-assign]
        lambda req_id, *_: steps.append(req_id))
    many = {f"q{i}": _Request(i) for i in range(400)}
    for i, r in enumerate(many.values()):
        r.request_id = f"q{i}"
        pilot.on_add_request(r)  # type: ignore[arg-type]
    pilot.after_output(many, list(many), running=400)  # type: ignore[arg-type]
    assert 0 < len(steps) <= 8  # 2 expected
    steps.clear()
    pilot.after_output(many, ["q7"], running=1)  # type: ignore[arg-type]
    assert steps == ["q7"]  # a batch of one is scored whole
    pilot.close()


def test_every_class_present_scores_its_first_request_counterfactually() -> None:
    """A class of 4 requests among 400: none of its hash points is below 2/400, so the global
    rule alone would score it never; its lowest-point running request is scored every step,
    the same one while it runs, and none while none of its requests runs."""
    config = PluginConfig(k_mode="batch_max", counterfactual_per_step=2.0, suffix_drafts=False)
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    steps: list[str] = []
    pilot.counterfactual[NGRAM_DRAFT].step = (  # type: ignore[method-assign]
        lambda req_id, *_: steps.append(req_id))
    batch = _batch(pilot, ["a"] * 396 + ["rare"] * 4)
    rare = [i for i in batch if pilot.requests[i].traffic_class == "rare"]
    points = {i: score_point(i) for i in rare}
    assert min(points.values()) >= 2.0 / 400  # the control: the global rule misses them
    first = min(rare, key=lambda i: points[i])
    for _ in range(3):
        steps.clear()
        pilot.after_output(batch, list(batch), running=400)  # type: ignore[arg-type]
        assert [i for i in steps if i in rare] == [first]
    steps.clear()
    running = [i for i in batch if i not in rare]
    pilot.after_output(batch, running, running=len(running))  # type: ignore[arg-type]
    assert not set(steps) & set(rare) and steps
    pilot.close()


def test_per_class_counterfactual_picks_are_bounded_per_step_and_taken_in_turn() -> None:
    """With tens of classes in one batch, one step scores the first requests of at most
    COUNTERFACTUAL_CLASS_PICKS classes beside the global picks, and every class is scored within
    a few steps."""
    config = PluginConfig(k_mode="batch_max", counterfactual_per_step=2.0, suffix_drafts=False)
    pilot = Pilot(engine(), config, Classifier(max_classes=64),
                  announce(engine(), config, load))
    steps: list[str] = []
    pilot.counterfactual[NGRAM_DRAFT].step = (  # type: ignore[method-assign]
        lambda req_id, *_: steps.append(req_id))
    batch = _batch(pilot, [f"c{i % 40}" for i in range(400)])
    global_picks = {i for i in batch if score_point(i) < 2.0 / 400}
    scored: set[str] = set()
    for _ in range(40 // COUNTERFACTUAL_CLASS_PICKS + 1):
        steps.clear()
        pilot.after_output(batch, list(batch), running=400)  # type: ignore[arg-type]
        assert 0 < len(set(steps) - global_picks) <= COUNTERFACTUAL_CLASS_PICKS
        scored |= {pilot.requests[i].traffic_class for i in steps}
    present = {state.traffic_class for state in pilot.requests.values()}
    # The control: more classes than two steps pick.
    assert len(present) > 2 * COUNTERFACTUAL_CLASS_PICKS
    assert scored == present
    pilot.close()


def _composed_policy(pilot: Pilot, composition: bool) -> None:
    """chat settled on the draft model at K=2, docs settled off; with ``composition`` a per-step
    pricing under which one chat request among many does not pay the drafter's passes (the
    simulator's `collapse` engine and acceptance)."""
    from specpilot.contract.engine_stream import composition_to_proto, decision_to_proto
    from specpilot.contract.pricing import Composition, DraftPricing, StepPricing
    from specpilot.contract.records import Decision, Reason

    update = engine_pb2.PolicyUpdate(version=7, fail_static_timeout_seconds=1e6)
    for bucket in range(len(pilot.view.bucket_bounds) + 1):
        update.decisions.append(decision_to_proto(
            Decision("chat", bucket, "draft", 2, Reason.GOODPUT, 1.3)))
        update.decisions.append(decision_to_proto(Decision("docs", bucket, "", 0,
                                                           Reason.GOODPUT)))
    if composition:
        pricing = StepPricing(0.022, 1e-4, 2e-5, (64,), (1.6e-4,),
                              {"draft": DraftPricing(0.0, 0.0039, 2e-5)})
        update.composition.CopyFrom(composition_to_proto(Composition(pricing, {
            ("chat", "draft"): (1.0, 1.75, 2.31, 2.75), ("chat", NGRAM_DRAFT): (1.0, 1.15, 1.17),
            ("docs", NGRAM_DRAFT): (1.0, 1.05, 1.06)}, 0.01)))
    pilot.view.apply(policy_update_from_proto(update))


def test_batch_max_repicks_settled_classes_for_the_step_and_drafts_accordingly() -> None:
    """One chat request among seven documents: with the composition it leaves the draft model
    for n-gram drafts and the drafter drafts nothing; seven chat requests keep the drafter.
    Control: without the composition the lone chat request runs K=2 of the draft model."""
    config = PluginConfig(k_mode="batch_max")
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    lone = _batch(pilot, ["chat"] + ["docs"] * 7)
    for r in lone.values():
        r.all_token_ids = [1, 2, 3, 1, 2, 3, 1, 2]
    _composed_policy(pilot, composition=False)
    assert _drafted(pilot, lone, 8)["r0"] == [5, 6]  # the control: its decision
    _composed_policy(pilot, composition=True)
    drafted = _drafted(pilot, lone, 8)
    assert pilot._drafter_k == 0  # no model draft in the step
    assert drafted["r0"] == [3, 1]  # n-gram drafts, K=2, substituted
    pilot.close()
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    crowd = _batch(pilot, ["chat"] * 7 + ["docs"])
    _composed_policy(pilot, composition=True)
    _drafted(pilot, crowd, 8)
    assert pilot._drafter_k >= 2
    pilot.close()


def _native_engine(kind: DraftKind) -> EngineSpec:
    """An engine on vLLM's own drafter of ``kind``."""
    name = {DraftKind.SUFFIX: SUFFIX_DRAFT, DraftKind.NGRAM: NGRAM_DRAFT}.get(kind, "draft")
    return EngineSpec(model="m", tokenizer="target", drafter=name, drafter_kind=kind,
                      drafter_tokenizer="same" if kind is DraftKind.MODEL else "", max_k=4,
                      async_scheduling=False, greedy_draft_sampling=True, ngram_min=2,
                      ngram_max=4, max_model_len=128, max_num_seqs=8)


def _verified(kind: DraftKind) -> dict[int, tuple[int, ...]]:
    """One step on an engine whose own drafter proposed 2, 0 and 4 tokens to three requests that
    the policy asks K=4 of, then verified with 2, - and 1 accepted: the acceptance histograms
    reported, by K."""
    e = _native_engine(kind)
    config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False)
    pilot = Pilot(e, config, Classifier(), announce(e, config, load))
    requests = _batch(pilot, ["a", "a", "a"])
    _policy(pilot, {"a": (e.drafter, 4)})
    proposals = {"r0": [5, 6], "r1": [], "r2": [5, 6, 7, 8]}
    pilot.on_schedule_start()
    for i, r in requests.items():
        r.spec_token_ids = list(proposals[i])
    pilot.on_drafts(requests, list(requests), 3, None)  # type: ignore[arg-type]

    scheduled = {i: 1 + len(p) for i, p in proposals.items()}
    output = SimpleNamespace(
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={i: p for i, p in proposals.items() if p},
        num_invalid_spec_tokens=None, num_spec_tokens_to_schedule=4)
    sampled = SimpleNamespace(req_id_to_index={"r0": 0, "r1": 1, "r2": 2},
                              sampled_token_ids=[[5, 6, 9], [9], [5, 9]])
    pilot.on_output(output, sampled)
    payload = pilot.stats.drain(running_requests=3)
    pilot.close()
    hists: dict[int, list[int]] = {}
    for rec in payload.acceptance:
        assert (rec.traffic_class, rec.draft, rec.counterfactual) == ("a", e.drafter, False)
        hist = hists.setdefault(rec.k, [0] * (rec.k + 1))
        for a, n in enumerate(rec.steps_by_accepted):
            hist[a] += n
    return {k: tuple(h) for k, h in hists.items()}


@pytest.mark.parametrize("kind", [DraftKind.SUFFIX, DraftKind.NGRAM])
def test_vllms_own_deterministic_drafter_is_scored_as_the_k_asked(kind: DraftKind) -> None:
    # vLLM's n-gram and suffix drafters propose 0..K tokens: scored as K=4 asked, the short
    # proposal's missing tail counts as rejected and the empty one as a step with none accepted,
    # so E(K) is the tokens a step gains (three steps: 2, 0 and 1 accepted of 4).
    assert _verified(kind) == {4: (1, 1, 1, 0, 0)}


@pytest.mark.parametrize("kind", [DraftKind.SUFFIX, DraftKind.NGRAM])
def test_vllms_own_deterministic_drafter_is_scored_counterfactually_while_off(
        kind: DraftKind) -> None:
    """While its class is off, the engine's own n-gram or suffix drafter proposes nothing, so
    the plugin scores its drafts counterfactually (its own proposer of the same kind): a class
    turned off is seen to pay again, also on requests it served before. Control: a request the
    drafter serves is scored for real only."""
    e = _native_engine(kind)

    def scored(*policies: tuple[str, int]) -> list[AcceptanceRecord]:
        """Eight steps under each of ``policies`` in turn: the counterfactual records of the
        engine's drafter."""
        config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False)
        pilot = Pilot(e, config, Classifier(), announce(e, config, load))
        assert e.drafter in pilot.counterfactual
        requests = _batch(pilot, ["a"])
        r0 = requests["r0"]
        for version, policy in enumerate(policies, start=1):
            put_policy(pilot.view, {"a": policy}, version=version)
            pilot.stats.drain(running_requests=1)  # only this policy's records are kept
            for token in [1, 2, 3, 4] * 2:  # repeats its prompt: every proposal matches
                r0.all_token_ids = [*r0.all_token_ids, token]
                r0.spec_token_ids = [1, 2, 3, 4] if policy[1] else []
                pilot.on_schedule_start()
                pilot.on_drafts(requests, ["r0"], 1, None)  # type: ignore[arg-type]
                pilot.after_output(requests, ["r0"], running=1)  # type: ignore[arg-type]
        records = pilot.stats.drain(running_requests=1).acceptance
        pilot.close()
        return [r for r in records if r.draft == e.drafter and r.counterfactual]

    off = scored(("", 0))
    assert off and sum(sum(r.steps_by_accepted[1:]) for r in off) > 0  # tries, some accepted
    assert scored((e.drafter, 4)) == []
    assert scored((e.drafter, 4), ("", 0))  # served, then off: scored again


def test_a_model_drafter_is_scored_as_it_drafted() -> None:
    # Control: a model drafter's proposal is what the engine verifies, K as drafted (an empty
    # one is no step of speculation at all); the rule above would have put all three under K=4.
    assert _verified(DraftKind.MODEL) == {2: (0, 0, 1), 4: (0, 1, 0, 0, 0)}


def _confidence_step(cuts: Mapping[str, tuple[str, int]], transformed: bool = False,
                     token_cut: TokenCut | None = None,
                     acceptance: list[AcceptanceRecord] | None = None, drafted: int = 4
                     ) -> tuple[ConfidenceRecord, ...]:
    """One step on a model drafter that proposed ``drafted`` tokens (4, or fewer where it
    stopped early) to each of two requests of class "a" with the drafter's confidences, under
    ``cuts`` (the policy), verified with 2 and 0 accepted: the confidence records reported (the
    acceptance records into ``acceptance``)."""
    e = _native_engine(DraftKind.MODEL)
    config = PluginConfig(k_mode="per_request", suffix_drafts=False)
    pilot = Pilot(e, config, Classifier(), announce(e, config, load))
    requests = _batch(pilot, ["a", "a"])
    if transformed:
        for r in requests.values():
            pilot.requests[r.request_id].transformed = True
    _policy(pilot, cuts)
    if token_cut is not None:
        pilot.view.apply(PolicyUpdate(2, tuple(
            EngineDecision("a", b, draft, k) for b in range(len(pilot.view.bucket_bounds) + 1)
            for draft, k in [cuts["a"]]), fail_static_timeout_seconds=1e9, cut=token_cut))
    pilot.on_schedule_start()
    confidences = [[0.99, 0.9, 0.5, 0.1][:drafted], [0.3, 0.95, 0.95, 0.95][:drafted]]
    for r in requests.values():
        r.spec_token_ids = r.spec_token_ids[:drafted]
    pilot.on_drafts(requests, list(requests), 2, None, confidences)  # type: ignore[arg-type]
    proposals = {i: list(r.spec_token_ids) for i, r in requests.items()}
    scheduled = {i: 1 + len(p) for i, p in proposals.items()}
    output = SimpleNamespace(
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={i: p for i, p in proposals.items() if p},
        num_invalid_spec_tokens=None, num_spec_tokens_to_schedule=4)
    sampled = SimpleNamespace(req_id_to_index={"r0": 0, "r1": 1},
                              sampled_token_ids=[[*proposals["r0"][:2], 9], [9]])
    pilot.on_output(output, sampled)
    payload = pilot.stats.drain(running_requests=2)
    pilot.close()
    if acceptance is not None:
        acceptance.extend(payload.acceptance)
    return payload.confidence


def test_the_drafters_confidences_are_counted_at_the_k_verified() -> None:
    from specpilot.contract.confidence import confidence_bucket as b

    records = _confidence_step({"a": ("draft", 3)})  # cut to K=3: the 4th is never verified
    got = {(r.position, r.transformed): (r.tried_by_bucket, r.accepted_by_bucket)
           for r in records}
    assert set(got) == {(1, False), (2, False), (3, False)}
    tried = {p: {i: n for i, n in enumerate(t) if n} for (p, _), (t, _) in got.items()}
    accepted = {p: {i: n for i, n in enumerate(a) if n} for (p, _), (_, a) in got.items()}
    # r0 accepted 2 of 3 (positions 1, 2 accepted, 3 tried); r1 accepted none (position 1 tried)
    assert tried == {1: {b(0.99): 1, b(0.3): 1}, 2: {b(0.9): 1}, 3: {b(0.5): 1}}
    assert accepted == {1: {b(0.99): 1}, 2: {b(0.9): 1}, 3: {}}
    assert all(r.transformed for r in _confidence_step({"a": ("draft", 3)}, transformed=True))


def test_substituted_drafts_report_no_confidence() -> None:
    # The plugin's n-gram tokens replace the drafter's: its confidences say nothing of them.
    assert _confidence_step({"a": (NGRAM_DRAFT, 3)}) == ()


def test_transformed_sampling_is_recognised_on_vllms_own_parameters() -> None:
    from vllm import SamplingParams

    def transformed(params: SamplingParams, structured: bool = False) -> bool:
        request = SimpleNamespace(sampling_params=params, use_structured_output=structured)
        return pilot_module.transforms_sampling(request)

    assert not transformed(SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8))
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.1),
                   SamplingParams(repetition_penalty=1.1), SamplingParams(min_tokens=4),
                   SamplingParams(logit_bias={5: 2.0}), SamplingParams(allowed_token_ids=[1, 2]),
                   SamplingParams(bad_words=["x"])):
        assert transformed(params), params
    assert transformed(SamplingParams(), structured=True)


def test_the_token_cut_shortens_each_requests_drafts_by_their_confidences() -> None:
    """r0's tokens at 0.99 and 0.9 survive (0.95, then 0.95 x 0.9), its third at 0.5 does not
    (x 0.2); r1's first token at 0.3 already falls short: it verifies none. Decided K=4."""
    from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
    from specpilot.contract.confidence import confidence_bucket as b

    accept = [0.2] * N_CONFIDENCE_BUCKETS
    accept[b(0.99)], accept[b(0.9)] = 0.95, 0.9
    rows = CalibrationRows("a", "draft", False, 4, tuple(accept * 4))
    scored: list[AcceptanceRecord] = []
    records = _confidence_step({"a": ("draft", 4)},
                               token_cut=TokenCut((0.5,) * 9, (rows,)), acceptance=scored)
    tried = {r.position: sum(r.tried_by_bucket) for r in records}
    # r0 verified 2 (both accepted, as the step's output says: 2 accepted), r1 none.
    assert tried == {1: 1, 2: 1}
    # Both are scored as the K asked, the cut tail rejected: the class's acceptance is learnt
    # from every request, not from those the cut kept.
    assert [(r.k, r.steps_by_accepted) for r in scored] == [(4, (1, 0, 1, 0, 0))]
    # The control: without the cut both verify their 4 (r0 up to its rejection, r1 its first).
    assert {r.position: sum(r.tried_by_bucket)
            for r in _confidence_step({"a": ("draft", 4)})} == {1: 2, 2: 1, 3: 1}


def test_drafts_the_drafter_stopped_early_are_scored_as_drafted() -> None:
    """The drafter stopped after two passes (K=4 decided, a cut that keeps every token): each
    request is scored as the K=2 it drafted, as the simulator scores it, not as the 4 decided."""
    rows = CalibrationRows("a", "draft", False, 4, (1.0,) * 32)
    scored: list[AcceptanceRecord] = []
    _confidence_step({"a": ("draft", 4)}, token_cut=TokenCut((0.5,) * 9, (rows,)),
                     acceptance=scored, drafted=2)
    assert [(r.k, r.steps_by_accepted) for r in scored] == [(2, (1, 0, 1))]


def test_a_decode_steps_timing_carries_the_context_its_requests_held() -> None:
    """The step's context is what its requests' KV caches held when it was scheduled, as the
    SchedulerOutput keeps it (vLLM advances the request objects' counts right after
    scheduling); a step of new requests only holds 0 and is known. The control: an output that
    does not say is unknown."""
    config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False)

    def step_context(with_counts: bool, cached: tuple[int, ...] = (40, 70, 90)
                     ) -> tuple[int, int | None]:
        pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
        requests = _batch(pilot, ["a", "a", "a"])
        pilot.on_schedule_start()
        fields: dict[str, object] = {}
        if with_counts:
            fields = {"scheduled_cached_reqs": SimpleNamespace(num_computed_tokens=list(cached)),
                      "scheduled_new_reqs": []}
        output = SimpleNamespace(
            num_scheduled_tokens=dict.fromkeys(requests, 1), total_num_scheduled_tokens=3,
            scheduled_spec_decode_tokens={}, num_invalid_spec_tokens=None,
            num_spec_tokens_to_schedule=0, **fields)
        sampled = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(requests)},
                                  sampled_token_ids=[[9], [9], [9]])
        pilot.on_output(output, sampled)
        (sums,) = pilot.stats.drain(running_requests=3).step_sums
        pilot.close()
        return sums.steps, sums.sum_context_tokens

    assert step_context(True) == (1, 200)
    assert step_context(True, (0, 0, 0)) == (1, 0)
    assert step_context(False) == (1, None)


def test_a_step_that_prefills_a_chunk_is_timed_with_its_prefill_tokens() -> None:
    """Every sequence of a step verifies one token plus its drafts; the step's other tokens are
    a prompt chunk prefilled beside them, timed with the decode steps under their own count
    (the cost model's prefill column). The control: a decode-only step counts none."""
    config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False)

    def timed(tokens: dict[int, int]) -> tuple[int, int, int, int]:
        pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
        requests = list(_batch(pilot, ["a", "a", "a"]))
        pilot.on_schedule_start()
        output = SimpleNamespace(
            num_scheduled_tokens={requests[i]: n for i, n in tokens.items()},
            total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens={requests[0]: [5, 6]}, num_invalid_spec_tokens=None,
            num_spec_tokens_to_schedule=2, scheduled_cached_reqs=SimpleNamespace(
                num_computed_tokens=[40, 70, 0][:len(tokens)]), scheduled_new_reqs=[])
        sampled = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(requests)},
                                  sampled_token_ids=[[9, 5], [9], []])
        pilot.on_output(output, sampled)
        (sums,) = pilot.stats.drain(running_requests=3).step_sums
        pilot.close()
        return sums.steps, sums.batch_size, sums.sum_verified_tokens, sums.sum_prefill_tokens

    # r0 verifies 1 + 2 drafts, r1 decodes one token, r2 prefills a 300-token chunk.
    assert timed({0: 3, 1: 1, 2: 300}) == (1, 3, 5, 299)  # r2: one token, 299 prefill
    assert timed({0: 3, 1: 1}) == (1, 2, 4, 0)


def test_a_step_whose_drafter_may_stop_is_timed_at_its_drafts_width() -> None:
    """A step with a stop plan is timed once its drafts arrive, at their width (the passes the
    drafter ran, in whichever process the worker runs): K=1, one draft token per sequence, not
    the K asked; where they never arrive, at the K asked when the next step's output comes.
    The control: a step without a plan is timed at once, at the K asked."""
    from specpilot.engine_plugin.drafter_stop import StopPlan, mark_stop

    config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False)

    def timed(plan: bool, width: int | None) -> list[tuple[int, int]]:
        pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
        requests = _batch(pilot, ["a", "a"])
        ks = []
        for _ in range(2):
            pilot.on_schedule_start()
            output = SimpleNamespace(
                num_scheduled_tokens=dict.fromkeys(requests, 1), total_num_scheduled_tokens=2,
                scheduled_spec_decode_tokens={}, num_invalid_spec_tokens=None,
                num_spec_tokens_to_schedule=4)
            mark_stop(output, StopPlan(0.1, 1.0, {}) if plan else None)
            sampled = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(requests)},
                                      sampled_token_ids=[[9], [9]])
            pilot.on_output(output, sampled)
            ks.append([(s.k, s.sum_draft_tokens)
                       for s in pilot.stats.drain(running_requests=2).step_sums])
            if width is not None:
                pilot.on_drafts(requests, list(requests), 2, None, None,  # type: ignore[arg-type]
                                width)
                ks.append([(s.k, s.sum_draft_tokens)
                           for s in pilot.stats.drain(running_requests=2).step_sums])
        pilot.close()
        return [k for step in ks for k in step]

    assert timed(True, 1) == [(1, 2), (1, 2)]
    assert timed(True, 4) == [(4, 8), (4, 8)]
    # The drafts never came: the first step is timed when the second's output comes.
    assert timed(True, None) == [(4, 8)]
    assert timed(False, 1) == [(4, 8), (4, 8)]


def test_batch_max_prices_a_step_at_its_requests_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step re-pick is asked with the mean KV length of the step's requests."""
    from specpilot.engine_plugin.policy.step import StepPolicy

    pilot = Pilot(engine(), PluginConfig(k_mode="batch_max"), Classifier(),
                  announce(engine(), PluginConfig(k_mode="batch_max"), load))
    requests = _batch(pilot, ["a", "b"])
    requests["r0"].num_computed_tokens, requests["r1"].num_computed_tokens = 100, 300
    seen: list[float] = []
    real = StepPolicy.compose

    def compose(self: StepPolicy, lookup: object, counts: Mapping[str, int], batch_size: int,
                context_tokens: float = 0.0) -> None:
        seen.append(context_tokens)
        real(self, lookup, counts, batch_size, context_tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(StepPolicy, "compose", compose)
    pilot.on_schedule_start()
    pilot.batch_k(requests.values())  # type: ignore[arg-type]
    pilot.close()
    assert seen == [200.0]


def _stop_plan(k_mode: KMode, pass_tokens: tuple[float, ...] = (3.0,) * 9,
               batch_k: int = 4) -> dict[str, tuple[str | None, int]] | None:
    """The stop plan ``plan_drafter_stop`` puts on a step of four requests: r0 class "a" on the
    drafter at K=3 (calibrated), r1 class "b" on the drafter at K=4 (not calibrated), r2 class
    "c" on n-gram drafts at K=2, r3 class "a" still prefilling; r4 is not the pilot's."""
    from specpilot.engine_plugin.drafter_stop import STOP_ATTR

    config = PluginConfig(k_mode=k_mode, suffix_drafts=False)
    pilot = Pilot(engine(), config, Classifier(), announce(engine(), config, load))
    requests = _batch(pilot, ["a", "b", "c", "a"])
    requests["r3"].is_prefill_chunk = True
    requests["r4"] = _Request(4)
    rows = CalibrationRows("a", "draft", False, 4, (0.5,) * 32, (0.9,) * 4)
    by_class = {"a": ("draft", 3), "b": ("draft", 4), "c": (NGRAM_DRAFT, 2)}
    pilot.view.apply(PolicyUpdate(2, tuple(
        EngineDecision(c, b, draft, k) for b in range(len(pilot.view.bucket_bounds) + 1)
        for c, (draft, k) in by_class.items()), fail_static_timeout_seconds=1e9,
        cut=TokenCut((0.2,) * 9, (rows,), pass_tokens)))
    pilot.on_schedule_start()
    output = SimpleNamespace(num_scheduled_tokens={i: 1 for i in requests},
                             num_spec_tokens_to_schedule=batch_k)
    pilot.plan_drafter_stop(output, requests, len(requests))  # type: ignore[arg-type]
    pilot.close()
    plan = getattr(output, STOP_ATTR)
    if plan is None:
        return None
    assert (plan.min_survival, plan.pass_tokens) == (0.2, 3.0)
    return {i: (None if r is None else r.traffic_class, k)
            for i, (r, k) in plan.requests.items()}


def test_the_drafters_stop_is_planned_per_request_from_the_decisions() -> None:
    # Per request: each its K on the drafter, with its class's calibration where there is one;
    # n-gram drafts keep the room they are substituted into; a prefill chunk's drafts are
    # dropped; a request the pilot does not hold is drafted as vLLM asks.
    assert _stop_plan("per_request") == {"r0": ("a", 3), "r1": (None, 4), "r2": (None, 2),
                                         "r3": (None, 0), "r4": (None, 4)}
    # The step's batch K caps every K.
    assert _stop_plan("per_request", batch_k=2) == {
        "r0": ("a", 2), "r1": (None, 2), "r2": (None, 2), "r3": (None, 0), "r4": (None, 2)}
    # batch_max lengthens n-gram drafts whatever the drafter drafted; batch_wide verifies the
    # batch K of every request.
    assert _stop_plan("batch_max")["r2"] == (None, 0)  # type: ignore[index]
    assert _stop_plan("batch_wide") == {"r0": ("a", 4), "r1": (None, 4), "r2": (None, 4),
                                        "r3": (None, 0), "r4": (None, 4)}
    # No pass price, or one pass asked: nothing to stop.
    assert _stop_plan("per_request", pass_tokens=()) is None
    assert _stop_plan("per_request", batch_k=1) is None


@pytest.mark.parametrize("kind", [DraftKind.SUFFIX, DraftKind.NGRAM, DraftKind.MODEL])
def test_the_drafter_is_idle_when_every_scheduled_request_is_off(kind: DraftKind) -> None:
    """Where every scheduled request's class is off, the drafter's proposal is marked idle (the
    worker skips it, prefill steps too: these requests are new, so a model drafter admits them
    off) and the step is timed without its passes. A request on, one the pilot does not know or
    ``skip_idle_drafter`` off keep the proposal."""
    from specpilot.engine_plugin.worker_patch import IDLE_ATTR, should_skip_drafter

    e = _native_engine(kind)

    def step(policy: Mapping[str, tuple[str, int]], scheduled: Sequence[str] = ("r0", "r1"),
             skip: bool = True) -> tuple[bool, list[tuple[int, int]]]:
        config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False,
                              skip_idle_drafter=skip)
        pilot = Pilot(e, config, Classifier(), announce(e, config, load))
        _batch(pilot, ["a", "b"])
        _policy(pilot, policy)
        pilot.on_schedule_start()
        output = _output(scheduled)
        pilot.mark_step(output, 2)
        sampled = SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(scheduled)},
                                  sampled_token_ids=[[9]] * len(scheduled))
        pilot.on_output(output, sampled)
        timed = [(s.k, s.sum_draft_tokens)
                 for s in pilot.stats.drain(running_requests=2).step_sums]
        pilot.close()
        assert getattr(output, IDLE_ATTR) is should_skip_drafter(output)
        return should_skip_drafter(output), timed

    off = {"a": ("", 0), "b": ("", 0)}
    assert step(off) == (True, [(0, 0)])
    assert step({"a": ("", 0), "b": (e.drafter, 2)}) == (False, [(4, 8)])
    assert step(off, ("r0", "stranger"))[0] is False
    assert step(off, skip=False)[0] is False


def _output(scheduled: Sequence[str]) -> SimpleNamespace:
    """A decode step's SchedulerOutput as ``mark_step`` and ``on_output`` read it."""
    return SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(scheduled, 1), total_num_scheduled_tokens=len(scheduled),
        scheduled_spec_decode_tokens={}, num_invalid_spec_tokens=None,
        num_spec_tokens_to_schedule=4)


@pytest.mark.parametrize("probe_steps", [True, False])
def test_a_request_of_a_class_that_probes_the_drafter_is_not_admitted_off(
        probe_steps: bool) -> None:
    """A class off that probes the model draft (whole steps, or a share of requests) admits its
    requests on: a probe drafts for requests the drafter must have seen. Control: the same class
    without a probe admits them off."""
    from specpilot.contract.records import EngineDecision, PolicyUpdate

    e = _native_engine(DraftKind.MODEL)

    def admitted_off(probe_rate: float) -> bool:
        config = PluginConfig(k_mode="batch_max", ngram_drafts=False, suffix_drafts=False)
        pilot = Pilot(e, config, Classifier(), announce(e, config, load))
        _batch(pilot, ["a"])
        pilot.view.apply(PolicyUpdate(1, tuple(
            EngineDecision("a", bucket, "", 0, probe_rate=probe_rate, probe_k=1,
                           probe_draft=e.drafter, probe_steps=probe_steps)
            for bucket in range(len(pilot.view.bucket_bounds) + 1)),
            fail_static_timeout_seconds=1e9))
        pilot.on_schedule_start()
        pilot.mark_step(_output(["r0"]), 1)
        off = pilot.requests["r0"].off_for_life
        pilot.close()
        return off

    assert not admitted_off(0.01)
    assert admitted_off(0.0)


@pytest.mark.parametrize("skip", [True, False])
def test_a_model_drafter_never_drafts_for_a_request_admitted_off(skip: bool) -> None:
    """A model drafter must see a request's prompt to draft for it, so a request whose class is
    off at its first scheduled step stays off for life: later steps holding only such requests
    skip the drafter (prefill too), and its drafts are cut to nothing after its class turns on,
    while a request admitted on keeps the drafter. Control: with ``skip_idle_drafter`` off the
    drafter sees every request and a class switched on drafts for all of them."""
    from specpilot.engine_plugin.worker_patch import IDLE_ATTR

    e = _native_engine(DraftKind.MODEL)
    config = PluginConfig(k_mode="per_request", ngram_drafts=False, suffix_drafts=False,
                          skip_idle_drafter=skip)
    pilot = Pilot(e, config, Classifier(), announce(e, config, load))
    requests = _batch(pilot, ["a", "b"])
    put_policy(pilot.view, {"a": ("", 0), "b": (e.drafter, 2)}, version=1)

    def idle(scheduled: Sequence[str]) -> bool:
        pilot.on_schedule_start()
        output = _output(scheduled)
        pilot.mark_step(output, len(scheduled))
        return bool(getattr(output, IDLE_ATTR))

    assert not idle(["r0", "r1"])  # r0 admitted off, r1 on
    assert idle(["r0"]) is skip
    put_policy(pilot.view, {"a": (e.drafter, 4), "b": ("", 0)}, version=2)
    r2 = requests["r2"] = _Request(2)  # class a, now on
    r2.sampling_params = _Params("a")  # type: ignore[assignment]
    pilot.on_add_request(r2)  # type: ignore[arg-type]
    assert idle(["r0"]) is skip  # still off for life
    assert not idle(["r0", "r2"]) and not idle(["r1"])  # r2 admitted on; r1 was
    pilot.on_schedule_start()
    for r in requests.values():
        r.spec_token_ids = [5, 6, 7, 8]
    pilot.on_drafts(requests, list(requests), 3, None)  # type: ignore[arg-type]
    assert requests["r0"].spec_token_ids == ([] if skip else [5, 6, 7, 8])
    assert requests["r2"].spec_token_ids == [5, 6, 7, 8]
    assert requests["r1"].spec_token_ids == []  # admitted on, b off now: cut this step
    for req_id in requests:
        pilot._forget(req_id)  # what on_free does first
    assert pilot._off_for_life == 0
    pilot.close()
