"""The real target's drafters, trained on its own distribution over ShareGPT conversations.

- ``eagle``: an EAGLE-1 head (:class:`benchmarks.demo.eagle.EagleHead`) trained on the target's
  hidden states, teacher-forced: feature regression plus the KL from the target's next-token
  distribution, the way EAGLE heads are trained for real models.
- ``draft``: a small draft model with the target's tokenizer: the target's first layers with
  its (tied) embeddings and LM head, distilled on the target's next-token distribution (only
  the layers and the final norm train; the embeddings stay the target's).

Both are built once beside the target (``<models root>/eagle``, ``<models root>/draft``) with a
marker recording their settings, training summary and the target's provenance. The target
teaches in the dtype it is served in (``smollm2.serve_dtype``: bfloat16 where the CPU computes it
natively, float32 elsewhere), so the heads learn the hidden states they will be served; the
trained parts in float32; LM-head products in the target's dtype.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.demo.cache import build_once, read_marker
from benchmarks.demo.eagle import (
    EagleHead,
    EagleSettings,
    copy_tokenizer,
    head_logits,
    save_eagle_head,
    train_head,
)
from benchmarks.demo.models import warmup_cosine
from benchmarks.real.fetch import timed
from benchmarks.real.smollm2 import MARKER as TARGET_MARKER
from benchmarks.real.smollm2 import serve_dtype

VERSION = "specpilot-smollm2-drafters-1"
MARKER = "drafter.json"


@dataclass(frozen=True)
class DrafterSettings:
    """How the real target's drafters are trained (fixed steps and seeds: reproducible)."""

    head_steps: int = 250
    head_lr: float = 2e-3
    head_unroll: int = 2  # draft steps trained per window (positions past the first)
    draft_layers: int = 2
    draft_steps: int = 200
    draft_lr: float = 1e-3
    # The KL runs over this many of the training text's most frequent tokens.
    vocab_rows: int = 8192
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # tokens per window
    warmup_steps: int = 20
    seed: int = 2026
    own_share: float = 0.5  # of the training windows from the target's own answers


@dataclass(frozen=True)
class Drafters:
    eagle: Path
    draft: Path


@dataclass(frozen=True)
class TrainingText:
    """What the drafters train on, as token ids of templated conversations: answers the target
    wrote itself (what a drafter meets while serving) and answers ShareGPT holds."""

    own: Sequence[Sequence[int]]
    written: Sequence[Sequence[int]]


class ConversationWindows:
    """Random ``seq_len + 1`` token windows over concatenated conversations, a share
    ``own_share`` of them from the target's own answers (``batch(size)``: a
    ``(size, seq_len + 1)`` tensor)."""

    def __init__(self, text: TrainingText, seq_len: int, seed: int,
                 own_share: float = 0.5) -> None:
        import torch

        def stream(ids: Sequence[Sequence[int]]) -> Any:
            return torch.tensor([t for one in ids for t in one], dtype=torch.long)

        self.streams = [s for s in (stream(text.own), stream(text.written))
                        if s.numel() > seq_len + 1]
        if not self.streams:
            raise ValueError("no training conversations longer than one window")
        self.own_share = own_share if len(self.streams) == 2 else 1.0
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def tokens(self) -> int:
        return sum(int(s.numel()) for s in self.streams)

    def frequent(self, rows: int) -> Any:
        """The ``rows`` most frequent token ids of the streams, sorted."""
        import torch

        counts = torch.bincount(torch.cat(self.streams))
        top = torch.topk(counts, min(rows, int(counts.numel()))).indices
        return torch.sort(top).values

    def batch(self, size: int) -> Any:
        import torch

        span = self.seq_len + 1
        rows = []
        for _ in range(size):
            first = float(torch.rand((), generator=self.gen)) < self.own_share
            s = self.streams[0 if first else -1]
            start = int(torch.randint(0, int(s.numel()) - span, (1,), generator=self.gen))
            rows.append(s[start:start + span])
        return torch.stack(rows)


def load_target(target_dir: Path) -> Any:
    """The target in the dtype it is served in, frozen, for teaching."""
    import torch
    from transformers import LlamaForCausalLM

    loader: Any = LlamaForCausalLM
    target = loader.from_pretrained(target_dir, dtype=getattr(torch, serve_dtype()))
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def train_eagle(target_dir: Path, data: ConversationWindows, out: Path,
                settings: DrafterSettings, progress: bool) -> dict[str, Any]:
    target = load_target(target_dir)
    head = EagleHead(target, settings.seed)
    summary = train_head(head, target, data, EagleSettings(steps=settings.head_steps,
                                                           lr=settings.head_lr,
                                                           seed=settings.seed),
                         batch_size=settings.batch_size, warmup_steps=settings.warmup_steps,
                         progress=progress, vocab=data.frequent(settings.vocab_rows),
                         unroll=settings.head_unroll)
    save_eagle_head(head, target_dir, out)
    return summary


def truncated_target(target: Any, layers: int) -> Any:
    """A float32 copy of ``target``'s first ``layers`` decoder layers, its final norm and its
    tied embeddings (a draft model vLLM loads as an ordinary Llama)."""
    from transformers import LlamaForCausalLM

    config = target.config.__class__.from_dict(
        {**target.config.to_dict(), "num_hidden_layers": layers, "dtype": "float32"})
    llama: Any = LlamaForCausalLM
    draft = llama(config)
    own = {k: v for k, v in target.state_dict().items()
           if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict({k: v.float() for k, v in own.items()}, strict=False)
    draft.tie_weights()
    return draft


def distill_draft(target: Any, draft: Any, data: ConversationWindows,
                  settings: DrafterSettings, progress: bool) -> dict[str, Any]:
    """Train ``draft``'s layers and final norm on KL(target || draft) over ``data``."""
    import sys

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    started = time.perf_counter()
    draft.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    lm_head = target.lm_head.weight  # frozen, the draft's own (tied) weights
    vocab = data.frequent(settings.vocab_rows)
    opt = torch.optim.AdamW(params, lr=settings.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(settings.warmup_steps, settings.draft_steps))
    recent: list[tuple[float, float]] = []
    bar = tqdm(total=settings.draft_steps, desc="draft model", file=sys.stderr,
               disable=not progress, leave=True, dynamic_ncols=True)
    draft.train()
    try:
        for _ in range(settings.draft_steps):
            batch = data.batch(settings.batch_size)[:, :-1]
            with torch.inference_mode():
                top = target.model(input_ids=batch).last_hidden_state
                teacher = F.log_softmax(head_logits(lm_head, top, vocab), dim=-1)
            teacher = teacher.clone().flatten(0, 1)
            hidden = draft.model(input_ids=batch).last_hidden_state
            logits = F.log_softmax(head_logits(lm_head, hidden, vocab), dim=-1).flatten(0, 1)
            kl = F.kl_div(logits, teacher, log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            kl.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                agree = float((logits.argmax(-1) == teacher.argmax(-1)).float().mean())
            recent.append((float(kl.detach()), agree))
            del recent[:-20]
            bar.update(1)
            bar.set_postfix(kl=f"{recent[-1][0]:.3f}", top1=f"{agree:.2f}", refresh=False)
    finally:
        bar.close()
    draft.eval()
    n = max(len(recent), 1)
    return {"steps": settings.draft_steps, "layers": settings.draft_layers,
            "seconds": round(time.perf_counter() - started, 2),
            "final_kl": round(sum(r[0] for r in recent) / n, 4),
            "final_top1_agreement": round(sum(r[1] for r in recent) / n, 4)}


def train_draft(target_dir: Path, data: ConversationWindows, out: Path,
                settings: DrafterSettings, progress: bool) -> dict[str, Any]:
    import torch

    target = load_target(target_dir)
    torch.manual_seed(settings.seed)
    draft = truncated_target(target, settings.draft_layers)
    summary = distill_draft(target, draft, data, settings, progress)
    draft.to(torch.bfloat16).save_pretrained(out)
    copy_tokenizer(target_dir, out)
    return summary


# Drafters for the engine tests: a head trained briefly (acceptance well inside 0..1, which is
# what exactness tests need) and the draft model untrained; built in well under a minute.
QUICK_SETTINGS = DrafterSettings(head_steps=30, head_unroll=1, draft_steps=0)


def prepare_drafters(target_dir: Path, training_text: Callable[[], TrainingText],
                     data_key: dict[str, Any], *, settings: DrafterSettings | None = None,
                     progress: bool = True, suffix: str = "") -> Drafters:
    """The EAGLE head and the draft model of the target in ``target_dir``, built once beside it
    (in ``eagle<suffix>`` and ``draft<suffix>``) from ``training_text()`` (called only when a
    drafter is built; ``data_key`` names what it returns, so a new recipe rebuilds)."""
    settings = settings or DrafterSettings()
    target_marker = json.loads((target_dir / TARGET_MARKER).read_text())
    key = {"version": VERSION, "settings": asdict(settings), "data": data_key,
           "dtype": serve_dtype(),
           "target_sha256": target_marker.get("file_sha256")}
    paths = Drafters(eagle=target_dir.parent / f"eagle{suffix}",
                     draft=target_dir.parent / f"draft{suffix}")

    def valid(data: dict[str, Any]) -> bool:
        return all(data.get(k) == v for k, v in key.items())

    todo = [(name, path) for name, path in asdict(paths).items()
            if read_marker(Path(path) / MARKER, valid) is None]
    if not todo:
        return paths
    data = ConversationWindows(training_text(), settings.seq_len, settings.seed,
                               settings.own_share)
    trainers = {"eagle": train_eagle, "draft": train_draft}
    for name, path in todo:
        if progress:
            import sys
            print(f"[specpilot models] training the {name} drafter on {data.tokens:,} tokens "
                  f"into {path} (once)", file=sys.stderr, flush=True)

        def build(tmp: Path, name: str = name) -> dict[str, Any]:
            started = time.perf_counter()
            summary = trainers[name](target_dir, data, tmp, settings, progress)
            return {**key, "drafter": name, "training_tokens": data.tokens,
                    "build_seconds": round(time.perf_counter() - started, 2),
                    "train_summary": summary}

        with timed(f"{name} drafter", progress):
            build_once(Path(path), MARKER, valid, build)
    return paths
