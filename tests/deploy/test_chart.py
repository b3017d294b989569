"""The Helm chart, validated offline: rendered by Helm's own Go SDK (helm-python-sdk) over a
matrix of values, every manifest checked with kubernetes-validate --strict for Kubernetes 1.29
and 1.33, only the engine deciding the pod's readiness, the alerts checked and unit-tested with
promtool, the Grafana dashboard checked against the metrics the controller and the installed vLLM
really export, and broken values refused with a message naming the value."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from itertools import product
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import numpy as np
import pytest
import yaml

from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    StepTimingRecord,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.app import start_server
from specpilot.controller.settings import core_config, load_settings
from specpilot.engine_plugin.config import PluginConfig
from tests.certs import make_pki
from tests.integration.engine_client import EngineClient
from tests.integration.engine_client import hello as engine_hello

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


def engine_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    engine: dict[str, Any] = next(c for c in pod_spec(docs)["containers"] if c["name"] == "vllm")
    return engine


def readiness_gates(spec: Mapping[str, Any]) -> list[str]:
    """The probes of containers other than the engine that decide the pod's readiness: a
    readiness or startup probe of a sidecar (an init container with restartPolicy Always, whose
    readiness counts toward the pod's) or of an ordinary container. The controller must have
    none: without it the engine serves on, and the Service keeps sending it traffic."""
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    others = [c for c in spec["containers"] if c["name"] != "vllm"]
    return [f"{c['name']}.{probe}" for c in sidecars + others
            for probe in ("readinessProbe", "startupProbe") if probe in c]


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
                # The controller's /metrics, and vLLM's own on the engine port (plain HTTP).
                assert [e["port"] for e in endpoints] == ["http-metrics", "http"]
                assert endpoints[1]["path"] == "/metrics" and "scheme" not in endpoints[1]
                assert d["spec"]["selector"]["matchLabels"] == one(
                    docs, "Deployment")["spec"]["selector"]["matchLabels"]
    engine = next(c for c in spec["containers"] if c["name"] == "vllm")
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    if not values.get("tls", {}).get("engineClientAuth"):  # else its mTLS port (check_tls)
        assert engine_env["SPECPILOT_PLUGIN_CONTROLLER"] == "127.0.0.1:50051"
    # The controller listens beyond loopback (the Service): the engine's stream carries the
    # engine's own token, which an init container derives from the engine secret (the same
    # Secret key as the controller's) into a volume the engine reads; the engine never gets the
    # secret (test_the_chart_issues_each_engine_its_own_token runs it).
    minter = next(c for c in spec["initContainers"] if c["name"] == "engine-token")
    minted = {e["name"]: e for e in minter["env"]}
    assert minted["SPECPILOT_ENGINE_SECRET"]["valueFrom"] \
        == env["SPECPILOT_ENGINE_SECRET"]["valueFrom"]
    assert env["SPECPILOT_ENGINE_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == token_secret
    assert spec["initContainers"].index(minter) == 0  # before the engine and the native sidecar
    assert minter["image"] == engine["image"]  # never the controller's (fail-static)
    assert not any("secretKeyRef" in e.get("valueFrom", {}) and e["valueFrom"]["secretKeyRef"][
        "name"] == token_secret for e in engine["env"])
    assert engine_env["SPECPILOT_PLUGIN_TOKEN_FILE"] == "/run/specpilot-engine/token"
    assert {"name": "engine-token", "mountPath": "/run/specpilot-engine", "readOnly": True} \
        in engine["volumeMounts"]
    if not values["policyToken"]:
        assert set(secrets[0]["data"]) == {"token", "engine-secret", "read-token"}
    assert "--scheduler-cls=specpilot.engine_plugin.scheduler.SpecPilotScheduler" in engine["args"]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and "specpilot.yaml" in d["data"])
    settings = yaml.safe_load(config["data"]["specpilot.yaml"])
    assert settings["grpc_host"] == "0.0.0.0"
    # The settings file is one the controller takes, and with the engine secret from the
    # Secret it may listen beyond loopback (start_server refuses open engine streams there).
    taken = load_settings(**settings, engine_secret="s" * 32)
    assert taken.grpc_host == "0.0.0.0" and taken.engine_secret is not None
    # The fleet is the served model's from the start (kept after the engine left).
    assert settings["fleet_model"] == "Qwen/Qwen2.5-1.5B-Instruct"
    # A stuck controller is restarted (its readiness: test_only_the_engine_decides_readiness).
    assert "livenessProbe" in ctl
    if "tls" in values:
        check_tls(docs, values["tls"], settings)
    else:
        assert ctl["livenessProbe"]["grpc"] == {"port": 50051}
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
    assert ctl["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-metrics",
                                               "scheme": "HTTPS"}
    assert "grpc" not in ctl["livenessProbe"]
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
    else:  # TLS alone does not authenticate engines: the chart's engine secret is needed
        with pytest.raises(Exception, match="set engine_secret"):
            asyncio.run(start_and_stop())
        settings["engine_secret"] = "e" * 32
        assert asyncio.run(start_and_stop())


def test_the_charts_http_answers_its_service_names_only_and_reads_need_the_read_token() -> None:
    """The controller listens on 0.0.0.0 in the chart, so anything in the cluster reaches its
    HTTP: the rendered settings (and the read token the pod gets from the Secret) start a real
    controller that answers the Service's names and IP literals, refuses another Host (a
    DNS-rebinding page) and serves the dashboard's reads only with the token. Control: the chart
    set neither (every Host and every reader was served)."""
    docs = render({"controller": {"settings": {"max_k": 4}}})
    config = next(d for d in docs if d["kind"] == "ConfigMap" and "specpilot.yaml" in d["data"])
    settings = yaml.safe_load(config["data"]["specpilot.yaml"])
    assert settings["http_host"] == "0.0.0.0" and settings["max_k"] == 4
    env = {e["name"]: e for e in controller_of(docs)["env"]}
    read_key = env["SPECPILOT_DASHBOARD_READ_TOKEN"]["valueFrom"]["secretKeyRef"]["key"]
    assert read_key in one(docs, "Secret")["data"]
    settings.update(grpc_port=0, http_port=0, http_host="127.0.0.1", policy_token="p" * 24,
                    engine_token="e" * 24, dashboard_read_token="r" * 24)

    async def probe() -> list[int]:
        server = await start_server(load_settings(**settings))
        try:
            statuses = []
            for host, path, token in (("demo-specpilot.ml.svc:9464", "/api/dashboard", "r" * 24),
                                      ("10.0.0.7:9464", "/healthz", ""),
                                      ("rebind.evil.example", "/api/dashboard", "r" * 24),
                                      ("demo-specpilot.ml.svc", "/api/events", "")):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
                auth = f"Authorization: Bearer {token}\r\n" if token else ""
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode())
                statuses.append(int((await reader.readline()).split()[1]))
                writer.close()
            return statuses
        finally:
            await server.stop(grace_seconds=0)

    assert asyncio.run(probe()) == [200, 200, 421, 401]


def merged(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers merged key by key, as Helm merges values (later layers win, null deletes)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                out.pop(key, None)
            elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = merged(out[key], value)
            else:
                out[key] = value
    return out


# Where the weights come from: a Hugging Face id (public; gated, with a token Secret and a cache
# claim), or a volume (a claim, a node directory, any volume source).
MODEL_SOURCES: dict[str, dict[str, Any]] = {
    "hf": {},
    "hf-token": {"engine": {"model": "meta-llama/Llama-3.1-8B-Instruct", "speculativeConfig": {
        "model": "meta-llama/Llama-3.2-1B-Instruct", "num_speculative_tokens": 4}},
                 "model": {"huggingface": {"tokenSecret": "hf-token", "tokenSecretKey": "hf",
                                           "cache": {"existingClaim": "hf-cache"}}}},
    "pvc": {"engine": {"model": "/models/llama-8b", "speculativeConfig": {
        "model": "/models/llama-1b", "num_speculative_tokens": 3}},
            "model": {"source": "volume", "volume": {"existingClaim": "weights",
                                                     "subPath": "llama"}}},
    "hostpath": {"engine": {"model": "/models/target"},
                 "model": {"source": "volume", "volume": {"hostPath": "/mnt/models"}}},
    "volume-spec": {"engine": {"model": "/weights/target", "speculativeConfig": ""},
                    "model": {"source": "volume", "volume": {
                        "mountPath": "/weights",
                        "spec": {"nfs": {"server": "nfs.example", "path": "/models"}}}}},
}
# The pod around it: the defaults (one GPU, a 4 GiB /dev/shm), a CPU engine, and what a
# production cluster passes through.
POD_VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cpu": {"engine": {"gpu": {"count": 0}, "shm": {"enabled": False}}},
    "production": {
        "imagePullSecrets": [{"name": "registry"}, {"name": "mirror"}],
        "serviceAccount": {"create": True, "name": "llm-engine",
                           "annotations": {"iam.gke.io/gcp-service-account": "llm@p.iam"}},
        "podSecurityContext": {"fsGroup": 2000, "runAsUser": 10001,
                               "seccompProfile": {"type": "RuntimeDefault"}},
        "engine": {"gpu": {"resource": "nvidia.com/gpu", "count": 2},
                   "shm": {"sizeLimit": "16Gi"},
                   "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                   "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                   "volumeMounts": [{"name": "chat-templates", "mountPath": "/templates",
                                     "readOnly": True}],
                   "extraArgs": ["--tensor-parallel-size", "2"]},
        "controller": {"securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                                           "allowPrivilegeEscalation": False,
                                           "seccompProfile": {"type": "RuntimeDefault"}},
                       "env": [{"name": "SPECPILOT_HALF_LIFE_SECONDS", "value": "120"}],
                       "volumeMounts": [{"name": "chat-templates", "mountPath": "/templates"}]},
        "volumes": [{"name": "chat-templates", "configMap": {"name": "templates"}}],
        "runtimeClassName": "nvidia",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In",
                 "values": ["us-east1-b"]}]}]}}},
        "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "podLabels": {"team": "inference"},
        "strategy": {"type": "Recreate"},
        "metrics": {"podMonitor": {"enabled": True}},
    },
}
SERVING = [(m, p, native) for m, p, native in product(MODEL_SOURCES, POD_VARIANTS, (True, False))]


def serving_values(source: str, pod: str, native: bool) -> dict[str, Any]:
    return merged(MODEL_SOURCES[source], POD_VARIANTS[pod], {"sidecar": {"native": native}})


@pytest.mark.parametrize(("source", "pod", "native"), SERVING,
                         ids=[f"{m}-{p}-{'native' if n else 'plain'}" for m, p, n in SERVING])
def test_serving_values_render_valid_kubernetes(source: str, pod: str, native: bool) -> None:
    values = serving_values(source, pod, native)
    docs = render(values)
    for doc in docs:
        if doc["kind"] not in OPERATOR_KINDS:
            for version in KUBERNETES:
                kubernetes_validate.validate(doc, version, strict=True)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    full = merged(defaults, values)
    spec, engine, ctl = pod_spec(docs), engine_of(docs), controller_of(docs)
    check_model(full, spec, engine)
    check_engine_resources(full["engine"], engine, spec)
    # The pass-through values land where Kubernetes reads them.
    test_pod = next(d for d in docs if d["kind"] == "Pod")
    assert spec.get("imagePullSecrets") == (full["imagePullSecrets"] or None)
    assert test_pod["spec"].get("imagePullSecrets") == (full["imagePullSecrets"] or None)
    account = one(docs, "ServiceAccount")
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"].get("annotations") == (full["serviceAccount"]["annotations"]
                                                      or None)
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == full["podSecurityContext"]
    assert engine["securityContext"] == full["engine"]["securityContext"]
    assert ctl["securityContext"] == full["controller"]["securityContext"]
    assert spec.get("runtimeClassName") == (full["runtimeClassName"] or None)
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert spec.get(key) == (full[key] or None), key
    template = one(docs, "Deployment")["spec"]["template"]["metadata"]
    assert full["podLabels"].items() <= template["labels"].items()
    assert full["podAnnotations"].items() <= template["annotations"].items()
    assert one(docs, "Deployment")["spec"].get("strategy") == (full["strategy"] or None)
    volumes = {v["name"] for v in spec["volumes"]}
    assert {v["name"] for v in full["volumes"]} <= volumes
    for container, side in ((engine, full["engine"]), (ctl, full["controller"])):
        assert all(e in container["env"] for e in side["env"])
        assert all(m in container["volumeMounts"] for m in side["volumeMounts"])
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
    # The engine serves the model named, with the scheduler subclass and any extra arguments.
    assert engine["args"][0] == f"--model={full['engine']['model']}"
    assert speculative_config(engine) == draft_of(full)
    extra = full["engine"]["extraArgs"]
    assert engine["args"][len(engine["args"]) - len(extra):] == extra
    for monitor in (d for d in docs if d["kind"] == "PodMonitor"):
        ports = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
        assert ports == ["http-metrics", "http"]  # the controller's and vLLM's own /metrics


def speculative_config(engine: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's --speculative-config, parsed (None without the flag)."""
    flags = [a.split("=", 1)[1] for a in engine["args"] if a.startswith("--speculative-config=")]
    assert len(flags) <= 1
    return json.loads(flags[0]) if flags else None


def draft_of(values: dict[str, Any]) -> dict[str, Any] | None:
    """engine.speculativeConfig as vLLM should receive it: JSON text or a map; none if empty."""
    given = values["engine"].get("speculativeConfig")
    if isinstance(given, str):
        return json.loads(given) if given else None
    return given or None


@pytest.mark.parametrize("draft", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    '{"method": "suffix", "num_speculative_tokens": 8}', "", None,
], ids=["ngram-map", "suffix-text", "empty", "null"])
def test_a_draft_set_replaces_the_default_whole(draft: dict[str, Any] | str | None) -> None:
    """The default draft is JSON text, so a map set over it replaces it rather than merging into
    it (a merged map would keep the default's draft model beside an n-gram method)."""
    engine = engine_of(render({"engine": {"speculativeConfig": draft}}))
    assert speculative_config(engine) == (json.loads(draft) if isinstance(draft, str) and draft
                                          else draft or None)


def check_model(values: dict[str, Any], spec: dict[str, Any], engine: dict[str, Any]) -> None:
    """The weights are where vLLM reads them: a read-only volume at model.volume.mountPath, or
    a Hugging Face cache at HF_HOME (with HF_TOKEN from the Secret when one is named)."""
    model = values["model"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    env = {e["name"]: e for e in engine["env"]}
    if model["source"] == "volume":
        source = model["volume"]
        assert mounts["model"]["mountPath"] == source["mountPath"]
        assert mounts["model"]["readOnly"] is True
        assert mounts["model"].get("subPath") == (source["subPath"] or None)
        volume = {k: v for k, v in volumes["model"].items() if k != "name"}
        if source["existingClaim"]:
            assert volume == {"persistentVolumeClaim": {"claimName": source["existingClaim"],
                                                        "readOnly": True}}
        elif source["hostPath"]:
            assert volume == {"hostPath": {"path": source["hostPath"], "type": "Directory"}}
        else:
            assert volume == source["spec"]
        assert "hf-cache" not in volumes and "HF_HOME" not in env and "HF_TOKEN" not in env
        return
    hf = model["huggingface"]
    assert env["HF_HOME"]["value"] == mounts["hf-cache"]["mountPath"] == hf["cache"]["mountPath"]
    cache = volumes["hf-cache"]
    if hf["cache"]["existingClaim"]:
        assert cache["persistentVolumeClaim"] == {"claimName": hf["cache"]["existingClaim"]}
    else:
        assert cache["emptyDir"] == {"sizeLimit": hf["cache"]["sizeLimit"]}
    if hf["tokenSecret"]:
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {
            "name": hf["tokenSecret"], "key": hf["tokenSecretKey"]}}
    else:
        assert "HF_TOKEN" not in env
    assert "model" not in volumes


def check_engine_resources(values: dict[str, Any], engine: dict[str, Any],
                           spec: dict[str, Any]) -> None:
    """engine.gpu's count in requests and limits (none for a CPU engine) beside
    engine.resources, and a memory-backed /dev/shm of engine.shm.sizeLimit."""
    gpu, resources = values["gpu"], engine["resources"]
    for kind in ("requests", "limits"):
        expected = dict(values["resources"].get(kind, {}))
        if gpu["count"]:
            expected[gpu["resource"]] = gpu["count"]
        assert resources.get(kind, {}) == expected, kind
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    if values["shm"]["enabled"]:
        assert shm[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": values["shm"]["sizeLimit"]}
        assert mounts["/dev/shm"] == "dshm"
    else:
        assert not shm and "/dev/shm" not in mounts


def test_only_the_engine_decides_readiness() -> None:
    """Across both values matrices, no container but the engine has a readiness or startup
    probe, and the controller has a liveness probe: fail-static includes the Service."""
    gating: dict[str, list[str]] = {}
    for i, values in enumerate(MATRIX + [serving_values(*case) for case in SERVING]):
        spec = pod_spec(render(values))
        if gates := readiness_gates(spec):
            gating[f"case {i}: {json.dumps(values)[:120]}"] = gates
        ctl = next(c for c in spec.get("initContainers", []) + spec["containers"]
                   if c["name"] == "specpilot")
        assert "livenessProbe" in ctl
        engine = next(c for c in spec["containers"] if c["name"] == "vllm")
        assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert not gating, gating


def test_the_readiness_check_catches_a_gating_controller() -> None:
    """The control of readiness_gates: a readiness or startup probe on the controller, as a
    native sidecar or as an ordinary container, is caught."""
    for native in (True, False):
        for probe in ("readinessProbe", "startupProbe"):
            docs = render({"sidecar": {"native": native}})
            ctl = controller_of(docs)
            ctl[probe] = {"grpc": {"port": 50051}, "periodSeconds": 5}
            assert readiness_gates(pod_spec(docs)) == [f"specpilot.{probe}"]


def controller_gates(docs: list[dict[str, Any]]) -> list[str]:
    """What would let the controller's image hold back the engine's start: an init container
    of the controller's image (the kubelet runs every init container to completion, and pulls
    and starts a native sidecar, before it starts any main container), the controller listed
    before the engine (the kubelet starts main containers in order), a pod-local volume (an
    emptyDir: what one container writes for another) that the engine mounts and a container of
    the controller's image also mounts (something the engine would wait for), and a lifecycle
    hook on the engine."""
    spec = pod_spec(docs)
    controller_image = controller_of(docs)["image"]
    gates = [f"initContainers.{c['name']}" for c in spec.get("initContainers", [])
             if c["image"] == controller_image]
    names = [c["name"] for c in spec["containers"]]
    if names[0] != "vllm":
        gates.append(f"containers: {names} (the engine is not first)")
    engine = engine_of(docs)
    written = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    shared = written & {m["name"] for m in engine.get("volumeMounts", [])} & {
        m["name"] for c in spec.get("initContainers", []) + spec["containers"]
        if c["image"] == controller_image for m in c.get("volumeMounts", [])}
    gates += [f"volume {v} shared with the controller's image" for v in sorted(shared)]
    if "lifecycle" in engine:
        gates.append("vllm.lifecycle")
    return gates


def test_the_engine_starts_without_the_controller_image() -> None:
    """Fail-static at the Pod level: by default nothing that runs before the engine uses the
    controller's image (the engine-token step runs the engine's image) and the controller is
    an ordinary container after the engine, so an unpullable controller image leaves the engine
    serving on its static configuration. Across both values matrices only the native sidecar
    opt-in (sidecar.native=true) puts the controller before the engine, as documented."""
    docs = render({})
    spec, engine, ctl = pod_spec(docs), engine_of(docs), controller_of(docs)
    assert {c["image"] for c in spec["initContainers"]} == {engine["image"]}
    assert ctl["image"] != engine["image"]
    assert ctl in spec["containers"] and "restartPolicy" not in ctl
    assert controller_gates(docs) == []
    for values in MATRIX + [serving_values(*case) for case in SERVING]:
        native = values["sidecar"]["native"]
        assert controller_gates(render(values)) == (["initContainers.specpilot"] if native
                                                    else []), json.dumps(values)[:160]


def test_the_start_check_catches_a_controller_gate() -> None:
    """The control of controller_gates: the engine-token step on the controller's image (as
    the chart had it), the controller listed first, a volume shared with it, and the native
    sidecar opt-in are each caught."""
    def mutated(change: Any) -> list[str]:
        docs = render({})
        change(pod_spec(docs), controller_of(docs))
        return controller_gates(docs)

    def minter_on_controller_image(spec: dict[str, Any], ctl: dict[str, Any]) -> None:
        spec["initContainers"][0]["image"] = ctl["image"]

    def controller_first(spec: dict[str, Any], ctl: dict[str, Any]) -> None:
        spec["containers"].reverse()

    def shared_volume(spec: dict[str, Any], ctl: dict[str, Any]) -> None:
        ctl["volumeMounts"].append({"name": "engine-token", "mountPath": "/run/t"})

    assert mutated(minter_on_controller_image) == [
        "initContainers.engine-token", "volume engine-token shared with the controller's image"]
    assert mutated(controller_first) == ["containers: ['specpilot', 'vllm'] (the engine is "
                                         "not first)"]
    assert mutated(shared_volume) == ["volume engine-token shared with the controller's image"]
    assert controller_gates(render({"sidecar": {"native": True}})) == ["initContainers.specpilot"]


def vllm_parses(arg_lists: list[list[str]]) -> list[dict[str, Any]]:
    """Each argument list parsed by the installed vLLM's own OpenAI-server parser (in a child
    process: importing vLLM loads torch and its plugins), with the scheduler class it names
    resolved: vLLM's async_scheduling (None = left to vLLM, which turns it on for draft methods
    on GPUs) and whether the class is an AsyncScheduler."""
    program = """
import importlib, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
out = []
for args in json.load(sys.stdin):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    module, _, name = ns.scheduler_cls.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    out.append({"async_scheduling": ns.async_scheduling, "scheduler_cls": ns.scheduler_cls,
                "async_class": issubclass(cls, AsyncScheduler),
                "scheduler": issubclass(cls, Scheduler)})
print("PARSED " + json.dumps(out))
"""
    ran = subprocess.run([sys.executable, "-c", program], input=json.dumps(arg_lists),
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    line = next(x for x in ran.stdout.splitlines() if x.startswith("PARSED "))
    parsed: list[dict[str, Any]] = json.loads(line.removeprefix("PARSED "))
    return parsed


def test_the_engine_sets_async_scheduling_with_its_matching_scheduler_class() -> None:
    """engine.asyncScheduling both ways: the rendered arguments, parsed by vLLM's own server
    parser, set async scheduling explicitly (never left to vLLM, which turns it on for draft
    methods, where the sync class's update_draft_token_ids is never called) and name the
    specpilot scheduler class of that mode."""
    cases = (False, True)
    rendered = [engine_of(render({"engine": {"asyncScheduling": on}}))["args"] for on in cases]
    for on, args in zip(cases, rendered, strict=True):
        assert ("--async-scheduling" if on else "--no-async-scheduling") in args
    parsed = vllm_parses(rendered)
    for on, got in zip(cases, parsed, strict=True):
        assert got["async_scheduling"] is on, got
        assert got["scheduler"] and got["async_class"] is on, got
        assert got["scheduler_cls"] == "specpilot.engine_plugin.scheduler." + (
            "SpecPilotAsyncScheduler" if on else "SpecPilotScheduler")


# Kubernetes' types in values.schema.json: their fields listed, so that a misspelt field fails
# `helm install` naming it.
SCHEMA_TYPES = {
    "#/definitions/securityContext": "securitycontext-v1",
    "#/definitions/podSecurityContext": "podsecuritycontext-v1",
    "#/definitions/resources": "resourcerequirements-v1",
    "#/definitions/env/items": "envvar-v1",
    "#/definitions/volumeMounts/items": "volumemount-v1",
    "#/properties/tolerations/items": "toleration-v1",
    "#/properties/affinity": "affinity-v1",
    "#/properties/imagePullSecrets/items": "localobjectreference-v1",
}


@pytest.mark.parametrize(("pointer", "kubernetes_type"), SCHEMA_TYPES.items())
def test_the_schemas_kubernetes_types_have_kubernetes_fields(pointer: str,
                                                             kubernetes_type: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    node = schema
    for part in pointer.removeprefix("#/").split("/"):
        node = node[part]
    assert node["additionalProperties"] is False
    newest = KUBERNETES[-1]
    theirs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{newest}.0-local-strict/{kubernetes_type}.json", newest)
    assert set(node["properties"]) == set(theirs["properties"])


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_the_monitor_leaves_vllm_to_another_scrape_when_told(monitor: str) -> None:
    docs = render({"metrics": {"scrapeEngine": False, monitor: {"enabled": True}}})
    kind = monitor[0].upper() + monitor[1:]
    spec = one(docs, kind)["spec"]
    endpoints = spec.get("endpoints") or spec["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["http-metrics"]


def test_helm_lint_strict_finds_nothing_above_info() -> None:
    """`helm lint --strict` on the defaults (its only finding is that the chart has no icon)."""
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBERNETES[-1]}.0")
    assert not report["errors"]
    assert [m for m in report["messages"] if m["severity"] > 1] == []


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
    ({"model": {"source": "volume"}}, "model.source=volume needs exactly one of"),
    ({"model": {"source": "volume", "volume": {"existingClaim": "w", "hostPath": "/m"}}},
     "model.source=volume needs exactly one of"),
    ({"model": {"source": "s3"}}, "source"),
    ({"model": {"volume": {"hostPath": "models"}}}, "hostPath"),
    ({"engine": {"gpu": {"count": -1}}}, "count"),
    ({"engine": {"resources": {"limit": {"memory": "1Gi"}}}}, "limit"),
    ({"engine": {"securityContext": {"runAsNonroot": True}}}, "runAsNonroot"),
    ({"controller": {"securityContext": {"readOnlyRootFileSystem": True}}},
     "readOnlyRootFileSystem"),
    ({"podSecurityContext": {"fsgroup": 10001}}, "fsgroup"),
    ({"imagePullSecrets": ["registry"]}, "imagePullSecrets"),
    ({"serviceAccount": {"craete": True}}, "craete"),
    ({"engine": {"env": [{"name": "N", "value": 1}]}}, "value"),
    ({"engine": {"volumeMounts": [{"name": "v"}]}}, "mountPath"),
    ({"tolerations": [{"key": "nvidia.com/gpu", "efect": "NoSchedule"}]}, "efect"),
    ({"engine": {"shm": {"size": "8Gi"}}}, "size"),
    ({"engine": {"volumes": []}}, "volumes"),
    ({"engine": {"speculativeConfig": "{model: draft}"}},
     "engine.speculativeConfig is not a JSON object"),
    ({"engine": {"speculativeConfig": ["model"]}}, "speculativeConfig"),
    ({"policyToken": {"engineSecretValue": "too-short"}}, "engineSecretValue"),
    ({"policyToken": {"engineKey": "engine-token"}}, "engineKey"),
    ({"engine": {"extraArgs": ["--async-scheduling"]}},
     "engine.extraArgs has --async-scheduling: set engine.asyncScheduling instead"),
    ({"engine": {"extraArgs": ["--scheduler-cls=my.Scheduler"]}},
     "engine.extraArgs has --scheduler-cls=my.Scheduler: set engine.asyncScheduling instead"),
    ({"engine": {"tokenInit": {"resources": {"limit": {"memory": "1Gi"}}}}}, "limit"),
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


def test_the_chart_issues_each_engine_its_own_token(tmp_path: Path) -> None:
    """What the pod runs: the engine-token init container's command line (its module run by
    this interpreter for the image's python3, its $(POD_NAME) as the kubelet expands it) writes
    the engine's own token from the Secret's engine secret where the engine reads it; the
    controller, on the chart's settings with the same secret, takes the engine's stream for its
    pod's id and refuses it for another pod's."""
    secret = "engine-secret-of-the-release-0123456789"
    docs = render({"policyToken": {"engineSecretValue": secret}})
    assert base64.b64decode(one(docs, "Secret")["data"]["engine-secret"]).decode() == secret
    minter = next(c for c in pod_spec(docs)["initContainers"] if c["name"] == "engine-token")
    engine_env = {e["name"]: e.get("value") for e in engine_of(docs)["env"]}
    token_file = engine_env["SPECPILOT_PLUGIN_TOKEN_FILE"]
    local = str(tmp_path / "token")  # the shared volume, here
    args = [a.replace("$(POD_NAME)", "demo-7d9f").replace(token_file, local)
            for a in minter["args"]]
    # The engine's image runs it: the module form of specpilot's CLI, with its python3.
    assert minter["image"] == engine_of(docs)["image"]
    assert minter["command"][:2] == ["python3", "-m"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}
    ran = subprocess.run([sys.executable, *minter["command"][1:], *args], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path,
                         env={**env, "SPECPILOT_ENGINE_SECRET": secret})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    own = (("authorization", f"Bearer {Path(local).read_text().strip()}"),)
    config = next(d for d in docs if d["kind"] == "ConfigMap" and "specpilot.yaml" in d["data"])
    settings = {**yaml.safe_load(config["data"]["specpilot.yaml"]), "grpc_host": "127.0.0.1",
                "grpc_port": 0, "http_host": "127.0.0.1", "http_port": 0,
                "policy_token": "t" * 24, "engine_secret": secret}

    async def streams() -> tuple[bool, grpc.StatusCode]:
        server = await start_server(load_settings(**settings))
        try:
            async with grpc.aio.insecure_channel(server.grpc_target) as ch:
                ack = await EngineClient(ch, own).connect(engine_hello("demo-7d9f"))
                with pytest.raises(grpc.aio.AioRpcError) as other:
                    await EngineClient(ch, own).connect(engine_hello("demo-5c2a"))
                return bool(ack.accepted_drafts), other.value.code()
        finally:
            await server.stop(grace_seconds=0)

    assert asyncio.run(streams()) == (True, grpc.StatusCode.PERMISSION_DENIED)


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
def controller_exposition() -> str:
    """What a controller with an engine, reports and decisions exports (controller/metrics.py)."""
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    now = time.time()
    core.connect_engine(EngineHello("e", "m", "v", (DraftSpec("d", DraftKind.MODEL, 4, "v"),),
                                    4), now)
    metrics = Metrics(core, time.time)
    core.ingest("e", EngineReport(1, 1.0, 0, (AcceptanceRecord("chat", "d", 2, (1, 2, 3)),),
                                  step_timings=(StepTimingRecord(0, "d", 2, 5, 5, 15, 10, 0.1),)),
                now)
    metrics.decisions(core.decide(now))
    return metrics.render().decode()


@pytest.fixture(scope="module")
def exported_metrics(controller_exposition: str) -> set[str]:
    """Every series name the controller exports, and every vllm: series of the installed
    vLLM."""
    names = set()
    for line in controller_exposition.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names.update(name + s for s in ("_bucket", "_sum", "_count"))
    return names | vllm_metrics()


def series(name: str, kind: str) -> set[str]:
    """The series Prometheus scrapes of a prometheus_client metric of this kind and name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {name + s for s in suffixes.get(kind, ("",))}


def vllm_metrics() -> set[str]:
    """Every vllm: series the installed vLLM's Prometheus logger exports, read from its source
    (importing vLLM would load torch): the name of each Gauge, Counter and Histogram it makes,
    and the counters of its speculative-decoding metrics."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm not found: the dashboard's vLLM panels are checked against its source")
    root = Path(next(iter(spec.submodule_search_locations)))
    loggers = (root / "v1" / "metrics" / "loggers.py").read_text()
    spec_decode = (root / "v1" / "spec_decode" / "metrics.py").read_text()
    made = re.findall(r'_(gauge|counter|histogram)_cls\(\s*name="(vllm:\w+)"', loggers)
    made += [("counter", n) for n in re.findall(r'\(\s*"(vllm:spec_decode_\w+)",', spec_decode)]
    made += re.findall(r'_(counter)_cls\(\s*name="(vllm:\w+)"', spec_decode)
    assert len(made) > 30, "vLLM's metric definitions moved: update vllm_metrics()"
    return {s for kind, name in made for s in series(name, kind)}


def unknown_metrics(expr: str, exported: set[str]) -> set[str]:
    """The specpilot and vLLM metric names ``expr`` queries that the controller and vLLM do not
    export (all of them when it queries none: a panel must show something of theirs)."""
    names = set(re.findall(r"\b(?:specpilot_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr))
    return names - exported if names else {"<no specpilot or vLLM metric>"}


def _panels() -> Iterator[dict[str, Any]]:
    dash = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    yield from dash["panels"]


def test_the_grafana_dashboard_queries_only_what_the_controller_and_vllm_export(
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
    """The control of the check above: a misspelt name, a name vLLM does not export (its
    older time_per_output_token histogram) and a query of no specpilot or vLLM metric."""
    good = "max(specpilot_acceptance_first_position_ratio)"
    assert not unknown_metrics(good, exported_metrics)
    assert not unknown_metrics("rate(vllm:spec_decode_num_accepted_tokens_total[5m])",
                               exported_metrics)
    assert unknown_metrics("max(specpilot_acceptance_first_position)", exported_metrics) == {
        "specpilot_acceptance_first_position"}
    old = "histogram_quantile(0.5, rate(vllm:time_per_output_token_seconds_bucket[5m]))"
    assert unknown_metrics(old, exported_metrics) == {"vllm:time_per_output_token_seconds_bucket"}
    assert unknown_metrics("rate(vllm:spec_decode_num_accepted_tokens[5m])", exported_metrics)
    assert unknown_metrics("up", exported_metrics)


@pytest.fixture(scope="module")
def model_labelled(controller_exposition: str, exported_metrics: set[str]) -> set[str]:
    """The series that carry model_name: the controller's whose samples have it, and every
    vllm: series (vLLM labels each with model_name and engine)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    loggers = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    assert 'labelnames = ["model_name", "engine"]' in loggers.read_text()
    ours = {line.split("{")[0] for line in controller_exposition.splitlines()
            if not line.startswith("#") and 'model_name="' in line}
    assert "specpilot_class_measured_speedup_ratio" in ours  # the fixture has a served step
    return ours | {n for n in exported_metrics if n.startswith("vllm:")}


VARIABLE_MATCHERS = {"model": "model_name", "namespace": "namespace", "pod": "pod"}
_SELECTOR = re.compile(r"(specpilot_[a-z0-9_]+|vllm:[a-z0-9_:]+)(\{[^}]*\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def unfiltered(expr: str, model_labelled: set[str]) -> list[str]:
    """The metric selectors of ``expr`` that do not follow the dashboard's variables: each must
    match namespace=~"$namespace" and pod=~"$pod" (labels Prometheus' Kubernetes scrapes add),
    and model_name=~"$model" where the series carries model_name. The controller's pod-wide
    series have no model label; they follow the model through $pod, whose options are the
    model's pods."""
    missing = []
    for selector in _SELECTOR.finditer(expr):
        name = selector.group(1)
        have = set(_MATCHER.findall(selector.group(2) or ""))
        want = {(label, "=~", f"${var}") for var, label in VARIABLE_MATCHERS.items()
                if var != "model" or name in model_labelled}
        missing += [f"{name}: {label}" for label, _, _ in sorted(want - have)]
    return missing


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def test_the_grafana_dashboard_filters_by_model_namespace_and_pod(
        exported_metrics: set[str], model_labelled: set[str]) -> None:
    """The model, namespace and pod variables, chained (a pod is one of the model's), and every
    query of every panel filtered by them; the measured-speedup panel among the panels."""
    dash = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    queries = {}
    for name, label in VARIABLE_MATCHERS.items():
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", name
        # Several at once, and All = the values listed (no allValue such as .*), so All pods
        # are the selected model's pods.
        assert v["multi"] and v["includeAll"] and "allValue" not in v, name
        queries[name] = q = _variable_query(v)
        assert re.fullmatch(rf"label_values\((.+), {label}\)", q), q
        assert not unknown_metrics(q, exported_metrics), q
    assert 'model_name=~"$model"' in queries["namespace"]
    assert 'model_name=~"$model"' in queries["pod"] and 'namespace=~"$namespace"' in queries["pod"]
    exprs = [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]
    assert exprs
    for title, expr in exprs:
        assert not unfiltered(expr, model_labelled), (title, expr, unfiltered(expr, model_labelled))
    measured = [p for p in _panels() if any(
        "specpilot_class_measured_speedup_ratio" in t["expr"] for t in p["targets"])]
    assert [p["title"] for p in measured] == ["Measured speedup, by class"]
    assert measured[0]["fieldConfig"]["defaults"]["unit"] == "suffix:x"


def test_a_query_that_ignores_the_variables_is_caught(model_labelled: set[str]) -> None:
    """The control of unfiltered(): the dashboard's queries before the variables, a selector
    missing one matcher, and a matcher with another value are caught; a pod-wide series needs
    no model matcher."""
    assert unfiltered("specpilot_class_measured_speedup_ratio", model_labelled) == [
        "specpilot_class_measured_speedup_ratio: model_name",
        "specpilot_class_measured_speedup_ratio: namespace",
        "specpilot_class_measured_speedup_ratio: pod"]
    assert unfiltered("sum(specpilot_engines_connected)", model_labelled) == [
        "specpilot_engines_connected: namespace", "specpilot_engines_connected: pod"]
    assert unfiltered('rate(vllm:generation_tokens_total{namespace=~"$namespace", '
                      'pod=~"$pod"}[5m])', model_labelled) == [
        "vllm:generation_tokens_total: model_name"]
    assert unfiltered('specpilot_speculation_enabled{model_name=~"$model", namespace="ml", '
                      'pod=~"$pod"}', model_labelled) == [
        "specpilot_speculation_enabled: namespace"]
    assert not unfiltered('sum(specpilot_engines_connected{namespace=~"$namespace", '
                          'pod=~"$pod"})', model_labelled)
