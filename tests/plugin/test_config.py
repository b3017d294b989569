"""PluginConfig from the environment: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import logging
import os
from dataclasses import fields
from pathlib import Path

import pytest

from specpilot.contract.fielddocs import field_docs
from specpilot.engine_plugin.config import PluginConfig, settings_table


def test_defaults() -> None:
    c = PluginConfig.from_env({})
    assert c.controller == ""
    assert c.engine_id.endswith(f"-{os.getpid()}")
    assert (c.class_rules, c.max_classes, c.report_interval_seconds) == ("", 16, 1.0)
    assert (c.fail_static_timeout_seconds, c.queue_size) == (30.0, 64)
    assert (c.reconnect_initial_seconds, c.reconnect_max_seconds) == (0.5, 10.0)
    assert c.k_mode == "per_request"


def test_every_variable_is_read() -> None:
    env = {
        "SPECPILOT_PLUGIN_CONTROLLER": "127.0.0.1:50051",
        "SPECPILOT_PLUGIN_ENGINE_ID": "pod-7",
        "SPECPILOT_PLUGIN_CLASS_RULES": "/etc/specpilot/rules.yaml",
        "SPECPILOT_PLUGIN_MAX_CLASSES": "8",
        "SPECPILOT_PLUGIN_REPORT_INTERVAL_SECONDS": "0.25",
        "SPECPILOT_PLUGIN_FAIL_STATIC_TIMEOUT_SECONDS": "12",
        "SPECPILOT_PLUGIN_QUEUE_SIZE": "5",
        "SPECPILOT_PLUGIN_RECONNECT_INITIAL_SECONDS": "0.1",
        "SPECPILOT_PLUGIN_RECONNECT_MAX_SECONDS": "2",
        "SPECPILOT_PLUGIN_K_MODE": "batch_wide",
    }
    c = PluginConfig.from_env(env)
    assert c == PluginConfig(
        controller="127.0.0.1:50051", engine_id="pod-7", class_rules="/etc/specpilot/rules.yaml",
        max_classes=8, report_interval_seconds=0.25, fail_static_timeout_seconds=12.0,
        queue_size=5, reconnect_initial_seconds=0.1, reconnect_max_seconds=2.0,
        k_mode="batch_wide")


def test_empty_values_mean_default_and_ipv6_needs_brackets() -> None:
    assert PluginConfig.from_env({"SPECPILOT_PLUGIN_QUEUE_SIZE": ""}).queue_size == 64
    assert PluginConfig.from_env({"SPECPILOT_PLUGIN_CONTROLLER": "[::1]:9"}).controller == "[::1]:9"


@pytest.mark.parametrize(("var", "value", "fragment"), [
    ("CONTROLLER", "localhost", "host:port"),
    ("CONTROLLER", "localhost:http", "not an integer"),
    ("CONTROLLER", "localhost:70000", "outside 1..65535"),
    ("CONTROLLER", "::1:50051", "brackets"),
    ("MAX_CLASSES", "1", ">= 2"),
    ("MAX_CLASSES", "many", "integer"),
    ("REPORT_INTERVAL_SECONDS", "0", "> 0"),
    ("REPORT_INTERVAL_SECONDS", "nan", "finite"),
    ("FAIL_STATIC_TIMEOUT_SECONDS", "-1", "> 0"),
    ("QUEUE_SIZE", "0", ">= 1"),
    ("QUEUE_SIZE", "2.5", "integer"),
    ("RECONNECT_INITIAL_SECONDS", "soon", "number"),
    ("K_MODE", "mixed", "per_request, batch_max, batch_wide"),
])
def test_bad_values_name_the_variable(var: str, value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        PluginConfig.from_env({f"SPECPILOT_PLUGIN_{var}": value})
    assert str(err.value).startswith(f"SPECPILOT_PLUGIN_{var}: ")
    assert fragment in str(err.value)


def test_backoff_bounds_are_related() -> None:
    with pytest.raises(ValueError, match=r"^SPECPILOT_PLUGIN_RECONNECT_MAX_SECONDS: "):
        PluginConfig.from_env({"SPECPILOT_PLUGIN_RECONNECT_INITIAL_SECONDS": "5",
                               "SPECPILOT_PLUGIN_RECONNECT_MAX_SECONDS": "1"})


def test_unknown_variable_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specpilot.engine_plugin.config"):
        PluginConfig.from_env({"SPECPILOT_PLUGIN_CONTROLER": "x:1"})
    assert "SPECPILOT_PLUGIN_CONTROLER: unknown" in caplog.text


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"^SPECPILOT_PLUGIN_QUEUE_SIZE: "):
        PluginConfig(queue_size=0)
    with pytest.raises(ValueError, match=r"^SPECPILOT_PLUGIN_ENGINE_ID: must not be empty"):
        PluginConfig(engine_id="  ")


def test_settings_table_in_the_docs_is_up_to_date() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine-plugin.md").read_text()
    begin = doc.index("-->\n", doc.index("<!-- generated from PluginConfig")) + len("-->\n")
    end = doc.index("<!-- end of generated settings -->")
    assert doc[begin:end] == settings_table(), (
        "docs/engine-plugin.md's settings table is stale: paste "
        "`python -c 'from specpilot.engine_plugin.config import settings_table as t; "
        "print(t(), end=\"\")'`")


def test_every_setting_has_one_docstring() -> None:
    docs = field_docs(PluginConfig)  # raises on a field without one
    assert set(docs) == {f.name for f in fields(PluginConfig)} and all(docs.values())


def test_tls_variables_are_read_and_go_together() -> None:
    env = {"SPECPILOT_PLUGIN_TLS_CA_FILE": "/etc/specpilot/tls/ca.crt",
           "SPECPILOT_PLUGIN_TLS_CERT_FILE": "/etc/specpilot/tls/tls.crt",
           "SPECPILOT_PLUGIN_TLS_KEY_FILE": "/etc/specpilot/tls/tls.key",
           "SPECPILOT_PLUGIN_TLS_SERVER_NAME": "llm-specpilot.ml.svc"}
    c = PluginConfig.from_env(env)
    assert (c.tls_ca_file, c.tls_cert_file, c.tls_key_file, c.tls_server_name) == (
        "/etc/specpilot/tls/ca.crt", "/etc/specpilot/tls/tls.crt", "/etc/specpilot/tls/tls.key",
        "llm-specpilot.ml.svc")
    # TLS without a client certificate (the controller verified, the engine not).
    assert PluginConfig.from_env({"SPECPILOT_PLUGIN_TLS_CA_FILE": "ca.crt"}).tls_cert_file == ""
    # Defaults: plaintext.
    assert PluginConfig.from_env({}).tls_ca_file == ""


@pytest.mark.parametrize(("env", "named", "fragment"), [
    ({"TLS_CA_FILE": "ca", "TLS_CERT_FILE": "c"}, "TLS_CERT_FILE", "TLS_KEY_FILE too"),
    ({"TLS_CA_FILE": "ca", "TLS_KEY_FILE": "k"}, "TLS_KEY_FILE", "TLS_CERT_FILE too"),
    ({"TLS_CERT_FILE": "c", "TLS_KEY_FILE": "k"}, "TLS_CERT_FILE", "needs SPECPILOT_PLUGIN_TLS_CA"),
    ({"TLS_SERVER_NAME": "svc"}, "TLS_SERVER_NAME", "needs SPECPILOT_PLUGIN_TLS_CA_FILE"),
])
def test_tls_variables_that_do_not_go_together_are_named(env: dict[str, str], named: str,
                                                          fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        PluginConfig.from_env({f"SPECPILOT_PLUGIN_{k}": v for k, v in env.items()})
    assert str(err.value).startswith(f"SPECPILOT_PLUGIN_{named}: ")
    assert fragment in str(err.value)
