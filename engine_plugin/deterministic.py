"""Deterministic drafts the plugin proposes itself (n-gram, suffix), and their acceptance
measured counterfactually.

A deterministic draft is a function of the request's tokens (and, for suffix drafts, of the
responses the engine produced before): the plugin substitutes its tokens for the model drafter's
where the policy picks it, and verification treats them as one-hot, so the output distribution
stays the target's.

Counterfactual acceptance: the probability that a deterministic draft's first j tokens are
accepted equals the probability that the target generates exactly those j tokens. Comparing a
proposal made at context length n with the tokens the request actually produced at n, n+1, ...
therefore measures the draft's acceptance on traffic that another drafter (or none) served,
without running it in the verification path. Each request keeps at most one pending proposal; it
is scored once enough of its continuation is known, and the next one is made at the then
current length, as a request served by that draft would after a verification.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

# (request id, the request's whole token list, its prompt length, K) -> up to K draft tokens.
RequestProposer = Callable[[str, Sequence[int], int, int], list[int]]


class DeterministicDraft(Protocol):
    """A draft the plugin proposes in the scheduler (``ngram``, ``suffix`` beside this module)."""

    name: str

    def propose(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int
                ) -> list[int]:
        """Up to ``k`` draft tokens after ``tokens`` (vLLM's list itself: read only where new)."""
        ...

    def finish(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        """The request left the engine with ``tokens``: drop its state (a suffix draft also
        keeps its response for later requests)."""
        ...


def accepted_prefix(proposal: Sequence[int], actual: Sequence[int]) -> int:
    """Length of the common prefix of a proposal and what the target actually generated."""
    n = 0
    for p, a in zip(proposal, actual, strict=False):
        if p != a:
            break
        n += 1
    return n


class Counterfactual:
    """Scores one deterministic draft's proposals (``propose``) against the tokens requests
    really produced, each proposal asking for ``k`` tokens."""

    def __init__(self, propose: RequestProposer, k: int) -> None:
        self._propose = propose
        self.k = k
        # Request id -> (context length the proposal was made at, the proposal).
        self._pending: dict[str, tuple[int, list[int]]] = {}

    def step(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int
             ) -> tuple[int, int] | None:
        """Advance one request whose token list is now ``tokens``.

        Returns (K proposed, accepted) when a pending proposal could be scored, else None.
        Proposals are made once the whole prompt is in the list (the first is scored against
        the token its prefill samples).
        """
        scored = None
        pending = self._pending.get(req_id)
        if pending is not None:
            start, proposal = pending
            known = tokens[start : start + len(proposal)]
            accepted = accepted_prefix(proposal, known)
            # Resolved once the continuation covers the proposal or already diverged from it,
            # and only after the target produced a token since (a prefill chunk produces none).
            # Scored as K asked, not as the proposal's length: a short or empty proposal (no
            # match) is a step that yields 1 + accepted tokens, like rejections at the end.
            if len(tokens) > start and (len(known) == len(proposal) or accepted < len(known)):
                scored = (self.k, accepted)
                pending = None
                del self._pending[req_id]
        n = len(tokens)
        if pending is None and n >= num_prompt_tokens:
            self._pending[req_id] = (n, self._propose(req_id, tokens, num_prompt_tokens, self.k))
        return scored

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
