"""Prompt-lookup (n-gram) drafts: proposals, and their acceptance measured counterfactually.

Proposals use vLLM's own matcher (`_find_longest_matched_ngram_and_propose_tokens`, the function
behind its n-gram drafter), so a draft substituted by the plugin is what vLLM's n-gram method would
have proposed, for contexts up to MAX_CONTEXT_TOKENS (beyond that the plugin searches only the most
recent tokens, to bound its per-step cost; substitution and counterfactual scoring use the same
window, so they stay comparable).

Counterfactual acceptance: an n-gram draft is deterministic and verified as one-hot, so the
probability that its first j tokens are accepted equals the probability that the target generates
exactly those j tokens. Comparing a proposal made at context length n with the tokens the request
actually produced at n, n+1, ... therefore measures the n-gram draft's acceptance on traffic that
another drafter (or none) served, without running it in the verification path. Each request keeps
at most one pending proposal; it is scored once enough of its continuation is known, and the next
one is made at the then current length, as an n-gram-served request would after a verification.

Cost: the scorer keeps each scored request's last MAX_CONTEXT_TOKENS tokens in its own int32
buffer and appends only the tokens that are new since its last proposal (re-reading the list only
when vLLM rewrote it), so a proposal costs the matcher itself, about 1-2 us, instead of slicing and
converting the whole context (3-30 us). One batched matcher call per step would save only the
numba dispatch (well under 1 us per proposal) and would need the buffers copied into one array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

NGRAM_DRAFT = "ngram"
# Search only this much recent context: proposals come from nearby text and the cost stays bounded.
MAX_CONTEXT_TOKENS = 2048


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, max_model_len: int) -> None:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as find,
        )

        self._find = find
        self.min_n, self.max_n, self.max_model_len = min_n, max_n, max_model_len

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the longest earlier match of the context's suffix."""
        if k <= 0 or len(tokens) < self.min_n:
            return []
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


WindowProposer = Callable[[np.ndarray, int, int], list[int]]


class _Context:
    """One scored request: the last MAX_CONTEXT_TOKENS of its tokens as int32 (appended with the
    tokens that are new since the last proposal, never re-read whole), and its pending proposal."""

    __slots__ = ("buf", "end", "num_prompt", "pending", "pending_start", "start", "total")

    def __init__(self) -> None:
        self.buf = np.empty(2 * MAX_CONTEXT_TOKENS, dtype=np.int32)
        self.start = self.end = self.total = 0  # window = buf[start:end], of `total` tokens
        self.num_prompt = -1
        self.pending_start = 0
        self.pending: list[int] | None = None

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


def accepted_prefix(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """Length of the common prefix of a proposal and what the target actually generated."""
    n = 0
    for p, a in zip(proposal, actual, strict=False):
        if p != a:
            break
        n += 1
    return n


class CounterfactualNgram:
    """Scores n-gram proposals against the tokens requests really produced. ``propose``:
    ``NgramProposer.propose_window`` (or a stand-in)."""

    def __init__(self, propose: WindowProposer, k: int) -> None:
        self._propose = propose
        self.k = k
        self._contexts: dict[str, _Context] = {}

    def step(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int
             ) -> tuple[int, int] | None:
        """Advance one request whose token list is now ``tokens`` (read only where it is new:
        pass vLLM's list itself, not a copy).

        Returns (K proposed, accepted) when a pending proposal could be scored, else None.
        Proposals are made only in the decode phase (after the prompt).
        """
        scored = None
        ctx = self._contexts.get(req_id)
        if ctx is None:
            ctx = self._contexts[req_id] = _Context()
        pending = ctx.pending
        if pending is not None:
            known = tokens[ctx.pending_start : ctx.pending_start + len(pending)]
            accepted = accepted_prefix(pending, known)
            # Resolved once the continuation covers the proposal or already diverged from it.
            # Scored as K asked, not as the proposal's length: a short or empty proposal (no
            # match) is a step that yields 1 + accepted tokens, like rejections at the end.
            if len(known) == len(pending) or accepted < len(known):
                scored = (self.k, accepted)
                ctx.pending = pending = None
        n = len(tokens)
        if pending is None and n >= num_prompt_tokens:
            ctx.pending_start = n
            ctx.pending = self._propose(ctx.window(tokens, num_prompt_tokens), n, self.k)
        return scored

    def forget(self, req_id: str) -> None:
        self._contexts.pop(req_id, None)
