"""What Ray Serve runs as its HAProxy (docs/ray-serve.md): it hands Ray's config to the node's daemon,
waits until the current worker runs it, then answers Ray's admin socket as that HAProxy would;
soft-stopped (SIGUSR1), it lives on while an old worker still serves its config."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from yarl import URL

from .binary import BRIDGE_NAME, names_the_bridge, resolve_binary
from .effective import sha256_text
from .eventloop import wait_set
from .files import bind_unix_private, read_regular, write_new
from .haproxy.config import Config
from .haproxy.global_policy import first_stats_socket
from .haproxy.handoff import HANDOFF_SERVER
from .settings import Settings, SettingsError, decode_text, load_settings
from .statusclient import StatusFetchError, fetch_status, status_target, url_from_listen

# HAProxy's default `stats timeout` (Ray's template says 30s too): an idle client is let go.
IDLE_TIMEOUT_S = 30.0
# The longest command line read (tune.bufsize caps HAProxy's own at 16 KiB by default).
MAX_COMMAND_BYTES = 1 << 20
_PID_LINE = re.compile(rb"^Pid: \d+(?=\r?$)", re.M)
_HAND_OFF_SERVER = HANDOFF_SERVER.encode()


def asks_show_info(line: bytes) -> bool:
    """Whether a command line (commands separated by `;`) holds a plain `show info`."""
    return any(command.split()[:2] == [b"show", b"info"] for command in line.split(b";"))


def with_pid(answer: bytes, pid: int) -> bytes:
    """`show info`'s answer with `pid` on its `Pid:` line."""
    return _PID_LINE.sub(b"Pid: %d" % pid, answer)


def without_hand_off_rows(lines: bytes) -> bytes:
    """Whole answer lines without the hand-off's server: Ray counts the servers of `show stat`
    (`<backend>,<server>,...`) and saves `show servers state` (`<id> <backend> <id> <server> ...`)
    as its replicas, and `_hs_current` is the daemon's, not a replica."""
    if _HAND_OFF_SERVER not in lines:
        return lines
    return b"".join(line for line in lines.splitlines(keepends=True) if not _is_hand_off_row(line))


def _is_hand_off_row(line: bytes) -> bool:
    csv = line.split(b",", 2)
    words = line.split(None, 4)
    return (len(csv) > 2 and csv[1] == _HAND_OFF_SERVER) or (len(words) > 4 and words[3] == _HAND_OFF_SERVER)


def socket_mode(words: tuple[str, ...]) -> int:
    """The file mode a `stats socket` line asks for (`mode 666`); else HAProxy's usual 0600."""
    for i, word in enumerate(words[:-1]):
        if word == "mode":
            with contextlib.suppress(ValueError):
                return int(words[i + 1], 8) & 0o777
    return 0o600


def bind_over(path: Path, mode: int) -> socket.socket:
    """A listening unix socket that has replaced whatever was at `path` in one rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    sock = bind_unix_private(tmp, mode)
    try:
        sock.listen(64)
        sock.setblocking(False)
        os.replace(tmp, path)
    except BaseException:
        sock.close()
        tmp.unlink(missing_ok=True)
        raise
    return sock


class AdminRelay:
    """Answers on Ray's admin socket: `show info` with `pid`, the rest relayed to `worker_socket`."""

    def __init__(self, worker_socket: Path, pid: int) -> None:
        self.worker_socket = worker_socket
        self.pid = pid
        self._server: asyncio.AbstractServer | None = None
        self._worker_down = False  # said once, until it answers again

    async def start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_unix_server(self._client, sock=sock, limit=MAX_COMMAND_BYTES)

    def close(self) -> None:
        """Stop listening; the path is left alone (a newer bridge's socket may be there)."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Nothing read until the worker is reached: with HAProxy down, the command left unread
        # makes the close a reset, which Ray's health check takes for a dead HAProxy's socket.
        writer.transport.pause_reading()
        worker = await self._open_worker()
        if worker is None:
            writer.transport.abort()
            return
        writer.transport.resume_reading()
        try:
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                line = await reader.readline()
            if line.strip():
                await self._relay(line if line.endswith(b"\n") else line + b"\n", worker, writer)
        except (TimeoutError, OSError, ValueError) as exc:
            log.debug("admin socket client: %s", exc)
        finally:
            for stream in (worker[1], writer):
                stream.close()
                with contextlib.suppress(OSError):
                    await stream.wait_closed()

    async def _open_worker(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            async with asyncio.timeout(5):
                opened = await asyncio.open_unix_connection(str(self.worker_socket))
        except (OSError, TimeoutError) as exc:
            if not self._worker_down:
                log.warning("the daemon's worker does not answer on %s: %s", self.worker_socket, exc)
            self._worker_down = True
            return None
        if self._worker_down:
            log.info("the daemon's worker answers on %s again", self.worker_socket)
        self._worker_down = False
        return opened

    async def _relay(
        self, line: bytes, worker: tuple[asyncio.StreamReader, asyncio.StreamWriter], client: asyncio.StreamWriter
    ) -> None:
        reader, writer = worker
        writer.write(line)
        await writer.drain()
        edit = (lambda lines: with_pid(lines, self.pid)) if asks_show_info(line) else without_hand_off_rows
        unfinished = b""  # a line cut by the chunk's end: edited once whole
        while True:  # `show stat` of a big config: passed on as it comes
            async with asyncio.timeout(IDLE_TIMEOUT_S):
                chunk = await reader.read(1 << 16)
            data = unfinished + chunk
            whole = data.rfind(b"\n") + 1 if chunk else len(data)
            unfinished = data[whole:]
            client.write(edit(data[:whole]))
            await client.drain()
            if not chunk:
                return


class UsageError(ValueError):
    """A command line HAProxy would refuse, or one the bridge cannot stand in for. One line."""


@dataclass(frozen=True)
class Run:
    """Start (or, with `-sf`, replace) the HAProxy that runs `config`."""

    config: Path
    soft_stop: tuple[int, ...] = ()  # -sf: the processes this one replaces (Ray signals them itself)
    hard_stop: tuple[int, ...] = ()  # -st

    @property
    def replaces(self) -> bool:
        """Ray reloads (a manager that has run HAProxy before), as opposed to a first start."""
        return bool(self.soft_stop or self.hard_stop)


@dataclass(frozen=True)
class PassThrough:
    """A query that starts nothing (version, check, usage): the real binary answers it."""

    args: tuple[str, ...]


# Flags that only ask something, answered by the real binary as they are.
QUERIES = frozenset({"-v", "-vv", "-c", "-h", "--help", "-cc"})
# Flags without an argument that only shape how a process that does not exist would run.
IGNORED = frozenset({"-db", "-dR", "-dr", "-q", "-V", "-W", "-Ws", "-dV", "-dW", "-dM", "-de", "-dp", "-dS", "-dG"})
# Flags with one argument, ignored with it (`-x`: where HAProxy would fetch the listening sockets).
IGNORED_WITH_ARGUMENT = frozenset({"-p", "-S", "-L", "-N", "-m", "-C", "-x"})


def parse_argv(args: list[str]) -> Run | PassThrough:
    """Ray's argument forms (and HAProxy's other read-only ones); UsageError for anything else."""
    if not args or any(a in QUERIES for a in args):
        return PassThrough(tuple(args))
    configs: list[Path] = []
    soft: list[int] = []
    hard: list[int] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-sf", "-st"):
            pids = soft if arg == "-sf" else hard
            i += 1
            while i < len(args) and args[i].isascii() and args[i].isdigit():
                pids.append(int(args[i]))
                i += 1
            continue
        if arg == "-f" or arg in IGNORED_WITH_ARGUMENT:
            if i + 1 >= len(args):
                raise UsageError(f"option {arg} needs an argument")
            if arg == "-f":
                configs.append(Path(args[i + 1]))
            i += 2
            continue
        if arg == "-D":
            raise UsageError("-D (daemon mode) is not for the bridge: the node's haproxy-supervisor runs HAProxy")
        if arg in IGNORED:
            i += 1
            continue
        raise UsageError(f"unknown option {arg!r}")
    if len(configs) != 1:
        raise UsageError(f"the bridge runs exactly one config (-f FILE), got {len(configs)}")
    return Run(configs[0], tuple(soft), tuple(hard))


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
    """Running: the current worker runs this text, the daemon has read nothing newer, converged.
    Refused: it is what the daemon read last, and a record after `written_at` says `invalid` or
    `failed` with the config to blame (convergence.transient false): nothing retries it."""
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
    """Why Ray's config must not be handed over, or None to hand it over: a manager that just
    started (no `-sf`) first renders no replicas, and handing that over would answer 404/503
    where the daemon serves servers from before the restart. With `-sf` an empty config is meant."""
    if replaces or in_place is None or primary_server_count(mine):
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


SETTINGS_ENV = "HAPROXY_SUPERVISOR_SETTINGS"
DEFAULT_SETTINGS = Path("/etc/haproxy-supervisor/config.yaml")
# Ray gives HAProxy RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S (30 s) to answer, then SIGKILLs it;
# a bridge Ray forgot about gives up by itself after this long.
STARTUP_LIMIT_S = 120.0
POLL_S = 0.1
SOFT_STOP_POLL_S = 1.0
# An old worker's exit must be seen on two answers this far apart: the daemon lists old
# workers on its own polls, so one answer right after a reload may not show the newest yet.
QUIET_FOR_S = 1.0
# The config handed to the daemon: the daemon's user reads it (it is no secret to it).
CONFIG_MODE = 0o644

log = logging.getLogger(BRIDGE_NAME)


class BridgeError(Exception):
    """Why the bridge cannot stand in for HAProxy. One line."""


def exec_real_binary(settings: Settings, args: tuple[str, ...]) -> None:
    """A query that starts nothing (`-v`, `-vv`, `-c` ...): become the daemon's HAProxy binary,
    so that its answer and exit code are HAProxy's."""
    binary = resolve_binary(settings.haproxy.binary)
    if names_the_bridge(binary):
        raise BridgeError(f"haproxy.binary {settings.haproxy.binary!r} resolves to the bridge itself ({binary})")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(binary, [binary, *args])
    except OSError as exc:
        raise BridgeError(f"cannot run {binary}: {exc.strerror or exc}") from None


# HAProxy's time units, in milliseconds: its default unit.
TIME_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def hard_stop_after_s(config: Config) -> float | None:
    """The config's `hard-stop-after`, in seconds: no old worker outlives it."""
    line = config.global_setting("hard-stop-after")
    words = line.words if line is not None else ()
    found = re.fullmatch(r"([0-9]+)(ms|s|m|h|d)?", words[1]) if len(words) > 1 else None
    return None if found is None else int(found[1]) * TIME_UNITS_MS[found[2] or "ms"] / 1000


class Bridge:
    def __init__(self, settings: Settings, run: Run, stop: asyncio.Event, soft_stop: asyncio.Event) -> None:
        self.settings = settings
        self.run = run
        self.url = url_from_listen(settings.status.listen)
        self.stop = stop
        self.soft_stop = soft_stop

    async def status(self) -> dict[str, Any]:
        return await fetch_status(self.url, timeout=2.0)

    def _read_config(self) -> tuple[str, Config]:
        try:
            text = decode_text(read_regular(self.run.config, self.settings.haproxy.max_config_bytes))
        except OSError as exc:
            raise BridgeError(f"cannot read {self.run.config}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise BridgeError(f"{self.run.config}: {exc}") from None
        return text, Config.parse(text)

    def admin_socket(self, config: Config) -> tuple[Path, int]:
        """Where Ray asks which HAProxy runs (the path the daemon's move_stats_socket frees), and its mode."""
        words = first_stats_socket(config)
        if words is None:
            raise BridgeError(f"{self.run.config}: no `stats socket` in global: Ray could not tell which HAProxy runs")
        path = words[2].removeprefix("unix@")
        if not path.startswith("/"):
            raise BridgeError(f"{self.run.config}: `stats socket {words[2]}` is not a unix socket path")
        if Path(path) == self.settings.haproxy.stats_socket:
            raise BridgeError(
                f"{self.run.config}: `stats socket {path}` is where the daemon's workers bind theirs "
                f"(haproxy.runtime_dir {self.settings.haproxy.runtime_dir}): the bridge would answer itself"
            )
        return Path(path), socket_mode(words[3:])

    def _in_place(self) -> Config | None:
        """The config the daemon watches now (what it runs, or is about to)."""
        try:
            text = decode_text(read_regular(self.settings.haproxy.config, self.settings.haproxy.max_config_bytes))
        except (OSError, ValueError):
            return None
        return Config.parse(text)

    def _hand_over(self, text: str) -> datetime | None:
        """Write Ray's config where the daemon watches, in one rename; None when it is there already."""
        target = self.settings.haproxy.config
        data = text.encode()
        with contextlib.suppress(OSError):
            if read_regular(target, self.settings.haproxy.max_config_bytes) == data:
                return None
        written_at = datetime.now(UTC)
        try:
            write_new(target, data, CONFIG_MODE)
        except OSError as exc:
            raise BridgeError(f"cannot write {target} for the daemon: {exc.strerror or exc}") from None
        return written_at

    async def _nobody_listens(self) -> str | None:
        """Why no daemon can be listening on the status address (refused, no socket file), or
        None when something accepts connections: a daemon slow to answer is waited for."""
        _, path = status_target(self.url)
        try:
            if path is not None:
                opened = asyncio.open_unix_connection(path)
            else:
                url = URL(self.url)
                opened = asyncio.open_connection(url.host, url.port)
            async with asyncio.timeout(2.0):
                _, writer = await opened
        except TimeoutError:
            return None
        except OSError as exc:
            return f"cannot connect to {self.url}: {exc.strerror or exc}"
        writer.close()
        return None

    async def _wait_for_the_daemon(self) -> None:
        nobody = await self._nobody_listens()
        if nobody is not None:
            raise BridgeError(
                f"no haproxy-supervisor daemon answers ({nobody}); not starting HAProxy: "
                f"run the daemon with {self.settings.source} (docs/ray-serve.md)"
            )
        deadline = time.monotonic() + STARTUP_LIMIT_S
        while True:
            try:
                doc = await self.status()
                break
            except StatusFetchError as exc:
                if time.monotonic() > deadline:
                    raise BridgeError(f"the haproxy-supervisor daemon does not answer: {exc}") from None
                await asyncio.sleep(POLL_S)
        watched = (doc.get("config") or {}).get("rendered_path")
        if watched != str(self.settings.haproxy.config):
            raise BridgeError(
                f"the daemon at {self.url} watches {watched}, not {self.settings.haproxy.config} "
                f"({self.settings.source}): another daemon's settings?"
            )

    async def _until(self, decide: Callable[[dict[str, Any]], Verdict], deadline: float) -> Verdict:
        """Poll /status until `decide(doc)` is not Waiting; the last Waiting at the deadline."""
        verdict: Verdict = Waiting("no answer from the daemon yet")
        while time.monotonic() < deadline:
            try:
                verdict = decide(await self.status())
            except StatusFetchError as exc:
                verdict = Waiting(f"the daemon does not answer: {exc}")
            if not isinstance(verdict, Waiting):
                return verdict
            await asyncio.sleep(POLL_S)
        return verdict

    async def main(self) -> int:
        if not self.settings.haproxy.move_stats_socket:
            raise BridgeError(
                f"{self.settings.source}: haproxy.move_stats_socket is false: the daemon's worker would bind "
                "Ray's admin socket itself; set it to true (docs/ray-serve.md)"
            )
        text, config = self._read_config()
        admin_path, mode = self.admin_socket(config)
        await self._wait_for_the_daemon()
        deadline = time.monotonic() + STARTUP_LIMIT_S
        reason = hold_back_reason(self.run.replaces, config, self._in_place())
        if reason is not None:
            log.warning("%s", reason)
            verdict = await self._until(serving_config, deadline)
        else:
            sha = sha256_text(text)
            written_at = self._hand_over(text)
            verdict = await self._until(lambda doc: handover_verdict(doc, sha, written_at), deadline)
        if isinstance(verdict, Refused):
            sys.stderr.write(verdict.message.rstrip("\n") + "\n")
            log.error("the daemon refused %s; HAProxy keeps serving the last good config", self.run.config)
            return 1
        if not isinstance(verdict, Running):
            raise BridgeError(f"the daemon did not run {self.run.config} within {STARTUP_LIMIT_S:g}s: {verdict.reason}")
        relay = AdminRelay(self.settings.haproxy.stats_socket, os.getpid())
        await relay.start(bind_over(admin_path, mode))
        log.info(
            "ready: the daemon's worker %d runs %s (generation %s); answering on %s as pid %d",
            verdict.worker_pid, "it" if reason is None else "the config it kept", verdict.generation,
            admin_path, os.getpid(),
        )
        waits = [asyncio.ensure_future(event.wait()) for event in (self.stop, self.soft_stop)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        relay.close()
        for waiting in waits:
            waiting.cancel()
        if not self.soft_stop.is_set():
            return 0
        # A bridge that held its config back stands for the config the daemon kept.
        return await self._drain(verdict.rendered_sha256, hard_stop_after_s(config))

    async def _drain(self, mine: str, hard_stop_after: float | None) -> int:
        """Soft-stopped: live on while an old worker serves this config, as that old HAProxy would."""
        bound = None if hard_stop_after is None else time.monotonic() + hard_stop_after + 5
        quiet_since: float | None = None
        said: list[int] | None = None
        while not self.stop.is_set():
            now = time.monotonic()
            if bound is not None and now > bound:
                log.info("soft-stopped: hard-stop-after has passed; exiting")
                return 0
            try:
                serving = serving_mine(await self.status(), mine)
            except StatusFetchError as exc:
                log.debug("soft-stopped: the daemon does not answer: %s", exc)
                quiet_since = None
            else:
                if serving:
                    quiet_since = None
                    if serving != said:
                        log.info("soft-stopped: old workers %s still serve this config", serving)
                        said = serving
                elif quiet_since is None:
                    quiet_since = now
                elif now - quiet_since >= QUIET_FOR_S:
                    log.info("soft-stopped: no old worker serves this config; exiting")
                    return 0
            await wait_set(self.stop, SOFT_STOP_POLL_S)
        return 0


class Signals:
    """SIGUSR1 (Ray's soft-stop) and SIGTERM/SIGINT (stop), caught for the whole life of the
    process with plain handlers: asyncio's own are removed when its loop closes, and a SIGUSR1
    Ray sends again at that moment (it signals every live old PID after each reload) would
    then kill the bridge instead of letting it exit 0."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[int, asyncio.Event] = {}
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def attach(self) -> tuple[asyncio.Event, asyncio.Event]:
        """(stop, soft_stop) on the running loop, set already for a signal seen before."""
        self._loop = asyncio.get_running_loop()
        stop, soft_stop = asyncio.Event(), asyncio.Event()
        self._events = {signal.SIGUSR1: soft_stop, signal.SIGTERM: stop, signal.SIGINT: stop}
        for sig in self.seen:
            self._events[sig].set()
        return stop, soft_stop

    def _on_signal(self, signum: int, frame: object) -> None:
        self.seen.add(signum)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._events[signum].set)


async def _run(settings: Settings, run: Run, signals: Signals) -> int:
    stop, soft_stop = signals.attach()
    return await Bridge(settings, run, stop, soft_stop).main()


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    signals = Signals()  # first: until then SIGUSR1's default action would kill the bridge
    environ = os.environ if environ is None else environ
    logging.basicConfig(level=logging.INFO, format=f"{BRIDGE_NAME}[{os.getpid()}]: %(message)s", stream=sys.stderr)
    args = sys.argv[1:] if argv is None else argv
    try:
        invocation = parse_argv(args)
        settings = load_settings(Path(environ.get(SETTINGS_ENV) or DEFAULT_SETTINGS), environ)
        if isinstance(invocation, PassThrough):
            exec_real_binary(settings, invocation.args)  # does not return
        assert isinstance(invocation, Run)
        return asyncio.run(_run(settings, invocation, signals))
    except (UsageError, SettingsError, BridgeError) as exc:
        print(f"{BRIDGE_NAME}: {exc}", file=sys.stderr)
        return 1
    finally:
        # Python's finalisation puts SIG_DFL back for signals it handles, and Ray may signal
        # this PID again meanwhile: an exit on its way must stay an exit 0.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
