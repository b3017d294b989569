"""specpilot: run the controller (serve) or talk to a running one (policy ...).

    specpilot serve [--config FILE] [--grpc-port N] [--http-port N] [--set NAME=VALUE ...]
    specpilot policy get [--class C] [--json]
    specpilot policy set --class C (--pin-k N | --force-draft D | --force-off) [--note TEXT]
    specpilot policy clear --class C
    specpilot policy watch [--class C] [--json]
    specpilot policy explain --class C [--batch SIZE_OR_RANGE] [--json]
    specpilot settings [--config FILE] [--markdown]
    specpilot engine-token --id ID [--config FILE] [--output FILE]
    specpilot simulate SCENARIO.yaml [...] [--policy NAME ...] [--seed N] [--out DIR] [--jobs N]
    specpilot demo [--scale F]          controller + vLLM-CPU engine + mixed traffic, live
    specpilot models                    build the demo's tiny trained models (cached)
    specpilot bench engine [--reps N]   specpilot against static configurations, real engine

Settings come from defaults < the config file < SPECPILOT_* environment < flags. The policy
commands reach --target (env SPECPILOT_TARGET, default 127.0.0.1:50051); writes send
--token (env SPECPILOT_POLICY_TOKEN, the same variable that sets the server's token).
--tls-ca (env SPECPILOT_TARGET_TLS_CA) talks TLS to a controller with tls_cert_file, with
--tls-cert/--tls-key as a client certificate and --tls-server-name for the name to
check (policy and check alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, TypeVar

import grpc
import yaml
from google.protobuf.message import Message

from specpilot.contract.buckets import batch_range, parse_batch
from specpilot.contract.records import ALL_CLASSES, Override, arm_key
from specpilot.contract.tls import TLSError, open_channel
from specpilot.controller.logsafe import shown
from specpilot.controller.server.app import ServeError, engine_credentials, start_server
from specpilot.controller.server.auth import engine_token
from specpilot.controller.server.explain import TOO_LITTLE, arm_label, decision_detail
from specpilot.controller.server.stubs import PolicyStub, policy_stub
from specpilot.controller.server.views import to_json_dict
from specpilot.controller.settings import (
    SECRET_SETTINGS,
    Settings,
    SettingsError,
    server_config,
    settings_from,
    settings_reference,
    unknown_environment,
)
from specpilot.controller.wire import event_from_proto, override_from_proto, override_to_proto
from specpilot.v1 import common_pb2, policy_pb2

DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "SPECPILOT_TARGET"
TOKEN_ENV = "SPECPILOT_POLICY_TOKEN"
CONFIG_ENV = "SPECPILOT_CONFIG"
# Flags of `serve` that map one to one onto a setting of the same name.
SERVE_FLAGS = ("grpc_host", "grpc_port", "http_host", "http_port",
               "report_interval_seconds", "seed")
# Secrets never come from the command line (every local user reads it in `ps`): environment
# (SPECPILOT_POLICY_TOKEN, SPECPILOT_ENGINE_SECRET, e.g. from a Secret) or the settings file.

M = TypeVar("M", bound=Message)  # a policy API response


def _say(line: str, *, err: bool = False) -> None:
    print(f"specpilot: {line}", file=sys.stderr if err else sys.stdout, flush=True)


def _plain(text: str | None) -> str | None:
    """A docstring as --help shows it: reST literals (double backquotes) as plain words."""
    return None if text is None else re.sub(r"``(.+?)``", r"\1", text, flags=re.DOTALL)


def known_variables() -> tuple[str, ...]:
    """The SPECPILOT_* variables that are not a setting's (SPECPILOT_<NAME>) nor the engine
    plugin's (SPECPILOT_PLUGIN_*): start-up warns about any other (a misspelt one)."""
    tools = ("SPECPILOT_CACHE",  # what `models --real` and the benchmarks build (benchmarks.real)
             "SPECPILOT_SERVE_DTYPE",  # the real model's dtype (benchmarks.real.smollm2)
             "SPECPILOT_DEMO_CACHE",  # the demo's tiny models (benchmarks.demo.cli)
             "SPECPILOT_TEST_CACHE",  # the test suite's models (tests/engine)
             "SPECPILOT_VENV", "SPECPILOT_LOCK")  # tools/setup-venv.sh: another venv or lock
    return (CONFIG_ENV, TARGET_ENV, *(env for _, env, _ in TLS_OPTIONS), *tools)


def _warn_unknown_variables() -> None:
    for warning in unknown_environment(os.environ, known_variables()):
        _say(f"warning: {warning}", err=True)


def _settings_failed(exc: SettingsError) -> int:
    """Every problem, a line each; exit code 2."""
    for line in exc.lines:
        _say(line, err=True)
    if len(exc.lines) > 1:
        _say(f"{len(exc.lines)} problems in the settings; nothing started", err=True)
    return 2


# --- serve ---------------------------------------------------------------------------------
def _settings_from_args(args: argparse.Namespace) -> Settings:
    # Values stay strings here: pydantic parses them, so a bad one is reported like any other
    # bad setting (a line naming it and the flag) rather than by argparse.
    overrides: dict[str, Any] = {name: getattr(args, name) for name in SERVE_FLAGS}
    origins = {name: "--" + name.replace("_", "-") for name in SERVE_FLAGS}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise SettingsError(f"bad setting {item}: --set needs NAME=VALUE")
        key = name.strip().replace("-", "_")
        if key in SECRET_SETTINGS:
            raise SettingsError(f"{key} is a secret: set SPECPILOT_{key.upper()} or put it in "
                                "the settings file, not on the command line")
        try:
            overrides[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise SettingsError(f"bad setting {key}: {value!r} is not a YAML value (from --set); "
                                "quote it, or write lists as [a, b]") from None
        origins[key] = "--set"
    return settings_from(args.config or os.environ.get(CONFIG_ENV), overrides, origins)


async def _serve(settings: Settings) -> int:
    try:
        server = await start_server(settings)
    except ServeError as exc:
        _say(str(exc), err=True)
        return 1
    tls = " (TLS)" if server.tls else ""
    _say(f"grpc listening on {server.grpc_target}{tls}")
    if server.engine_grpc_port is not None:
        _say(f"engine streams (mTLS) listening on {server.engine_grpc_target}")
    _say(f"http listening on {server.http_url}")
    _say(f"dashboard at {server.http_url}/ (read-only without the policy token)")
    if server.token_generated:
        _say(f"policy token (generated, shown once; set SPECPILOT_POLICY_TOKEN to choose one): "
             f"{server.token}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    _say("stopping")
    await server.stop()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    _warn_unknown_variables()
    try:
        settings = _settings_from_args(args)
    except SettingsError as exc:
        return _settings_failed(exc)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="specpilot: %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(settings))


def cmd_settings(args: argparse.Namespace) -> int:
    """The reference of every setting (--markdown), or the settings in effect here as YAML."""
    if args.markdown:
        print(settings_reference(), end="")
        return 0
    _warn_unknown_variables()
    try:
        settings = settings_from(args.config or os.environ.get(CONFIG_ENV), {})
    except SettingsError as exc:
        return _settings_failed(exc)
    # SecretStr dumps as a mask, so the token is never printed here.
    print(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_engine_token(args: argparse.Namespace) -> int:
    """Engine ``--id``'s own token, derived from engine_secret (SPECPILOT_ENGINE_SECRET or the
    settings file): printed, or written to ``--output`` (mode 0640) for the engine to read as
    SPECPILOT_PLUGIN_TOKEN_FILE, so the engine never holds the secret."""
    if not args.id:
        _say("--id: an engine id is needed (the engine's SPECPILOT_PLUGIN_ENGINE_ID)", err=True)
        return 2
    try:
        settings = settings_from(args.config or os.environ.get(CONFIG_ENV), {})
        secret, _ = engine_credentials(server_config(settings))
    except SettingsError as exc:
        return _settings_failed(exc)
    except ServeError as exc:
        _say(str(exc), err=True)
        return 2
    if not secret:
        _say("engine_secret is not set: set SPECPILOT_ENGINE_SECRET (e.g. from a Secret) or "
             "put it in the settings file (--config)", err=True)
        return 2
    token = engine_token(secret, args.id)
    if not args.output:
        print(token)
        return 0
    try:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except OSError as exc:
        _say(f"--output {args.output}: {exc}", err=True)
        return 1
    _say(f"engine {args.id!r}: token written to {args.output}")
    return 0


# --- policy client -------------------------------------------------------------------------
def _reason(value: int) -> str:
    return common_pb2.DecisionReason.Name(value).removeprefix("DECISION_REASON_").lower()


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *([shown(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def _print_json(msg: Any, indent: int | None = 2) -> None:
    print(json.dumps(to_json_dict(msg), indent=indent), flush=True)


def _print_response(resp: M, args: argparse.Namespace, render: Callable[[M], str]) -> int:
    """The response as JSON with --json, else as ``render`` writes it; exit code 0."""
    if args.json:
        _print_json(resp)
    else:
        print(render(resp))
    return 0


def _override_text(ov: Override) -> str:
    return ov.action + (f" ({ov.note})" if ov.note else "")


def _scope_text(ov: policy_pb2.Override) -> str:
    scope = {policy_pb2.OVERRIDE_SCOPE_POD: "pod",
             policy_pb2.OVERRIDE_SCOPE_FLEET: "fleet"}.get(ov.scope, "?")
    return scope + (f", via {ov.set_by}" if ov.set_by else "")


_SCOPES = {"default": policy_pb2.OVERRIDE_SCOPE_UNSPECIFIED, "pod": policy_pb2.OVERRIDE_SCOPE_POD,
           "fleet": policy_pb2.OVERRIDE_SCOPE_FLEET}


def render_policy(resp: policy_pb2.GetPolicyResponse) -> str:
    bounds = tuple(resp.batch_bucket_upper_bounds)
    engines = ", ".join(map(shown, resp.engines))
    out = [f"policy version {resp.version}; engines: {engines or 'none'}", ""]
    rows = [
        (c.traffic_class + (" (offline)" if c.offline else ""),
         batch_range(bounds, d.batch_bucket),
         arm_label(d.draft, d.k), _reason(d.reason),
         speedup_text(d.expected_speedup, d.too_little_evidence),
         f"{d.probe_rate:.1%} of {'steps' if d.probe_steps else 'requests'} at K={d.probe_k}"
         if d.probe_rate > 0 else "-")
        for c in resp.classes for d in c.decisions
    ]
    out.append(_table(("CLASS", "BATCH", "CHOICE", "REASON", "SPEEDUP", "PROBE"), rows)
               if rows else "no decisions yet (no engine connected)")
    # Estimates without evidence are the bare prior: not worth a row.
    estimates = [(c.traffic_class, e) for c in resp.classes for e in c.estimates
                 if e.positions and e.positions[0].effective_tries > 0]
    if estimates:
        out += ["", "acceptance by position (posterior mean; tries after forgetting at position 1)"]
        out.append(_table(("CLASS", "DRAFT", "TRIES", "CHANGES", "MEAN BY POSITION"), [
            (cls, e.draft, f"{e.positions[0].effective_tries:.0f}",
             e.changes_detected, " ".join(f"{p.mean:.2f}" for p in e.positions))
            for cls, e in estimates]))
    overrides = {(o.traffic_class, _override_text(override_from_proto(o)), _scope_text(o))
                 for c in resp.classes for o in c.overrides}
    if overrides:
        out += ["", _table(("OVERRIDE ON", "ACTION", "SCOPE"), sorted(overrides))]
    return "\n".join(out)


def speedup_text(speedup: float, too_little_evidence: bool) -> str:
    """An expected speedup over no speculation as the policy's tables print it: "too little
    evidence" where the posteriors cannot tell it from 1 (or it was bounded by the step costs
    measured), and no ratio where the choice slows the rest of a shared batch more than the
    class gains (its speedup reads 0)."""
    if too_little_evidence:
        return TOO_LITTLE
    return "slows the batch" if speedup < 0.005 else f"{speedup:.2f}x"


def render_event(e: common_pb2.DecisionEvent, bounds: Sequence[int]) -> str:
    """One decision as ``policy watch`` prints it; ``bounds``: the controller's batch bucket
    upper bounds, to name the batch range. A change reads "<before> -> <after>"; a class's
    first decision in a bucket (nothing was in force: ``previous_k`` unset) reads
    "first: <after>", never as a change from "off"."""
    d = e.decision
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.unix_seconds))
    change = (f"{shown(arm_label(e.previous_draft, e.previous_k))} -> "
              if e.HasField("previous_k") else "first: ")
    return (f"{when}  v{e.policy_version}  {d.traffic_class}  "
            f"batch {batch_range(tuple(bounds), d.batch_bucket)}  "
            f"{change}{shown(arm_label(d.draft, d.k))}  "
            f"{shown(decision_detail(event_from_proto(e)))}")


def render_explanation(resp: policy_pb2.ExplainDecisionResponse) -> str:
    chosen = arm_key(resp.decision.draft, resp.decision.k)
    rows = [("*" if arm_key(a.draft, a.k) == chosen else "", arm_label(a.draft, a.k),
             f"{a.expected_tokens:.2f}", f"{a.step_seconds * 1e3:.2f}",
             f"{a.goodput_tokens_per_second:.1f}", speedup_text(a.speedup, a.too_little_evidence))
            for a in resp.arms]
    table = _table(("", "ARM", "E[TOKENS]", "STEP MS", "TOKENS/S", "SPEEDUP"), rows)
    return f"{shown(resp.text)}\n\nat batch size {resp.batch_size}:\n{table}"


def _write_metadata(args: argparse.Namespace) -> tuple[tuple[str, str | bytes], ...]:
    return (("authorization", f"Bearer {args.token}"),) if args.token else ()


def policy_get(stub: PolicyStub, args: argparse.Namespace) -> int:
    resp = stub.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class=args.cls),
                          timeout=args.timeout)
    return _print_response(resp, args, render_policy)


def policy_set(stub: PolicyStub, args: argparse.Namespace) -> int:
    try:
        override = Override(args.cls, pin_k=args.pin_k, force_draft=args.force_draft,
                            force_off=args.force_off, note=args.note)
    except ValueError as exc:
        _say(str(exc), err=True)
        return 2
    ov = override_to_proto(override)
    ov.scope = _SCOPES[args.scope]
    resp = stub.SetOverride(policy_pb2.SetOverrideRequest(override=ov), timeout=args.timeout,
                            metadata=_write_metadata(args))
    print(f"override on {args.cls}: {_override_text(override)}; policy version "
          f"{resp.policy_version}")
    if args.pin_k and _engines(stub, args) == []:
        # With engines connected, a pin above their largest K is refused; before any, it is
        # taken, and the engines run what they can.
        print(f"no engine is connected yet: K={args.pin_k} is capped at the largest K an "
              "engine offers once one connects (specpilot policy get shows what runs)")
    return 0


def _engines(stub: PolicyStub, args: argparse.Namespace) -> list[str] | None:
    """The engines connected to the controller; None where it did not say (the write is
    done: a failed read must not make it look refused)."""
    # The class just overridden keeps the answer small ("*" is no class: all of them).
    cls = "" if args.cls == ALL_CLASSES else args.cls
    try:
        return list(stub.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class=cls),
                                   timeout=args.timeout).engines)
    except grpc.RpcError:
        return None


def policy_clear(stub: PolicyStub, args: argparse.Namespace) -> int:
    resp = stub.ClearOverride(policy_pb2.ClearOverrideRequest(traffic_class=args.cls,
                                                              scope=_SCOPES[args.scope]),
                              timeout=args.timeout, metadata=_write_metadata(args))
    what = "cleared" if resp.cleared else "had no override"
    print(f"override on {args.cls}: {what}; policy version {resp.policy_version}")
    return 0


def policy_watch(stub: PolicyStub, args: argparse.Namespace) -> int:
    # A read first, so that a wrong target fails at once (a stream would wait) and the line
    # below says whether any decision is there to replay; nothing more is said while idle.
    policy = stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=args.timeout)
    decided = any(c.decisions for c in policy.classes if args.cls in ("", c.traffic_class))
    which = f" of class {args.cls}" if args.cls else ""
    _say(f"watching decisions{which} at {args.target} (Ctrl-C to stop)"
         + ("; the decisions so far first" if decided else "; none yet"), err=True)
    stream = stub.WatchDecisions(policy_pb2.WatchDecisionsRequest(traffic_class=args.cls))
    # Ctrl-C (the way a watch ends) cancels the stream: a KeyboardInterrupt raised inside gRPC's
    # own wait can leave its call state half-updated, and the process then hung on exit.
    cancel: Callable[[], object] = stream.cancel  # untyped in grpc's stubs; bound, not called
    previous = signal.signal(signal.SIGINT, lambda *_: cancel())
    try:
        for resp in stream:
            if args.json:
                _print_json(resp.event, indent=None)
            else:
                print(render_event(resp.event, policy.batch_bucket_upper_bounds), flush=True)
    except grpc.RpcError as exc:
        if not (isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.CANCELLED):
            raise
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def policy_explain(stub: PolicyStub, args: argparse.Namespace) -> int:
    # --batch is a batch size or a range as the policy names them: the controller's bounds say
    # which bucket that is.
    bounds = tuple(stub.GetPolicy(policy_pb2.GetPolicyRequest(),
                                  timeout=args.timeout).batch_bucket_upper_bounds)
    try:
        bucket = parse_batch(bounds, args.batch)
    except ValueError as exc:
        _say(f"--batch: {exc}", err=True)
        return 2
    resp = stub.ExplainDecision(
        policy_pb2.ExplainDecisionRequest(traffic_class=args.cls, batch_bucket=bucket),
        timeout=args.timeout)
    return _print_response(resp, args, render_explanation)


def render_recommendations(resp: policy_pb2.GetRecommendationsResponse) -> str:
    if not resp.classes:
        return "no recommendations yet (no class has enough evidence on a speculative engine)"
    rows = [(c.traffic_class, c.batch_size, "*" if i == 0 else "", o.pool,
             arm_label(o.draft, o.k), f"{o.goodput_tokens_per_second:.1f}",
             f"{o.tries:.0f}" if o.draft else "-", o.sidecars)
            for c in resp.classes for i, o in enumerate(c.options)]
    return _table(("CLASS", "BATCH", "", "POOL", "CHOICE", "TOKENS/S", "TRIES", "SIDECARS"),
                  rows)


def policy_recommend(stub: PolicyStub, args: argparse.Namespace) -> int:
    resp = stub.GetRecommendations(policy_pb2.GetRecommendationsRequest(traffic_class=args.cls),
                                   timeout=args.timeout)
    return _print_response(resp, args, render_recommendations)


def _channel(args: argparse.Namespace) -> grpc.Channel | None:
    """The channel of every client command: plaintext, or TLS with --tls-ca (and a client
    certificate with --tls-cert and --tls-key); None, said on stderr, for options or files it
    cannot use."""
    try:
        return open_channel(args.target, ca_file=args.tls_ca or "",
                            cert_file=args.tls_cert or "", key_file=args.tls_key or "",
                            server_name=args.tls_server_name or "")
    except TLSError as exc:
        _say(str(exc), err=True)
        return None


# A refusal's field (the policy API's names, at the start of its message) -> the flag that set it.
_FLAGS = (("override.traffic_class", "--class"), ("override.pin_k", "--pin-k"),
          ("override.force_draft", "--force-draft"), ("override.note", "--note"),
          ("override.scope", "--scope"), ("scope", "--scope"), ("traffic_class", "--class"),
          ("batch_bucket", "--batch"))
# What gRPC says when the target speaks HTTP/1 (the controller's HTTP port, say), not HTTP/2.
_NOT_GRPC = ("Failed parsing HTTP/2", "Expected SETTINGS frame", "http1.x server")
_TLS = ("ssl", "handshake", "certificate", "tls")


def _unreachable(target: str, details: str, tls: bool) -> str:
    """Why the controller at ``target`` could not be reached (gRPC's UNAVAILABLE ``details``;
    ``tls``: whether the client talked TLS), and what to pass instead."""
    if any(s in details for s in _NOT_GRPC):
        return (f"{target} answered, but not with gRPC: is it the controller's HTTP port? "
                f"The gRPC port is printed by specpilot serve (default {DEFAULT_TARGET}); "
                "pass --target HOST:GRPC_PORT")
    if any(s in details for s in ("errors resolving", "DNS resolution failed")):
        return f"cannot resolve the host of {target}: pass --target HOST:PORT (or set {TARGET_ENV})"
    no_controller = (f"no controller at {target}: start one with specpilot serve, or pass "
                     f"--target HOST:PORT (or set {TARGET_ENV})")
    if "Connection refused" in details:
        return no_controller
    if tls and "WRONG_VERSION_NUMBER" in details:
        return (f"{target} answered, but not with TLS: a controller without tls_cert_file "
                "takes no --tls-ca (nor SPECPILOT_TARGET_TLS_CA); or is it another port?")
    if tls and "Hostname Verification" in details:
        return (f"the certificate of {target} is not issued for that host: pass the name it "
                "is issued for with --tls-server-name NAME")
    if tls and "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"the certificate of {target} is not signed by the CA of --tls-ca: pass the CA "
                "that signed the controller's tls_cert_file")
    if "Socket closed" in details:
        if tls:
            return (f"{target} closed the TLS connection: a controller with tls_client_ca_file "
                    "asks for a client certificate: pass --tls-cert FILE --tls-key FILE")
        return (f"{target} closed the connection: if its controller serves TLS (tls_cert_file), "
                "pass --tls-ca FILE, the CA that signed its certificate")
    if tls and any(s in details.lower() for s in _TLS):
        return (f"TLS with {target} failed ({details}): check --tls-ca, --tls-cert, --tls-key "
                "and --tls-server-name")
    if "failed to connect to all addresses" in details:
        return no_controller
    return (f"{target} did not answer ({details}): is a controller's gRPC port there? "
            "pass --target HOST:PORT")


def rpc_failure(exc: grpc.RpcError, target: str, timeout: float, tls: bool = False) -> str:
    """What went wrong with a call to the controller at ``target`` (``timeout``: the call's, in
    seconds; ``tls``: whether it was made over TLS), in the command line's terms: what to pass
    or run next, not the protocol's status."""
    if not isinstance(exc, grpc.Call):
        return f"{target}: {exc}"
    code, details = exc.code(), exc.details() or ""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return ("this command changes policy and needs the controller's policy token: pass "
                f"--token TOKEN or set {TOKEN_ENV} (specpilot serve prints it at start-up)")
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return (f"the controller at {target} refused this policy token (--token or "
                f"{TOKEN_ENV}): pass its own, the one specpilot serve printed at start-up or "
                f"the one it was started with ({TOKEN_ENV} or policy_token_file)")
    if code is grpc.StatusCode.UNAVAILABLE:
        return _unreachable(target, details, tls)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"no answer from {target} within {timeout:g} s: is a controller's gRPC "
                "port there? pass --target HOST:PORT, or a longer --timeout")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        for field, flag in _FLAGS:
            if details.startswith(field + ": "):
                return (f"the controller at {target} refused {flag}: "
                        f"{details.removeprefix(field + ': ')}")
        return f"the controller at {target} refused the request: {details}"
    if code is grpc.StatusCode.NOT_FOUND:
        return f"{target}: {details} (specpilot policy get lists the classes it knows)"
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return f"{target}: {details}"
    return f"{target}: {code.name}: {details}"


def cmd_policy(args: argparse.Namespace) -> int:
    if (channel := _channel(args)) is None:
        return 2
    with channel:
        try:
            result: int = args.run(policy_stub(channel), args)
        except grpc.RpcError as exc:
            _say(rpc_failure(exc, args.target, args.timeout, bool(args.tls_ca)), err=True)
            return 1
    return result


# --- parser --------------------------------------------------------------------------------
EXTRA_COMMANDS_GROUP = "specpilot.commands"
# Where the extra commands come from, for the help text and for a command that is not installed.
TOOLS_HINT = ("the simulator, the demo and the benchmarks (simulate, demo, models, bench) come "
              "with specpilot-tools: from a checkout, pip install -e ./benchmarks (make setup "
              "does)")


class ExtraCommand(Protocol):
    """What a ``specpilot.commands`` entry point names: a command another distribution adds
    (specpilot-tools adds the simulator, the demo and the benchmarks). ``attach`` fills the
    command's parser (arguments, description, ``func``) and may import heavy modules: it runs
    only when the command is used."""

    help: str

    def attach(self, parser: argparse.ArgumentParser) -> None: ...


def extra_commands() -> dict[str, EntryPoint]:
    """The installed ``specpilot.commands`` entry points by command name (not loaded)."""
    return {ep.name: ep for ep in entry_points(group=EXTRA_COMMANDS_GROUP)}


def cmd_check(args: argparse.Namespace) -> int:
    """Wait until the controller at ``--target`` answers gRPC health SERVING and lists at least
    ``--expect-engines`` engines (the Helm chart's test hook); 0 then, 1 at the deadline."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + args.timeout
    call = 5.0  # seconds, each call
    last = "no answer yet"
    if (channel := _channel(args)) is None:
        return 2
    with channel:
        health, stub = health_pb2_grpc.HealthStub(channel), policy_stub(channel)
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=call).status
                engines = list(stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=call).engines)
                if status == health_pb2.HealthCheckResponse.SERVING \
                        and len(engines) >= args.expect_engines:
                    _say(f"{args.target}: serving, engines: "
                         f"{', '.join(map(shown, engines)) or 'none'}")
                    return 0
                last = (f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}, "
                        f"{len(engines)} engine(s) of {args.expect_engines}")
            except grpc.RpcError as exc:
                last = rpc_failure(exc, args.target, call, bool(args.tls_ca))
            if time.monotonic() > deadline:
                _say(f"{args.target}: not ready after {args.timeout:.0f} s: {last}", err=True)
                return 1
            time.sleep(1.0)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of a tool command are loaded only when ``command`` names it."""
    parser = argparse.ArgumentParser(prog="specpilot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the controller sidecar")
    serve.add_argument("--config", help="YAML file of settings (env SPECPILOT_CONFIG)")
    for name in SERVE_FLAGS:
        serve.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                           help=_plain(Settings.model_fields[name].description))
    serve.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="any other setting (value parsed as YAML); repeatable")
    serve.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"))
    serve.set_defaults(func=cmd_serve)

    check = commands.add_parser("check", help="wait until a controller is healthy and lists "
                                "its engines (the Helm chart's test)")
    check.add_argument("--target", default="127.0.0.1:50051", help="controller gRPC host:port")
    check.add_argument("--expect-engines", type=int, default=0, metavar="N",
                       help="engines that must be connected (default 0: health only)")
    check.add_argument("--timeout", type=float, default=60.0, help="seconds to wait")
    _add_tls_options(check, with_defaults=True)
    check.set_defaults(func=cmd_check)

    shown = commands.add_parser("settings", help="show the settings in effect, or their reference")
    shown.add_argument("--config", help="YAML file of settings (env SPECPILOT_CONFIG)")
    shown.add_argument("--markdown", action="store_true",
                       help="print the reference of every setting as Markdown")
    shown.set_defaults(func=cmd_settings)

    token = commands.add_parser("engine-token", help="derive an engine's own token from "
                                "engine_secret (SPECPILOT_ENGINE_SECRET)")
    token.add_argument("--id", required=True, help="the engine's id (its "
                       "SPECPILOT_PLUGIN_ENGINE_ID)")
    token.add_argument("--config", help="YAML file of settings (env SPECPILOT_CONFIG)")
    token.add_argument("--output", metavar="FILE",
                       help="write the token here (mode 0640) instead of printing it")
    token.set_defaults(func=cmd_engine_token)

    extras = extra_commands()
    if not extras:
        parser.epilog = TOOLS_HINT[0].upper() + TOOLS_HINT[1:] + "."
    for name, entry in sorted(extras.items()):
        try:
            tool: ExtraCommand = entry.load()
        except Exception as exc:  # a broken add-on must not take the sidecar's CLI with it
            _say(f"command '{name}' ({entry.value}) failed to load: {exc}; reinstall the "
                 f"distribution that provides it ({TOOLS_HINT})", err=True)
            continue
        sub = commands.add_parser(name, help=tool.help,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            tool.attach(sub)
            sub.description = _plain(sub.description)

    policy = commands.add_parser("policy", help="read, override, watch or explain the policy",
                                 parents=[_connection_options(with_defaults=True)])
    policy.set_defaults(func=cmd_policy)
    actions = policy.add_subparsers(dest="action", required=True)
    # The same options after the action too (`policy get --target ...`); the defaults stay above.
    again = _connection_options(with_defaults=False)

    def action(name: str, run: Callable[[PolicyStub, argparse.Namespace], int], text: str,
               class_required: bool) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=text, parents=[again])
        p.add_argument("--class", dest="cls", required=class_required, default="",
                       metavar="CLASS", help="traffic class ('*' for all, where it applies)")
        p.set_defaults(run=run)
        return p

    get = action("get", policy_get, "the policy and its estimates", False)
    get.add_argument("--json", action="store_true", help="print the response as JSON")
    set_ = action("set", policy_set, "set an override", True)
    what = set_.add_mutually_exclusive_group(required=True)
    what.add_argument("--pin-k", type=int, metavar="N",
                      help="pin K (0 = off); refused above the largest K the connected engines "
                           "offer; with no engine connected yet, taken and capped at an "
                           "engine's largest K once one connects")
    what.add_argument("--force-draft", metavar="DRAFT", help="use this draft")
    what.add_argument("--force-off", action="store_true", help="speculation off")
    set_.add_argument("--note", default="", help="kept with the override")
    clear = action("clear", policy_clear, "clear an override", True)
    for p in (set_, clear):
        p.add_argument("--scope", choices=sorted(_SCOPES), default="default",
                       help="pod: this controller; fleet: every controller of the model "
                            "sharing the state store; default: fleet where one is configured")
    watch = action("watch", policy_watch, "stream decisions as they happen", False)
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    explain = action("explain", policy_explain, "explain one class's decision", True)
    explain.add_argument("--batch", default="1", metavar="SIZE_OR_RANGE",
                         help="a batch size (e.g. 24) or a batch range as policy get prints it "
                              "(e.g. 17-32); default 1")
    explain.add_argument("--json", action="store_true", help="print the response as JSON")
    recommend = action("recommend", policy_recommend,
                       "the fleet's best draft and pool per class (needs a shared store)", False)
    recommend.add_argument("--json", action="store_true", help="print the response as JSON")
    return parser


def _connection_options(with_defaults: bool) -> argparse.ArgumentParser:
    """--target, --token and --timeout; without defaults they only override the ones given
    before the action."""

    def default(value: object) -> object:
        return value if with_defaults else argparse.SUPPRESS

    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--target",
                         default=default(os.environ.get("SPECPILOT_TARGET", DEFAULT_TARGET)),
                         help="controller gRPC address host:port (env SPECPILOT_TARGET)")
    options.add_argument("--token", default=default(os.environ.get("SPECPILOT_POLICY_TOKEN")),
                         help="bearer token for writes (env SPECPILOT_POLICY_TOKEN)")
    options.add_argument("--timeout", type=float, default=default(10.0),
                         help="per call, seconds")
    _add_tls_options(options, with_defaults)
    return options


# The client's TLS options: flag, environment variable, help.
TLS_OPTIONS = (
    ("--tls-ca", "SPECPILOT_TARGET_TLS_CA",
     "PEM CA that signed the controller's certificate: talk TLS (a controller with "
     "tls_cert_file)"),
    ("--tls-cert", "SPECPILOT_TARGET_TLS_CERT",
     "PEM client certificate, for a controller that requires one (tls_client_ca_file)"),
    ("--tls-key", "SPECPILOT_TARGET_TLS_KEY", "PEM key of --tls-cert"),
    ("--tls-server-name", "SPECPILOT_TARGET_TLS_SERVER_NAME",
     "check the controller's certificate for this name instead of the target's host"),
)


def _add_tls_options(parser: argparse.ArgumentParser, with_defaults: bool) -> None:
    for flag, env, text in TLS_OPTIONS:
        parser.add_argument(flag, metavar="FILE" if flag != "--tls-server-name" else "NAME",
                            default=os.environ.get(env) if with_defaults else argparse.SUPPRESS,
                            help=f"{text} (env {env})")


def _command_names(parser: argparse.ArgumentParser) -> set[str]:
    return {name for action in parser._actions
            if isinstance(action, argparse._SubParsersAction) for name in action.choices}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    if command is not None and command not in _command_names(parser):
        hint = "" if extra_commands() else f"; {TOOLS_HINT}"
        _say(f"no command '{command}' (specpilot --help lists them){hint}", err=True)
        return 2
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's exit
    except BrokenPipeError:
        return _stdout_closed()
    return result


# The exit status when the reader of stdout went away early (`specpilot policy get | head`):
# 128 + SIGPIPE, what a shell reports for a program that signal ended, as `cat` and other
# commands end there; quietly (no traceback), and `set -o pipefail` still sees the cut.
STDOUT_CLOSED_EXIT = 128 + signal.SIGPIPE


def _stdout_closed() -> int:
    # Python flushes stdout again at exit: with /dev/null behind it, that flush cannot fail
    # (it would print "Exception ignored ... BrokenPipeError").
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return STDOUT_CLOSED_EXIT


if __name__ == "__main__":
    sys.exit(main())
