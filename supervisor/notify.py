"""systemd's notify protocol (sd_notify) without a library: `KEY=VALUE` lines in one datagram to
NOTIFY_SOCKET. Without it every call is a no-op, so the daemon runs the same anywhere."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from .state import State

log = logging.getLogger(__name__)

# Variables that belong to the daemon's own unit; a child (HAProxy) must not see them.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify_address(value: str) -> str | bytes | None:
    """NOTIFY_SOCKET -> a sendto() address. `@name` is Linux's abstract namespace (a leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock and other families are not ours to speak


def watchdog_interval(environ: Mapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC (sd_watchdog_enabled(3)); None when
    none is armed, or WATCHDOG_PID names another process."""
    raw = environ.get("WATCHDOG_USEC", "").strip()
    if not raw.isdigit() or int(raw) == 0:
        return None
    owner = environ.get("WATCHDOG_PID", "").strip()
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(raw) / 1_000_000 / 2


def format_message(**fields: str | int) -> bytes:
    """`READY=1\\nSTATUS=...`; values are flattened to one line each (a newline would start a new field)."""
    return "\n".join(f"{key}=" + str(value).replace("\n", " ") for key, value in fields.items()).encode()


def summary_line(state: State, old_workers: int | None = None) -> str:
    """The one-line STATUS= text: what runs, what was last done, what went wrong."""
    current = state.current
    if not state.master_up:
        head = "haproxy master down" if state.master_pid is None else f"haproxy master {state.master_pid} starting"
    elif current is None or current.worker_pid is None:
        head = f"haproxy master {state.master_pid}, no worker yet"
    else:
        head = f"generation {current.number} worker {current.worker_pid}"
    parts = [head]
    if old_workers is not None:
        parts.append(f"old workers {old_workers}")
    r = state.reloads
    parts.append(f"reloads ok {r.ok} failed {r.failed} invalid {r.invalid}")
    if state.master_restarts:
        parts.append(f"master restarts {state.master_restarts}")
    if r.last is not None and r.last.result in ("failed", "invalid") and r.last.error:
        first = r.last.error.strip().splitlines()[0] if r.last.error.strip() else ""
        parts.append(f"last {r.last.result}: {first[:120]}")
    return "; ".join(parts)


class Notifier:
    """Sends notify messages to systemd; every method is safe to call when not under systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = notify_address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = watchdog_interval(env, os.getpid())
        self._socket: socket.socket | None = None
        self._warned = False
        self.ready_sent = False

    def send(self, **fields: str | int) -> bool:
        if self.address is None:
            return False
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.setblocking(False)
            self._socket.sendto(format_message(**fields), self.address)
            return True
        except OSError as exc:
            # systemd gone or the socket full: never let notify break the daemon, say so once.
            if not self._warned:
                log.warning("sd_notify to %r failed: %s", self.address, exc)
                self._warned = True
            return False

    def ready(self, status: str) -> None:
        if not self.ready_sent:
            log.info("ready: %s", status)
        self.ready_sent = True
        self.send(READY=1, STATUS=status)

    def reloading(self, status: str) -> None:
        # MONOTONIC_USEC lets systemd (>= 253) tell this reload from an earlier one.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(RELOADING=1, MONOTONIC_USEC=usec, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self) -> None:
        self.send(STOPPING=1, STATUS="stopping")

    async def run_watchdog(self, unwell: Callable[[], str | None]) -> None:
        """Ping from the event loop itself, so a blocked loop stops the pings; none while `unwell()`
        names a reason: unrecovered within WatchdogSec, systemd restarts the daemon."""
        if self.watchdog_s is None or self.address is None:
            return
        log.info("systemd watchdog armed: WATCHDOG=1 every %.3fs", self.watchdog_s)
        withheld = False
        while True:
            reason = unwell()
            if reason is None:
                if withheld:
                    log.info("systemd watchdog: WATCHDOG=1 again")
                    withheld = False
                self.send(WATCHDOG=1)
            elif not withheld:
                log.error("systemd watchdog: no WATCHDOG=1 while %s", reason)
                withheld = True
            await asyncio.sleep(self.watchdog_s)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment minus systemd's notify variables, for HAProxy."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV}
