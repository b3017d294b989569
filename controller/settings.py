"""Every controller setting, in one place, each with its unit and default.

Sources, later ones win: defaults below < YAML file (``--config`` or ``SPECPILOT_CONFIG``) <
environment (``SPECPILOT_<NAME>``, e.g. ``SPECPILOT_HALF_LIFE_SECONDS=120``) < command-line flags.
Lists in the environment are JSON (``SPECPILOT_OFFLINE_CLASSES='["batch"]'``).
A bad value stops start-up with one line naming the setting (see ``load_settings``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.core.acceptance import EstimatorConfig
from controller.core.buckets import DEFAULT_BUCKET_BOUNDS
from controller.core.controller import CoreConfig
from controller.core.cost_model import CostPrior
from controller.core.policy import PolicyConfig


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


class Settings(BaseSettings):
    """Controller configuration. Units are in the field names or descriptions."""

    model_config = SettingsConfigDict(env_prefix="SPECPILOT_", extra="forbid", frozen=True)

    # --- serving -------------------------------------------------------------------------------
    grpc_host: str = Field("127.0.0.1", description="Address the gRPC services bind to.")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    http_host: str = Field("127.0.0.1", description="Address of /metrics, /healthz and /api.")
    http_port: int = Field(9464, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    policy_token: SecretStr | None = Field(
        None,
        description="Bearer token that PolicyService writes must carry. Unset: a random token is "
        "generated at start-up and printed once.",
    )
    max_report_bytes: int = Field(
        1 << 20, ge=1024, description="Largest accepted engine report, bytes; larger ones are "
        "rejected with a reason and the stream stays up."
    )
    report_interval_seconds: float = Field(
        1.0, gt=0, description="How often engines report, seconds (sent in the hello ack)."
    )
    fail_static_timeout_seconds: float = Field(
        30.0, gt=0, description="Engines fall back to their static config after this long "
        "without hearing from the controller, seconds."
    )
    decision_log_size: int = Field(1000, ge=1, description="Decisions kept for watch/replay.")
    seed: int | None = Field(None, description="Seed of the Thompson-sampling RNG; unset: random.")

    # --- traffic classes ----------------------------------------------------------------------
    max_classes: int = Field(
        16, ge=1, le=256, description="Distinct class names tracked; more fold into 'other'."
    )
    offline_classes: list[str] = Field(
        default_factory=list, description="Classes of prefill-dominated batch work."
    )
    offline_mode: Literal["pin_off", "goodput"] = Field(
        "pin_off",
        description="pin_off: offline classes never speculate. goodput: decided by the same "
        "goodput math at the largest batch bucket (offline work runs at full load).",
    )

    # --- acceptance estimator -----------------------------------------------------------------
    max_k: int = Field(8, ge=1, le=32, description="Largest K the controller considers, tokens.")
    half_life_seconds: float = Field(
        300.0, gt=0, description="Half-life of acceptance evidence, seconds."
    )
    prior_alpha: float = Field(1.0, gt=0, description="Beta prior pseudo-accepts per position.")
    prior_beta: float = Field(1.0, gt=0, description="Beta prior pseudo-rejects per position.")
    change_fast_half_life_seconds: float = Field(
        20.0, gt=0, description="Half-life of the change detector's fast estimate, seconds."
    )
    change_z_threshold: float = Field(
        5.0, gt=0, description="|z| between fast and slow acceptance that flags a change."
    )
    change_min_tries: float = Field(
        200.0, gt=0, description="Effective tries the fast estimate needs before it can flag."
    )

    # --- step-cost model ----------------------------------------------------------------------
    batch_bucket_upper_bounds: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BUCKET_BOUNDS),
        description="Inclusive upper bounds of batch-size buckets, sequences; one open bucket "
        "follows the last.",
    )
    cost_knots_tokens: list[int] = Field(
        default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024],
        description="Verified-token counts where the step-cost slope may change (hinge knots).",
    )
    cost_prior_base_seconds: float = Field(0.02, ge=0, description="Prior fixed step time, s.")
    cost_prior_seconds_per_token: float = Field(
        2e-5, ge=0, description="Prior step time per verified token below the ridge, s."
    )
    cost_prior_ridge_tokens: int = Field(
        128, ge=1, description="Prior ridge point (memory- to compute-bound), verified tokens; "
        "must be one of cost_knots_tokens."
    )
    cost_prior_seconds_per_token_above_ridge: float = Field(
        2e-4, ge=0, description="Prior extra step time per verified token above the ridge, s."
    )
    cost_prior_draft_seconds_per_pass: float = Field(
        1e-3, ge=0, description="Prior model-draft time per sequential draft pass, s."
    )
    cost_prior_draft_seconds_per_token: float = Field(
        1e-5, ge=0, description="Prior model-draft time per proposed token, s."
    )
    cost_prior_strength_steps: float = Field(
        20.0, gt=0, description="Weight of the cost prior, in equivalent observed steps."
    )
    cost_half_life_seconds: float = Field(
        600.0, gt=0, description="Half-life of step-timing evidence, seconds."
    )

    # --- policy --------------------------------------------------------------------------------
    warmup_k: int = Field(2, ge=0, description="K used for a class before any data, tokens.")
    dwell_seconds: float = Field(
        5.0, ge=0, description="Minimum time a (class, bucket) choice stays, seconds."
    )
    joint_interval_seconds: float = Field(
        5.0, gt=0, description="Age after which a bucket's joint (whole-batch) arm search is "
        "rerun, seconds (two buckets per decide round; all after a detected change)."
    )
    hysteresis_ratio: float = Field(
        0.03, ge=0, description="Relative sampled-goodput gain a new arm needs to replace the "
        "current one (0.03 = 3%)."
    )
    min_speedup: float = Field(
        1.02, ge=1.0, description="Smallest expected speedup over no speculation (ratio) that "
        "justifies drafting; smaller gains are inside the cost model's error."
    )
    probe_rate_initial: float = Field(
        0.05, ge=0, le=1, description="Share of a class's requests probed right after it goes off."
    )
    probe_rate_min: float = Field(
        0.005, ge=0, le=1, description="Floor of the probe share while off."
    )
    probe_half_life_seconds: float = Field(
        120.0, gt=0, description="Half-life of the probe share while off, seconds."
    )
    probe_k: int = Field(2, ge=1, description="K of probed requests, tokens.")

    # --- state store (Redis comes with the fleet issue) ----------------------------------------
    state_store: Literal["memory"] = Field("memory", description="Where state lives.")

    @model_validator(mode="after")
    def _check_relations(self) -> Settings:
        bounds = self.batch_bucket_upper_bounds
        if not bounds or any(b <= 0 for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError("batch_bucket_upper_bounds: must be positive and strictly increasing")
        knots = self.cost_knots_tokens
        if not knots or any(k <= 0 for k in knots) or knots != sorted(set(knots)):
            raise ValueError("cost_knots_tokens: must be positive and strictly increasing")
        if self.cost_prior_ridge_tokens not in knots:
            raise ValueError("cost_prior_ridge_tokens: must be one of cost_knots_tokens")
        if self.warmup_k > self.max_k:
            raise ValueError("warmup_k: must not exceed max_k")
        if self.probe_k > self.max_k:
            raise ValueError("probe_k: must not exceed max_k")
        if self.probe_rate_min > self.probe_rate_initial:
            raise ValueError("probe_rate_min: must not exceed probe_rate_initial")
        return self


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from file < environment < ``overrides`` (None values are ignored).

    Raises SettingsError with one line naming the first bad setting.
    """
    file_values: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(Path(config_file).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"config file {config_file}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"config file {config_file}: expected a mapping of settings")
        file_values = loaded or {}
    explicit = {k: v for k, v in overrides.items() if v is not None}
    try:
        env_only = Settings()
        # File values apply only where the environment did not set the field.
        merged = {k: v for k, v in file_values.items() if k not in env_only.model_fields_set}
        return Settings(**{**merged, **explicit})
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        name = ".".join(str(p) for p in err["loc"])
        # Cross-field checks name their setting at the start of the message.
        raise SettingsError(f"bad setting {name}: {msg}" if name else f"bad setting {msg}") from exc


def core_config(settings: Settings) -> CoreConfig:
    """The pure core's configuration from the settings (the core never sees pydantic)."""
    s = settings
    return CoreConfig(
        estimator=EstimatorConfig(
            max_k=s.max_k,
            half_life_seconds=s.half_life_seconds,
            prior_alpha=s.prior_alpha,
            prior_beta=s.prior_beta,
            fast_half_life_seconds=s.change_fast_half_life_seconds,
            z_threshold=s.change_z_threshold,
            min_tries=s.change_min_tries,
        ),
        policy=PolicyConfig(
            max_k=s.max_k,
            warmup_k=s.warmup_k,
            dwell_seconds=s.dwell_seconds,
            joint_interval_seconds=s.joint_interval_seconds,
            hysteresis_ratio=s.hysteresis_ratio,
            min_speedup=s.min_speedup,
            probe_rate_initial=s.probe_rate_initial,
            probe_rate_min=s.probe_rate_min,
            probe_half_life_seconds=s.probe_half_life_seconds,
            probe_k=s.probe_k,
            offline_mode=s.offline_mode,
        ),
        cost_prior=CostPrior(
            base_seconds=s.cost_prior_base_seconds,
            seconds_per_token=s.cost_prior_seconds_per_token,
            ridge_tokens=s.cost_prior_ridge_tokens,
            seconds_per_token_above_ridge=s.cost_prior_seconds_per_token_above_ridge,
            draft_seconds_per_pass=s.cost_prior_draft_seconds_per_pass,
            draft_seconds_per_token=s.cost_prior_draft_seconds_per_token,
            strength_steps=s.cost_prior_strength_steps,
        ),
        cost_knots_tokens=tuple(s.cost_knots_tokens),
        cost_half_life_seconds=s.cost_half_life_seconds,
        batch_bucket_upper_bounds=tuple(s.batch_bucket_upper_bounds),
        max_classes=s.max_classes,
        offline_classes=frozenset(s.offline_classes),
        decision_log_size=s.decision_log_size,
    )


def settings_reference() -> str:
    """Markdown table of every setting: name, environment variable, default, meaning with unit.
    docs/configuration.md is this text; a test keeps them equal."""
    rows = [
        "# Configuration reference",
        "",
        "Generated from `controller/settings.py` by `specpilot settings --markdown`; do not edit.",
        "Sources, later ones win: defaults < YAML file (`--config`) < environment "
        "(`SPECPILOT_<NAME>`) < command-line flags.",
        "",
        "| setting | environment | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None else json.dumps(default)
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `SPECPILOT_{name.upper()}` | `{shown}` | {desc} |")
    return "\n".join(rows) + "\n"
