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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
        window = np.asarray(tokens[-MAX_CONTEXT_TOKENS:], dtype=np.int32)
        # The matcher caps k by max_model_len - len(tokens); pass the true length's headroom.
        headroom = self.max_model_len - len(tokens)
        out = self._find(window, self.min_n, self.max_n, len(window) + headroom, k)
        return [int(t) for t in out]


@dataclass
class _Pending:
    start: int
    tokens: list[int]


def accepted_prefix(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """Length of the common prefix of a proposal and what the target actually generated."""
    n = 0
    for p, a in zip(proposal, actual, strict=False):
        if p != a:
            break
        n += 1
    return n


class CounterfactualNgram:
    """Scores n-gram proposals against the tokens requests really produced."""

    def __init__(self, propose: Callable[[Sequence[int], int], list[int]], k: int) -> None:
        self._propose = propose
        self.k = k
        self._pending: dict[str, _Pending] = {}

    def step(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int
             ) -> tuple[int, int] | None:
        """Advance one request whose token list is now ``tokens``.

        Returns (K proposed, accepted) when a pending proposal could be scored, else None.
        Proposals are made only in the decode phase (after the prompt).
        """
        scored = None
        pending = self._pending.get(req_id)
        if pending is not None:
            known = tokens[pending.start : pending.start + len(pending.tokens)]
            accepted = accepted_prefix(pending.tokens, known)
            # Resolved once the continuation covers the proposal or already diverged from it.
            # Scored as K asked, not as the proposal's length: a short or empty proposal (no
            # match) is a step that yields 1 + accepted tokens, like rejections at the end.
            if len(known) == len(pending.tokens) or accepted < len(known):
                scored = (self.k, accepted)
                del self._pending[req_id]
                pending = None
        if pending is None and len(tokens) >= num_prompt_tokens:
            self._pending[req_id] = _Pending(len(tokens), self._propose(tokens, self.k))
        return scored

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
