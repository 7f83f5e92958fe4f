"""What /status shows, and whether the daemon is ready: pure functions of State."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from .. import __version__
from ..settings import Settings
from ..state import (
    Convergence,
    Generation,
    OldWorker,
    PendingRemoval,
    ReloadRecord,
    State,
    SuspectServer,
    rfc3339,
    utcnow,
)

RELOAD_RESULTS = ("ok", "failed", "invalid", "skipped_unchanged", "runtime_applied", "unknown")


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
    }


def _oldest_first(workers: Iterable[OldWorker], now: datetime) -> list[OldWorker]:
    return sorted(workers, key=lambda w: (-(w.age_s(now) or 0.0), w.pid))


def status_document(state: State, settings: Settings, now: datetime) -> dict[str, Any]:
    """The /status JSON. Its keys are exactly those documented in docs/status.md."""
    current = state.current
    reloads = state.reloads
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
            _old_worker_json(w, now, state.generations) for w in _oldest_first(state.old_workers.values(), now)
        ],
        "reloads": {
            **{result: getattr(reloads, result) for result in RELOAD_RESULTS},
            "last": reload_json(reloads.last),
            "recent": [reload_json(r) for r in reversed(reloads.history)],
        },
        "config": {
            "rendered_path": state.rendered_path or str(settings.haproxy.config),
            "rendered_sha256": state.rendered_sha256,
            "effective_path": state.effective_path or str(settings.haproxy.effective_config),
            "last_good_sha256": state.last_good_sha256,
        },
        "convergence": _convergence_json(state.convergence, now),
        "observe": {"enabled": settings.observe.enabled, "error_limit": settings.observe.error_limit},
        "dead_servers": sorted(state.dead_servers),
        "operator_dead": sorted(state.operator_dead),
        "pending_removals": [_pending_json(r, now) for _, r in sorted(state.pending_removals.items())],
        "suspect_servers": [_suspect_json(s, now) for _, s in sorted(state.suspect_servers.items())],
        "detector": {
            "enabled": settings.detector.enabled, "abort": settings.detector.abort,
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


def _convergence_json(convergence: Convergence, now: datetime) -> dict[str, Any]:
    return {
        "converged": convergence.converged,
        "unconverged_s": _seconds(convergence.unconverged_s(now)),
        "since": rfc3339(convergence.unconverged_since),
        "reason": convergence.reason,
        "transient": convergence.transient,
        "attempts": convergence.attempts,
        "next_attempt_at": rfc3339(convergence.next_attempt_at),
    }


SOCKET_MISSING = "the HAProxy master's socket is missing from runtime_dir: the daemon is recreating it"


def not_ready_reason(state: State, grace_s: float = float("inf"), now: datetime | None = None) -> str | None:
    """Why /readyz says 503, or None when ready.

    Not converged for longer than `grace_s` (reload.converge_grace_s) is a reason when what stands
    in the way passes (convergence.transient), not when the config itself is the problem (invalid,
    or refused by HAProxy): HAProxy then serves the last good config, and a controller that
    rendered a bad config everywhere would otherwise empty the whole fleet.
    """
    if not state.master_socket_ok:
        return SOCKET_MISSING
    if not state.ready:
        if not state.master_up:
            return "HAProxy master is not running"
        current = state.current
        if current is None or current.worker_pid is None:
            return "no current worker yet"
        return "the current worker does not run the last good config"
    convergence = state.convergence
    waited = convergence.unconverged_s(now or utcnow())
    if convergence.transient and waited > grace_s:
        return f"not converged for {waited:.0f}s (reload.converge_grace_s={grace_s:g}): {convergence.reason}"
    return None
