"""``specpilot bench real``: SmolLM2-135M-Instruct on held-out ShareGPT traffic, served by vLLM's
OpenAI server with the plugin, driven by vLLM's own serving benchmark, under every static
configuration a user could pick and under specpilot; alternating, repeated; medians, spread,
ratios, the ceiling, and the exactness checks in every run. The load is a plan of phases sized by
wall-clock time (:mod:`benchmarks.real.plan`); each phase's tokens/s counts its time only
(:mod:`benchmarks.real.client`), and a run's is the phases' tokens over their summed seconds.

Each repetition runs every configuration once, in an order rotated by one per repetition. Each
specpilot configuration has its own controller (a ``specpilot serve`` sidecar) that lives across
its runs, as a sidecar lives beside its engine. Exactness: the greedy classes' texts equal no
speculation's, request by request, in every run, on the requests of each phase's sequence that
both runs reached (a faster configuration gets further); the sampled class's first
``PROBE_TOKENS`` tokens on a fixed prompt are distributed as no speculation's (chi-square and
total variation per position, :mod:`benchmarks.demo.distribution`).

The ceiling: every phase served by the static configuration best in that phase (its median
tokens/s), the tokens those phases would give over the plan's time.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.demo.bench import rotated
from benchmarks.demo.calibration import CalibrationRow, calibration_json, calibration_markdown
from benchmarks.demo.configs import (
    DEFAULT_BATCH_TABLE,
    OFF,
    PROBABILISTIC,
    EngineConfig,
    forced_off,
    specpilot_config,
    without_token_cut,
)
from benchmarks.demo.distribution import Comparison, compare_positions
from benchmarks.real.client import run_phase
from benchmarks.real.explain import ExplanationLog
from benchmarks.real.plan import (
    DEFAULT_PLAN,
    MAX_TOKENS,
    ROUND,
    TimedPhase,
    phase_pools,
    phase_requests,
    plan_spec,
)
from benchmarks.real.probe import PROBE_SAMPLES, sample_probe
from benchmarks.real.server import OpenAIServer, free_port, server_command
from benchmarks.real.sharegpt import CLASSES, HELDOUT, TrafficRequest
from benchmarks.real.smollm2 import SERVED_NAME
from specpilot.contract.classes import DEFAULT_CLASS

if TYPE_CHECKING:
    from benchmarks.demo.sidecar import Sidecar
    from benchmarks.real.models import RealModels

Printer = Callable[[str], None]
HEADLINE = ("Real model (SmolLM2-135M-Instruct, ShareGPT held-out): specpilot / best static = "
            "{ratio:.2f}x end to end ({name} against {best})")


def real_configs(max_k: int = 4) -> list[EngineConfig]:
    """No speculation; the EAGLE head and the draft model at static K=2 and K=4 (probabilistic
    drafting: what a user serving sampled traffic picks); n-gram and suffix K=4; vLLM's
    batch-size table on the head; specpilot on the head and on the draft model (n-gram and
    suffix drafts offered), and on suffix decoding (no model drafter)."""
    p = PROBABILISTIC
    return [
        EngineConfig(OFF),
        EngineConfig("eagle:2p", "eagle", 2, draft_sampling=p),
        EngineConfig("eagle:4p", "eagle", 4, draft_sampling=p),
        EngineConfig("draft:2p", "draft", 2, draft_sampling=p),
        EngineConfig("draft:4p", "draft", 4, draft_sampling=p),
        EngineConfig("ngram:4", "ngram", 4),
        EngineConfig("suffix:4", "suffix", 4),
        EngineConfig("eagle-table-p", "eagle", max(k for _, _, k in DEFAULT_BATCH_TABLE),
                     batch_table=DEFAULT_BATCH_TABLE, draft_sampling=p),
        specpilot_config(max_k, "eagle"),
        specpilot_config(max_k),
        specpilot_config(max_k, "suffix"),
    ]


def real_optional_configs(max_k: int = 4) -> list[EngineConfig]:
    """Configurations run only when named (``--config``): specpilot on the head and on the draft
    model with the controller's ``token_cut`` off, everything else as with it (``batch_max``,
    where the engine is told each request's K, so it cuts each request's drafts); specpilot on
    n-gram; and each engine specpilot steers with every class forced off (``-forced-off``:
    what off costs against no speculation)."""
    classes = [c.name for c in CLASSES] + [DEFAULT_CLASS]
    return [without_token_cut(specpilot_config(max_k, "eagle")),
            without_token_cut(specpilot_config(max_k)),
            specpilot_config(max_k, "ngram"),
            *(forced_off(specpilot_config(max_k, d), classes)
              for d in ("suffix", "ngram", "eagle", "draft"))]


def select_configs(names: Sequence[str], max_k: int = 4) -> list[EngineConfig]:
    """The configurations ``names`` asks for, in the line-up's order (none: every default one).
    Raises ValueError naming the unknown ones and the known."""
    default, optional = real_configs(max_k), real_optional_configs(max_k)
    if not names:
        return default
    known = default + optional
    unknown = set(names) - {c.name for c in known}
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; known: "
                         f"{[c.name for c in known]}")
    return [c for c in known if c.name in names]


@dataclass(frozen=True)
class RealBenchOptions:
    reps: int = 3
    out: Path = Path("benchmarks/results/real")
    configs: tuple[str, ...] = ()  # names to run (default: all)
    phases: tuple[TimedPhase, ...] = DEFAULT_PLAN
    seed: int = 0  # of the phases' request sequences
    max_tokens: int = MAX_TOKENS
    probe_samples: int = PROBE_SAMPLES
    cache: Path | None = None
    plots: bool = True
    # The engine tests' briefly trained drafters (``eagle-quick``, ``draft-quick``: about a
    # minute to build) instead of the benchmark's own (about 20 minutes on 2 cores).
    quick_drafters: bool = False
    # The drafters' acceptance table and the engine's step costs (measured once per drafter
    # build, a few minutes each on 2 cores).
    drafter_tables: bool = True
    # Seconds between polls of each specpilot controller's explanations (0: none).
    explain_every: float = 0.0


@dataclass
class Run:
    """One configuration's run: vLLM's result per phase, in the plan's order, with the phase's
    own keys (:func:`benchmarks.real.client.phase_result`). Its tokens are those streamed within
    the phases' time, its seconds the phases' (a drain after a phase's time counts in neither)."""

    config: str
    rep: int
    phases: list[dict[str, Any]]

    @property
    def output_tokens(self) -> float:
        return sum(sum(p["window_output_tokens"]) for p in self.phases)

    @property
    def seconds(self) -> float:
        return sum(float(p["phase_seconds"]) for p in self.phases)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def phase_rate(self, i: int) -> float:
        return float(self.phases[i]["window_tokens_per_second"])

    def requests(self, i: int) -> int:
        return len(self.phases[i]["request_ids"])


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    ordered = sorted(xs)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def request_rows(run: Run) -> list[dict[str, Any]]:
    """Per request sent: id, class, phase, position in its phase's sequence, output tokens
    (all, and those within the phase's time), TTFT and TPOT (s), text."""
    rows = []
    for i, phase in enumerate(run.phases):
        for j, (rid, cls) in enumerate(zip(phase["request_ids"], phase["classes"], strict=True)):
            n = int(phase["output_lens"][j])
            ttft = float(phase["ttfts"][j])
            latency = float(phase["latencies"][j])
            rows.append({"id": rid, "class": cls, "phase": i, "position": j, "tokens": n,
                         "window_tokens": float(phase["window_output_tokens"][j]),
                         "ttft": ttft, "tpot": (latency - ttft) / (n - 1) if n > 1 else math.nan,
                         "text": phase["generated_texts"][j]})
    return rows


def compare_greedy(mine: Run, reference: Run, greedy: frozenset[str]) -> tuple[int, int]:
    """(mismatched, compared): the greedy requests whose text differs from the reference's, of
    those compared, in each phase over the prefix of its sequence both runs reached. Raises
    ValueError when the runs sent different requests at one position (not the same plan)."""
    mismatched = compared = 0
    for i, (a, b) in enumerate(zip(mine.phases, reference.phases, strict=True)):
        n = min(len(a["request_ids"]), len(b["request_ids"]))
        if a["request_ids"][:n] != b["request_ids"][:n]:
            raise ValueError(f"phase {i}: {mine.config} and {reference.config} sent different "
                             "requests; the runs did not replay the same plan")
        for j in range(n):
            if a["classes"][j] in greedy:
                compared += 1
                mismatched += a["generated_texts"][j] != b["generated_texts"][j]
    return mismatched, compared


@dataclass(frozen=True)
class Latency:
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def latency(rows: Sequence[Mapping[str, Any]]) -> Latency:
    ttft = [float(r["ttft"]) for r in rows]
    tpot = [float(r["tpot"]) for r in rows if not math.isnan(float(r["tpot"]))]
    return Latency(_percentile(ttft, 50), _percentile(ttft, 99), _percentile(tpot, 50),
                   _percentile(tpot, 99))


@dataclass(frozen=True)
class ConfigFigures:
    name: str
    rates: tuple[float, ...]  # end-to-end tokens/s per repetition
    phase_rates: tuple[float, ...]  # median per phase
    latency: Latency  # over every request of every repetition
    class_latency: dict[str, Latency]
    class_tokens_per_second: dict[str, float]  # the class's output tokens / run time, median
    acceptance: tuple[float, ...]  # per phase: vLLM's acceptance rate (pooled over reps)
    mismatched: int  # greedy requests whose text differs from no speculation's
    compared: int  # greedy requests compared (those both runs reached), over the repetitions
    requests: tuple[float, ...]  # requests sent per phase, median of the repetitions
    distribution: tuple[Comparison, ...] = ()
    # vLLM's own figures per phase, as its serving benchmark computed them (medians over the
    # repetitions): VLLM_FIELDS.
    vllm: tuple[dict[str, float], ...] = ()

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(self.rates)

    @property
    def exact(self) -> bool:
        return self.mismatched == 0 and all(c.same for c in self.distribution)


VLLM_FIELDS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
               "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms")


def _acceptance(runs: Sequence[Run], n_phases: int) -> tuple[float, ...]:
    out = []
    for i in range(n_phases):
        drafted = sum(int(r.phases[i].get("spec_decode_draft_tokens", 0)) for r in runs)
        accepted = sum(int(r.phases[i].get("spec_decode_accepted_tokens", 0)) for r in runs)
        out.append(accepted / drafted if drafted else math.nan)
    return tuple(out)


def figures(name: str, runs: Sequence[Run], reference: Run, phases: Sequence[TimedPhase],
            greedy: frozenset[str], probe: Sequence[Sequence[int]] | None,
            reference_probe: Sequence[Sequence[int]] | None) -> ConfigFigures:
    rows = [request_rows(r) for r in runs]
    pooled = [row for rs in rows for row in rs]
    checks = [compare_greedy(r, reference, greedy) for r in runs if r is not reference]
    classes = sorted({r["class"] for r in pooled})
    return ConfigFigures(
        name=name, rates=tuple(r.tokens_per_second for r in runs),
        phase_rates=tuple(statistics.median(r.phase_rate(i) for r in runs)
                          for i in range(len(phases))),
        latency=latency(pooled),
        class_latency={c: latency([r for r in pooled if r["class"] == c]) for c in classes},
        class_tokens_per_second={c: statistics.median(
            sum(r["window_tokens"] for r in rs if r["class"] == c) / run.seconds
            for rs, run in zip(rows, runs, strict=True)) for c in classes},
        acceptance=_acceptance(runs, len(phases)), mismatched=sum(m for m, _ in checks),
        compared=sum(n for _, n in checks),
        requests=tuple(statistics.median(r.requests(i) for r in runs)
                       for i in range(len(phases))),
        vllm=tuple({k: statistics.median(float(r.phases[i].get(k, math.nan)) for r in runs)
                    for k in VLLM_FIELDS} for i in range(len(phases))),
        distribution=(tuple(compare_positions(reference_probe, probe))
                      if probe is not None and reference_probe is not None and name != OFF
                      else ()))


def paired_decode(ours: Sequence[Run], theirs: Sequence[Run], phase: int
                  ) -> dict[str, tuple[float, float]]:
    """Per class: (ours, theirs) decode seconds (each request's latency after its first token)
    summed over the requests both runs of a repetition sent in ``phase`` (the same ids: the
    same requests), the repetitions paired in order. Unlike a phase's tokens/s this compares
    like with like: a faster configuration's extra requests are in neither sum."""
    sums: dict[str, list[float]] = {}
    for a, b in zip(ours, theirs, strict=False):
        mine, other = a.phases[phase], b.phases[phase]
        index = {rid: j for j, rid in enumerate(other["request_ids"])}
        for i, rid in enumerate(mine["request_ids"]):
            if (j := index.get(rid)) is None:
                continue
            pair = sums.setdefault(mine["classes"][i], [0.0, 0.0])
            pair[0] += float(mine["latencies"][i]) - float(mine["ttfts"][i])
            pair[1] += float(other["latencies"][j]) - float(other["ttfts"][j])
    return {c: (x, y) for c, (x, y) in sorted(sums.items())}


@dataclass(frozen=True)
class Versus:
    name: str
    best_static: str
    ratio_best_static: float
    ratio_per_phase: tuple[float, ...]
    best_per_phase: tuple[str, ...]
    ceiling_tokens_per_second: float
    ceiling_share: float
    tpot_p99_ratio: float  # ours / the best static's (<= 1: no worse)
    spread: tuple[float, ...]  # ours / best static, per repetition (same rotation index)
    # Its controller's predicted step times against the measured ones, over all its runs.
    calibration: tuple[CalibrationRow, ...] = ()
    # Per phase, against that phase's best static: ``paired_decode`` (when the runs were given).
    decode_per_phase: tuple[dict[str, tuple[float, float]], ...] = ()


def _phase_rate(i: int) -> Callable[[ConfigFigures], float]:
    return lambda f: f.phase_rates[i]


def versus(ours: ConfigFigures, statics: Sequence[ConfigFigures], seconds: Sequence[float],
           calibration: tuple[CalibrationRow, ...] = (),
           runs: Mapping[str, Sequence[Run]] | None = None) -> Versus:
    """``ours`` against the static configurations; ``seconds``: the plan's phases' durations
    (the ceiling runs each on its best static configuration for that long); ``runs`` by
    configuration, for the decode time of the same requests per phase (``paired_decode``)."""
    best = max(statics, key=lambda f: f.tokens_per_second)
    n_phases = len(ours.phase_rates)
    tops = [max(statics, key=_phase_rate(i)) for i in range(n_phases)]
    decode = (tuple(paired_decode(runs[ours.name], runs[top.name], i)
                    for i, top in enumerate(tops)) if runs is not None else ())
    ceiling = sum(s * top.phase_rates[i] for i, (s, top) in
                  enumerate(zip(seconds, tops, strict=True))) / sum(seconds)
    return Versus(
        ours.name, best.name, ours.tokens_per_second / best.tokens_per_second,
        tuple(ours.phase_rates[i] / tops[i].phase_rates[i] for i in range(n_phases)),
        tuple(t.name for t in tops), ceiling, ours.tokens_per_second / ceiling,
        ours.latency.tpot_p99 / best.latency.tpot_p99,
        tuple(a / b for a, b in zip(ours.rates, best.rates, strict=False)), calibration,
        decode)


@dataclass
class RealReport:
    configs: list[ConfigFigures]
    versus: list[Versus]
    phases: tuple[TimedPhase, ...]
    seconds: float
    drafters: dict[str, Any] = field(default_factory=dict)
    # The drafters' acceptance table and the engine's step costs (markdown), when measured.
    drafter_tables: list[str] = field(default_factory=list)
    # The dtype the engines served the target in (smollm2.serve_dtype).
    dtype: str = ""

    @property
    def greedy_noise(self) -> int:
        """Greedy requests whose text differed between no speculation's own repetitions: the
        dtype's batch-shape noise (0 in float32)."""
        off = next((c for c in self.configs if c.name == OFF), None)
        return off.mismatched if off is not None else 0

    @property
    def greedy_noise_compared(self) -> int:
        off = next((c for c in self.configs if c.name == OFF), None)
        return off.compared if off is not None else 0

    @property
    def exact(self) -> bool:
        """Every sampled distribution the target's, and no greedy mismatch unless no
        speculation itself shows the same noise between its repetitions."""
        return self.distributions_same and (
            self.greedy_noise > 0 or all(c.mismatched == 0 for c in self.configs))

    @property
    def distributions_same(self) -> bool:
        return all(all(x.same for x in c.distribution) for c in self.configs)

    def headline(self) -> str:
        """specpilot's best engine against the best static configuration: each specpilot
        configuration is a deployment a user could pick, as each static one is; both named."""
        v = max(self.versus, key=lambda v: v.ratio_best_static, default=None)
        return "" if v is None else HEADLINE.format(ratio=v.ratio_best_static, name=v.name,
                                                     best=v.best_static)


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def phase_label(p: TimedPhase) -> str:
    return f"{p.name} (c={p.concurrency}, {p.seconds:g} s)"


def markdown(report: RealReport) -> str:
    phases = [phase_label(p) for p in report.phases]
    rows = [[c.name, _fmt(c.tokens_per_second),
             " / ".join(_fmt(x) for x in c.rates),
             *(_fmt(x) for x in c.phase_rates),
             _fmt(c.latency.ttft_p50 * 1e3, 0), _fmt(c.latency.ttft_p99 * 1e3, 0),
             _fmt(c.latency.tpot_p50 * 1e3, 1), _fmt(c.latency.tpot_p99 * 1e3, 1),
             f"{c.mismatched} / {c.compared}",
             "reference" if c.name == OFF else ("same" if all(x.same for x in c.distribution)
                                                 else "DIFFERS")]
            for c in report.configs]
    lines = [report.headline(), "",
             f"Plan (`--plan {plan_spec(report.phases)}`): closed-loop clients per phase for "
             "its seconds, then its requests in flight finish; tokens/s counts the tokens "
             "streamed within the phases' time over that time. The target served in "
             f"{report.dtype or 'its default dtype'}.", "",
             "End to end (output tokens/s, median of the repetitions; measured by vLLM's "
             "serving-benchmark client; greedy ≠ off: differing / compared):", "",
             *_table(["configuration", "tokens/s", "per repetition", *phases, "TTFT p50 ms",
                      "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "greedy ≠ off",
                      "sampled distribution"], rows), ""]
    classes = sorted({k for c in report.configs for k in c.class_latency})
    lines += ["Per class (output tokens/s of the class over the run; TPOT p50 / p99 ms):", "",
              *_table(["configuration", *classes],
                      [[c.name, *(f"{_fmt(c.class_tokens_per_second.get(k, math.nan))} "
                                  f"({_fmt(c.class_latency[k].tpot_p50 * 1e3)} / "
                                  f"{_fmt(c.class_latency[k].tpot_p99 * 1e3)})"
                                  if k in c.class_latency else "-" for k in classes)]
                       for c in report.configs]), ""]
    lines += ["vLLM's own figures (its serving benchmark's metrics, `vllm-results.json`; per "
              "phase: requests sent; output tokens/s over the phase and its drain; TTFT, TPOT "
              "and end-to-end latency p50-p99 ms; medians of the repetitions; - where vLLM did "
              "not compute one):", "",
              *_table(["configuration", *phases],
                      [[c.name, *(f"{n:g} req; {_fmt(v['output_throughput'])} tok/s; TTFT "
                                  f"{_fmt(v['median_ttft_ms'], 0)}-{_fmt(v['p99_ttft_ms'], 0)}; "
                                  f"TPOT {_fmt(v['median_tpot_ms'])}-{_fmt(v['p99_tpot_ms'])}; "
                                  f"E2E {_fmt(v['median_e2el_ms'], 0)}-"
                                  f"{_fmt(v['p99_e2el_ms'], 0)}"
                                  for n, v in zip(c.requests, c.vllm, strict=True))]
                       for c in report.configs]), ""]
    lines += ["Acceptance (vLLM's spec-decode counters, accepted / drafted tokens, per phase):",
              "", *_table(["configuration", *phases],
                          [[c.name, *(_fmt(a, 2) for a in c.acceptance)]
                           for c in report.configs if c.name != OFF]), ""]
    for v in report.versus:
        lines += [
            f"**{v.name}** / best static ({v.best_static}): **{v.ratio_best_static:.3f}x** "
            "end to end; per repetition "
            + ", ".join(f"{x:.3f}" for x in v.spread),
            "- per phase against that phase's best static: " + ", ".join(
                f"{p} {r:.3f} ({b})" for p, r, b in zip(phases, v.ratio_per_phase,
                                                      v.best_per_phase, strict=True)),
            f"- share of the ceiling (each phase on its best static, "
            f"{_fmt(v.ceiling_tokens_per_second)} tokens/s): **{v.ceiling_share:.3f}**",
            f"- TPOT p99 / the best static's: {v.tpot_p99_ratio:.3f}"]
        if v.decode_per_phase:
            lines += ["- decode seconds of the same requests (after their first token, all "
                      "repetitions), ours / that phase's best static's, per class: " + "; ".join(
                          f"{p} " + ", ".join(f"{c} {x:.1f} / {y:.1f}"
                                              for c, (x, y) in d.items())
                          for p, d in zip(phases, v.decode_per_phase, strict=True))]
        lines += [""]
        if v.calibration:
            lines += calibration_markdown(v.name, v.calibration)
    lines += [*report.drafter_tables]
    lines += [f"- sampled distribution the target's in every configuration: "
              f"{'yes' if report.distributions_same else 'NO'}"
              f"; greedy requests whose text differs from no speculation's first run (on the "
              f"requests both reached): per configuration above, and {report.greedy_noise} of "
              f"{report.greedy_noise_compared} between no speculation's own repetitions, the "
              f"dtype's noise",
              f"- whole benchmark {report.seconds / 60:.1f} min"]
    return "\n".join(lines)


def report_json(report: RealReport) -> dict[str, Any]:
    def clean(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 5)

    return {
        "headline": report.headline(),
        "plan": plan_spec(report.phases),
        "dtype": report.dtype,
        "phases": [vars(p) for p in report.phases],
        "configs": [{"name": c.name, "tokens_per_second": clean(c.tokens_per_second),
                     "rates": [clean(x) for x in c.rates],
                     "phase_rates": [clean(x) for x in c.phase_rates],
                     "latency": {k: clean(v) for k, v in vars(c.latency).items()},
                     "class_latency": {k: {n: clean(x) for n, x in vars(v).items()}
                                       for k, v in c.class_latency.items()},
                     "class_tokens_per_second": {k: clean(v) for k, v in
                                                 c.class_tokens_per_second.items()},
                     "acceptance": [clean(x) for x in c.acceptance],
                     "requests": list(c.requests),
                     "mismatched": c.mismatched, "compared": c.compared,
                     "distribution": [{"p_value": x.p_value, "total_variation":
                                       round(x.total_variation, 4), "same": x.same}
                                      for x in c.distribution]}
                    for c in report.configs],
        "versus": [{**{k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in vars(x).items() if k != "calibration"},
                    "calibration": calibration_json(x.calibration)} for x in report.versus],
        "exact": report.exact, "seconds": round(report.seconds, 1),
        "drafters": report.drafters,
    }


def plot(report: RealReport, path: Path) -> None:
    import numpy as np

    from benchmarks.plots import pyplot, save_figure

    plt = pyplot()
    groups = [f"{p.name}\n(c={p.concurrency}, {p.seconds:g} s)" for p in report.phases] + ["all"]
    x = np.arange(len(groups))
    width = 0.8 / max(len(report.configs), 1)
    fig, ax = plt.subplots(figsize=(14, 4.8))
    ours = {v.name for v in report.versus}
    for i, c in enumerate(report.configs):
        ax.bar(x + (i - (len(report.configs) - 1) / 2) * width,
               [*c.phase_rates, c.tokens_per_second], width, label=c.name,
               edgecolor="black" if c.name in ours else None)
    ax.set_xticks(x, groups)
    ax.set_ylabel("output tokens/s (median)")
    ax.legend(ncol=3, fontsize=8)
    ax.set_title(report.headline())
    save_figure(fig, path)


def drafter_tables(models: RealModels) -> list[str]:
    """The drafters' acceptance per class and position and the engine's step costs (measured
    once per drafter build), as markdown."""
    from benchmarks.real import acceptance, step_costs

    return ["Each drafter's acceptance (held-out prompts, static K=4):", "",
            acceptance.markdown(acceptance.record(models)), "",
            "Engine step costs (ms per step):", "",
            step_costs.markdown(step_costs.record(models)), ""]


def run_real_bench(options: RealBenchOptions = RealBenchOptions(),
                   echo: Printer = print) -> RealReport:
    from benchmarks.demo.engine import apply_engine_env
    from benchmarks.demo.sidecar import Sidecar
    from benchmarks.real.models import prepare_real_models
    from benchmarks.real.smollm2 import serve_dtype

    apply_engine_env()
    started = time.monotonic()
    configs = select_configs(options.configs)
    drafters = any(c.drafter in ("eagle", "draft") for c in configs)
    models = prepare_real_models(options.cache, drafters=drafters, quick=options.quick_drafters)
    tables = drafter_tables(models) if drafters and options.drafter_tables else []
    heldout = {c.name: models.traffic.requests(c.name, HELDOUT) for c in CLASSES}
    n_phases = len(options.phases)
    phase_pools(heldout, n_phases, options.seed)  # a class too small fails before any server

    def sequence(i: int) -> Iterator[TrafficRequest]:
        return phase_requests(heldout, i, n_phases, options.seed)

    greedy = frozenset(c.name for c in CLASSES if c.temperature == 0)
    offline = [c.name for c in CLASSES if c.offline]
    sampled = next((r for r in itertools.islice(sequence(0), 10 * ROUND) if r.temperature > 0),
                   None)
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(models.target))
    runs: dict[str, list[Run]] = {c.name: [] for c in configs}
    probes: dict[str, list[list[int]]] = {}
    total = options.reps * len(configs)
    logs = options.out / "logs"
    run_seconds = sum(p.seconds for p in options.phases)
    echo(f"plan {plan_spec(options.phases)}: {run_seconds / 60:.1f} min of load a run (and each "
         f"phase's drain), {total} runs, the target in {serve_dtype()}")
    with ExitStack() as stack:
        controllers: dict[str, Sidecar] = {}
        for c in configs:
            if c.specpilot:
                controllers[c.name] = Sidecar({"report_interval_seconds": 0.5, "seed": 0,
                                               "offline_classes": offline, **c.controller})
                stack.callback(controllers[c.name].stop)
        explained = {name: ExplanationLog(c.target, options.out / f"explanations-{name}.jsonl",
                                          options.explain_every)
                     for name, c in controllers.items() if options.explain_every > 0}
        for log in explained.values():
            stack.callback(log.stop)
        for rep in range(options.reps):
            for config in rotated(configs, rep):
                port = free_port()
                command = server_command(
                    models.target, SERVED_NAME, port, specpilot=config.specpilot,
                    speculative_config=config.speculative_config(models.draft, models.eagle),
                    max_num_seqs=max(p.concurrency for p in options.phases))
                env = ({"SPECPILOT_PLUGIN_CONTROLLER": controllers[config.name].target,
                        "SPECPILOT_PLUGIN_ENGINE_ID": f"{config.name}-{rep}",
                        **{f"SPECPILOT_PLUGIN_{k}": v for k, v in config.plugin_env.items()}}
                       if config.specpilot else {})
                with OpenAIServer(command, env, logs / f"{config.name}-{rep}.log", port) as url:
                    results = []
                    for i, phase in enumerate(options.phases):
                        if config.name in explained:
                            explained[config.name].label = f"rep {rep} {phase_label(phase)}"
                        result = run_phase(url, SERVED_NAME, sequence(i), phase.concurrency,
                                           phase.seconds, options.max_tokens, tokenizer,
                                           tag=f"{config.name}-{rep}-{i}")
                        results.append(result)
                        echo(f"  {config.name} rep {rep + 1} {phase_label(phase)}: "
                             f"{len(result['request_ids'])} requests, "
                             f"{result['window_tokens_per_second']:.1f} tok/s, drain "
                             f"{result['drain_seconds']:.1f} s")
                    if sampled is not None and config.name not in probes \
                            and options.probe_samples:
                        probes[config.name] = sample_probe(url, SERVED_NAME, sampled,
                                                           options.probe_samples)
                if config.name in explained:
                    explained[config.name].label = ""  # idle until its next run
                run = Run(config.name, rep, results)
                runs[config.name].append(run)
                echo(f"[{sum(len(v) for v in runs.values())}/{total}] rep {rep + 1} "
                     f"{config.name:<16} {run.tokens_per_second:7.1f} tok/s  phases "
                     + " ".join(f"{run.phase_rate(i):.1f}" for i in range(len(results)))
                     + f"  ({(time.monotonic() - started) / 60:.1f} min)")
        decisions = {name: c.get("/api/decisions") for name, c in controllers.items()}
        calibration = {name: c.cost_calibration() for name, c in controllers.items()}
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    # Every phase of every run (vLLM's metrics in its result JSON's keys, with the phase's own),
    # written before any figure is derived, so the runs' hours survive a failing one.
    (out / "vllm-results.json").write_text(json.dumps(
        {name: [{"rep": r.rep, "phases": r.phases} for r in rs] for name, rs in runs.items()})
        + "\n")
    (out / "probes.json").write_text(json.dumps(probes) + "\n")
    reference = (runs.get(OFF) or next(iter(runs.values())))[0]
    figs = [figures(c.name, runs[c.name], reference, options.phases, greedy,
                    probes.get(c.name), probes.get(OFF)) for c in configs]
    statics = [f for f, c in zip(figs, configs, strict=True) if not c.specpilot]
    seconds = [p.seconds for p in options.phases]
    report = RealReport(
        figs, [versus(f, statics, seconds, calibration.get(c.name, ()), runs)
               for f, c in zip(figs, configs, strict=True) if c.specpilot and statics],
        options.phases, time.monotonic() - started, models.drafter_summary, tables,
        serve_dtype())
    (out / "real.json").write_text(json.dumps(report_json(report), indent=2) + "\n")
    for name, body in decisions.items():
        (out / f"decisions-{name}.json").write_bytes(body)
    (out / "real.md").write_text(markdown(report) + "\n")
    if options.plots:
        plot(report, out / "real.png")
    echo(markdown(report))
    echo(f"written to {out}/real.{{json,md{',png' if options.plots else ''}}}, "
         "vllm-results.json, probes.json")
    return report
