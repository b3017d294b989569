"""The Helm chart, validated offline: rendered by Helm's own Go SDK (helm-python-sdk) over a
matrix of values, every manifest checked with kubernetes-validate --strict for Kubernetes 1.29
and 1.33, the alerts checked and unit-tested with promtool, the Grafana dashboard checked
against the metrics the controller really exports, and broken values refused with a message
naming the value."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import numpy as np
import pytest
import yaml

from controller.core.controller import ControllerCore
from controller.core.types import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    StepTimingRecord,
)
from controller.metrics import Metrics
from controller.server.app import start_server
from controller.settings import core_config, load_settings
from engine_plugin.config import PluginConfig
from tests.certs import make_pki

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specpilot"
KUBERNETES = ("1.29", "1.33")
# Kinds of the Prometheus operator: no schema in kubernetes-validate; checked below instead.
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
ON = {"alerts": {"enabled": True}, "grafana": {"dashboard": {"enabled": True}}}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name="demo", namespace="ml")
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def controller_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec = pod_spec(docs)
    found = [c for c in spec.get("initContainers", []) + spec["containers"]
             if c["name"] == "specpilot"]
    assert len(found) == 1
    return found[0]


MATRIX = [
    {"sidecar": {"native": native}, "redis": redis, "metrics": monitors, "policyToken": token,
     **ON}
    for native, redis, monitors, token in product(
        (True, False),
        ({"enabled": False}, {"enabled": True, "url": "redis://redis:6379/0"},
         {"enabled": True, "existingSecret": "redis-url"}),
        ({}, {"serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kps"}}},
         {"podMonitor": {"enabled": True}}),
        ({}, {"existingSecret": "my-token"}))
]
# TLS (server only; mTLS for the engine with the controller's certificate; with its own), with
# each monitor, native or not.
TLS_VARIANTS = (
    {"enabled": True, "secretName": "llm-tls"},
    {"enabled": True, "secretName": "llm-tls", "engineClientAuth": True},
    {"enabled": True, "secretName": "llm-tls", "caKey": "tls.crt", "serverName": "llm.example",
     "engineClientAuth": True, "engineSecretName": "engine-tls", "engineGrpcPort": 50060},
)
MATRIX += [
    {"sidecar": {"native": native}, "redis": {"enabled": False}, "metrics": monitors,
     "policyToken": {}, "tls": tls, **ON}
    for native, monitors, tls in product(
        (True, False),
        ({"serviceMonitor": {"enabled": True}}, {"podMonitor": {"enabled": True}}),
        TLS_VARIANTS)
]


def _tls_id(v: dict[str, Any]) -> str:
    tls = v.get("tls")
    if not tls:
        return "plaintext"
    if not tls.get("engineClientAuth"):
        return "tls"
    return "mtls-engine-secret" if tls.get("engineSecretName") else "mtls"


@pytest.mark.parametrize("values", MATRIX, ids=lambda v: "-".join((
    "native" if v["sidecar"]["native"] else "plain",
    "redis-secret" if v["redis"].get("existingSecret") else
    "redis" if v["redis"]["enabled"] else "memory",
    next(iter(v["metrics"]), "nomonitor"), "token-secret" if v["policyToken"] else "token",
    _tls_id(v))))
def test_every_combination_renders_valid_kubernetes(values: dict[str, Any]) -> None:
    docs = render(values)
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            continue
        for version in KUBERNETES:
            kubernetes_validate.validate(doc, version, strict=True)
    # What each value promises.
    spec, ctl = pod_spec(docs), controller_of(docs)
    native = values["sidecar"]["native"]
    assert (ctl in spec.get("initContainers", [])) is native
    assert (ctl.get("restartPolicy") == "Always") is native
    env = {e["name"]: e for e in ctl["env"]}
    assert ("SPECPILOT_STATE_STORE" in env) is values["redis"]["enabled"]
    if values["redis"].get("existingSecret"):
        assert env["SPECPILOT_STATE_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "redis-url"
    token_secret = env["SPECPILOT_POLICY_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if values["policyToken"]:
        assert token_secret == "my-token" and not secrets
    else:
        assert [s["metadata"]["name"] for s in secrets] == [token_secret]
    kinds = {d["kind"] for d in docs}
    assert ("ServiceMonitor" in kinds) is ("serviceMonitor" in values["metrics"])
    assert ("PodMonitor" in kinds) is ("podMonitor" in values["metrics"])
    for kind in ("ServiceMonitor", "PodMonitor"):
        for d in docs:
            if d["kind"] == kind:
                endpoints = d["spec"].get("endpoints") or d["spec"]["podMetricsEndpoints"]
                assert endpoints[0]["port"] == "http-metrics"
                assert d["spec"]["selector"]["matchLabels"] == one(
                    docs, "Deployment")["spec"]["selector"]["matchLabels"]
    engine = next(c for c in spec["containers"] if c["name"] == "vllm")
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    if not values.get("tls", {}).get("engineClientAuth"):  # else its mTLS port (check_tls)
        assert engine_env["SPECPILOT_PLUGIN_CONTROLLER"] == "127.0.0.1:50051"
    # The controller listens beyond loopback (the Service): the engine's stream carries the
    # engine token, the same Secret key on both sides.
    plugin_token = next(e for e in engine["env"] if e["name"] == "SPECPILOT_PLUGIN_TOKEN")
    assert plugin_token["valueFrom"] == env["SPECPILOT_ENGINE_TOKEN"]["valueFrom"]
    assert plugin_token["valueFrom"]["secretKeyRef"]["name"] == token_secret
    if not values["policyToken"]:
        assert set(secrets[0]["data"]) == {"token", "engine-token"}
    assert "--scheduler-cls=engine_plugin.scheduler.SpecPilotScheduler" in engine["args"]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and "specpilot.yaml" in d["data"])
    settings = yaml.safe_load(config["data"]["specpilot.yaml"])
    assert settings["grpc_host"] == "0.0.0.0"
    # The settings file is one the controller takes, and with the engine token from the Secret
    # it may listen beyond loopback (start_server refuses open engine streams there).
    taken = load_settings(**settings, engine_token="from-the-secret")
    assert taken.grpc_host == "0.0.0.0" and taken.engine_token is not None
    probes = [ctl[p] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    if "tls" in values:
        check_tls(docs, values["tls"], settings)
    else:
        assert all(p["grpc"] == {"port": 50051} for p in probes)
        assert not any(e["name"].startswith("SPECPILOT_PLUGIN_TLS") for e in engine["env"])
        assert "tls_cert_file" not in settings


def check_tls(docs: list[dict[str, Any]], tls: dict[str, Any], settings: dict[str, Any]) -> None:
    """What the TLS values promise: the controller serves TLS from the Secret (mTLS on its
    engine port with engineClientAuth), its probes are HTTPS GETs (the kubelet's gRPC probes
    cannot speak TLS), the engine verifies it (and presents its certificate), the monitors
    scrape HTTPS, the test checks over TLS."""
    spec, ctl = pod_spec(docs), controller_of(docs)
    engine = next(c for c in spec["containers"] if c["name"] == "vllm")
    mtls = tls.get("engineClientAuth", False)
    server_name = tls.get("serverName", "demo-specpilot.ml.svc")
    engine_port = tls.get("engineGrpcPort", 50052)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["specpilot-tls"]["secret"]["secretName"] == "llm-tls"
    mounts = {m["name"]: m["mountPath"] for m in ctl["volumeMounts"]}
    assert settings["tls_cert_file"] == mounts["specpilot-tls"] + "/tls.crt"
    assert settings["tls_key_file"] == mounts["specpilot-tls"] + "/tls.key"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert ctl[probe]["httpGet"] == {"path": "/healthz", "port": "http-metrics",
                                         "scheme": "HTTPS"}
        assert "grpc" not in ctl[probe]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    engine_mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    assert env["SPECPILOT_PLUGIN_TLS_CA_FILE"] == engine_mounts["specpilot-engine-tls"] + "/ca.crt"
    assert env["SPECPILOT_PLUGIN_TLS_SERVER_NAME"] == server_name
    sources = volumes["specpilot-engine-tls"]["projected"]["sources"]
    assert sources[0]["secret"] == {"name": "llm-tls", "items": [
        {"key": tls.get("caKey", "ca.crt"), "path": "ca.crt"}]}
    ports = {p["name"]: p["containerPort"] for p in ctl["ports"]}
    if mtls:
        assert env["SPECPILOT_PLUGIN_CONTROLLER"] == f"127.0.0.1:{engine_port}"
        tls_dir = engine_mounts["specpilot-engine-tls"]
        assert env["SPECPILOT_PLUGIN_TLS_CERT_FILE"] == tls_dir + "/tls.crt"
        assert env["SPECPILOT_PLUGIN_TLS_KEY_FILE"] == tls_dir + "/tls.key"
        assert sources[1]["secret"]["name"] == tls.get("engineSecretName", "llm-tls")
        assert (settings["tls_client_auth"], settings["engine_grpc_port"]) == ("engines",
                                                                               engine_port)
        assert settings["tls_client_ca_file"] == "/etc/specpilot-tls/" + tls.get("caKey",
                                                                                 "ca.crt")
        assert ports["grpc-engine"] == engine_port
        service = one(docs, "Service")
        assert engine_port not in {p["port"] for p in service["spec"]["ports"]}
    else:
        assert env["SPECPILOT_PLUGIN_CONTROLLER"] == "127.0.0.1:50051"
        assert "SPECPILOT_PLUGIN_TLS_CERT_FILE" not in env and len(sources) == 1
        assert "tls_client_ca_file" not in settings and "grpc-engine" not in ports
    # The engine's TLS environment is one the plugin takes.
    plugin = PluginConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert plugin.tls_ca_file and bool(plugin.tls_cert_file) is mtls
    for d in docs:
        if d["kind"] in ("ServiceMonitor", "PodMonitor"):
            endpoint = (d["spec"].get("endpoints") or d["spec"]["podMetricsEndpoints"])[0]
            assert endpoint["scheme"] == "https"
            assert endpoint["tlsConfig"] == {"serverName": server_name, "ca": {"secret": {
                "name": "llm-tls", "key": tls.get("caKey", "ca.crt")}}}
    test_pod = next(d for d in docs if d["kind"] == "Pod")
    args = test_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--tls-ca") + 1] == "/etc/specpilot-tls/ca.crt"
    assert args[args.index("--tls-server-name") + 1] == server_name
    assert test_pod["spec"]["volumes"][0]["secret"]["items"][0]["key"] == tls.get("caKey",
                                                                                  "ca.crt")


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_the_charts_tls_settings_start_a_controller(tmp_path: Path, mtls: bool) -> None:
    """The ConfigMap's settings, with the Secret's files where the chart mounts them (here a
    directory of made-up certificates), start a real controller: with mTLS even without the
    engine token, since engine streams are authenticated by their certificates."""
    docs = render({"tls": {"enabled": True, "secretName": "llm-tls", "engineClientAuth": mtls}})
    config = next(d for d in docs if d["kind"] == "ConfigMap" and "specpilot.yaml" in d["data"])
    settings = yaml.safe_load(config["data"]["specpilot.yaml"])
    pki = make_pki(tmp_path)
    files = {"/etc/specpilot-tls/tls.crt": pki.server.cert, "/etc/specpilot-tls/tls.key":
             pki.server.key, "/etc/specpilot-tls/ca.crt": pki.ca}
    settings = {k: str(files[v]) if isinstance(v, str) and v in files else v
                for k, v in settings.items()}
    settings.update(grpc_port=0, http_port=0, policy_token="t" * 24)
    if mtls:
        settings["engine_grpc_port"] = 0

    async def start_and_stop() -> bool:
        server = await start_server(load_settings(**settings))
        await server.stop(grace_seconds=0)
        return server.tls and (server.engine_grpc_port is not None) is mtls

    if mtls:
        assert asyncio.run(start_and_stop())
    else:  # TLS alone does not authenticate engines: the chart's engine token is needed
        with pytest.raises(Exception, match="set engine_token"):
            asyncio.run(start_and_stop())
        settings["engine_token"] = "e" * 24
        assert asyncio.run(start_and_stop())


def test_strict_validation_is_a_real_check() -> None:
    """The control: a field Kubernetes does not know fails the strict validation."""
    deployment = one(render({}), "Deployment")
    pod_spec_ = deployment["spec"]["template"]["spec"]
    pod_spec_["containers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"enabled": True}}, "redis.enabled=true needs redis.url or redis.existingSecret"),
    ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true"),
    ({"controller": {"grpcPort": "fifty"}}, "grpcPort"),
    ({"redis": {"url": "http://redis:6379"}}, "url"),
    ({"alerts": {"acceptanceDrop": {"window": "half an hour"}}}, "window"),
    ({"sidecar": {"nativ": True}}, "nativ"),
    ({"tls": {"enabled": True}}, "tls.enabled=true needs tls.secretName"),
    ({"tls": {"engineClientAuth": True}}, "tls.engineClientAuth=true needs tls.enabled=true"),
    ({"tls": {"enabled": True, "secretName": "s", "engineClientAuth": True,
              "engineGrpcPort": 50051}}, "tls.engineGrpcPort must differ"),
    ({"tls": {"enabld": True}}, "enabld"),
])
def test_broken_values_are_refused_naming_the_value(values: dict[str, Any], message: str
                                                    ) -> None:
    with pytest.raises(helm.HelmError) as failure:
        render(values)
    assert message in str(failure.value)


def test_a_generated_token_secret_is_kept_across_upgrades() -> None:
    secret = one(render({}), "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["token"]) >= 40  # 32 random characters, base64


# --- alerts ---------------------------------------------------------------------------------------

def _promtool() -> str:
    path = ROOT / ".tools" / "bin" / "promtool"
    found = str(path) if path.exists() else shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: run tools/install-tools.sh (Debian package prometheus)")
    return found


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rule = one(render(ON), "PrometheusRule")
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def test_the_rendered_rules_pass_promtool_check(rules_file: Path) -> None:
    got = subprocess.run([_promtool(), "check", "rules", str(rules_file)], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    alerts = {r["alert"] for g in yaml.safe_load(rules_file.read_text())["groups"]
              for r in g["rules"]}
    assert alerts == {"SpecpilotAcceptanceDrop", "SpecpilotSpeculationTurnedOff",
                      "SpecpilotNoEngineConnected", "SpecpilotReportsRejected",
                      "SpecpilotPolicyStale"}


def test_every_alert_fires_on_its_bad_series_and_stays_quiet_on_the_good_one(
        rules_file: Path) -> None:
    """tests/deploy/alerts_test.yaml: one bad and one good series per alert (the seed's 0.72 ->
    0.58 acceptance drop among them); promtool fails on any difference."""
    test = rules_file.parent / "alerts_test.yaml"
    test.write_text((Path(__file__).parent / "alerts_test.yaml").read_text())
    got = subprocess.run([_promtool(), "test", "rules", str(test)], capture_output=True,
                         text=True, timeout=60, cwd=rules_file.parent)
    assert got.returncode == 0, got.stdout + got.stderr


def test_the_alert_tests_can_fail(rules_file: Path) -> None:
    """The control: expecting the acceptance-drop alert on the good series fails promtool."""
    spec = yaml.safe_load((Path(__file__).parent / "alerts_test.yaml").read_text())
    drop = next(t for t in spec["tests"] if t.get("name", "").startswith("acceptance drop"))
    for case in drop["alert_rule_test"]:
        if not case["exp_alerts"]:
            case["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    spec["tests"] = [drop]
    test = rules_file.parent / "broken_test.yaml"
    test.write_text(yaml.safe_dump(spec))
    got = subprocess.run([_promtool(), "test", "rules", str(test)], capture_output=True,
                         text=True, timeout=60, cwd=rules_file.parent)
    assert got.returncode != 0


# --- the Grafana dashboard ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported_metrics() -> set[str]:
    """Every metric family name a controller with an engine, reports and decisions exports."""
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    now = time.time()
    core.connect_engine(EngineHello("e", "m", "v", (DraftSpec("d", DraftKind.MODEL, 4, "v"),),
                                    4), now)
    metrics = Metrics(core, time.time)
    core.ingest("e", EngineReport(1, 1.0, 0, (AcceptanceRecord("chat", "d", 2, (1, 2, 3)),),
                                  step_timings=(StepTimingRecord(0, "d", 2, 5, 5, 15, 10, 0.1),)),
                now)
    metrics.decisions(core.decide(now))
    names = set()
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names


def unknown_metrics(expr: str, exported: set[str]) -> set[str]:
    """The specpilot metric names ``expr`` queries that the controller does not export (all of
    them when it queries none: a panel must show something of specpilot's)."""
    names = set(re.findall(r"\bspecpilot_[a-z0-9_]+", expr))
    return names - exported if names else {"<no specpilot metric>"}


def _panels() -> Iterator[dict[str, Any]]:
    dash = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    yield from dash["panels"]


def test_the_grafana_dashboard_queries_only_what_the_controller_exports(
        exported_metrics: set[str]) -> None:
    dash = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert dash["uid"] == "specpilot-overview"  # stable: links and provisioning keep working
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"
        for target in panel["targets"]:
            assert not unknown_metrics(target["expr"], exported_metrics), panel["title"]
    # The ConfigMap carries it whole, labelled for the Grafana sidecar.
    cm = next(d for d in render(ON) if d["kind"] == "ConfigMap" and
              d["metadata"]["name"].endswith("-dashboard"))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["specpilot.json"]) == dash


def test_a_dashboard_naming_a_metric_that_does_not_exist_is_caught(
        exported_metrics: set[str]) -> None:
    """The control of the check above: a misspelt name and a query of no specpilot metric."""
    good = "max(specpilot_acceptance_first_position_ratio)"
    assert not unknown_metrics(good, exported_metrics)
    assert unknown_metrics("max(specpilot_acceptance_first_position)", exported_metrics) == {
        "specpilot_acceptance_first_position"}
    assert unknown_metrics("up", exported_metrics)
