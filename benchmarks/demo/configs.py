"""Engine configurations the benchmark compares: no speculation, static ones, and specpilot."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.real.fetch import cache_root

# Where the tiny models are built and cached: the user's cache folder, so a demo run from any
# folder finds them.
DEFAULT_CACHE = cache_root() / "demo-models"

SPECPILOT = "specpilot"
SPECPILOT_EAGLE = "specpilot-eagle"
SPECPILOT_SUFFIX = "specpilot-suffix"
SPECPILOT_NGRAM = "specpilot-ngram"
OFF = "off"
# The model drafters specpilot runs on, with the name of its configuration on each.
SPECPILOT_NAMES: dict[str, str] = {"draft": SPECPILOT, "eagle": SPECPILOT_EAGLE}
# Every engine specpilot steers: the model drafters, and vLLM's suffix decoding and prompt lookup
# (no model drafter whose passes the engine pays for while speculation is off; K cut per
# request).
SPECPILOT_ENGINES: dict[str, str] = {**SPECPILOT_NAMES, "suffix": SPECPILOT_SUFFIX,
                                     "ngram": SPECPILOT_NGRAM}

# vLLM's own static schedule by batch size, (first batch size, last batch size, K): long drafts
# while the batch is small, shorter ones as it grows, none in a large batch.
DEFAULT_BATCH_TABLE: tuple[tuple[int, int, int], ...] = ((1, 2, 4), (3, 8, 2), (9, 1024, 0))


@dataclass(frozen=True)
class EngineConfig:
    """How one engine is started: its drafter, K, and whether specpilot steers it."""

    name: str
    # "none", "draft" (the trained draft model), "eagle" (the EAGLE head on the target's hidden
    # states, benchmarks.demo.eagle), "ngram" (prompt lookup) or "suffix" (suffix decoding).
    drafter: str = "none"
    # num_speculative_tokens: the static K, or the largest K specpilot may choose.
    k: int = 0
    batch_table: tuple[tuple[int, int, int], ...] = ()
    # Run the specpilot scheduler connected to the controller.
    specpilot: bool = False
    # SPECPILOT_PLUGIN_* values for this engine (specpilot configs only).
    plugin_env: dict[str, str] = field(default_factory=dict)
    # The model draft's sampling: "greedy" (drafts are one-hot to rejection sampling) or
    # "probabilistic" (rejection sampling uses the draft's probabilities: far higher acceptance
    # on sampled traffic, identical at T=0).
    draft_sampling: str = "greedy"
    # The controller's settings for this configuration's sidecar (specpilot configs only), over
    # the benchmark's own: what one configuration changes in the controller, e.g. the token cut.
    controller: dict[str, Any] = field(default_factory=dict)

    def speculative_config(self, draft_dir: Path, eagle_dir: Path | None = None
                           ) -> dict[str, Any] | None:
        if self.drafter == "none" or self.k == 0:
            return None
        spec: dict[str, Any]
        if self.drafter in ("draft", "eagle"):
            if self.drafter == "eagle" and eagle_dir is None:
                raise ValueError(f"{self.name}: needs the EAGLE head's directory")
            model = eagle_dir if self.drafter == "eagle" else draft_dir
            spec = {"model": str(model), "num_speculative_tokens": self.k,
                    "draft_sample_method": self.draft_sampling}
            if self.drafter == "eagle":
                spec["method"] = "eagle"
        elif self.drafter == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": self.k,
                    "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        elif self.drafter == "suffix":
            spec = {"method": "suffix", "num_speculative_tokens": self.k}
        else:
            raise ValueError(f"{self.name}: unknown drafter {self.drafter!r}")
        if self.batch_table:
            spec["num_speculative_tokens_per_batch_size"] = [list(t) for t in self.batch_table]
        return spec


PROBABILISTIC = "probabilistic"


def bench_configs(max_k: int = 4) -> list[EngineConfig]:
    """The line-up: off, static draft K=2 and K=4 with probabilistic drafting (``p``: what a
    user serving sampled traffic would configure), static n-gram K=4, vLLM's static batch-size
    table (probabilistic drafting), the EAGLE head at static K=2 (probabilistic), and specpilot
    on each model drafter (the draft model, the EAGLE head: up to ``max_k``, probabilistic
    drafting, n-gram drafts offered)."""
    return [
        EngineConfig(OFF),
        EngineConfig("draft:2p", "draft", 2, draft_sampling=PROBABILISTIC),
        EngineConfig("draft:4p", "draft", 4, draft_sampling=PROBABILISTIC),
        EngineConfig("ngram:4", "ngram", 4),
        EngineConfig("draft-table-p", "draft", max(k for _, _, k in DEFAULT_BATCH_TABLE),
                     batch_table=DEFAULT_BATCH_TABLE, draft_sampling=PROBABILISTIC),
        EngineConfig("eagle:2p", "eagle", 2, draft_sampling=PROBABILISTIC),
        specpilot_config(max_k),
        specpilot_config(max_k, "eagle"),
    ]


SPECPILOT_DECISIONS = "specpilot-decisions"


def optional_configs() -> list[EngineConfig]:
    """Configurations run only when named (``--config``): the EAGLE head at static K=4,
    probabilistic drafting; specpilot on the draft model with its decisions applied as they
    are (no per-step re-picks: ``SPECPILOT_PLUGIN_STEP_COMPOSITION=false``), to measure what
    the re-picks gain side by side."""
    ours = specpilot_config()
    return [EngineConfig("eagle:4p", "eagle", 4, draft_sampling=PROBABILISTIC),
            replace(ours, name=SPECPILOT_DECISIONS,
                    plugin_env={**ours.plugin_env, "STEP_COMPOSITION": "false"})]


def specpilot_config(max_k: int = 4, drafter: str = "draft") -> EngineConfig:
    """specpilot on ``drafter`` up to ``max_k``. On a model drafter ("draft", "eagle") with
    n-gram and suffix drafts substituted where they win (suffix drafts are off by default in the
    plugin; the benchmark offers them); on vLLM's suffix decoding ("suffix") or prompt lookup
    ("ngram") with K cut per request (the only K mode the suffix engine runs)."""
    if drafter not in SPECPILOT_ENGINES:
        raise ValueError(f"specpilot runs on a model drafter {sorted(SPECPILOT_NAMES)}, on "
                         f"suffix decoding or on n-gram, not {drafter!r}")
    if drafter in ("suffix", "ngram"):
        return EngineConfig(SPECPILOT_ENGINES[drafter], drafter, max_k, specpilot=True,
                            plugin_env={"K_MODE": "per_request"})
    # batch_max: the drafter drafts only the largest K the batch's requests want, so a shorter
    # K (or off) saves draft passes too, not only verification; each request keeps its own K.
    return EngineConfig(SPECPILOT_NAMES[drafter], drafter, max_k, specpilot=True,
                        plugin_env={"K_MODE": "batch_max", "SUFFIX_DRAFTS": "true"},
                        draft_sampling=PROBABILISTIC)


FORCED_OFF_SUFFIX = "-forced-off"


def forced_off(ours: EngineConfig, classes: Iterable[str]) -> EngineConfig:
    """``ours`` with every class of ``classes`` marked offline, so its controller pins it off:
    the engine configured for speculation, specpilot's answer always "off". What "off is free"
    is measured with, against an engine without speculation. Named ``<name>-forced-off``."""
    if not ours.specpilot:
        raise ValueError(f"{ours.name}: only a specpilot configuration can be forced off")
    return replace(ours, name=ours.name + FORCED_OFF_SUFFIX,
                   controller={**ours.controller, "offline_classes": sorted(set(classes))})


NOCUT_SUFFIX = "-nocut"


def without_token_cut(ours: EngineConfig) -> EngineConfig:
    """``ours`` with the controller's ``token_cut`` off, everything else equal, named
    ``<name>-nocut``: what the per-token cut (each request's drafts cut token by token where the
    engine is told the request's K: ``per_request``, ``batch_max``) and the drafter's early stop,
    both on by default, are measured against. Both need the confidences only model drafters
    report."""
    if not ours.specpilot or ours.drafter not in SPECPILOT_NAMES:
        raise ValueError(f"{ours.name}: the token cut needs specpilot on a model drafter "
                         f"{sorted(SPECPILOT_NAMES)}")
    return replace(ours, name=ours.name + NOCUT_SUFFIX,
                   controller={**ours.controller, "token_cut": False})


def static_rivals(ours: EngineConfig, configs: Iterable[EngineConfig]) -> list[EngineConfig]:
    """The static configurations a specpilot configuration is measured against: those on the
    drafts it can choose itself (no speculation, n-gram, suffix, its own model drafter), so a
    ratio says what the controller gains, not what a better drafter would."""
    return [c for c in configs
            if not c.specpilot and c.drafter in ("none", "ngram", "suffix", ours.drafter)]
