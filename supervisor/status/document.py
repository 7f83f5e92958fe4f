"""What /status and /metrics show, and whether the daemon is ready: pure functions of State,
and the Prometheus collector that reads State at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, get_args

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .. import __version__
from ..settings import Settings
from ..state import (
    DurationHistogram,
    Generation,
    OldWorker,
    PendingRemoval,
    ReloadRecord,
    ReloadResult,
    State,
    SuspectServer,
    rfc3339,
    utcnow,
)

RELOAD_RESULTS: tuple[str, ...] = get_args(ReloadResult)


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def reload_json(record: ReloadRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "at": rfc3339(record.at),
        "result": record.result,
        "duration_ms": round(record.duration_ms, 3),
        "error": record.error,
    }


def _old_worker_json(worker: OldWorker, now: datetime, generations: dict[int, Generation]) -> dict[str, Any]:
    generation = generations.get(worker.generation) if worker.generation is not None else None
    return {
        "pid": worker.pid,
        "generation": worker.generation,
        "rendered_sha256": generation.rendered_sha256 if generation else None,
        "age_s": _seconds(worker.age_s(now)),
        "rss_bytes": worker.rss_bytes,
        "connections": worker.connections,
        "steered": sorted(worker.steered),
        "push": {"state": worker.push.state, "at": rfc3339(worker.push.at), "error": worker.push.error},
        "handed_off": worker.handed_off,
    }


def status_document(state: State, settings: Settings, now: datetime) -> dict[str, Any]:
    """The /status JSON. Its keys are exactly those documented in docs/status.md."""
    current = state.current
    reloads = state.reloads
    convergence = state.convergence
    # The daemon resolves the binary into State; until it has, the configured name is the truth.
    binary = state.haproxy_binary if state.haproxy_binary != "haproxy" else settings.haproxy.binary
    return {
        "supervisor": {
            "pid": state.supervisor_pid,
            "version": __version__,
            "uptime_s": _seconds(max(0.0, (now - state.started_at).total_seconds())),
            "ready": not_ready_reason(state, settings.reload.converge_grace_s, now) is None,
        },
        "haproxy": {
            "version": state.haproxy_version,
            "master_pid": state.master_pid,
            "binary": binary,
            "up": state.master_up,
        },
        "worker": {
            "pid": current.worker_pid if current else None,
            "generation": current.number if current else None,
            "config_sha256": current.effective_sha256 if current else None,
            "rendered_sha256": current.rendered_sha256 if current else None,
            "started_at": rfc3339(current.started_at) if current else None,
        },
        "old_workers": [
            _old_worker_json(w, now, state.generations)
            for w in sorted(state.old_workers.values(), key=lambda w: (-(w.age_s(now) or 0.0), w.pid))
        ],
        "reloads": {
            **{result: getattr(reloads, result) for result in RELOAD_RESULTS},
            "last": reload_json(reloads.last),
            "recent": [reload_json(r) for r in reversed(reloads.history)],
        },
        "config": {
            "rendered_path": str(settings.haproxy.config),
            "rendered_sha256": state.rendered_sha256,
            "effective_path": str(settings.haproxy.effective_config),
            "last_good_sha256": state.last_good_sha256,
        },
        "convergence": {
            "converged": convergence.converged,
            "unconverged_s": _seconds(convergence.unconverged_s(now)),
            "since": rfc3339(convergence.unconverged_since),
            "reason": convergence.reason,
            "transient": convergence.transient,
            "attempts": convergence.attempts,
            "next_attempt_at": rfc3339(convergence.next_attempt_at),
        },
        "observe": {"enabled": settings.observe.enabled, "error_limit": settings.observe.error_limit},
        "dead_servers": sorted(state.dead_servers),
        "operator_dead": sorted(state.operator_dead),
        "pending_removals": [_pending_json(r, now) for _, r in sorted(state.pending_removals.items())],
        "suspect_servers": [_suspect_json(s, now) for _, s in sorted(state.suspect_servers.items())],
        "detector": {
            "enabled": settings.detector.enabled,
            "abort": state.detector_aborts, "abort_off_because": state.detector_abort_off,
            "stalled_aborted": state.stalled_aborted, "idle_closed": state.idle_closed,
        },
        "writes": {
            "failing": [{"file": what, "error": error} for what, error in sorted(state.write_failing.items())],
            "failures": state.write_failures,
        },
    }


def _suspect_json(suspect: SuspectServer, now: datetime) -> dict[str, Any]:
    return {
        "server": suspect.key,
        "endpoint": suspect.endpoint,
        "why": suspect.why,
        "left_in": suspect.left_in,
        "since": rfc3339(suspect.since),
        "suspect_s": _seconds(max(0.0, (now - suspect.since).total_seconds())),
    }


def _pending_json(removal: PendingRemoval, now: datetime) -> dict[str, Any]:
    return {
        "server": removal.key,
        "worker_pid": removal.worker_pid,
        "since": rfc3339(removal.since),
        "pending_s": _seconds(max(0.0, (now - removal.since).total_seconds())),
        "tries": removal.tries,
        "last_answer": removal.last_answer,
        "sessions_shut_down": removal.sessions_shut_down,
    }


SOCKET_MISSING = "the HAProxy master's socket is missing from runtime_dir: the daemon is recreating it"


def not_ready_reason(state: State, grace_s: float = float("inf"), now: datetime | None = None) -> str | None:
    """Why /readyz says 503, or None when ready. Not converged for longer than `grace_s` is a
    reason only when what stands in the way passes (convergence.transient): a controller that
    rendered a bad config everywhere would otherwise empty the whole fleet."""
    if not state.master_socket_ok:
        return SOCKET_MISSING
    if not state.master_up:
        return "HAProxy master is not running"
    current = state.current
    if current is None or current.worker_pid is None:
        return "no current worker yet"
    if current.effective_sha256 != state.last_good_sha256:
        return "the current worker does not run the last good config"
    convergence = state.convergence
    waited = convergence.unconverged_s(now or utcnow())
    if convergence.transient and waited > grace_s:
        return f"not converged for {waited:.0f}s (reload.converge_grace_s={grace_s:g}): {convergence.reason}"
    return None


# The classic text format: every Prometheus version parses it (1.0.0 needs Prometheus 3).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _histogram_buckets(histogram: DurationHistogram) -> list[tuple[str, float]]:
    buckets = [(repr(bound), float(count)) for bound, count in zip(histogram.BOUNDS, histogram.counts, strict=True)]
    buckets.append(("+Inf", float(histogram.count)))
    return buckets


class StateCollector(Collector):
    """Builds every haproxy_supervisor_* metric from State at scrape time; no global registry."""

    def __init__(
        self, state: State, clock: Callable[[], datetime], grace_s: float, old_workers_max: int | None
    ) -> None:
        self.state = state
        self.clock = clock
        self.grace_s = grace_s
        self.old_workers_max = old_workers_max

    def collect(self) -> Iterator[Metric]:
        state, now = self.state, self.clock()
        reloads = state.reloads
        workers = list(state.old_workers.values())
        gauge, counter = GaugeMetricFamily, CounterMetricFamily

        yield from self._scalars(
            (gauge, "haproxy_supervisor_up",
             "1 while the HAProxy master runs (what /healthz reports), else 0.", int(state.master_up)),
            (gauge, "haproxy_supervisor_ready", "1 while /readyz says 200, else 0.",
             int(not_ready_reason(state, self.grace_s, now) is None)),
            (gauge, "haproxy_supervisor_converged",
             "1 while the current worker runs the effective config built from the rendered config, else 0.",
             int(state.convergence.converged)),
            (gauge, "haproxy_supervisor_unconverged_seconds",
             "Seconds the node has not run the rendered config; 0 when converged.",
             state.convergence.unconverged_s(now)),
        )
        family = counter("haproxy_supervisor_reloads", "Config changes handled, by result.", labels=["result"])
        for result in RELOAD_RESULTS:
            family.add_metric([result], getattr(reloads, result))
        yield family
        yield counter(
            "haproxy_supervisor_runtime_applies", "Changes applied through the Runtime API without a reload.",
            value=reloads.runtime_applied,
        )
        generation = gauge(
            "haproxy_supervisor_config_generation", "Generation number of the config the current worker runs.",
        )
        if state.current_generation is not None:
            generation.add_metric([], state.current_generation)
        yield generation
        yield gauge(
            "haproxy_supervisor_old_workers", "Old (soft-stopped, draining) HAProxy workers alive.", value=len(workers),
        )
        if self.old_workers_max is not None:
            # Exported so that an alert can compare against the node's own cap, whatever it is set to.
            yield gauge(
                "haproxy_supervisor_old_workers_max",
                "old_workers.max: past it the oldest old workers are sent SIGTERM.",
                value=self.old_workers_max,
            )
        ages = [age for w in workers if (age := w.age_s(now)) is not None]
        yield from self._scalars(
            (gauge, "haproxy_supervisor_old_worker_oldest_age_seconds",
             "Age of the oldest old worker; 0 when there is none.",
             max(ages, default=0.0)),
            (gauge, "haproxy_supervisor_old_worker_connections",
             "Connections held by old workers, summed (unknown counts left out).",
             sum(w.connections or 0 for w in workers)),
            (gauge, "haproxy_supervisor_old_worker_rss_bytes",
             "Resident memory of old workers, summed (unknown sizes left out).",
             sum(w.rss_bytes or 0 for w in workers)),
            (gauge, "haproxy_supervisor_steered_servers",
             "Distinct backend/server pairs that at least one old worker is steered away from.",
             len({key for w in workers for key in w.steered})),
            (gauge, "haproxy_supervisor_pending_removals",
             "Servers removed from the config that a worker still holds in maint (routing nothing): the current "
             "worker, `del server` refused while connections are attached and retried in the background; an old "
             "worker, until it holds no connection to the server.",
             len(state.pending_removals)),
            (gauge, "haproxy_supervisor_dead_servers", "Servers known dead, for any reason (operator included).",
             len(state.dead_servers)),
        )
        suspects = gauge(
            "haproxy_supervisor_suspect_servers",
            "Servers the stalled-connection detector holds unreachable (a connect stalled in SYN-SENT, or data "
            "retransmitted and not acknowledged), by why.", labels=["why"],
        )
        for why in ("connect", "retransmit"):
            suspects.add_metric([why], sum(1 for s in state.suspect_servers.values() if s.why == why))
        yield suspects
        yield from self._scalars(
            (gauge, "haproxy_supervisor_detector_aborting",
             "1 when the stalled-connection detector destroys stalled sockets (detector.abort, with CAP_NET_ADMIN), "
             "else 0.", int(state.detector_aborts)),
            (counter, "haproxy_supervisor_stalled_sockets_aborted",
             "Workers' stalled sockets to suspect servers, and old workers' connects to known-dead ones, destroyed "
             "(SOCK_DESTROY), so HAProxy retries at once.",
             state.stalled_aborted),
            (counter, "haproxy_supervisor_idle_connections_closed",
             "Workers' idle pooled connections to suspect servers destroyed, so no request is sent on one.",
             state.idle_closed),
        )
        yield HistogramMetricFamily(
            "haproxy_supervisor_push_duration_seconds",
            "Time to work out and push the old workers' steer-map entries through the master CLI, per push round.",
            buckets=_histogram_buckets(state.push_duration),
            sum_value=state.push_duration.sum,
        )
        yield from self._scalars(
            (counter, "haproxy_supervisor_push_failures", "Pushes to old workers that failed.", state.push_failures),
            (counter, "haproxy_supervisor_server_state_reads",
             "Full `show servers state` reads of a worker (the current one's evidence, an old one's own view).",
             state.server_state_reads),
            (gauge, "haproxy_supervisor_server_events",
             "1 when HAProxy's server state changes are heard on the master's stderr, else 0 (polled).",
             int(state.server_events)),
            (counter, "haproxy_supervisor_master_restarts", "Times the HAProxy master was restarted after it died.",
             state.master_restarts),
            (counter, "haproxy_supervisor_write_failures",
             "Writes of best-effort files (server state, generations record) that failed; HAProxy ran on without them.",
             state.write_failures),
            (gauge, "haproxy_supervisor_writes_failing",
             "Best-effort files whose last write failed (`writes.failing` in /status).",
             len(state.write_failing)),
            (gauge, "haproxy_supervisor_event_loop_lag_seconds",
             "The worst delay of the daemon's event loop over the last 10 to 20 s: how late any task ran.",
             state.event_loop_lag_s),
        )

    @staticmethod
    def _scalars(*metrics: tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]) -> Iterator[Metric]:
        """One unlabelled sample each: (family, name, help, value)."""
        for family, name, documentation, value in metrics:
            yield family(name, documentation, value=value)

def metrics_registry(
    state: State, clock: Callable[[], datetime] = utcnow, grace_s: float = float("inf"),
    old_workers_max: int | None = None,
) -> CollectorRegistry:
    """A private registry: the State collector plus this process's own process_* metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state, clock, grace_s, old_workers_max))
    ProcessCollector(registry=registry)
    return registry
