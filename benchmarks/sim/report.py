"""Results of simulations as numbers (JSON), tables (markdown) and plots (PNG).

Targets are checked here. Per scenario, by kind: specpilot >= 0.97 of the oracle on
stationary scenarios, >= 0.93 where load or acceptance shifts, >= 0.99 of ``off`` where
speculation does not pay; >= the best static K everywhere. Over the suite: first of the
non-oracle policies on the geometric mean, at >= 0.99 of the oracle, and first on the geometric
mean of every scenario kind.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.plots import pyplot, save_figure
from benchmarks.sim.engine import RunResult

ORACLE_TARGET = {"stationary": 0.97, "shifting": 0.93}
OFF_TARGET = 0.99
SUITE_TARGET = 0.99  # specpilot's geometric mean of its ratios to the oracle


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    kind: str
    description: str
    seed: int
    runs: dict[str, RunResult]
    seeds: int = 1  # runs pooled per policy: seeds seed .. seed + seeds - 1

    def ratio(self, policy: str, to: str = "oracle") -> float | None:
        if policy not in self.runs or to not in self.runs:
            return None
        return self.runs[policy].throughput / self.runs[to].throughput

    def best_static(self) -> str | None:
        statics = [p for p in self.runs if p.startswith("static:")]
        return max(statics, key=lambda p: self.runs[p].throughput) if statics else None

    def checks(self) -> list[tuple[str, bool]]:
        """(what, met) for every target that applies and whose policies ran."""
        out: list[tuple[str, bool]] = []
        if "specpilot" not in self.runs:
            return out
        target = ORACLE_TARGET.get(self.kind)
        r = self.ratio("specpilot")
        if target is not None and r is not None:
            out.append((f"specpilot {r:.3f} of oracle >= {target}", r >= target))
        r_off = self.ratio("specpilot", "off")
        if self.kind == "no_gain" and r_off is not None:
            out.append((f"specpilot {r_off:.3f} of off >= {OFF_TARGET}", r_off >= OFF_TARGET))
        best = self.best_static()
        if best is not None:
            r_best = self.ratio("specpilot", best)
            assert r_best is not None
            out.append((f"specpilot {r_best:.3f} of best static ({best}) >= 1", r_best >= 1.0))
        return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def suite_geomeans(results: list[ScenarioResult]) -> dict[str, float]:
    """Per policy run on every scenario: geometric mean of its ratio to the oracle."""
    common = set.intersection(*(set(r.runs) for r in results)) if results else set()
    if "oracle" not in common:
        return {}
    out = {}
    for p in common:
        ratios = [r.ratio(p) for r in results]
        out[p] = geomean([x for x in ratios if x is not None])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kind_geomeans(results: list[ScenarioResult]) -> dict[str, dict[str, float]]:
    """Per scenario kind: ``suite_geomeans`` of its scenarios."""
    kinds: dict[str, list[ScenarioResult]] = {}
    for r in results:
        kinds.setdefault(r.kind, []).append(r)
    return {kind: suite_geomeans(rs) for kind, rs in sorted(kinds.items())}


def idle_changes_per_minute(run: RunResult) -> float | None:
    """Decision changes per minute for (class, bucket)s the class did not decode in since the
    previous change (None for policies without a decision log)."""
    if run.idle_decision_changes is None:
        return None
    return run.idle_decision_changes / (run.duration_seconds / 60.0)


# Which fields of a pooled run (``engine.pool_runs``) come from the first seed alone.
FIRST_SEED_FIELDS = ("timeline_seconds", "k_timeline", "batch_timeline", "tokens_timeline")


# --- JSON ------------------------------------------------------------------------------------
def scenario_json(result: ScenarioResult) -> dict[str, object]:
    runs = {}
    for name, run in result.runs.items():
        data = asdict(run)
        data["throughput"] = run.throughput
        data["ratio_to_oracle"] = result.ratio(name)
        data["phase_throughput"] = run.phase_throughput()
        data["class_throughput"] = run.class_throughput()
        data["class_acceptance"] = run.class_acceptance()
        data["idle_decision_changes_per_minute"] = idle_changes_per_minute(run)
        runs[name] = data
    return {"scenario": result.name, "kind": result.kind, "seed": result.seed,
            "seeds": result.seeds,
            "fields": {
                "first_seed_only": list(FIRST_SEED_FIELDS),
                "pooled": ("every other field of a run: counts, tokens and seconds summed over "
                           "the seeds (so rates are pooled ratios), latency weighted by finished "
                           "requests")},
            "description": result.description,
            "checks": [{"check": c, "met": ok} for c, ok in result.checks()], "runs": runs}


# --- markdown --------------------------------------------------------------------------------
def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def scenario_markdown(result: ScenarioResult) -> str:
    runs = result.runs
    any_run = next(iter(runs.values()))
    phases = any_run.phase_labels
    classes = list(any_run.class_tokens)
    head = (["policy", "tokens/s", "vs oracle"] + [f"phase {p}" for p in phases]
            + [f"{c} tok/s" for c in classes])
    last = result.seed + result.seeds - 1
    pooled = f" Pooled over {result.seeds} seeds ({result.seed}..{last})." if last > result.seed \
        else ""
    lines = [f"### {result.name} ({result.kind})", "", result.description.strip() + pooled, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, run in sorted(runs.items(), key=lambda kv: -kv[1].throughput):
        ct = run.class_throughput()
        cells = ([f"`{name}`", f"{run.throughput:.1f}", _fmt(result.ratio(name))]
                 + [f"{x:.1f}" for x in run.phase_throughput()]
                 + [f"{ct[c]:.1f}" for c in classes])
        lines.append("| " + " | ".join(cells) + " |")
    checks = result.checks()
    idle = {name: x for name, run in runs.items()
            if (x := idle_changes_per_minute(run)) is not None}
    if checks or idle:
        lines.append("")
    lines.extend(f"- {'met' if ok else 'NOT met'}: {what}" for what, ok in checks)
    lines.extend(f"- `{name}`: {x:.2f} decision changes per minute in (class, bucket)s without "
                 f"traffic since the previous change (goal 0)" for name, x in idle.items())
    return "\n".join(lines) + "\n"


def suite_markdown(results: list[ScenarioResult]) -> str:
    """Ratio to the oracle per policy and scenario, with the geometric mean, best first."""
    g = suite_geomeans(results)
    if not g:
        return ""
    head = ["policy", *(r.name for r in results), "geomean"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown = [p for p in g if not p.startswith("static:")]
    best_static = max((p for p in g if p.startswith("static:")), key=lambda p: g[p], default=None)
    if best_static is not None:
        shown.append(best_static)
    for p in sorted(shown, key=lambda p: -g[p]):
        label = f"`{p}`" + (" (best static on the suite)" if p == best_static else "")
        lines.append("| " + " | ".join([label, *(_fmt(r.ratio(p)) for r in results),
                                        _fmt(g[p])]) + " |")
    lines.append("| best static per scenario | " + " | ".join(
        f"{_fmt(r.ratio(b))} `{b}`" if (b := r.best_static()) else "-" for r in results)
        + " | |")
    first = next((p for p in g if p != "oracle"), None)
    lines += ["", f"- {'met' if first == 'specpilot' else 'NOT met'}: first non-oracle policy "
              f"on the geometric mean is `{first}`"]
    if "specpilot" in g:
        ok = g["specpilot"] >= SUITE_TARGET
        lines.append(f"- {'met' if ok else 'NOT met'}: specpilot {g['specpilot']:.3f} of the "
                     f"oracle on the geometric mean >= {SUITE_TARGET}")
    for kind, by_policy in kind_geomeans(results).items():
        ranked = [(p, x) for p, x in by_policy.items() if p != "oracle"]
        if not ranked or "specpilot" not in by_policy:
            continue
        top, x = ranked[0]
        runner_up = next(((p, y) for p, y in ranked if p != "specpilot"), None)
        versus = f", then `{runner_up[0]}` {runner_up[1]:.3f}" if runner_up else ""
        lines.append(f"- {'met' if top == 'specpilot' else 'NOT met'} (kind {kind}): first "
                     f"non-oracle policy on the kind's geometric mean is `{top}` {x:.3f} "
                     f"(specpilot {by_policy['specpilot']:.3f}{versus})")
    for r in results:
        lines.extend(f"- {'met' if ok else 'NOT met'} ({r.name}): {what}"
                     for what, ok in r.checks())
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------

def plot_k_timeline(result: ScenarioResult, path: Path,
                    policies: tuple[str, ...] = ("oracle", "specpilot")) -> None:
    """Mean K per class over time, one panel per class, for the chosen policies (and batch size
    on a second axis)."""
    plt = pyplot()
    shown = [p for p in policies if p in result.runs]
    any_run = result.runs[shown[0]]
    classes = list(any_run.k_timeline)
    fig, axes = plt.subplots(len(classes), 1, figsize=(9, 2.2 * len(classes) + 0.6),
                             sharex=True, squeeze=False)
    dt = any_run.timeline_seconds
    for ax, c in zip(axes[:, 0], classes, strict=True):
        for p in shown:
            ks = result.runs[p].k_timeline[c]
            ax.step([i * dt for i in range(len(ks))], [math.nan if k is None else k for k in ks],
                    where="post", label=p, linewidth=1.4 if p == "specpilot" else 1.0)
        ax.set_ylabel(f"{c}\nmean K")
        twin = ax.twinx()
        batch = any_run.batch_timeline
        twin.plot([i * dt for i in range(len(batch))],
                  [math.nan if b is None else b for b in batch], color="0.7", linewidth=0.8,
                  linestyle=":")
        twin.set_ylabel("batch", color="0.5")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("simulated seconds")
    fig.suptitle(f"{result.name}: K per class over time (dotted: batch size)")
    save_figure(fig, path)


def plot_ratios(labels: list[str], ratios: dict[str, list[float | None]], path: Path,
                title: str) -> None:
    """Grouped bars: ratio to the oracle per policy (one group per scenario or one group)."""
    plt = pyplot()
    policies = list(ratios)
    width = 0.8 / max(len(policies), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(labels) * max(1, len(policies) / 4)), 4))
    for i, p in enumerate(policies):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [math.nan if r is None else r for r in ratios[p]], width, label=p,
               edgecolor="black" if p == "specpilot" else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=15,
                  fontsize=8)
    ax.set_ylabel("throughput / oracle")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=7, ncol=4, loc="lower left")
    ax.set_title(title)
    save_figure(fig, path)


def comparison_policies(result: ScenarioResult) -> list[str]:
    """Policies worth a bar: every non-static one plus the best static."""
    out = [p for p in result.runs if not p.startswith("static:") and p != "oracle"]
    best = result.best_static()
    return out + ([best] if best else [])


def write_scenario(result: ScenarioResult, out: Path, plots: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "result.json", out / "table.md"]
    paths[0].write_text(json.dumps(scenario_json(result), indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(scenario_markdown(result), encoding="utf-8")
    if plots:
        plot_k_timeline(result, out / "k_timeline.png")
        shown = comparison_policies(result)
        plot_ratios([result.name], {p: [result.ratio(p)] for p in shown}, out / "ratios.png",
                    f"{result.name}: throughput relative to the oracle")
        paths += [out / "k_timeline.png", out / "ratios.png"]
    return paths


def write_suite(results: list[ScenarioResult], out: Path, plots: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    g = suite_geomeans(results)
    summary = {"geomean_ratio_to_oracle": g,
               "geomean_ratio_to_oracle_by_kind": kind_geomeans(results),
               "scenarios": {r.name: {p: r.ratio(p) for p in r.runs} for r in results}}
    paths = [out / "suite.json", out / "suite.md"]
    paths[0].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(suite_markdown(results), encoding="utf-8")
    if plots and g:
        shown = [p for p in g if not p.startswith("static:") and p != "oracle"]
        labels = [r.name for r in results]
        ratios: dict[str, list[float | None]] = {p: [r.ratio(p) for r in results] for p in shown}
        ratios["best static"] = [r.ratio(b) if (b := r.best_static()) else None for r in results]
        plot_ratios(labels, ratios, out / "suite.png", "Throughput relative to the oracle")
        paths.append(out / "suite.png")
    return paths
