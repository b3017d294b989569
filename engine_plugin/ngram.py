"""Prompt-lookup (n-gram) drafts, a deterministic draft (specpilot.engine_plugin.deterministic).

Proposals use vLLM's own matcher (`_find_longest_matched_ngram_and_propose_tokens`, the function
behind its n-gram drafter), so a draft substituted by the plugin is what vLLM's n-gram method would
have proposed, for contexts up to MAX_CONTEXT_TOKENS (beyond that the plugin searches only the most
recent tokens, to bound its per-step cost; substitution and counterfactual scoring use the same
window, so they stay comparable).

Cost: the proposer keeps each request's last MAX_CONTEXT_TOKENS tokens in its own int32 buffer
and appends only the tokens that are new since its last proposal (re-reading the list only when
vLLM rewrote it), so a proposal costs the matcher itself, about 1-2 us, instead of slicing and
converting the whole context (3-30 us); the matcher is compiled when the proposer is built, at
engine start, never in a served step. One batched matcher call per step would save only the
numba dispatch (well under 1 us per proposal) and would need the buffers copied into one array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NGRAM_DRAFT = "ngram"
# Search only this much recent context: proposals come from nearby text and the cost stays bounded.
MAX_CONTEXT_TOKENS = 2048


class NgramProposer:
    """The n-gram draft: proposals from vLLM's matcher over each request's recent tokens."""

    name = NGRAM_DRAFT

    def __init__(self, min_n: int, max_n: int, max_model_len: int) -> None:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as find,
        )

        self._find = find
        self.min_n, self.max_n, self.max_model_len = min_n, max_n, max_model_len
        self._contexts: dict[str, _Context] = {}
        # Compile the matcher now, at engine start, as vLLM's own n-gram drafter does: numba
        # compiles on the first call, which would otherwise stall a served step's scheduler.
        find(np.zeros(2 * max_n, dtype=np.int32), min_n, max_n, 2 * max_n + 1, 1)

    def propose(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int
                ) -> list[int]:
        """Up to k tokens following the longest earlier match of the context's suffix, from the
        request's own buffer (appended with the tokens new since its last proposal)."""
        ctx = self._contexts.get(req_id)
        if ctx is None:
            ctx = self._contexts[req_id] = _Context()
        return self.propose_window(ctx.window(tokens, num_prompt_tokens), len(tokens), k)

    def finish(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        self._contexts.pop(req_id, None)

    def propose_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        """``propose`` for a context read whole (sliced and converted): the reference."""
        return self.propose_window(np.asarray(tokens[-MAX_CONTEXT_TOKENS:], dtype=np.int32),
                                   len(tokens), k)

    def propose_window(self, window: np.ndarray, total: int, k: int) -> list[int]:
        """``propose`` for a context of ``total`` tokens whose last ones (up to
        MAX_CONTEXT_TOKENS) are the int32 array ``window``."""
        if k <= 0 or total < self.min_n:
            return []
        # The matcher caps k by max_model_len - len(tokens); pass the true length's headroom.
        headroom = self.max_model_len - total
        out: list[int] = self._find(window, self.min_n, self.max_n, len(window) + headroom,
                                    k).tolist()
        return out


class _Context:
    """One request's last MAX_CONTEXT_TOKENS tokens as int32 (appended with the tokens that are
    new since the last proposal, never re-read whole)."""

    __slots__ = ("buf", "end", "num_prompt", "start", "total")

    def __init__(self) -> None:
        self.buf = np.empty(2 * MAX_CONTEXT_TOKENS, dtype=np.int32)
        self.start = self.end = self.total = 0  # window = buf[start:end], of `total` tokens
        self.num_prompt = -1

    def window(self, tokens: Sequence[int], num_prompt_tokens: int) -> np.ndarray:
        """The last MAX_CONTEXT_TOKENS of ``tokens`` (the request's whole token list)."""
        n, total = len(tokens), self.total
        if (n < total or num_prompt_tokens != self.num_prompt
                or (total and tokens[total - 1] != self.buf[self.end - 1])):
            # First sight, or vLLM rewrote the list (a streaming session's next input): read the
            # window again.
            tail = tokens[-MAX_CONTEXT_TOKENS:]
            self.start, self.end = 0, len(tail)
            self.buf[: self.end] = tail
            self.num_prompt = num_prompt_tokens
        elif n > total:
            new = tokens[total:]
            m = len(new)
            if m >= MAX_CONTEXT_TOKENS:
                self.start, self.end = 0, MAX_CONTEXT_TOKENS
                self.buf[:MAX_CONTEXT_TOKENS] = new[-MAX_CONTEXT_TOKENS:]
            else:
                if self.end + m > len(self.buf):  # full: keep the last window, amortized O(1)
                    self.buf[:MAX_CONTEXT_TOKENS] = self.buf[self.end - MAX_CONTEXT_TOKENS:self.end]
                    self.end = MAX_CONTEXT_TOKENS
                self.buf[self.end:self.end + m] = new
                self.end += m
                self.start = max(0, self.end - MAX_CONTEXT_TOKENS)
        self.total = n
        return self.buf[self.start:self.end]
