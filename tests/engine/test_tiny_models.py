"""The tiny model build: cached, complete, and a mismatched draft that differs in two tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.demo.tiny_models import MARKER, VERSION, TinyModels, build_tiny_models


def test_build_is_cached_and_complete(tiny_models: TinyModels) -> None:
    started = time.perf_counter()
    again = build_tiny_models(tiny_models.root)
    assert time.perf_counter() - started < 1.0
    assert again == tiny_models
    assert json.loads((tiny_models.root / MARKER).read_text())["version"] == VERSION
    for model in (tiny_models.target, tiny_models.draft, tiny_models.mismatched_draft):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (model / name).is_file(), model / name
    target = json.loads((tiny_models.target / "config.json").read_text())
    draft = json.loads((tiny_models.draft / "config.json").read_text())
    assert target["num_hidden_layers"] == 2 and draft["num_hidden_layers"] == 1
    assert target["vocab_size"] == draft["vocab_size"] == tiny_models.vocab_size


def _heads(models: TinyModels) -> dict[str, tuple[Path, Path]]:
    return {"eagle": (models.eagle, models.target),
            "exact_eagle": (models.exact_eagle, models.exact_target)}


@pytest.mark.parametrize("name", ["eagle", "exact_eagle"])
def test_the_eagle_head_holds_what_vllm_loads(tiny_models: TinyModels, name: str) -> None:
    from safetensors import safe_open

    head_dir, target_dir = _heads(tiny_models)[name]
    head = json.loads((head_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    assert head["num_hidden_layers"] == 1 and head["hidden_size"] == target["hidden_size"]
    assert head["architectures"] == ["LlamaForCausalLM"]  # what vLLM maps to its EAGLE model
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    # fc over (token embedding, target hidden state); no input norm, no embeddings, no LM head:
    # vLLM shares the target's.
    assert tuple(fc.shape) == (target["hidden_size"], 2 * target["hidden_size"])
    assert "layers.0.self_attn.q_proj.weight" in names
    assert not any("input_layernorm" in n or "embed_tokens" in n or "lm_head" in n
                   for n in names)
    assert (head_dir / "tokenizer.json").is_file()  # for the tokenizer guard


def _greedy_agreement(head_dir: Path, target_dir: Path) -> float:
    """Teacher-forced share of positions where the head's top token is the target's, on random
    token windows, with the head's weights as saved (the way vLLM computes it)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from benchmarks.demo.eagle import EagleHead

    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = EagleHead(target, seed=0)
    weights = load_file(str(head_dir / "model.safetensors"))
    head.fc.weight.data.copy_(weights.pop("fc.weight"))
    head.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items()})
    tokens = torch.randint(4, target.config.vocab_size, (8, 64),
                           generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = target.model(input_ids=tokens).last_hidden_state
        want = target.lm_head(hidden[:, 1:]).argmax(-1)  # the target's next token after x[t+1]
        got = head.lm_head(head.forward(tokens[:, 1:], hidden[:, :-1])).argmax(-1)
    return float((got == want).float().mean())


def test_the_exact_head_drafts_its_targets_greedy_tokens(tiny_models: TinyModels) -> None:
    # Not 1.0: EAGLE pairs x[t+1] with h[t], so the head's attention never sees a sequence's
    # first token (the target's does); a few near-ties flip on that (0.994 measured).
    assert _greedy_agreement(tiny_models.exact_eagle, tiny_models.exact_target) > 0.98
    # Control: the trained head on the 2-layer target is a real, imperfect draft.
    assert _greedy_agreement(tiny_models.eagle, tiny_models.target) < 0.9


def test_tokenizers(tiny_models: TinyModels) -> None:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(tiny_models.tokenizer)
    target = AutoTokenizer.from_pretrained(tiny_models.target)
    draft = AutoTokenizer.from_pretrained(tiny_models.draft)
    bad = AutoTokenizer.from_pretrained(tiny_models.mismatched_draft)
    assert len(base) == tiny_models.vocab_size
    assert base.get_vocab() == target.get_vocab() == draft.get_vocab()
    assert (base.bos_token, base.eos_token, base.unk_token, base.pad_token) == (
        "<s>",
        "</s>",
        "<unk>",
        "<pad>",
    )
    text = "def foo(x):\n    return x  # GNU General Public License"
    ids = base(text)["input_ids"]
    assert ids[0] == base.bos_token_id
    assert base.decode(ids, skip_special_tokens=True) == text

    # Same size (so vLLM accepts it silently), two entries differ: the ids of two tokens swap.
    good_vocab, bad_vocab = base.get_vocab(), bad.get_vocab()
    assert len(bad) == len(base)
    assert set(good_vocab) == set(bad_vocab)
    differing = sorted(t for t in good_vocab if good_vocab[t] != bad_vocab[t])
    assert differing == sorted(tiny_models.mismatched_tokens)
    a, b = tiny_models.mismatched_tokens
    assert good_vocab[a] == bad_vocab[b] and good_vocab[b] == bad_vocab[a]
