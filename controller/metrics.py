"""Every Prometheus metric of the controller, defined here and nowhere else.

Conventions: prefix ``specpilot_``, base units (ratios in 0..1, seconds), ``_total`` on counters,
labels only from bounded sets: ``class`` (at most ``max_classes`` + "other" + "default"), ``draft``
(drafts the engines offered), ``batch`` (a batch range, named as everywhere else: "1", "3-4",
"129+"), ``reason`` and ``outcome`` (the fixed sets below). The per-class series carry
``model_name``, the label vLLM's own ``vllm:*`` series carry, so the two join. No ``_created``
series: they double the exposition and no dashboard or alert reads them.

Event counters are incremented by the server as things happen. Gauges that describe the core's
state are read from the core at scrape time by a collector, so they can never go stale and a class
or draft that disappears takes its series with it. Each server owns its registry: several servers
can run in one process (the tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specpilot.contract.buckets import batch_range
from specpilot.contract.records import DecisionEvent, Reason, StepPrediction
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.recommend import Recommendation
from specpilot.controller.core.snapshot import CoreSnapshot

disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide

RejectReason = Literal["validation", "implausible", "beyond_rate", "oversized", "before_hello"]
HelloOutcome = Literal["accepted", "rejected", "unauthenticated", "permission_denied",
                       "already_connected"]
WriteOutcome = Literal["ok", "invalid", "unauthenticated", "permission_denied", "unavailable"]
HttpRefusal = Literal["host", "connections", "event_streams", "per_client", "read_token"]
# Malformed HTTP requests, by what the parser found (aiohttp's exception, snake_case).
HttpClientError = Literal["bad_http_message", "bad_http_method", "bad_status_line",
                          "content_encoding_error", "content_length_error",
                          "decompress_size_error", "http_bad_request", "invalid_header",
                          "invalid_url_error", "line_too_long", "payload_encoding_error",
                          "transfer_encoding_error", "other"]


class Metrics:
    """The counters of one server instance, plus the collector that reads its core."""

    def __init__(self, core: ControllerCore, clock: Callable[[], float],
                 model_name: str = "") -> None:
        """``model_name``: the served model's name as vLLM labels its series (the fleet's
        ``fleet_model``); "" = the one the engines announce."""
        self.registry = CollectorRegistry()
        self._bounds = core.config.batch_bucket_upper_bounds
        r = self.registry
        # prometheus_client appends "_total" to counter names.
        self._reports_received = Counter(
            "specpilot_reports_received", "Engine reports received, accepted or not.", registry=r)
        self._reports_rejected = Counter(
            "specpilot_reports_rejected",
            "Engine reports rejected with INVALID_ARGUMENT (state unchanged), by reason: "
            "validation (a field failed the checks), implausible (beyond what the engine can "
            "do), beyond_rate (more steps than the engine can run in the report's interval), "
            "oversized (above max_report_bytes), "
            "before_hello (a stream that did not open with a hello).",
            ["reason"], registry=r)
        self._reports_shed = Counter(
            "specpilot_reports_shed",
            "Engine reports shed unapplied because reports had used their share of the "
            "controller's loop (report_budget_share); the engine sends them again later.",
            registry=r)
        self._hellos = Counter(
            "specpilot_engine_hellos", "Engine hellos, by outcome.", ["outcome"], registry=r)
        self._classes_folded = Counter(
            "specpilot_report_classes_folded",
            "Class names in accepted reports folded into 'other' (class limit reached).",
            registry=r)
        self._records_dropped = Counter(
            "specpilot_engine_records_dropped",
            "Records the engine plugins dropped because their queue was full, as reported.",
            registry=r)
        self._decisions = Counter(
            "specpilot_decisions", "Decisions that changed a (class, bucket) choice, by reason.",
            ["reason"], registry=r)
        self._policy_updates = Counter(
            "specpilot_policy_updates_sent", "Policy updates sent on engine streams.", registry=r)
        self._report_to_decision = Histogram(
            "specpilot_report_to_decision_seconds",
            "How long each accepted report waited for the decide round that took it into "
            "account (then the policy goes out), seconds.",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
            registry=r)
        self._policy_writes = Counter(
            "specpilot_policy_writes", "PolicyService override writes, by outcome.", ["outcome"],
            registry=r)
        # The cost model's calibration, one step ahead: for each step-timing record, the steps,
        # their measured seconds and the seconds the model predicted for them just before
        # learning them. rate(predicted) / rate(measured) per batch range and K is its bias.
        cost_labels = ["batch", "k"]
        self._timed_steps = Counter(
            "specpilot_cost_model_steps",
            "Engine steps in accepted step-timing records, by batch range and K.",
            cost_labels, registry=r)
        self._measured_seconds = Counter(
            "specpilot_cost_model_measured_seconds",
            "Their wall time as the engine measured it, seconds.", cost_labels, registry=r)
        self._predicted_seconds = Counter(
            "specpilot_cost_model_predicted_seconds",
            "Their wall time as the cost model predicted it before learning them, seconds.",
            cost_labels, registry=r)
        self._cost_changes = Counter(
            "specpilot_cost_model_changes_detected",
            "Times the engine's step times left the cost model's predictions for long enough "
            "(its change test) that most of the step-cost evidence was forgotten.", registry=r)
        self._http_refused = Counter(
            "specpilot_http_refused",
            "HTTP connections and requests refused, by reason: host (Host header not in "
            "http_allowed_hosts, 421), connections (http_max_connections), event_streams "
            "(max_event_streams, 503), per_client (event_streams_per_client, 429), read_token "
            "(dashboard_read_token missing or wrong, 401/403).", ["reason"], registry=r)
        self._http_client_errors = Counter(
            "specpilot_http_client_errors",
            "Malformed HTTP requests (answered 400 and closed; logged at most once per "
            "interval per kind), by kind.", ["kind"], registry=r)
        self._event_streams_dropped = Counter(
            "specpilot_event_streams_dropped",
            "Dashboard event streams dropped because their client did not read "
            "(event_stream_buffer_bytes waiting); the page reconnects and reloads.", registry=r)
        # Every series of a bounded label set exists from the start, so rate() and absent()
        # alerts work before the first event.
        for label_set, counter in ((RejectReason, self._reports_rejected),
                                   (HelloOutcome, self._hellos),
                                   (WriteOutcome, self._policy_writes),
                                   (HttpRefusal, self._http_refused),
                                   (HttpClientError, self._http_client_errors)):
            for value in get_args(label_set):
                counter.labels(value)
        for reason in Reason:
            self._decisions.labels(reason.value)
        self._store_up: Gauge | None = None
        self._recommended: Gauge | None = None
        self._option_goodput: Gauge | None = None  # created by the first fleet round
        r.register(_CoreCollector(core, clock, model_name))

    def render(self) -> bytes:
        """The text exposition of this server's registry."""
        return generate_latest(self.registry)

    # --- events --------------------------------------------------------------------------------
    def report_received(self) -> None:
        self._reports_received.inc()

    def watch_loop_lag(self, lag: Callable[[], float]) -> None:
        """Export ``lag()`` (``overload.LoopLag``) as the loop-lag gauge."""
        Gauge("specpilot_event_loop_lag_seconds",
              "How late the controller's event loop last ran a 100 ms timer, seconds: above "
              "a few tens of ms something starves it.", registry=self.registry
              ).set_function(lag)

    def report_shed(self) -> None:
        self._reports_shed.inc()

    def report_rejected(self, reason: RejectReason) -> None:
        self._reports_rejected.labels(reason).inc()

    def report_accepted(self, records_dropped: int, folded_classes: int,
                        predictions: Iterable[StepPrediction], costs_changed: bool = False
                        ) -> None:
        self._records_dropped.inc(records_dropped)
        self._classes_folded.inc(folded_classes)
        if costs_changed:
            self._cost_changes.inc()
        for p in predictions:
            labels = (batch_range(self._bounds, p.batch_bucket), str(p.k))
            self._timed_steps.labels(*labels).inc(p.steps)
            self._measured_seconds.labels(*labels).inc(p.steps * p.measured_seconds)
            self._predicted_seconds.labels(*labels).inc(p.steps * p.predicted_seconds)

    def hello(self, outcome: HelloOutcome) -> None:
        self._hellos.labels(outcome).inc()

    def decisions(self, events: Iterable[DecisionEvent]) -> None:
        for e in events:
            self._decisions.labels(e.decision.reason.value).inc()

    def policy_update_sent(self) -> None:
        self._policy_updates.inc()

    def reports_decided(self, waits: Iterable[float]) -> None:
        for seconds in waits:
            self._report_to_decision.observe(seconds)

    def http_refused(self, reason: HttpRefusal) -> None:
        self._http_refused.labels(reason).inc()

    def http_client_error(self, kind: HttpClientError) -> None:
        self._http_client_errors.labels(kind).inc()

    def event_stream_dropped(self) -> None:
        self._event_streams_dropped.inc()

    def watch_event_streams(self, count: Callable[[], int]) -> None:
        """Export ``count()`` as the open dashboard event streams gauge."""
        Gauge("specpilot_event_streams", "Dashboard event streams (/api/events) open.",
              registry=self.registry).set_function(count)

    def policy_write(self, outcome: WriteOutcome) -> None:
        self._policy_writes.labels(outcome).inc()

    def state_store_up(self, up: bool) -> None:
        """Whether the shared state store answered the last fleet round (the series exists
        only where a store is configured)."""
        if self._store_up is None:
            self._store_up = Gauge(
                "specpilot_state_store_up",
                "1 while the shared state store (state_store) answers, 0 while it does not (the "
                "controller then decides from memory); absent without a store.",
                registry=self.registry)
        self._store_up.set(1.0 if up else 0.0)

    def recommendations(self, recs: Sequence[Recommendation]) -> None:
        """The fleet's latest recommendations: every option's goodput and which is best (the
        series exist only where a store is configured; each update replaces them all)."""
        if self._recommended is None:
            labels = ["traffic_class", "pool", "draft"]
            self._option_goodput = Gauge(
                "specpilot_recommendation_goodput_tokens_per_second",
                "Goodput of each way to serve a class at the fleet's load (pool, draft; draft "
                "'' is speculation off), posterior means, tokens/s of the batch.", labels,
                registry=self.registry)
            self._recommended = Gauge(
                "specpilot_recommendation",
                "1 for the recommended (pool, draft) of each class, 0 for the other options.",
                labels, registry=self.registry)
        assert self._option_goodput is not None
        self._option_goodput.clear()
        self._recommended.clear()
        for rec in recs:
            for i, opt in enumerate(rec.options):
                self._option_goodput.labels(rec.traffic_class, opt.pool, opt.draft).set(
                    opt.goodput)
                self._recommended.labels(rec.traffic_class, opt.pool, opt.draft).set(
                    1.0 if i == 0 else 0.0)


class _CoreCollector(Collector):
    """Gauges (and one counter) read from the core's snapshot at scrape time."""

    def __init__(self, core: ControllerCore, clock: Callable[[], float],
                 model_name: str) -> None:
        self._core = core
        self._clock = clock
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._core.snapshot(self._clock())
        # The model the engines serve, kept once seen: series keep their labels while the
        # engine reconnects.
        self._model_name = self._model_name or next(
            (e.model for e in snap.engines if e.model), "")
        model = self._model_name
        yield GaugeMetricFamily("specpilot_engines_connected", "Engines with an open stream.",
                                value=len(snap.engines))
        yield GaugeMetricFamily("specpilot_policy_version",
                                "Version of the policy pushed to engines.", value=snap.version)
        yield GaugeMetricFamily("specpilot_classes_tracked",
                                "Traffic classes tracked (including 'default' and 'other').",
                                value=len(snap.classes))
        yield GaugeMetricFamily("specpilot_overrides_active", "Operator overrides in force.",
                                value=len(snap.overrides))
        yield from _engines(snap)
        yield from _acceptance(snap, model)
        yield from _decisions(snap, model)


def _engines(snap: CoreSnapshot) -> Iterator[Metric]:
    # Aggregates over engines, not per-engine series: engine ids are not a bounded label set.
    engines = snap.engines
    yield GaugeMetricFamily(
        "specpilot_engine_running_requests",
        "Sequences running on the connected engines at their last report, summed.",
        value=sum(e.running_requests for e in engines))
    yield GaugeMetricFamily(
        "specpilot_engine_report_age_seconds",
        "Seconds since the least recent connected engine last reported (0 with none).",
        value=max((e.report_age_seconds for e in engines), default=0.0))
    yield GaugeMetricFamily(
        "specpilot_engine_policy_versions_behind",
        "How many policy versions the most outdated engine's last report was behind.",
        value=max((e.versions_behind for e in engines), default=0))


def _acceptance(snap: CoreSnapshot, model: str) -> Iterator[Metric]:
    labels = ["model_name", "class", "draft"]
    first = GaugeMetricFamily(
        "specpilot_acceptance_first_position_ratio",
        "Posterior mean acceptance rate of draft position 1.", labels=labels)
    pooled = GaugeMetricFamily(
        "specpilot_acceptance_per_token_ratio",
        "Posterior share of tried draft tokens that were accepted, all positions pooled "
        "(positions after a rejection are not tried).", labels=labels)
    changes = CounterMetricFamily(
        "specpilot_acceptance_changes_detected",
        "Times the change detector flagged an acceptance shift.", labels=labels)
    # Only (class, draft) pairs with evidence: the rest would show the bare prior.
    with_evidence = sorted((e for c in snap.classes for e in c.estimates if e.has_evidence),
                           key=lambda e: (e.traffic_class, e.draft))
    for e in with_evidence:
        values = [model, e.traffic_class, e.draft]
        first.add_metric(values, float(e.posterior.mean[0]))
        pooled.add_metric(values, e.per_token_rate)
        changes.add_metric(values, e.changes_detected)
    yield from (first, pooled, changes)


def _decisions(snap: CoreSnapshot, model: str) -> Iterator[Metric]:
    per_batch = ["model_name", "class", "batch"]
    k = GaugeMetricFamily(
        "specpilot_decision_speculative_tokens",
        "K chosen: draft tokens per step, per class and batch range (0 = speculation off).",
        labels=per_batch)
    speedup = GaugeMetricFamily(
        "specpilot_decision_expected_speedup_ratio",
        "Expected speedup of the chosen arm over no speculation, by the controller's estimates "
        "(1 = no gain).", labels=per_batch)
    probe = GaugeMetricFamily(
        "specpilot_decision_probe_ratio",
        "Share of the class's requests (or of steps, where the engine probes whole steps) "
        "probed with the model draft at a low K while the class runs none.", labels=per_batch)
    measured = GaugeMetricFamily(
        "specpilot_class_measured_speedup_ratio",
        "Speedup the class's served speculative steps achieved over no speculation: the tokens "
        "they emitted per step (measured acceptance) over their time relative to a plain step "
        "(the cost model's), decayed; absent before its first speculative step.",
        labels=["model_name", "class"])
    enabled = GaugeMetricFamily(
        "specpilot_speculation_enabled",
        "1 when the class speculates in at least one batch range, else 0.",
        labels=["model_name", "class"])
    bounds = snap.batch_bucket_upper_bounds
    for c in snap.classes:
        if not c.decisions:
            continue
        for d in c.decisions:
            labels = [model, c.name, batch_range(bounds, d.bucket)]
            k.add_metric(labels, d.k)
            speedup.add_metric(labels, d.expected_speedup)
            probe.add_metric(labels, d.probe_rate)
        enabled.add_metric([model, c.name], float(c.speculating))
        if c.measured_speedup is not None:
            measured.add_metric([model, c.name], c.measured_speedup)
    yield from (k, speedup, probe, measured, enabled)
