"""The bridge's decisions: pure functions of Ray's config and the daemon's /status document."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..haproxy.config import Config


@dataclass(frozen=True)
class Waiting:
    reason: str


@dataclass(frozen=True)
class Running:
    """The daemon's current worker runs the config the bridge handed over."""

    worker_pid: int
    generation: int | None
    rendered_sha256: str


@dataclass(frozen=True)
class Refused:
    """The daemon will not run it (invalid, or HAProxy refused it): HAProxy's own words."""

    message: str


Verdict = Waiting | Running | Refused

# The results after which the daemon goes on serving the last good config and does not try again.
REFUSING_RESULTS = ("invalid", "failed")


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def handover_verdict(doc: dict[str, Any], rendered_sha256: str, written_at: datetime | None) -> Verdict:
    """Does the daemon run the rendered config whose sha256 is given?

    Running: the current worker runs the effective config built from exactly this text
    (worker.rendered_sha256, set by a reload or a runtime apply), the daemon has read nothing
    newer (config.rendered_sha256) and it is converged. Refused: this text is what the daemon
    read last, and its verdict on it - a record after `written_at`, when the bridge wrote it -
    was `invalid` (haproxy -c) or `failed` with the config to blame (convergence.transient
    false): HAProxy keeps serving the last good config, and nothing retries it.
    """
    worker = doc.get("worker") or {}
    config = doc.get("config") or {}
    convergence = doc.get("convergence") or {}
    haproxy = doc.get("haproxy") or {}
    if config.get("rendered_sha256") != rendered_sha256:
        return Waiting("the daemon has not read the config yet")
    runs = worker.get("rendered_sha256") == rendered_sha256 and worker.get("pid")
    if runs and haproxy.get("up") and convergence.get("converged"):
        return Running(int(worker["pid"]), worker.get("generation"), rendered_sha256)
    last = (doc.get("reloads") or {}).get("last") or {}
    refused = convergence.get("transient") is False and last.get("result") in REFUSING_RESULTS
    if refused and not convergence.get("converged"):
        at = _parse_time(last.get("at"))
        # Record times have milliseconds; a write's time is cut to them before comparing.
        cutoff = None if written_at is None else written_at.replace(microsecond=written_at.microsecond // 1000 * 1000)
        if cutoff is None or (at is not None and at >= cutoff):
            return Refused(str(last.get("error") or convergence.get("reason") or "the daemon refused the config"))
    if not haproxy.get("up"):
        return Waiting("the daemon's HAProxy master is not running")
    return Waiting(str(convergence.get("reason") or "the current worker does not run it yet"))


def serving_config(doc: dict[str, Any]) -> Running | Waiting:
    """The config the daemon's current worker runs, whatever it is."""
    worker = doc.get("worker") or {}
    if (doc.get("haproxy") or {}).get("up") and worker.get("pid") and worker.get("rendered_sha256"):
        return Running(int(worker["pid"]), worker.get("generation"), str(worker["rendered_sha256"]))
    return Waiting("the daemon serves no config yet")


def serving_mine(doc: dict[str, Any], rendered_sha256: str) -> list[int]:
    """The old (soft-stopped) workers that still serve this rendered config: while any does, a
    bridge Ray soft-stopped stays alive, as the old HAProxy process Ray thinks it is would."""
    return sorted(
        int(w["pid"]) for w in doc.get("old_workers") or [] if w.get("rendered_sha256") == rendered_sha256
    )


def primary_server_count(config: Config) -> int:
    """Servers that are not `backup` (Ray lists its fallback proxy as every backend's backup)."""
    return sum(1 for server in config.servers() if not server.backup)


def hold_back_reason(replaces: bool, mine: Config, in_place: Config | None) -> str | None:
    """Why Ray's config must not be handed over, or None to hand it over.

    A manager that just started (no `-sf`: it has run no HAProxy yet) first renders a config
    without replicas; the daemon may be serving a config with servers, from before the
    manager's restart. Handing the empty one over would answer 404/503 until the manager
    renders its replicas. A config without servers from a manager that replaces its HAProxy
    (`-sf`) is meant (an app deleted, serve.shutdown) and goes through.
    """
    if replaces or in_place is None:
        return None
    mine_servers = primary_server_count(mine)
    if mine_servers:
        return None
    serving = primary_server_count(in_place)
    if not serving:
        return None
    backends = sum(1 for _ in mine.backends())
    return (
        f"held back a config with no servers ({backends} backends, backup servers only) from a manager "
        f"started without -sf: the daemon keeps the config with {serving} servers it runs, until the "
        "manager renders its replicas"
    )
