"""The pilot without vLLM: the hello after the tokenizer guard (``announce``), a constructor that
does no I/O, and ``Pilot.create`` that reads the rules and starts the link."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from controller.core.types import DraftKind, DraftSpec
from engine_plugin.classify import Classifier
from engine_plugin.config import PluginConfig
from engine_plugin.ngram import NGRAM_DRAFT
from engine_plugin.pilot import EngineSpec, Pilot, announce
from engine_plugin.policy_view import Choice
from engine_plugin.vocab import TokenizerLike, vocab_hash


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


def test_matching_draft_is_offered_with_ngram_substitution() -> None:
    a = announce(engine(), PluginConfig(engine_id="e1"), load)
    target_hash = vocab_hash(TOKENIZERS["target"])
    assert a.drafts_allowed == {"draft", NGRAM_DRAFT}
    assert a.hello.drafts == (DraftSpec("draft", DraftKind.MODEL, 4, target_hash),
                              DraftSpec(NGRAM_DRAFT, DraftKind.NGRAM, 4))
    h = a.hello
    assert (h.engine_id, h.model, h.target_vocab_hash, h.max_k) == ("e1", "m", target_hash, 4)
    assert (h.per_request_k, h.batch_wide_k, h.ngram_substitution, h.ngram_counterfactual) == (
        True, False, True, True)
    assert h.max_batch_size == 8


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
