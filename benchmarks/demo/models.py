"""Model preparation for ``specpilot demo`` / ``specpilot bench engine``: target and draft.

Everything is built locally, with fixed seeds, from text every machine with Python has
(:mod:`benchmarks.demo.corpus`: standard-library sources as *code*, licence and Debian copyright
files as *prose*), and cached on disk so it runs once:

- one byte-level BPE tokenizer (~2000 tokens), saved next to every model directory;
- ``trained_target``: a small ``LlamaForCausalLM`` (demo: hidden 256, 4 layers, ~5M params)
  trained with AdamW and a cosine schedule on code + prose windows;
- ``draft``: a 1-layer Llama (demo: hidden 128) distilled from the trained target (KL to the
  target's next-token distribution plus a little cross-entropy on the data);
- ``target``: for profiles that inflate, a copy of the trained target whose MLPs are widened
  (gate/up rows appended, matching *zero* columns in ``down_proj``), so it computes the same
  function with ~10x the work per step. On a CPU a 5M-parameter target's step costs less than
  vLLM's per-step overhead and speculation cannot pay; the inflated one behaves like a GPU
  target. The build checks that both give the same logits and greedy argmaxes.

``cache_dir / profile`` holds one build; it is complete when its :data:`MARKER` file holds the
current :data:`VERSION` and profile settings. Builds go to a temporary sibling directory that
is renamed into place, so an interrupted build never looks complete.

Measured on a 2-core CPU (fp32: bf16 autocast was ~30x slower there): the demo profile builds in
about 5-6 minutes; ``untrained`` (random tiny models, for CI) in a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.demo.cache import build_once, read_marker
from benchmarks.demo.corpus import (
    KINDS,
    SPECIAL_TOKENS,
    corpus_texts,
    heldout_texts,
    train_tokenizer,
    wrap_tokenizer,
)

__all__ = [
    "MARKER",
    "PROFILES",
    "VERSION",
    "LlamaShape",
    "ModelProfile",
    "ModelSet",
    "Progress",
    "TrainingData",
    "build_llama",
    "corpus_texts",
    "heldout_texts",
    "lr_schedule",
    "prepare_models",
    "warmup_cosine",
]

VERSION = "specpilot-demo-models-2"  # 2: a chat template
MARKER = "demo-models.json"


@dataclass(frozen=True)
class LlamaShape:
    """The size of one ``LlamaForCausalLM`` (vocabulary: the tokenizer's)."""

    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int


@dataclass(frozen=True)
class ModelProfile:
    """How to build one model set. Step counts are fixed so builds are reproducible."""

    name: str
    target: LlamaShape
    draft: LlamaShape
    train: bool = True
    target_steps: int = 0
    draft_steps: int = 0
    batch_size: int = 8  # windows per step, half code and half prose
    seq_len: int = 256
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    # Draft loss: KL(target || draft) + draft_ce_weight * cross-entropy on the data.
    draft_ce_weight: float = 0.25
    # MLP intermediate size of the inflated target (0: no inflation, target == trained_target).
    inflate_intermediate: int = 0
    max_position_embeddings: int = 512
    eval_windows: int = 16  # held-out windows per kind
    target_seed: int = 1234
    draft_seed: int = 4321
    data_seed: int = 2024


PROFILES: dict[str, ModelProfile] = {
    "demo": ModelProfile(
        name="demo",
        target=LlamaShape(hidden=256, layers=4, heads=4, head_dim=64, intermediate=1024),
        draft=LlamaShape(hidden=128, layers=1, heads=2, head_dim=64, intermediate=512),
        target_steps=300,
        draft_steps=260,
        inflate_intermediate=20480,
    ),
    # Random weights, no training: the tokenizer and tiny models in seconds (CI, smoke tests).
    "untrained": ModelProfile(
        name="untrained",
        # head_dim 32: vLLM's CPU attention rejects 16.
        target=LlamaShape(hidden=64, layers=2, heads=4, head_dim=32, intermediate=128),
        draft=LlamaShape(hidden=64, layers=1, heads=4, head_dim=32, intermediate=128),
        train=False,
    ),
}


@dataclass(frozen=True)
class ModelSet:
    """Paths of one build (each model dir also holds the tokenizer files)."""

    root: Path  # the cache directory of this build
    target: Path  # what the engine serves: the inflated target when the profile inflates
    trained_target: Path  # the un-inflated trained target
    draft: Path  # the trained draft
    profile: str
    vocab_size: int
    build_seconds: float
    train_summary: dict[str, Any]  # per model: params, steps, seconds, losses


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def stage(self, message: str) -> None:
        if self.enabled:
            print(f"[specpilot models] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ build


def build_llama(shape: LlamaShape, vocab_size: int, special: dict[str, int], seed: int,
                max_position_embeddings: int = 512) -> Any:
    """A randomly initialised float32 ``LlamaForCausalLM`` of ``shape`` (seeded); ``special``
    maps ``<s>``, ``</s>`` and ``<pad>`` to their token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_position_embeddings,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        bos_token_id=special["<s>"],
        eos_token_id=special["</s>"],
        pad_token_id=special["<pad>"],
        dtype="float32",
    )
    torch.manual_seed(seed)
    llama: Any = LlamaForCausalLM  # untyped constructor
    return llama(config)


def _params(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))


def _token_stream(tok: Any, texts: list[str]) -> Any:
    """All ``texts`` tokenized (each starts with ``<s>``, ends with ``</s>``), concatenated."""
    import torch

    eos = int(tok.token_to_id("</s>"))
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class TrainingData:
    """Random training windows (half code, half prose) and fixed held-out windows."""

    def __init__(self, tok: Any, profile: ModelProfile) -> None:
        import torch

        self.seq_len = profile.seq_len
        self.train = {k: _token_stream(tok, corpus_texts(k)) for k in KINDS}
        self.heldout = {k: _token_stream(tok, heldout_texts(k)) for k in KINDS}
        self.gen = torch.Generator().manual_seed(profile.data_seed)
        self.eval = {k: self._even_windows(self.heldout[k], profile.eval_windows) for k in KINDS}

    def _even_windows(self, stream: Any, n: int) -> Any:
        import torch

        span = self.seq_len + 1
        last = int(stream.numel()) - span
        if last < 0:
            raise RuntimeError("held-out corpus too small for one evaluation window")
        starts = [round(i * last / max(n - 1, 1)) for i in range(n)]
        return torch.stack([stream[s : s + span] for s in starts])

    def batch(self, size: int) -> Any:
        import torch

        span = self.seq_len + 1
        rows = []
        for i in range(size):
            stream = self.train[KINDS[i % len(KINDS)]]
            s = int(torch.randint(0, int(stream.numel()) - span, (1,), generator=self.gen))
            rows.append(stream[s : s + span])
        return torch.stack(rows)


def lr_schedule(profile: ModelProfile, steps: int) -> Any:
    return warmup_cosine(profile.warmup_steps, steps)


def warmup_cosine(warmup_steps: int, steps: int) -> Any:
    """The learning-rate factor per step: linear warm-up, then cosine down to a tenth."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        frac = (step - warmup_steps) / max(steps - warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    return factor


def _heldout_loss(model: Any, data: TrainingData) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    model.eval()
    out: dict[str, float] = {}
    with torch.inference_mode():
        for kind, windows in data.eval.items():
            losses = []
            for chunk in windows.split(8):
                logits = model(input_ids=chunk[:, :-1]).logits
                losses.append(
                    float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()))
                )
            out[kind] = round(sum(losses) / len(losses), 4)
    out["all"] = round(sum(out[k] for k in KINDS) / len(KINDS), 4)
    model.train()
    return out


def _train(
    name: str,
    model: Any,
    data: TrainingData,
    profile: ModelProfile,
    steps: int,
    lr: float,
    progress: bool,
    teacher: Any = None,
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    started = time.perf_counter()
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": profile.weight_decay},
         {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(profile, steps))
    recent: list[float] = []
    bar = tqdm(total=steps, desc=name, file=sys.stderr, disable=not progress, leave=True,
               dynamic_ncols=True)
    try:
        for _ in range(steps):
            batch = data.batch(profile.batch_size)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            logits = model(input_ids=inputs).logits.flatten(0, 1)
            ce = F.cross_entropy(logits, labels.flatten())
            loss: Any
            if teacher is None:
                loss = ce
            else:
                with torch.inference_mode():
                    teacher_logits = teacher(input_ids=inputs).logits.flatten(0, 1)
                kl = F.kl_div(
                    F.log_softmax(logits, dim=-1),
                    F.log_softmax(teacher_logits.clone(), dim=-1),
                    log_target=True,
                    reduction="batchmean",
                )
                loss = kl + profile.draft_ce_weight * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            recent.append(float(ce.detach()))
            del recent[:-10]
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", ce=f"{float(ce):.3f}", refresh=False)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    model.eval()
    return {
        "params": _params(model),
        "steps": steps,
        "tokens": steps * profile.batch_size * profile.seq_len,
        "seconds": round(seconds, 2),
        "final_train_loss": round(sum(recent) / len(recent), 4) if recent else None,
        "heldout_loss": _heldout_loss(model, data),
        "distilled": teacher is not None,
    }


def _inflate(model: Any, intermediate: int, seed: int) -> Any:
    """A copy of ``model`` with MLPs widened to ``intermediate`` that computes the same function.

    The new units get small random gate/up rows and zero ``down_proj`` columns: their output
    is multiplied by exactly 0 before it reaches the residual stream.
    """
    import copy

    import torch
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    old = int(config.intermediate_size)
    if intermediate <= old:
        raise ValueError(f"inflate_intermediate {intermediate} <= intermediate_size {old}")
    config.intermediate_size = intermediate
    llama: Any = LlamaForCausalLM  # untyped constructor
    big = llama(config)  # (not on "meta": non-persistent buffers such as RoPE's need values)
    gen = torch.Generator().manual_seed(seed)
    extra = intermediate - old
    state: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if key.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            rows = torch.randn(extra, value.shape[1], generator=gen) * 0.02
            value = torch.cat([value, rows.to(value.dtype)], dim=0)
        elif key.endswith("mlp.down_proj.weight"):
            value = torch.cat([value, value.new_zeros(value.shape[0], extra)], dim=1)
        state[key] = value.detach().clone().contiguous()
    big.load_state_dict(state, strict=True)
    big.eval()
    return big


def _check_inflated(small: Any, big: Any, data: TrainingData, tokens: int = 384) -> dict[str, Any]:
    """Same logits and greedy argmaxes on a few hundred held-out tokens; raises if not."""
    import torch

    per_kind = max(tokens // len(KINDS), 2)
    diffs: list[float] = []
    mismatches = 0
    n = 0
    with torch.inference_mode():
        for kind in KINDS:
            ids = data.heldout[kind][:per_kind][None]
            a = small(input_ids=ids).logits[0].float()
            b = big(input_ids=ids).logits[0].float()
            diffs.append(float((a - b).abs().max()))
            top2 = a.topk(2, dim=-1).values
            gap = top2[:, 0] - top2[:, 1]
            # An argmax may only flip on an exact numerical tie (gap below the logit error).
            flips = (a.argmax(-1) != b.argmax(-1)) & (gap > 1e-4)
            mismatches += int(flips.sum())
            n += int(ids.shape[1])
    max_diff = max(diffs)
    result = {"tokens": n, "max_abs_logit_diff": max_diff, "argmax_mismatches": mismatches}
    if not max_diff < 1e-3 or mismatches:
        raise RuntimeError(f"inflated target does not match the trained target: {result}")
    return result


def _save(model: Any, tokenizer: Any, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _valid(profile: ModelProfile) -> Callable[[dict[str, Any]], bool]:
    """A marker is current when its version and the profile's settings match."""
    settings = json.loads(json.dumps(asdict(profile)))
    return lambda data: data.get("version") == VERSION and data.get("settings") == settings


def _model_set(root: Path, data: dict[str, Any]) -> ModelSet:
    return ModelSet(
        root=root,
        target=root / str(data["target"]),
        trained_target=root / "trained_target",
        draft=root / "draft",
        profile=str(data["profile"]),
        vocab_size=int(data["vocab_size"]),
        build_seconds=float(data["build_seconds"]),
        train_summary=dict(data["train_summary"]),
    )


def _build(tmp: Path, profile: ModelProfile, log: Progress, progress: bool) -> dict[str, Any]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    summary: dict[str, Any] = {}

    log.stage("tokenizer: training byte-level BPE on local text")
    t0 = time.perf_counter()
    raw = train_tokenizer()
    tokenizer = wrap_tokenizer(raw, profile.max_position_embeddings)
    tokenizer.save_pretrained(tmp / "tokenizer")
    special = {t: int(raw.token_to_id(t)) for t in SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    summary["tokenizer"] = {"vocab_size": vocab_size, "seconds": round(time.perf_counter() - t0, 2)}

    target = build_llama(profile.target, vocab_size, special, profile.target_seed,
                         profile.max_position_embeddings)
    draft = build_llama(profile.draft, vocab_size, special, profile.draft_seed,
                        profile.max_position_embeddings)
    target.eval()
    draft.eval()
    if profile.train:
        t0 = time.perf_counter()
        data = TrainingData(raw, profile)
        summary["data"] = {
            "train_tokens": {k: int(v.numel()) for k, v in data.train.items()},
            "heldout_tokens": {k: int(v.numel()) for k, v in data.heldout.items()},
            "seconds": round(time.perf_counter() - t0, 2),
        }
        log.stage(
            f"target: training {_params(target) / 1e6:.1f}M params for {profile.target_steps} "
            f"steps of {profile.batch_size}x{profile.seq_len} tokens"
        )
        summary["target"] = _train(
            "target", target, data, profile, profile.target_steps, profile.target_lr, progress
        )
        for p in target.parameters():
            p.requires_grad_(False)
        log.stage(
            f"draft: distilling {_params(draft) / 1e6:.2f}M params from the target for "
            f"{profile.draft_steps} steps"
        )
        torch.manual_seed(profile.draft_seed)
        summary["draft"] = _train(
            "draft", draft, data, profile, profile.draft_steps, profile.draft_lr, progress,
            teacher=target,
        )
    else:
        data = None
        for name, model in (("target", target), ("draft", draft)):
            summary[name] = {
                "params": _params(model),
                "steps": 0,
                "seconds": 0.0,
                "final_train_loss": None,
                "heldout_loss": None,
            }

    log.stage("save: trained target and draft")
    _save(target, tokenizer, tmp / "trained_target")
    _save(draft, tokenizer, tmp / "draft")
    target_name = "trained_target"
    if profile.inflate_intermediate:
        log.stage(
            f"inflate: widening the target's MLPs {profile.target.intermediate} -> "
            f"{profile.inflate_intermediate} (zero down_proj columns: same function)"
        )
        t0 = time.perf_counter()
        big = _inflate(target, profile.inflate_intermediate, profile.target_seed + 1)
        check_data = data if data is not None else TrainingData(raw, profile)
        check = _check_inflated(target, big, check_data)
        log.stage("save: inflated target")
        _save(big, tokenizer, tmp / "target")
        target_name = "target"
        summary["inflated_target"] = {
            "params": _params(big),
            "intermediate_size": profile.inflate_intermediate,
            "seconds": round(time.perf_counter() - t0, 2),
            **check,
        }
        del big
    return {
        "version": VERSION,
        "profile": profile.name,
        "settings": asdict(profile),
        "target": target_name,
        "vocab_size": vocab_size,
        "build_seconds": round(time.perf_counter() - started, 2),
        "train_summary": summary,
    }


def prepare_models(cache_dir: Path, profile: str = "demo", *, progress: bool = True) -> ModelSet:
    """Build (or reuse) the tokenizer, target, draft and (inflated) target of ``profile``.

    The build lives in ``cache_dir / profile`` and is returned at once when complete.
    Otherwise it is built into a temporary sibling directory renamed into place, so an
    interrupted build never looks complete and concurrent builders do not mix files.
    """
    try:
        prof = PROFILES[profile]
    except KeyError:
        raise ValueError(
            f"unknown model profile {profile!r}; expected one of {sorted(PROFILES)}"
        ) from None
    root = Path(cache_dir) / profile
    valid = _valid(prof)
    done = read_marker(root / MARKER, valid)
    if done is not None:
        return _model_set(root, done)

    log = Progress(progress)
    log.stage(f"building the {profile!r} models into {root} (once; cached afterwards)")
    from transformers.utils import logging as _hf_logging

    hf_logging: Any = _hf_logging  # partly untyped
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        data = build_once(root, MARKER, valid, lambda tmp: _build(tmp, prof, log, progress))
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()
    log.stage(f"done in {data['build_seconds']:.0f}s")
    return _model_set(root, data)
