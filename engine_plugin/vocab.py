"""Tokenizer identity: a hash over the vocabulary and special tokens, and a readable diff.

Draft and target must share a tokenizer byte for byte, or acceptance numbers mean nothing. The
engine hashes the target's and each draft's tokenizer at start-up, refuses speculation with a
draft whose hash differs (naming the first differing entries), and sends the hashes in its hello
so the controller refuses such a draft too.

``vocab_hash`` is the sha256 (hex) of a canonical text: a version line, then one JSON line
``[token, id]`` per ``get_vocab()`` item in sorted order, then a separator line, then one JSON
line ``[token, id]`` per special token (``all_special_tokens`` with their ids), sorted. JSON
escaping makes the encoding unambiguous for any token text. Sorting makes the hash independent of
dict order; special tokens are compared as a set of (token, id) pairs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

_SCHEME = "specpilot-vocab-v1"


class TokenizerLike(Protocol):
    """What is read from a tokenizer (Hugging Face tokenizers and vLLM's wrappers have these)."""

    def get_vocab(self) -> Mapping[str, int]: ...

    @property
    def all_special_tokens(self) -> Sequence[str]: ...


def _special_pairs(tokenizer: TokenizerLike, vocab: Mapping[str, int]) -> list[tuple[str, int]]:
    tokens = list(tokenizer.all_special_tokens)
    ids: Any = getattr(tokenizer, "all_special_ids", None)
    if ids is None or len(ids) != len(tokens):
        ids = [vocab.get(t, -1) for t in tokens]
    return sorted({(str(t), int(i)) for t, i in zip(tokens, ids, strict=True)})


def vocab_hash(tokenizer: TokenizerLike) -> str:
    """sha256 hex over the sorted vocabulary items and the special tokens with their ids."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    h.update(f"{_SCHEME}\n".encode())
    for token, token_id in sorted(vocab.items()):
        h.update(json.dumps([token, int(token_id)], ensure_ascii=False).encode("utf-8",
                                                                                "surrogatepass"))
        h.update(b"\n")
    h.update(b"--special--\n")
    for token, token_id in _special_pairs(tokenizer, vocab):
        h.update(json.dumps([token, token_id], ensure_ascii=False).encode("utf-8",
                                                                          "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


def first_differences(
    tok_a: TokenizerLike,
    tok_b: TokenizerLike,
    limit: int = 5,
    *,
    labels: tuple[str, str] = ("target", "draft"),
) -> list[str]:
    """Up to ``limit`` differences, vocabulary entries first (in order of the lowest id
    involved), then special tokens. Empty when the hashes would be equal."""
    a_name, b_name = labels
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    out: list[str] = []

    def where(vocab: Mapping[str, int], token: str, name: str) -> str:
        return f"id {vocab[token]} in {name}" if token in vocab else f"absent in {name}"

    differing = [t for t in vocab_a.keys() | vocab_b.keys() if vocab_a.get(t) != vocab_b.get(t)]
    absent = 1 << 62
    differing.sort(key=lambda t: (min(vocab_a.get(t, absent), vocab_b.get(t, absent)),
                                  vocab_a.get(t, absent), t))
    for token in differing[:limit]:
        out.append(f"token {token!r}: {where(vocab_a, token, a_name)}, "
                   f"{where(vocab_b, token, b_name)}")
    if len(vocab_a) != len(vocab_b) and len(out) < limit:
        out.append(f"vocabulary size: {len(vocab_a)} in {a_name}, {len(vocab_b)} in {b_name}")
    special_a = set(_special_pairs(tok_a, vocab_a))
    special_b = set(_special_pairs(tok_b, vocab_b))
    for token, token_id, name in sorted(
        [(t, i, a_name) for t, i in special_a - special_b]
        + [(t, i, b_name) for t, i in special_b - special_a]
    ):
        if len(out) >= limit:
            break
        out.append(f"special token {token!r} (id {token_id}) only in {name}")
    return out[:limit]
