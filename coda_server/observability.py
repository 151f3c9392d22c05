"""Operations: Prometheus metrics, one structured log line per RPC, and lifecycle log lines.

* `Observability` is what `PacerServer` owns: a per-server `CollectorRegistry` (never the global one),
  the RPC observer, the access log, the pacer collector and histograms, and the `/metrics` HTTP listener
  on `server.metrics_address`.
* `RpcObserver` gives every method handler (built once per method by rpc_handlers.py) a `MethodObserver`
  that counts and times every RPC under the standard gRPC server metric names (`grpc_server_started_total`,
  `grpc_server_handled_total`, `grpc_server_handling_seconds`), noting one line per RPC in the access log
  (logger `coda_server.rpc`, see logs.AccessLog). It brackets everything else the handler does, and
  authentication's refusals are observed too, so refused calls (e.g. UNAUTHENTICATED) are counted and logged.
* `PacerCollector` reads `PacerState` at scrape time: gauges and counters named `coda_pacer_*`, with the
  latest step report. Consumption histograms are fed by `Pacer.add_consume_listener`.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from typing import Any, Callable, Iterable, Optional

import grpc
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from coda_client._proto import pacer_pb2

from .core.async_pacer import AsyncPacer
from .core.settings import parse_host_port, setting
from .core.errors import NotReadyError
from .core.state import COUNTER, GAUGE, PacerState, reported_fields
from .core.types import ControlEvent, ControlEventType, ResetMode, StepReport, TrajectoryGroup
from .admission import Admission
from .logs import AccessLog, fields
from .metrics_listener import start_metrics_listener

log = logging.getLogger("coda_server")

# grpc_server_handling_seconds: the usual Prometheus latency buckets, extended for long-polls (up to
# server.max_wait_seconds, 600 s by default).
HANDLING_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0, 300.0, 600.0)
# Dispatch to Collect: generation of long responses takes minutes, and a group may wait in the buffer
# for a step or two.
DISPATCH_TO_COLLECT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
                               3600.0, 7200.0)
# Staleness in weight versions; the window keeps it near stale_steps.
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)

# gRPC method kinds, named as the standard gRPC server metrics name them.
_GRPC_TYPES = {(False, False): "unary", (False, True): "server_stream",
               (True, False): "client_stream", (True, True): "bidi_stream"}


# ------------------------------------------------------------------------------------------ logging

def log_control_event(pacer_state: Callable[[], PacerState],
                      replaying: Callable[[], bool] = lambda: False) -> Callable[[ControlEvent], None]:
    """A Pacer control listener that logs each pause, resume and the end of the job once, with its figures: not
    again while `replaying()` (a restart's recovery replays the journal's events, which were logged when they
    happened).

    Runs under the pacer lock (it is a control listener): it reads the state, which is re-entrant, and logs.
    SHUTDOWN is logged by the command line, which knows the grace period.
    """

    restores_seen = [pacer_state().restores]  # a PAUSE whose `restores` grew is a Restore's, not a Reset's

    def on_event(event: ControlEvent) -> None:
        by_restore = event.type == ControlEventType.PAUSE and event.restores > restores_seen[0]
        restores_seen[0] = max(restores_seen[0], event.restores)
        if replaying():
            return
        if event.type == ControlEventType.PAUSE:
            state = pacer_state()
            mode = ResetMode(event.mode).name.lower()
            what = ("told the workers to abort what they generate for a Restore" if by_restore
                    else "paused dispatch for a Reset")
            log.info("%s (mode %s) at step %d, weight version %d: %d group%s running, "
                     "%d buffered, %d trajectories queued", what, mode, event.step, event.weight_version,
                     state.running, "" if state.running == 1 else "s", state.buffered, state.queued_trajectories,
                     extra=fields(event="pause", mode=mode, step=event.step, weight_version=event.weight_version,
                                  generation=event.generation, running=state.running, buffered=state.buffered,
                                  queued_trajectories=state.queued_trajectories))
        elif event.type == ControlEventType.RESUME:
            state = pacer_state()
            log.info("resumed dispatch: step %d, weight version %d, generation %d; %d groups buffered, "
                     "dispatch would admit %d", event.step, event.weight_version, event.generation,
                     state.buffered, state.capacity,
                     extra=fields(event="resume", step=event.step, weight_version=event.weight_version,
                                  generation=event.generation, buffered=state.buffered, capacity=state.capacity))
        elif event.type == ControlEventType.JOB_ENDED:
            state = pacer_state()
            mode = ResetMode(event.mode).name.lower()
            log.info("job ended (EndJob, mode %s) at step %d, weight version %d: dispatch closed for good; %d groups "
                     "running, %d buffered, %d consumed in all", mode, event.step, event.weight_version,
                     state.running, state.buffered, state.consumed,
                     extra=fields(event="job_ended", mode=mode, step=event.step, weight_version=event.weight_version,
                                  running=state.running, buffered=state.buffered, consumed=state.consumed))

    return on_event


# ------------------------------------------------------------------------------ gRPC server metrics

GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")


class MethodStats:
    """The standard metrics of one method, as plain numbers the event loop bumps."""

    __slots__ = ("started", "handled", "buckets", "seconds")

    def __init__(self) -> None:
        self.started = 0
        self.handled: dict[str, int] = {}  # status code name -> calls
        self.buckets = [0] * (len(HANDLING_BUCKETS) + 1)  # calls per bucket (not cumulative); the last is +Inf
        self.seconds = 0.0

    def observe(self, code: str, seconds: float) -> None:
        handled = self.handled
        handled[code] = handled.get(code, 0) + 1
        self.buckets[bisect.bisect_left(HANDLING_BUCKETS, seconds)] += 1  # bucket i holds seconds <= le[i]
        self.seconds += seconds


class GrpcServerMetrics:
    """The standard gRPC server metrics (names and labels as go-grpc-prometheus / grpc-ecosystem use).

    A collector read at scrape time: a prometheus_client Counter or Histogram takes a lock and several
    Python calls per update, about 4 us per RPC for the three of them; plain numbers updated on the event
    loop cost a fraction of that. A scrape (another thread) copies them; under the GIL each copy is whole.
    """

    def __init__(self, registry: CollectorRegistry):
        self._methods: dict[tuple[str, str, str], MethodStats] = {}
        registry.register(self)

    def method(self, kind: str, service: str, method: str) -> MethodStats:
        return self._methods.setdefault((kind, service, method), MethodStats())

    def initialize(self, service: Any) -> None:
        """Start every method of a service descriptor at zero, so rates exist before the first call."""
        for method in service.methods:
            kind = _GRPC_TYPES[(method.client_streaming, method.server_streaming)]
            self.method(kind, service.full_name, method.name).handled.setdefault("OK", 0)

    def collect(self) -> Iterable[Any]:
        started = CounterMetricFamily("grpc_server_started", "RPCs started on the server.", labels=GRPC_LABELS)
        handled = CounterMetricFamily("grpc_server_handled", "RPCs completed on the server, whatever their status "
                                      "code.", labels=(*GRPC_LABELS, "grpc_code"))
        handling = HistogramMetricFamily("grpc_server_handling_seconds", "Seconds from the start of an RPC to its "
                                         "status (long-polls included).", labels=GRPC_LABELS)
        for labels, stats in list(self._methods.items()):
            started.add_metric(labels, stats.started)
            for code, count in list(stats.handled.items()):
                handled.add_metric((*labels, code), count)
            handling.add_metric(labels, cumulative_buckets(HANDLING_BUCKETS, stats.buckets), stats.seconds)
        yield started
        yield handled
        yield handling


def _split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method


def _request_has_request_id(service: str, method: str) -> bool:
    """Whether the method's request message declares a request_id (a method not described here: perhaps)."""
    try:
        described = descriptor_pool.Default().FindMethodByName(f"{service}.{method}")
    except KeyError:
        return True
    return "request_id" in described.input_type.fields_by_name


_SUCCESS = (None, grpc.StatusCode.OK)  # what context.code() says of a call that set no other code


def _status_code(context: grpc.aio.ServicerContext, error: Optional[BaseException]) -> str:
    """The code the client sees: what the handler set or aborted with, else OK / CANCELLED / UNKNOWN."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and (code != grpc.StatusCode.OK or error is None):
        return code.name
    if error is None:
        return "OK"
    # Cancelled by the client (or its deadline): the task is cancelled, or a streaming handler is closed
    # (GeneratorExit) when gRPC stops iterating it because the call has ended.
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "UNKNOWN"


class ClientCallMetrics:
    """Calls per client id, method and status code, with bounded cardinality: the first `max_clients`
    distinct ids are counted under their own name, later ones as "(other)", calls without an id as "(none)"
    (neither can be a client id: parentheses are not allowed in one)."""

    OTHER = "(other)"
    NONE = "(none)"

    def __init__(self, registry: CollectorRegistry, max_clients: int):
        self._max_clients = max_clients
        self._labels: dict[str, str] = {"": self.NONE}
        self._calls: dict[tuple[str, str, str], int] = {}
        registry.register(self)

    def label(self, client_id: str) -> str:
        label = self._labels.get(client_id)
        if label is None:
            named = len(self._labels) - 1
            label = client_id if named < self._max_clients else self.OTHER
            if label is not self.OTHER:
                self._labels[client_id] = label
        return label

    def count(self, client_id: str, method: str, code: str) -> None:
        key = (self._labels.get(client_id) or self.label(client_id), method, code)
        self._calls[key] = self._calls.get(key, 0) + 1

    def collect(self) -> Iterable[Any]:
        calls = CounterMetricFamily("coda_client_calls", "RPCs finished, by the caller's client id (x-coda-client-id), "
                                    "method and status code.", labels=("client", "grpc_method", "grpc_code"))
        for labels, count in list(self._calls.items()):
            calls.add_metric(labels, count)
        yield calls
        yield GaugeMetricFamily("coda_client_ids", "Distinct client ids counted under their own name (at most "
                                "server.metrics_max_clients).", value=len(self._labels) - 1)


class MethodObserver:
    """One method's metrics and access log; `begin`/`end` bracket each call (rpc_handlers.py calls them)."""

    __slots__ = ("service", "method", "_stats", "_access_log", "_clients", "_request_ids")

    def __init__(self, metrics: GrpcServerMetrics, kind: str, full_method: str,
                 access_log: Optional[AccessLog] = None, clients: Optional[ClientCallMetrics] = None):
        self._access_log = access_log
        self._clients = clients
        self.service, self.method = _split_method(full_method)
        self._stats = metrics.method(kind, self.service, self.method)
        # Asking a request without the field (GetState's) raises and catches an AttributeError: a microsecond.
        self._request_ids = _request_has_request_id(self.service, self.method)

    def begin(self, context: grpc.aio.ServicerContext) -> tuple[float, str]:
        """Count the start; returns the start time and the peer (read now: once a call is cancelled, its
        context must not be asked for the peer, which reads the finished C call and can crash the process)."""
        self._stats.started += 1
        access_log = self._access_log
        peer = context.peer() if access_log is not None and access_log.enabled() else ""
        return time.perf_counter(), peer

    def end(self, begun: tuple[float, str], context: grpc.aio.ServicerContext, request: Any,
            error: Optional[BaseException], caller: str = "") -> None:
        """Count the end with the status code the client sees; `caller` is the call's client id."""
        started, peer = begun
        elapsed = time.perf_counter() - started
        # The usual ending (answered, no code set) without the general case's calls.
        code = "OK" if error is None and context.code() in _SUCCESS else _status_code(context, error)
        self._stats.observe(code, elapsed)
        if self._clients is not None:
            self._clients.count(caller, self.method, code)
        if peer:
            request_id = getattr(request, "request_id", "") if request is not None and self._request_ids else ""
            self._access_log.note(self.service, self.method, code, elapsed, request_id, peer, caller)


class RpcObserver:
    """Counts, times and logs every RPC: hands each method its `MethodObserver` (rpc_handlers.py builds every
    method's handler around one). Unknown methods never reach it (gRPC answers UNIMPLEMENTED), so they are
    not counted (no label explosion)."""

    def __init__(self, metrics: GrpcServerMetrics, access_log: Optional[AccessLog] = None,
                 clients: Optional[ClientCallMetrics] = None):
        self._metrics = metrics
        self._access_log = access_log
        self._clients = clients

    def method(self, full_method: str, handler: grpc.RpcMethodHandler) -> MethodObserver:
        kind = _GRPC_TYPES[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return MethodObserver(self._metrics, kind, full_method, self._access_log, self._clients)


# ------------------------------------------------------------------------------------ pacer metrics

# (PacerState field, metric name, help, is_counter), from the declaration of PacerState (core/state.py).
# Read at scrape time; counters are exported with the `_total` suffix.
PACER_METRICS = tuple((f.name, how.metric, how.help, how.kind == COUNTER) for f, how in reported_fields()
                      if how.kind in (GAUGE, COUNTER))
# The latest step report (0 before the first Reset): (StepReport field, metric name, help).
STEP_REPORT_GAUGES = (
    ("step", "coda_pacer_step_report_step", "The step the latest step report is about."),
    ("pipeline_buf_size", "coda_pacer_step_report_pipeline_buf_size",
     "Latest step report: complete groups left in the pipeline buffer at the step boundary."),
    ("filter_drop", "coda_pacer_step_report_filter_drop", "Latest step report: groups a filter dropped in the step."),
    ("partial_ratio", "coda_pacer_step_report_partial_ratio",
     "Latest step report: fraction of consumed trajectories whose start and end weight versions differ."),
    ("partial_span_max", "coda_pacer_step_report_partial_span_max",
     "Latest step report: largest end - start weight version among consumed trajectories."),
    ("partial_restored_count", "coda_pacer_step_report_partial_restored_count",
     "Latest step report: trajectories of the assembled groups the Reset restored (LoongSage's "
     "rollout/partial_restored_count; divide by N for groups)."),
    ("partial_dropped_incomplete_count", "coda_pacer_step_report_partial_dropped_incomplete_count",
     "Latest step report: trajectories of the incomplete groups the Reset dropped (LoongSage's "
     "rollout/partial_dropped_incomplete_count)."),
    ("partial_restored_group_count", "coda_pacer_step_report_partial_restored_groups",
     "Latest step report: assembled groups the Reset restored."),
    ("partial_dropped_incomplete_group_count", "coda_pacer_step_report_partial_dropped_incomplete_groups",
     "Latest step report: incomplete groups the Reset dropped."),
    ("pause_delay", "coda_pacer_step_report_pause_delay_seconds",
     "Latest step report: seconds from the pause until every running group was assembled (or the wait ended)."),
)


class PacerCollector:
    """`coda_server_ready` / `coda_server_recovering`, then the `coda_pacer_*` gauges and counters, read from the
    pacer's state at each scrape. While the state is rebuilt there is no state to read: only the first two."""

    def __init__(self, async_pacer: AsyncPacer, ready: Callable[[], bool]):
        self._pacer = async_pacer
        self._ready = ready

    def collect(self) -> Iterable[Any]:
        recovering = self._pacer.recovering
        yield GaugeMetricFamily("coda_server_ready", "1 while the server takes pacer calls (readiness SERVING), "
                                "else 0 (starting, recovering, draining, or the state directory failed).",
                                value=float(self._ready() and not recovering))
        yield GaugeMetricFamily("coda_server_recovering", "1 while the state is rebuilt from server.state_dir "
                                "(pacer calls answer UNAVAILABLE, reason RECOVERING), else 0.", value=float(recovering))
        if recovering:
            return
        try:
            state = self._pacer.state()  # takes the pacer lock once; the scrape runs in the HTTP thread
        except NotReadyError:  # recovery started after the check above
            return
        info = GaugeMetricFamily("coda_pacer_info", "The pacing strategy; always 1.", labels=["strategy"])
        info.add_metric([state.strategy], 1)
        yield info
        for attribute, name, help_text, is_counter in PACER_METRICS:
            value = getattr(state, attribute)
            if is_counter:
                yield CounterMetricFamily(name, help_text, value=value)
            else:
                yield GaugeMetricFamily(name, help_text, value=float(value))
        yield GaugeMetricFamily("coda_pacer_watchers", "WatchControl streams open now.",
                                value=self._pacer.watcher_count)
        yield CounterMetricFamily("coda_pacer_watchers_dropped", "WatchControl streams dropped because they fell "
                                  "server.watch_queue_events control events behind (their client stopped reading).",
                                  value=self._pacer.watchers.dropped)
        report = state.recent_reports[-1] if state.recent_reports else StepReport()
        for attribute, name, help_text in STEP_REPORT_GAUGES:
            yield GaugeMetricFamily(name, help_text, value=float(getattr(report, attribute)))
        # One step report per finished Reset. Every finished Reset increments the generation, and so does every
        # Restore (journaled and counted in `restores`, as the generation is), which computes no report.
        yield CounterMetricFamily("coda_pacer_step_reports", "Step reports computed (one per finished Reset).",
                                  value=state.generation - state.restores)


class AdmissionCollector:
    """Each admission limit's calls in progress, its value and its refusals; per-client rate-limit refusals."""

    def __init__(self, admission: Admission):
        self._admission = admission

    def collect(self) -> Iterable[Any]:
        in_progress = GaugeMetricFamily("coda_admission_in_progress", "Calls in progress counted against each "
                                        "admission limit.", labels=["limit"])
        limit = GaugeMetricFamily("coda_admission_limit", "The value of each admission limit.", labels=["limit"])
        refused = CounterMetricFamily("coda_admission_refused", "Calls refused RESOURCE_EXHAUSTED because an "
                                      "admission limit or a per-client rate limit was reached.", labels=["limit"])
        for entry in self._admission.limits.values():
            in_progress.add_metric([entry.key], entry.in_progress)
            limit.add_metric([entry.key], entry.limit)
            refused.add_metric([entry.key], entry.refused)
        for rate in self._admission.rate_limits.values():
            refused.add_metric([rate.key], rate.refused)
        yield in_progress
        yield limit
        yield refused


class ConsumptionMetrics:
    """Histograms of what the trainer takes (a Pacer consume listener), as plain numbers read at scrape time like
    GrpcServerMetrics': a prometheus_client Histogram takes a lock and several Python calls per observation, and
    the staleness one is observed per trajectory (a group's trajectories are counted by start version at once)."""

    def __init__(self, registry: CollectorRegistry):
        self._waits = [0] * (len(DISPATCH_TO_COLLECT_BUCKETS) + 1)  # groups per bucket (not cumulative), last +Inf
        self._waits_seconds = 0.0
        self._staleness = [0] * (len(STALENESS_BUCKETS) + 1)  # trajectories per bucket
        self._staleness_versions = 0
        registry.register(self)

    def on_consumed(self, groups: list[TrajectoryGroup], weight_version: int, now: float) -> None:
        for group in groups:
            waited = max(0.0, now - group.dispatched_at)
            self._waits[bisect.bisect_left(DISPATCH_TO_COLLECT_BUCKETS, waited)] += 1  # bucket i: <= le[i]
            self._waits_seconds += waited
            # Trajectories per start weight version: usually one version a group, so one count over the list.
            versions = [trajectory.start_weight_version for trajectory in group.trajectories]
            for version in set(versions):
                count = versions.count(version)
                staleness = weight_version - version
                self._staleness[bisect.bisect_left(STALENESS_BUCKETS, staleness)] += count
                self._staleness_versions += staleness * count

    def collect(self) -> Iterable[Any]:
        waits = HistogramMetricFamily("coda_pacer_dispatch_to_collect_seconds",
                                      "Seconds from Dispatch admitting a group to the trainer taking it with Collect.")
        waits.add_metric((), cumulative_buckets(DISPATCH_TO_COLLECT_BUCKETS, self._waits), self._waits_seconds)
        staleness = HistogramMetricFamily("coda_pacer_staleness_versions", "Per consumed trajectory: the weight "
                                          "version when the trainer took it minus its start_weight_version.")
        staleness.add_metric((), cumulative_buckets(STALENESS_BUCKETS, self._staleness), self._staleness_versions)
        yield waits
        yield staleness


def cumulative_buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """A histogram's Prometheus buckets, (le, cumulative count) with +Inf last, from its per-bucket counts (a
    copy is read: another thread may be counting)."""
    cumulative = list(itertools.accumulate(list(counts)))
    return [(floatToGoString(le), n) for le, n in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]


# ---------------------------------------------------------------------------------------- wiring

class Observability:
    """Metrics registry, RPC observer, access log, listeners and the /metrics listener of one PacerServer."""

    def __init__(self, config: Any, async_pacer: AsyncPacer, admission: Optional[Admission] = None):
        self.config = config
        self.metrics_address = str(config.server.get("metrics_address") or "")
        self.registry = CollectorRegistry()
        if admission is not None:
            self.registry.register(AdmissionCollector(admission))
        self.clients = ClientCallMetrics(self.registry, int(setting(config, "server.metrics_max_clients")))
        self.grpc_metrics = GrpcServerMetrics(self.registry)
        self.grpc_metrics.initialize(pacer_pb2.DESCRIPTOR.services_by_name["RolloutPacer"])
        self.ready = False  # readiness as the health service reports it; PacerServer sets it
        self.registry.register(PacerCollector(async_pacer, lambda: self.ready))
        self.consumption = ConsumptionMetrics(self.registry)
        async_pacer.pacer.add_consume_listener(self.consumption.on_consumed)
        async_pacer.pacer.add_control_listener(log_control_event(
            async_pacer.pacer.state, lambda: async_pacer.pacer.recorder.replaying))
        # None when server.log_rpcs is off; else the per-RPC lines, written in batches.
        self.access_log = (AccessLog(str(setting(config, "server.log_format")))
                           if bool(setting(config, "server.log_rpcs")) else None)
        self.rpc_observer = RpcObserver(self.grpc_metrics, self.access_log, self.clients)
        self._httpd: Any = None  # the /metrics WSGI server; its serving thread is a daemon

    def start_metrics(self, token_check: Optional[Callable] = None) -> Optional[int]:
        """Serve /metrics on server.metrics_address; returns the bound port (None when disabled).

        `token_check`: the gRPC port's bearer-token check, for server.metrics_require_token.
        Raises OSError when the address cannot be bound.
        """
        if not self.metrics_address:
            return None
        host, port = parse_host_port(self.metrics_address)  # validated with the configuration
        self._httpd, scheme, guarded = start_metrics_listener(host, port, self.registry, self.config.server,
                                                                token_check)
        bound = int(self._httpd.server_port)
        log.info("serving Prometheus metrics on %s://%s:%d/metrics%s", scheme, host, bound, guarded,
                 extra=fields(event="metrics", host=host, port=bound, scheme=scheme))
        return bound

    async def stop(self) -> None:
        """Write the last access-log lines; stop the /metrics listener (its shutdown waits for the serving
        thread, so off the event loop)."""
        if self.access_log is not None:
            self.access_log.flush()
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return

        def close() -> None:
            httpd.shutdown()
            httpd.server_close()

        await asyncio.get_running_loop().run_in_executor(None, close)
