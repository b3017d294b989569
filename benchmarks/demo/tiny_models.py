"""Tiny local models for engine tests: a byte-level BPE tokenizer, a target, a draft, a bad draft.

No model hub: everything is built here from local text (the Python standard library's sources
and /usr/share/common-licenses) in about 40 seconds, with fixed seeds, and cached on disk.

- ``tokenizer``: byte-level BPE (~2000 tokens incl. ``<unk> <s> </s> <pad>``), trained with
  ``tokenizers`` and wrapped as ``transformers.PreTrainedTokenizerFast``; prompts get ``<s>``.
- ``target``: ``LlamaForCausalLM``, 2 layers, hidden 64, 4 heads of dim 32 (vLLM's CPU
  attention rejects head_dim 16), random weights (seed 1234). Its LM head is scaled up so
  next-token distributions are peaked (top token typically tens of percent at temperature 1)
  rather than nearly uniform over the vocabulary: sampled-distribution tests then have a few
  well-populated tokens to compare, and greedy argmaxes are far from ties.
  Used as its own draft it is accepted 100% (greedy).
- ``draft``: a separate random 1-layer Llama (seed 4321) sharing the tokenizer: acceptance ~0.
- ``mismatched_draft``: the draft's weights with a tokenizer that differs from the target's in
  exactly two entries (two learned tokens swap ids). Same vocabulary size, so vLLM itself accepts
  it silently: only a vocabulary guard notices.
- ``eagle``: an EAGLE-1 head on the target (:mod:`benchmarks.demo.eagle`: ``fc`` and one
  decoder layer, the target's embeddings and scaled LM head shared as vLLM shares them), trained
  for 1,000 steps on the target's own T=0.8 samples (seed 5678, ~30 s), served with
  ``{"method": "eagle", "model": ...}``.
- ``exact_target`` and ``exact_eagle``: a random 1-layer target whose token embeddings all have
  RMS 1, and an EAGLE head that copies its layer (``fc`` passes the token embedding through, the
  target's hidden state is ignored). With unit-RMS embeddings the target's input norm is the
  identity, so the head computes the target's pre-norm hidden state exactly, and the final norm
  (weight 1) only rescales it: the head's greedy drafts are the target's tokens at every
  position (but for near-ties: EAGLE's attention never sees a sequence's first token), as the
  target drafting for itself is for the model draft. At T>0 the head's
  distribution is the target's at another temperature, so acceptance falls with temperature.

Every model directory holds its tokenizer next to the weights (``save_pretrained``,
safetensors). The corpus and tokenizer training live in :mod:`benchmarks.demo.corpus` (shared
with the demo models). A build is complete when ``<root>/tiny-models.json`` holds the current
:data:`VERSION`; :func:`build_tiny_models` returns such a build at once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.demo.cache import build_once
from benchmarks.demo.corpus import SPECIAL_TOKENS, train_tokenizer, wrap_tokenizer
from benchmarks.demo.eagle import (
    EagleHead,
    EagleSettings,
    OwnSamples,
    save_eagle_head,
    train_head,
)
from benchmarks.demo.models import PROFILES, LlamaShape, build_llama

VERSION = "specpilot-tiny-models-6"  # 6: a chat template
MARKER = "tiny-models.json"
VOCAB_SIZE = 2000
TARGET_SEED = 1234
DRAFT_SEED = 4321
EAGLE_SEED = 5678
EXACT_TARGET_SEED = 2468
# Steps of the EAGLE head's training on the target's own samples (~30 s): teacher-forced top-1
# agreement about 0.5, so T>0 tests see accepted EAGLE drafts, not only rejections.
EAGLE_STEPS = 1000
# Scale of the target's LM head over its random init (std 0.02 * 25 = 0.5): logits with a std of
# about 4 instead of 0.16, so temperature-1 distributions are peaked, not flat.
TARGET_LM_HEAD_SCALE = 25.0
DRAFT_LM_HEAD_SCALE = 25.0


@dataclass(frozen=True)
class TinyModels:
    """Paths of one build (each model dir also holds the tokenizer files)."""

    root: Path
    tokenizer: Path
    target: Path
    draft: Path
    mismatched_draft: Path
    eagle: Path  # an EAGLE-1 head on the target (trained; shares its embeddings and LM head)
    exact_target: Path  # a 1-layer target with unit-RMS token embeddings
    exact_eagle: Path  # an EAGLE-1 head on exact_target that copies its layer: exact greedy drafts
    vocab_size: int
    # The two token strings whose ids are swapped in mismatched_draft's tokenizer.
    mismatched_tokens: tuple[str, str]
    build_seconds: float


def _train_tokenizer() -> Any:
    return train_tokenizer(VOCAB_SIZE)


def _wrap(tok: Any) -> Any:
    return wrap_tokenizer(tok, model_max_length=512)


def _swap_two_tokens(tok: Any) -> tuple[Any, tuple[str, str]]:
    """A copy of ``tok`` whose two most recently learned tokens swap ids."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    specials = set(SPECIAL_TOKENS)
    by_id = sorted((i, t) for t, i in vocab.items() if t not in specials)
    (id_a, tok_a), (id_b, tok_b) = by_id[-2], by_id[-1]
    vocab[tok_a], vocab[tok_b] = id_b, id_a
    return Tokenizer.from_str(json.dumps(data)), (tok_a, tok_b)


def _llama(vocab_size: int, layers: int, seed: int, special: dict[str, int]) -> Any:
    # hidden 64 / 4 heads would give head_dim 16, which vLLM's CPU attention rejects
    # ("Unsupported CPU attention configuration: head_dim=16"); it supports 32, 64, ...
    model = build_llama(LlamaShape(hidden=64, layers=layers, heads=4, head_dim=32,
                                   intermediate=128), vocab_size, special, seed)
    model.eval()
    return model


def _save(model: Any, tokenizer: Any, path: Path, lm_head_scale: float) -> None:
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _unit_rms_embeddings(model: Any) -> None:
    """Scale every token embedding to RMS 1: the first layer's input norm (weight 1 at init) is
    then the identity up to its epsilon (a factor 1 - 5e-7)."""
    import torch

    with torch.no_grad():
        weight = model.model.embed_tokens.weight
        weight.div_(weight.pow(2).mean(-1, keepdim=True).sqrt())


def _copy_of_layer(target: Any) -> EagleHead:
    """An EAGLE head computing ``target``'s only layer on the token embeddings: ``fc`` takes the
    embedding half of its input as is and drops the target's hidden state; the layer's weights
    are the target's (its input norm, the identity here, is the one part EAGLE's layer lacks)."""
    import torch

    assert target.config.num_hidden_layers == 1
    head = EagleHead(target, EXACT_TARGET_SEED)
    hidden = target.config.hidden_size
    layer = {k: v for k, v in target.model.layers[0].state_dict().items()
             if not k.startswith("input_layernorm")}
    head.layer.load_state_dict(layer)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden] = torch.eye(hidden)
    return head


def _valid(data: dict[str, Any]) -> bool:
    return data.get("version") == VERSION


def _models(root: Path, data: dict[str, Any]) -> TinyModels:
    a, b = data["mismatched_tokens"]
    return TinyModels(
        root=root,
        tokenizer=root / "tokenizer",
        target=root / "target",
        draft=root / "draft",
        mismatched_draft=root / "mismatched_draft",
        eagle=root / "eagle",
        exact_target=root / "exact_target",
        exact_eagle=root / "exact_eagle",
        vocab_size=int(data["vocab_size"]),
        mismatched_tokens=(str(a), str(b)),
        build_seconds=float(data["build_seconds"]),
    )


def build_tiny_models(root: Path) -> TinyModels:
    """Build (or reuse) the tiny tokenizer, target, draft and mismatched draft under ``root``.

    Returns at once when ``root`` already holds a complete build of this :data:`VERSION`.
    Otherwise builds into a temporary sibling directory and renames it into place, so an
    interrupted build never looks complete and concurrent builders do not mix files.
    """
    root = Path(root)
    started = time.perf_counter()

    def build(tmp: Path) -> dict[str, Any]:
        raw = _train_tokenizer()
        tokenizer = _wrap(raw)
        tokenizer.save_pretrained(tmp / "tokenizer")
        special = {t: int(raw.token_to_id(t)) for t in SPECIAL_TOKENS}
        vocab_size = len(tokenizer)

        target = _llama(vocab_size, layers=2, seed=TARGET_SEED, special=special)
        _save(target, tokenizer, tmp / "target", TARGET_LM_HEAD_SCALE)
        head = EagleHead(target, EAGLE_SEED)
        train_head(head, target, OwnSamples(target, vocab_size, EAGLE_SEED),
                   EagleSettings(steps=EAGLE_STEPS), batch_size=PROFILES["untrained"].batch_size,
                   warmup_steps=PROFILES["untrained"].warmup_steps, progress=False)
        save_eagle_head(head, tmp / "target", tmp / "eagle")
        exact = _llama(vocab_size, layers=1, seed=EXACT_TARGET_SEED, special=special)
        _unit_rms_embeddings(exact)
        _save(exact, tokenizer, tmp / "exact_target", TARGET_LM_HEAD_SCALE)
        # After the save, which names the architecture that vLLM maps to its EAGLE model.
        save_eagle_head(_copy_of_layer(exact), tmp / "exact_target", tmp / "exact_eagle")
        draft = _llama(vocab_size, layers=1, seed=DRAFT_SEED, special=special)
        _save(draft, tokenizer, tmp / "draft", DRAFT_LM_HEAD_SCALE)

        swapped, mismatched_tokens = _swap_two_tokens(raw)
        mismatched = _wrap(swapped)
        assert len(mismatched) == vocab_size
        shutil.copytree(tmp / "draft", tmp / "mismatched_draft")
        for name in os.listdir(tmp / "tokenizer"):
            (tmp / "mismatched_draft" / name).unlink(missing_ok=True)
        mismatched.save_pretrained(tmp / "mismatched_draft")
        return {
            "version": VERSION,
            "vocab_size": vocab_size,
            "mismatched_tokens": list(mismatched_tokens),
            "build_seconds": round(time.perf_counter() - started, 3),
        }

    return _models(root, build_once(root, MARKER, _valid, build))


# Manual use: python -m benchmarks.demo.tiny_models DIR
if __name__ == "__main__":  # pragma: no cover
    import sys

    built = build_tiny_models(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-models"))
    print(built)
