"""Tokenizer identity on small word-level tokenizers built here (no downloads)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from specpilot.engine_plugin.vocab import first_differences, vocab_hash  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far"]


def make_tokenizer(words: list[str] = WORDS, **special: Any) -> Any:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"unk_token": "[UNK]", "bos_token": "<s>", "eos_token": "</s>", **special}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def test_equal_tokenizers_hash_equal() -> None:
    a, b = make_tokenizer(), make_tokenizer()
    assert a is not b
    h = vocab_hash(a)
    assert h == vocab_hash(b)
    assert len(h) == 64 and int(h, 16) >= 0
    assert first_differences(a, b) == []


def test_one_token_differs() -> None:
    words = list(WORDS)
    words[4] = "hat"  # id 7: "mat" in the target, "hat" in the draft
    a, b = make_tokenizer(), make_tokenizer(words)
    assert vocab_hash(a) != vocab_hash(b)
    diffs = first_differences(a, b)
    assert diffs == ["token 'mat': id 7 in target, absent in draft",
                     "token 'hat': absent in target, id 7 in draft"]


def test_swapped_ids_and_size() -> None:
    words = list(WORDS)
    words[0], words[1] = words[1], words[0]
    a, b = make_tokenizer(), make_tokenizer([*words, "extra"])
    diffs = first_differences(a, b, labels=("target", "draft-s"))
    assert diffs[:2] == ["token 'the': id 3 in target, id 4 in draft-s",
                         "token 'cat': id 4 in target, id 3 in draft-s"]
    assert "token 'extra': absent in target, id 11 in draft-s" in diffs
    assert "vocabulary size: 11 in target, 12 in draft-s" in diffs
    assert len(first_differences(a, b, limit=1)) == 1


def test_special_tokens_count() -> None:
    a = make_tokenizer()
    b = make_tokenizer(pad_token="[UNK]")  # same vocabulary, one more special role
    c = make_tokenizer(additional_special_tokens=["dog"])
    assert a.get_vocab() == c.get_vocab()
    assert vocab_hash(a) == vocab_hash(b)  # special tokens compare as a set of (token, id)
    assert vocab_hash(a) != vocab_hash(c)
    assert first_differences(a, c) == ["special token 'dog' (id 8) only in draft"]


def test_plain_objects_with_the_same_interface() -> None:
    class Plain:
        def __init__(self, vocab: dict[str, int], special: list[str]) -> None:
            self._vocab, self.all_special_tokens = vocab, special

        def get_vocab(self) -> dict[str, int]:
            return dict(self._vocab)

    hf = make_tokenizer()
    plain = Plain(hf.get_vocab(), list(hf.all_special_tokens))
    assert vocab_hash(plain) == vocab_hash(hf)
    # Token text with quotes, newlines and non-ASCII is encoded unambiguously.
    odd = Plain({'a"b': 0, "a\nb": 1, "é": 2, "\u0120x": 3}, [])
    assert vocab_hash(odd) != vocab_hash(Plain({'a"b': 0, "a\nb": 1, "é": 2, "\u0120y": 3}, []))
