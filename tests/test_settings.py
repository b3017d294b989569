"""Settings: precedence file < environment < flags, one clear line per bad setting, documented
once (under the field of the config dataclass), and derived whole into the core's config."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from specpilot.contract.fielddocs import field_docs
from specpilot.controller.core.acceptance import EstimatorConfig
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.cost_model import CostPrior
from specpilot.controller.core.policy import PolicyConfig
from specpilot.controller.settings import (
    CONCERNS,
    SETTINGS,
    FleetConfig,
    Settings,
    SettingsError,
    core_config,
    fleet_config,
    load_settings,
    settings_from,
    settings_reference,
    unknown_environment,
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


# --- every mistake at once, where it was made ---------------------------------------------------
def test_a_file_with_three_mistakes_reports_all_three_with_their_lines(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("grpc_port: 50051\n"
                   "half_life_secnds: 120\n"  # misspelt
                   "dwell_seconds: soon\n"  # not a number
                   "# a comment\n"
                   "max_k: 0\n")  # out of range
    with pytest.raises(SettingsError) as err:
        load_settings(cfg)
    assert err.value.lines == (
        f"{cfg}:2: bad setting half_life_secnds: not a setting; did you mean half_life_seconds?",
        f"{cfg}:3: bad setting dwell_seconds: should be a valid number, unable to parse string "
        "as a number, got 'soon'",
        f"{cfg}:5: bad setting max_k: should be greater than or equal to 1, got 0",
    )
    assert str(err.value) == "\n".join(err.value.lines)


def test_file_environment_and_flags_are_reported_together_each_with_its_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("max-k: 3\nSPECPILOT_DWELL_SECONDS: 2\nprobe_k: 2\nprobe_k: 3\n"
                   "batch_bucket_upper_bounds: [4, x]\n")
    # A list in the environment is JSON: a bare word was a traceback from pydantic-settings.
    monkeypatch.setenv("SPECPILOT_OFFLINE_CLASSES", "batch")
    monkeypatch.setenv("SPECPILOT_HALF_LIFE_SECONDS", "-5")
    with pytest.raises(SettingsError) as err:
        settings_from(cfg, {"grpc_port": "70000", "warmup_kk": 1}, {"grpc_port": "--grpc-port"})
    assert err.value.lines == (
        f"{cfg}:1: bad setting max-k: not a setting; did you mean max_k?",
        f"{cfg}:2: bad setting SPECPILOT_DWELL_SECONDS: not a setting; did you mean "
        "dwell_seconds?",
        f"{cfg}:4: bad setting probe_k: set twice (also on line 3): keep one",
        f"{cfg}:5: bad setting batch_bucket_upper_bounds: item 2: should be a valid integer, "
        "unable to parse string as an integer, got 'x'",
        "bad setting offline_classes: not JSON, got 'batch': a list in the environment is "
        "JSON, e.g. SPECPILOT_OFFLINE_CLASSES='[\"name\"]' (from SPECPILOT_OFFLINE_CLASSES)",
        "bad setting half_life_seconds: should be greater than 0, got '-5' "
        "(from SPECPILOT_HALF_LIFE_SECONDS)",
        "bad setting warmup_kk: not a setting; did you mean warmup_k?",
        "bad setting grpc_port: should be less than or equal to 65535, got '70000' "
        "(from --grpc-port)",
    )


def test_every_broken_relation_is_reported_and_secrets_are_never_echoed() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(max_k=2, warmup_k=3, probe_k=4)
    assert err.value.lines == ("bad setting warmup_k: must not exceed max_k (2), got 3",
                               "bad setting probe_k: must not exceed max_k (2), got 4")
    with pytest.raises(SettingsError) as err:
        load_settings(policy_token=12345678901234567890)
    assert "12345678901234567890" not in str(err.value)
    assert str(err.value).startswith("bad setting policy_token: should be a valid string")


def test_unknown_specpilot_variables_are_named_with_the_closest_one() -> None:
    environ = {"SPECPILOT_HALF_LIFE_SECOND": "120", "SPECPILOT_half_life_seconds": "1",
               "SPECPILOT_PLUGIN_CONTROLER": "x:1", "SPECPILOT_TARGET": "h:1",
               "SPECPILOT_XYZZY": "1", "PATH": "/bin"}
    assert unknown_environment(environ, ("SPECPILOT_TARGET",)) == [
        "SPECPILOT_HALF_LIFE_SECOND is not a specpilot setting or variable, so it is ignored; "
        "did you mean SPECPILOT_HALF_LIFE_SECONDS?",
        "SPECPILOT_XYZZY is not a specpilot setting or variable, so it is ignored "
        "(specpilot settings --markdown lists the variables)",
    ]


def test_no_specpilot_variable_the_project_reads_is_called_unknown() -> None:
    """Every SPECPILOT_* name in the code, the chart and the docs (Python constants aside) is a
    setting's, the plugin's or one of the CLI's known_variables: none would be warned about."""
    from specpilot.controller.cli import known_variables

    root = Path(__file__).resolve().parent.parent
    files = [p for d in ("controller", "engine_plugin", "benchmarks", "tools", "tests", "deploy")
             for p in (root / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".yaml", ".tpl", ".sh", ".md", "")]
    files += [root / "README.md", root / "Makefile", *(root / "docs").glob("*.md")]
    word = re.compile(r"\bSPECPILOT_[A-Z0-9_]*[A-Z0-9]\b")
    constant = re.compile(r"^(SPECPILOT_[A-Z0-9_]+)(?:: [^=]+)? = ", re.MULTILINE)
    names: dict[str, str] = {}
    constants: set[str] = set()
    for path in files:
        text = path.read_text(errors="replace")
        constants.update(constant.findall(text) if path.suffix == ".py" else ())
        for name in word.findall(text):
            names.setdefault(name, str(path.relative_to(root)))
    assert {"SPECPILOT_CACHE", "SPECPILOT_TARGET", "SPECPILOT_MAX_K"} <= set(names)  # it scans
    # Misspelt on purpose, in the tests of these warnings and of the plugin's own.
    deliberate = {"SPECPILOT_HALF_LIFE_SECOND", "SPECPILOT_XYZZY"}
    environ = dict.fromkeys(set(names) - constants - deliberate, "1")
    flagged = unknown_environment(environ, known_variables())
    assert flagged == [], {w.split()[0]: names[w.split()[0]] for w in flagged}
