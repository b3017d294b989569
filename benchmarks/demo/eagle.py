"""An EAGLE-1 head for the demo's target, trained on the target's own hidden states.

vLLM serves it with ``{"method": "eagle", "model": <this dir>}`` (``EagleLlamaForCausalLM``,
``vllm/model_executor/models/llama_eagle.py``): for a token x[t+1] and the target's final hidden
state h[t] (after its last norm) the head computes

    f = fc(concat(embed(x[t+1]), h[t]));  out = layer(f)   (one Llama decoder layer whose input
                                                           norm is the identity)

and ``lm_head(out)`` (no norm) gives the next draft token; ``out`` is fed back as the hidden state
of the next draft step. The checkpoint holds ``fc`` and the layer only: vLLM then shares the
target's embeddings and LM head with the head (it logs "Sharing target model lm_head weights"),
which is what the training below assumes too (both frozen, the target's).

Training (fixed seed, progress bar): windows of the corpus through the trained target give h[t];
the head learns to predict h[t+1] from (x[t+1], h[t]) - smooth L1 on the features plus the KL
from the target's next-token distribution to the head's, as EAGLE does. The un-inflated and the
inflated target compute the same function, so one head serves both.

Built once per model build, beside it (``<models root>/eagle``, marker ``eagle-head.json``), so
adding the head does not rebuild the target and draft.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.demo.cache import build_once, read_marker
from benchmarks.demo.models import (
    PROFILES,
    ModelSet,
    Progress,
    TrainingData,
    warmup_cosine,
)

VERSION = "specpilot-eagle-head-1"
MARKER = "eagle-head.json"
DIRECTORY = "eagle"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


@dataclass(frozen=True)
class EagleSettings:
    """How the head is trained for one model profile."""

    steps: int  # 0: random weights (the untrained profile's quick builds)
    lr: float = 2e-3
    seed: int = 777
    kl_weight: float = 1.0  # the feature loss weighs 1


SETTINGS: dict[str, EagleSettings] = {"demo": EagleSettings(steps=500),
                                      "untrained": EagleSettings(steps=0)}


class EagleHead:
    """The head's trainable parts (``fc`` and one decoder layer) around the target's frozen
    embeddings and LM head, computing what vLLM's ``EagleLlamaForCausalLM`` computes."""

    def __init__(self, target: Any, seed: int) -> None:
        import torch
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        config = target.config.__class__.from_dict(
            {**target.config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # causal when no mask is given
        self.config = config
        torch.manual_seed(seed)
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        layer: Any = LlamaDecoderLayer  # its norm is replaced below: typed loosely
        self.layer = layer(config, 0)
        self.layer.input_layernorm = torch.nn.Identity()  # as vLLM's first EAGLE layer
        self.rotary = LlamaRotaryEmbedding(config)
        self.embed = target.model.embed_tokens
        self.lm_head = target.lm_head

    def parameters(self) -> list[Any]:
        return [*self.fc.parameters(), *self.layer.parameters()]

    def forward(self, tokens: Any, hidden: Any) -> Any:
        """Features ``out`` for (x[t+1], h[t]) pairs: ``tokens`` (B, T), ``hidden`` (B, T, H)."""
        import torch

        # A bfloat16 target serves its embeddings and hidden states in bfloat16: the head
        # trains in float32.
        f = self.fc(torch.cat((self.embed(tokens).float(), hidden.float()), dim=-1))
        positions = torch.arange(tokens.shape[1])[None, :].expand(tokens.shape[0], -1)
        out: Any = self.layer(f, position_embeddings=self.rotary(f, positions),
                              position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, out: Any, vocab: Any = None) -> Any:
        """The target's (frozen) LM head over ``out``, in the head's dtype (bfloat16 matmuls
        are several times faster on CPUs with AMX), returned as float32; only the rows of
        ``vocab`` (token ids) when given."""
        return head_logits(self.lm_head.weight, out, vocab)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's tensors, named as vLLM loads them."""
        weights = {f"layers.0.{k}": v for k, v in self.layer.state_dict().items()
                   if not k.startswith("input_layernorm")}
        weights["fc.weight"] = self.fc.weight
        return {k: v.detach().contiguous() for k, v in weights.items()}


def head_logits(weight: Any, hidden: Any, vocab: Any = None) -> Any:
    """``hidden @ weight.T`` in ``weight``'s dtype, as float32; only the rows of ``vocab``."""
    import torch.nn.functional as F

    rows = weight if vocab is None else weight[vocab]
    return F.linear(hidden.to(rows.dtype), rows).float()


class Batches(Protocol):
    def batch(self, size: int) -> Any: ...


class OwnSamples:
    """Training windows for a target without a corpus of its own (the random test targets):
    its own sampled continuations (T=0.8) of random prompts, which is what it will serve."""

    def __init__(self, target: Any, vocab_size: int, seed: int, rows: int = 64,
                 prompt_tokens: int = 8, new_tokens: int = 120) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        prompts = torch.randint(4, vocab_size, (rows, prompt_tokens), generator=gen)
        torch.manual_seed(seed)
        with torch.inference_mode():
            self.rows = target.generate(prompts, max_new_tokens=new_tokens, do_sample=True,
                                        temperature=0.8, top_k=0, top_p=1.0)
        self.gen = gen

    def batch(self, size: int) -> Any:
        import torch

        return self.rows[torch.randint(0, self.rows.shape[0], (size,), generator=self.gen)]


def train_head(head: EagleHead, target: Any, data: Batches, settings: EagleSettings, *,
               batch_size: int, warmup_steps: int, progress: bool, vocab: Any = None,
               unroll: int = 1) -> dict[str, Any]:
    """Train ``head`` on ``target``'s hidden states over ``batch_size`` windows of ``data`` a
    step (learning rate: ``warmup_steps`` of warm-up, then cosine). ``vocab``: the token ids
    the KL runs over (all when None); a large vocabulary's softmax dominates the step, and the
    traffic's frequent tokens carry nearly all of its mass. ``unroll``: draft steps trained per
    window; step d > 0 reads the head's own features of step d - 1 in place of the target's,
    as drafting does past the first position (the loss averages the steps)."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    started = time.perf_counter()
    params = head.parameters()
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup_steps, settings.steps))
    recent: list[tuple[float, float, float]] = []
    bar = tqdm(total=settings.steps, desc="eagle head", file=sys.stderr, disable=not progress,
               leave=True, dynamic_ncols=True)
    try:
        for _ in range(settings.steps):
            batch = data.batch(batch_size)[:, :-1]
            with torch.inference_mode():
                hidden = target.model(input_ids=batch).last_hidden_state  # after the last norm
                teacher = F.log_softmax(
                    head_logits(target.lm_head.weight, hidden[:, 1:], vocab), dim=-1)
            hidden, teacher = hidden.float().clone(), teacher.clone()
            features, kls = [], []
            given = hidden[:, :-1]  # step 0 reads the target's h[t]
            for d in range(unroll):
                # (x[t+1+d], h[t+d]) -> h[t+1+d]; h[t+d] is the head's own for d > 0.
                out = head.forward(batch[:, 1 + d:], given)
                features.append(F.smooth_l1_loss(out, hidden[:, 1 + d:]))
                step_logits = F.log_softmax(head.logits(out, vocab), dim=-1)
                kls.append(F.kl_div(step_logits.flatten(0, 1),
                                    teacher[:, d:].flatten(0, 1), log_target=True,
                                    reduction="batchmean"))
                if d == 0:
                    logits = step_logits
                given = out.detach()[:, :-1]
            feature: Any = sum(features) / unroll
            kl: Any = sum(kls) / unroll
            loss: Any = feature + settings.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                agree = float((logits.argmax(-1) == teacher.argmax(-1)).float().mean())
                row = (float(feature.detach()), float(kl.detach()), agree)
            recent.append(row)
            del recent[:-20]
            bar.update(1)
            bar.set_postfix(feature=f"{row[0]:.3f}", kl=f"{row[1]:.3f}", top1=f"{agree:.2f}",
                            refresh=False)
    finally:
        bar.close()
    n = max(len(recent), 1)
    return {
        "steps": settings.steps,
        "seconds": round(time.perf_counter() - started, 2),
        "final_feature_loss": round(sum(r[0] for r in recent) / n, 4),
        "final_kl": round(sum(r[1] for r in recent) / n, 4),
        # Share of positions where the head's top token is the target's (teacher-forced).
        "final_top1_agreement": round(sum(r[2] for r in recent) / n, 4),
    }


def save_eagle_head(head: EagleHead, target_dir: Path, out: Path) -> None:
    """The head as vLLM loads it: weights, its config, and the target's tokenizer files (the
    tokenizer guard reads the draft's own tokenizer from its directory)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(head.state_dict(), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    copy_tokenizer(target_dir, out)


def copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files (those present) of the model in ``src`` into ``out``: a draft
    carries its target's tokenizer, which the tokenizer guard reads from its directory."""
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def _build(tmp: Path, models: ModelSet, settings: EagleSettings, progress: bool
           ) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    started = time.perf_counter()
    loader: Any = LlamaForCausalLM  # untyped
    target = loader.from_pretrained(models.trained_target, dtype=torch.float32)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    head = EagleHead(target, settings.seed)
    summary: dict[str, Any] = {"steps": 0, "seconds": 0.0}
    if settings.steps:
        profile = PROFILES[models.profile]
        raw = Tokenizer.from_file(str(models.trained_target / "tokenizer.json"))
        summary = train_head(head, target, TrainingData(raw, profile), settings,
                             batch_size=profile.batch_size, warmup_steps=profile.warmup_steps,
                             progress=progress)
    save_eagle_head(head, models.trained_target, tmp)
    return {"version": VERSION, "settings": asdict(settings),
            "target_build_seconds": models.build_seconds,
            "build_seconds": round(time.perf_counter() - started, 2), "train_summary": summary}


def prepare_eagle_head(models: ModelSet, *, progress: bool = True) -> Path:
    """The EAGLE head of ``models`` (built once, beside them): its directory."""
    settings = SETTINGS[models.profile]
    root = models.root / DIRECTORY

    def valid(data: dict[str, Any]) -> bool:
        return (data.get("version") == VERSION and data.get("settings") == asdict(settings)
                and data.get("target_build_seconds") == models.build_seconds)

    if read_marker(root / MARKER, valid) is None:
        Progress(progress).stage(
            f"eagle head: training for {settings.steps} steps into {root} (once)")
    build_once(root, MARKER, valid, lambda tmp: _build(tmp, models, settings, progress))
    return root
