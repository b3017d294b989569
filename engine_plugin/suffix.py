"""Suffix drafts (Suffix Decoding, arXiv 2411.04975), a deterministic draft
(specpilot.engine_plugin.deterministic), from the ``arctic-inference`` package that vLLM's own
``method: "suffix"`` uses.

A proposal continues the request's last tokens from the better-scoring of two suffix trees: one
over the request's own prompt and response, one over the responses of earlier requests (the
global tree; repetitive and agentic traffic repeats them). The plugin keeps its own cache, beside
whatever drafter the engine runs. Only the requests it proposes for enter it (those served by
suffix drafts, and the sample scored counterfactually): each is started with its prompt at its
first proposal, appended with its new tokens at each one, and its response stays in the global
tree when it finishes. Inserting costs about 1.3 us and 220 bytes per token (measured on 2,000
random 512-token responses), which is why the rest of the traffic is left out: a class scored
but not served sees a global tree of that sample only, so cross-request repeats are
under-counted until the class is served by suffix drafts (then all of its responses enter).

The tree parameters are the engine's (``SpeculativeConfig.suffix_decoding_*``: vLLM's defaults
when the engine runs another method), so a substituted suffix draft is what vLLM's suffix method
would propose with the same trees; the number of responses kept is the plugin's
``suffix_cached_responses`` (memory in the scheduler process).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SUFFIX_DRAFT = "suffix"


def suffix_available() -> bool:
    """Whether ``arctic_inference.suffix_decoding`` can be imported (its C++ extension built)."""
    try:
        return importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    except ImportError:  # the parent package is missing
        return False


@dataclass(frozen=True)
class SuffixTrees:
    """The engine's suffix-decoding settings (vLLM's ``SpeculativeConfig`` fields)."""

    max_tree_depth: int = 24  # tokens matched and drafted at most
    max_cached_requests: int = 10000  # responses in the global tree (0: no global tree)
    max_spec_factor: float = 1.0  # a draft is at most this times the matched length
    min_token_prob: float = 0.1  # draft tokens below this estimated probability are cut

    @classmethod
    def from_spec(cls, spec: Any) -> SuffixTrees:
        """From vLLM's ``SpeculativeConfig`` (None: the defaults)."""
        d = cls()

        def read(name: str, default: float) -> Any:
            return getattr(spec, f"suffix_decoding_{name}", default)

        return cls(max_tree_depth=int(read("max_tree_depth", d.max_tree_depth)),
                   max_cached_requests=int(read("max_cached_requests", d.max_cached_requests)),
                   max_spec_factor=float(read("max_spec_factor", d.max_spec_factor)),
                   min_token_prob=float(read("min_token_prob", d.min_token_prob)))


class SuffixProposer:
    """The suffix draft: proposals from a ``SuffixDecodingCache`` the plugin keeps itself."""

    name = SUFFIX_DRAFT

    def __init__(self, trees: SuffixTrees, max_model_len: int) -> None:
        from arctic_inference.suffix_decoding import (  # type: ignore[import-untyped]
            SuffixDecodingCache,
        )

        self.trees = trees
        self.max_model_len = max_model_len
        self._cache = SuffixDecodingCache(max_tree_depth=trees.max_tree_depth,
                                          max_cached_requests=trees.max_cached_requests)
        # Active request id -> (its prompt length, tokens the cache holds of it).
        self._fed: dict[str, tuple[int, int]] = {}

    def _sync(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        """Start the request in the cache, or append its tokens that are new."""
        fed = self._fed.get(req_id)
        if fed is None or fed[0] != num_prompt_tokens or fed[1] > len(tokens):
            # First proposal, or vLLM rewrote the list (a streaming session's next input).
            if fed is not None:
                self._cache.stop_request(req_id)
            self._cache.start_request(req_id, list(tokens[:num_prompt_tokens]))
            fed = (num_prompt_tokens, num_prompt_tokens)
        if len(tokens) > fed[1]:
            self._cache.add_active_response(req_id, list(tokens[fed[1]:]))
        self._fed[req_id] = (num_prompt_tokens, len(tokens))

    def propose(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int
                ) -> list[int]:
        n = len(tokens)
        k = min(k, self.max_model_len - n - 1)  # as vLLM's proposer: room for the bonus token
        if k <= 0:
            return []
        self._sync(req_id, tokens, num_prompt_tokens)
        context = list(tokens[-self.trees.max_tree_depth:])
        draft = self._cache.speculate(req_id, context, max_spec_tokens=k,
                                      max_spec_factor=self.trees.max_spec_factor,
                                      min_token_prob=self.trees.min_token_prob)
        return list(draft.token_ids)

    def finish(self, req_id: str, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        """A request the cache holds: its whole response stays in the global tree (up to
        ``max_cached_requests``, oldest evicted first); its prompt tree is dropped."""
        if req_id not in self._fed:
            return
        self._sync(req_id, tokens, num_prompt_tokens)
        del self._fed[req_id]
        self._cache.stop_request(req_id)
