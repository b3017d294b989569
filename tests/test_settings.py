"""Settings: precedence file < environment < flags, one clear line per bad setting, documented
once (under the field of the config dataclass), and derived whole into the core's config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controller.core.acceptance import EstimatorConfig
from controller.core.controller import CoreConfig
from controller.core.cost_model import CostPrior
from controller.core.policy import PolicyConfig
from controller.fielddocs import field_docs
from controller.settings import (
    CONCERNS,
    SETTINGS,
    FleetConfig,
    Settings,
    SettingsError,
    core_config,
    fleet_config,
    load_settings,
    settings_reference,
)


def test_precedence_file_then_environment_then_flags(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "specpilot.yaml"
    cfg.write_text("half_life_seconds: 100\ndwell_seconds: 3\nmax_k: 5\n")
    monkeypatch.setenv("SPECPILOT_DWELL_SECONDS", "4")
    monkeypatch.setenv("SPECPILOT_OFFLINE_CLASSES", '["batch"]')
    s = load_settings(cfg, max_k=6, grpc_port=None)
    assert s.half_life_seconds == 100  # file
    assert s.dwell_seconds == 4  # environment beats file
    assert s.max_k == 6  # flag beats file
    assert s.grpc_port == 50051  # None flags are ignored
    assert s.offline_classes == ["batch"]
    assert core_config(s).offline_classes == frozenset({"batch"})


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"max_k": 0}, "max_k"),
        ({"half_life_seconds": -1}, "half_life_seconds"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"warmup_k": 9, "max_k": 8}, "warmup_k"),
        ({"batch_bucket_upper_bounds": [4, 2]}, "batch_bucket_upper_bounds"),
        ({"cost_prior_ridge_tokens": 100}, "cost_prior_ridge_tokens"),
        ({"probe_k": 9}, "probe_k"),
        ({"probe_cost_floor": 0.1}, "probe_cost_floor"),
        ({"cost_knots_tokens": []}, "cost_knots_tokens"),
        ({"offline_mode": "sometimes"}, "offline_mode"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_bad_setting_is_one_line_naming_it(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(**overrides)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"bad setting {named}")


def test_bad_config_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(SettingsError, match="expected a mapping"):
        load_settings(bad)
    with pytest.raises(SettingsError, match=r"missing\.yaml"):
        load_settings(tmp_path / "missing.yaml")


def test_every_setting_is_documented() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, f"setting {name} has no description"


def test_configuration_reference_is_up_to_date() -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert doc.read_text() == settings_reference(), (
        "docs/configuration.md is stale: run "
        "`specpilot settings --markdown > docs/configuration.md`")


def test_every_config_field_has_one_docstring() -> None:
    for concern in CONCERNS:
        docs = field_docs(concern.config)  # raises on a field without one
        assert all(docs.values()), concern.config.__name__
    assert Settings.model_fields["change_z_threshold"].description == field_docs(
        EstimatorConfig)["change_z_threshold"]


def test_an_undocumented_field_fails_loudly() -> None:
    @dataclass(frozen=True)
    class Sloppy:
        documented: int = 1
        """Has one."""
        bare: int = 2

    with pytest.raises(TypeError, match=r"no docstring under field.* bare"):
        field_docs(Sloppy)


def test_settings_defaults_are_the_dataclass_defaults() -> None:
    policy = PolicyConfig()
    assert core_config(load_settings()) == CoreConfig(
        estimator=EstimatorConfig(max_k=policy.max_k), policy=policy, cost_prior=CostPrior())
    assert set(Settings.model_fields) == set(SETTINGS)
    assert fleet_config(load_settings()) == FleetConfig()  # "memory": no fleet


def test_flat_names_reach_their_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPILOT_COST_PRIOR_BASE_SECONDS", "0.5")
    core = core_config(load_settings(max_k=5, change_z_threshold=3.0, probe_k=4,
                                     batch_bucket_upper_bounds=[2, 8]))
    assert core.policy.max_k == core.estimator.max_k == 5  # one setting, both concerns
    assert core.estimator.change_z_threshold == 3.0
    assert core.cost_prior.base_seconds == 0.5
    assert core.policy.probe_k == 4
    assert core.batch_bucket_upper_bounds == (2, 8)
