"""The HAProxy master process: start, adopt, watch, restart with backoff, stop.

One object owns the master the way gunicorn's Arbiter owns its workers. HAProxy
runs in master-worker mode in the foreground (`-W`, no `-D`), as our child in a
session of its own, so a Ctrl-C on the daemon's terminal reaches the daemon only.
Its stdout is the daemon's; its stderr is the daemon's FIFO (haproxy/stderr.py), which
the daemon relays line by line to its own stderr (under systemd: the journal) and reads
server state changes from. The FIFO's write end is non-blocking: after a daemon crash
HAProxy's messages are lost (EPIPE, ignored), HAProxy is never stalled, and the next
daemon opens the FIFO again by its path.

A master that is not our child (adopted after a daemon restart) is watched through
a pidfd, which becomes readable when the process exits; a child is watched the
same way and reaped. No thread, no polling.

HAProxy's signals in master-worker mode (checked on 2.6.12): SIGUSR1 to the master
soft-stops every worker and the master exits once they are all gone; SIGTERM (and
SIGINT) hard-stop them. When the master dies, its workers notice (their pipe to the
master closes) and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import psutil

from .haproxy.api import CLIError, MasterCLI, ProcList, parse_show_info
from .haproxy.config import Config
from .haproxy.server_state import clear_server_state
from .haproxy.stderr import StderrRelay
from .notify import child_environment
from .settings import Settings
from .state import State

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_UPTIME_S = 10.0
HARD_STOP_WAIT_S = 5.0
POLL_S = 0.05


class MasterError(Exception):
    """The master could not be started or adopted. One line."""


class MasterSocketGone(MasterError):
    """Our master lives, but its socket file was removed (runtime_dir deleted while no daemon
    ran): reachable again only once it re-executes (MasterProcess.take_back)."""

    def __init__(self, pid: int, path: Path) -> None:
        super().__init__(f"haproxy master pid={pid} still holds {path}, which was removed: "
                         "refusing to start a second HAProxy")
        self.pid = pid


# The master CLI can change what every worker routes: its owner and group only, whatever the
# umask (HAProxy creates the socket; `-S path,mode,660` is a bind option of its own).
MASTER_SOCKET_MODE = "660"
# What HAProxy creates without an explicit mode of its own is never world-accessible.
CHILD_UMASK = 0o027


def master_command(settings: Settings) -> list[str]:
    h = settings.haproxy
    return [
        h.binary, "-W", "-S", f"{h.master_socket_path},mode,{MASTER_SOCKET_MODE}",
        "-f", str(h.effective_config), "-p", str(h.pid_file),
    ]


def next_backoff(previous: float | None, uptime_s: float | None) -> float:
    """At once after a master that ran for HEALTHY_UPTIME_S (its death is news, not a crash
    loop: a kill -9 of the current worker takes the master down with it, and every second
    waited is a second without a listener); then 1 s, 2 s, 4 s ... up to 30 s."""
    if previous is None or (uptime_s is not None and uptime_s >= HEALTHY_UPTIME_S):
        return 0.0
    return min(max(previous * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)


def _arg_after(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def is_our_master(cmdline: Sequence[str], settings: Settings) -> bool:
    """Is this argv a master-worker HAProxy started for our runtime_dir?

    Only for telling our workers apart from other processes (`is_our_master_worker`): a
    master itself is recognised by the socket it holds (`find_master`), since from 3.2 on
    its own argv after a reload reads `haproxy -sf <old> -x sockpair@4 -W ...`, like a worker's.
    """
    if len(cmdline) < 2 or "haproxy" not in Path(cmdline[0]).name or "-W" not in cmdline:
        return False
    socket_arg = _arg_after(cmdline, "-S")
    config_arg = _arg_after(cmdline, "-f")
    # `-S <path>[,<bind options>]`
    return (
        socket_arg is not None
        and socket_arg.split(",", 1)[0] == str(settings.haproxy.master_socket_path)
        and config_arg == str(settings.haproxy.effective_config)
    )


# ---------------------------------------------------------------- finding our master by process facts

# /proc/net/unix: `Num RefCount Protocol Flags Type St Inode Path`; Flags 00010000 = listening.
_UNIX_LISTENING = 0x10000


def _listening_unix_sockets(net_unix: str) -> list[tuple[int, str]]:
    """(inode, bound path) of every listening unix socket in a /proc/net/unix text."""
    sockets: list[tuple[int, str]] = []
    for line in net_unix.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) == 8 and int(fields[3], 16) & _UNIX_LISTENING and fields[6].isdigit():
            sockets.append((int(fields[6]), fields[7]))
    return sockets


def master_socket_candidates(net_unix: str, socket_path: Path) -> list[tuple[int, int | None]]:
    """(socket inode, PID named by the bound name or None) of the listeners bound at `socket_path`.

    HAProxy binds a unix socket as `<path>.<pid>.tmp` and renames it into place, so the kernel
    keeps that name, with the PID of the master that bound it: a master keeps its PID when it
    re-executes on reload, and the name stays when the file is removed since.
    """
    path = str(socket_path)
    found: list[tuple[int, int | None]] = []
    for inode, name in _listening_unix_sockets(net_unix):
        if name == path:
            found.append((inode, None))
        elif name.startswith(path + ".") and name.endswith(".tmp"):
            pid = name[len(path) + 1 : -len(".tmp")]
            if pid.isdigit():
                found.append((inode, int(pid)))
    return found


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (its /proc/<pid>/fd links `socket:[N]`)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError), os.scandir(f"/proc/{pid}/fd") as fds:
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def find_masters(settings: Settings) -> list[int]:
    """PIDs of the live HAProxy masters serving this runtime_dir's master socket, oldest first.

    Found by process facts, never by argv or the pid file: a master is a live process that holds
    the listening unix socket bound at `haproxy.master_socket_path`, including when that file
    was removed since (a recreated runtime_dir). Usually one; more than one means a second
    master was started beside the first. Reads /proc only (no HAProxy CLI), so it also works
    when the socket no longer answers. A worker never holds the master socket.
    """
    try:
        net_unix = Path("/proc/net/unix").read_text()
    except OSError:
        return []
    pids: set[int] = set()
    for inode, named in master_socket_candidates(net_unix, settings.haproxy.master_socket_path):
        if named is not None and inode in _socket_inodes(named):
            holders = [named]
        else:  # not bound under a `.<pid>.tmp` name, or that PID was reused: look at every process
            holders = [pid for pid in psutil.pids() if inode in _socket_inodes(pid)]
        pids.update(pid for pid in holders if _alive(pid))

    def started(pid: int) -> float:
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return float("inf")

    return sorted(pids, key=lambda pid: (started(pid), pid))


def find_master(settings: Settings) -> int | None:
    """The PID of the live HAProxy master of this runtime_dir (the oldest if several), or None.

    Call it before starting a master: while it returns a PID, starting another one would bind
    the same ports twice. See `find_masters`.
    """
    masters = find_masters(settings)
    if len(masters) > 1:
        log.warning("several haproxy masters hold %s: pids=%s; the oldest is ours",
                    settings.haproxy.master_socket_path, masters)
    return masters[0] if masters else None


# ---------------------------------------------------------------- worker readiness


def bind_ports(config: Config) -> set[int]:
    """The TCP ports the config's `bind` lines listen on (literal ports; ranges, unix and the
    like are left out: they cannot be checked this simply)."""
    ports: set[int] = set()
    for section in config.sections:
        if section.kind not in ("frontend", "listen"):
            continue
        for line in section.body:
            words = line.words
            if len(words) < 2 or words[0] != "bind" or "quic" in words[1]:
                continue
            for address in words[1].split(","):
                family, at, rest = address.rpartition("@")
                if at and family not in ("ipv4", "ipv6", "tcp", "tcp4", "tcp6"):
                    continue
                port = rest.rpartition(":")[2]
                if port.isdigit():
                    ports.add(int(port))
    return ports


# sock_diag (netlink): the kernel lists only the listening TCP sockets, however many
# connections the node holds; /proc/net/tcp would have to be read whole, with every connection.
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _TCP_LISTEN = 4, 20, 10
_NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 0x1, 0x300, 2, 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, seq, pid
_DIAG_PORT_AT, _DIAG_INODE_AT = 4, 68  # in struct inet_diag_msg: idiag_sport (big endian), idiag_inode


def _listening_tcp_sockets() -> dict[int, int]:
    """{socket inode: port} of every listening TCP socket (IPv4 and IPv6) of this network namespace."""
    found: dict[int, int] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        # struct inet_diag_req_v2: family, protocol, ext, pad, states, then a zeroed inet_diag_sockid.
        request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + bytes(48)
        header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY,
                                    _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(1)
            sock.send(header + request)
            done = False
            while not done:
                data = sock.recv(1 << 16)
                offset = 0
                while offset + _NLMSG_HEADER.size <= len(data):
                    length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
                    if kind == _NLMSG_DONE or length < _NLMSG_HEADER.size:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        raise OSError("sock_diag answered an error")
                    body = offset + _NLMSG_HEADER.size
                    (port,) = struct.unpack_from(">H", data, body + _DIAG_PORT_AT)
                    (inode,) = struct.unpack_from("=I", data, body + _DIAG_INODE_AT)
                    found[inode] = port
                    offset += (length + 3) & ~3
    return found


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports process `pid` holds a listening socket on; None when the kernel cannot say."""
    try:
        listening = _listening_tcp_sockets()
    except OSError as exc:
        log.debug("sock_diag unavailable (%s): listeners not checked", exc)
        return None
    return {listening[inode] for inode in _socket_inodes(pid) if inode in listening}


async def worker_ready(cli: MasterCLI, pid: int, ports: set[int]) -> bool:
    """Does the worker answer `@!<pid>` on the master CLI, and listen on every port in `ports`?

    Being listed by `show proc` is not enough: from 3.1 on the master lists a new worker before
    that worker has loaded its config, bound its ports or can be reached through the master.
    The listening sockets come from the kernel (sock_diag), matched to the worker's own fds;
    a fresh worker holds few, so this stays cheap on a node with many connections.
    """
    try:
        info = parse_show_info(await cli.on(pid, "show info", timeout=2))
    except CLIError:
        return False
    if info.get("Pid") != str(pid):
        return False  # `Can't find the target PID matching the prefix`: not reachable yet
    if not ports:
        return True
    held = listening_ports(pid)
    return held is None or ports <= held


def process_started_at(pid: int) -> datetime | None:
    """When a process started (wall clock), or None if it is gone or hidden."""
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), UTC)
    except psutil.Error:
        return None


def read_pid_file(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown: not our child"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class MasterProcess:
    """Start or adopt the master, notice its death, restart it with backoff, stop it gracefully."""

    def __init__(
        self,
        settings: Settings,
        state: State,
        cli: MasterCLI,
        on_started: Callable[[ProcList], Awaitable[None]] | None = None,
        stderr: StderrRelay | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.cli = cli
        self.on_started = on_started
        self.stderr = stderr  # None: the master shares the daemon's stderr
        # Held by whoever changes what HAProxy runs: (re)start, stop, and each reload.
        self.lock = asyncio.Lock()
        self.pid: int | None = None
        self.adopted = False
        self._child: subprocess.Popen[bytes] | None = None
        self._exit: asyncio.Future[None] | None = None
        self._wanted = asyncio.Event()
        self._up = asyncio.Event()
        self._up_since = 0.0
        self.stopping = False

    # ------------------------------------------------------------ facts

    @property
    def wanted(self) -> bool:
        """A master was started or adopted and should be kept running."""
        return self._wanted.is_set()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    @property
    def alive(self) -> bool:
        return self.pid is not None and self._exit is not None and not self._exit.done()

    async def wait_up(self) -> None:
        await self._up.wait()

    def request_start(self) -> None:
        """Ask run() to start the master (the effective config is on disk)."""
        self._wanted.set()

    def _config_ports(self) -> set[int]:
        """The ports the effective config on disk binds: what a ready worker listens on."""
        try:
            return bind_ports(Config.parse(self.settings.haproxy.effective_config.read_text()))
        except (OSError, UnicodeDecodeError):
            return set()

    async def _ready_worker(self, master_pid: int, ports: set[int]) -> tuple[ProcList | None, str]:
        """`show proc` when it lists `master_pid` with a current worker that is ready, else why not."""
        try:
            procs = await self.cli.show_proc()
        except CLIError as exc:
            return None, str(exc)
        worker = procs.current_worker
        if procs.master is None or procs.master.pid != master_pid or worker is None:
            return None, f"show proc lists master {procs.master.pid if procs.master else None}, no current worker"
        if not await worker_ready(self.cli, worker.pid, ports):
            return None, f"worker {worker.pid} is listed but does not answer or listen yet"
        return procs, ""

    # ------------------------------------------------------------ exit watching

    def _watch_exit(self, pid: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._exit = done
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            done.set_result(None)
            return

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, exited)

    def _stderr_end(self) -> int | None:
        """The write end of the FIFO for a master about to start, or None: it inherits ours."""
        if self.stderr is None:
            return None
        try:
            return self.stderr.write_end()
        except OSError as exc:
            log.warning("%s: cannot open (%s): haproxy writes to our stderr, server states are polled",
                        self.stderr.path, exc.strerror or exc)
            return None

    def _reap(self) -> str:
        if self._child is None:
            return describe_exit(None)
        try:
            code = self._child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return describe_exit(code)

    async def _wait_exit(self, timeout: float | None) -> bool:
        if self._exit is None:
            return True
        done, _ = await asyncio.wait({self._exit}, timeout=timeout)
        return bool(done)

    def _mark_up(self, pid: int) -> None:
        self.pid = pid
        self.state.master_pid = pid
        self.state.master_up = True
        self.state.server_events = self.stderr is not None and self.stderr.feeds(pid)
        self._up_since = time.monotonic()
        self._up.set()

    def _mark_down(self) -> None:
        self.state.master_up = False
        self.state.master_pid = None
        self.state.server_events = False
        self._up.clear()
        self.pid = None
        self._child = None

    # ------------------------------------------------------------ start / adopt

    async def start(self) -> ProcList:
        """Start a master on the effective config on disk; return once its first worker is ready."""
        cmd = master_command(self.settings)
        ports = self._config_ports()
        # A fresh master has no worker to hand states over from: a previous run's file would
        # put servers in states nobody asked for.
        clear_server_state(self.settings.haproxy.server_state_file)
        log.info("starting haproxy master: %s", shlex.join(cmd))
        stderr = self._stderr_end()
        try:
            child = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=child_environment(),
                umask=CHILD_UMASK,
            )
        except OSError as exc:
            raise MasterError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
        finally:
            if stderr is not None:
                os.close(stderr)
        self._child = child
        self.adopted = False
        self._watch_exit(child.pid)
        assert self._exit is not None
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while True:
            if self._exit.done():
                how = self._reap()
                self._child = None
                raise MasterError(f"haproxy master pid={child.pid} exited while starting ({how}); see its messages")
            ready, why = await self._ready_worker(child.pid, ports)
            if ready is not None:
                procs = ready
                break
            if time.monotonic() > deadline:
                self._kill_group(child.pid)
                raise MasterError(
                    f"haproxy master pid={child.pid} has no ready worker within {self.settings.reload.timeout_s}s "
                    f"({why}): killed"
                )
            await self._wait_exit(POLL_S)
        self._mark_up(child.pid)
        worker = procs.current_worker
        log.info("master started pid=%d worker=%d", child.pid, worker.pid if worker else 0)
        return procs

    async def adopt(self) -> ProcList | None:
        """Take over a master a previous daemon started for this runtime_dir, or None if there is none.

        The master is found by the socket it holds (`find_master`), not by its argv nor only by
        the pid file. Raises MasterError when our master is alive but its socket does not answer:
        starting a second HAProxy next to it would bind the same ports twice.
        """
        h = self.settings.haproxy
        pid = find_master(self.settings)
        recorded = read_pid_file(h.pid_file)
        if recorded is not None and recorded != pid:
            log.info("pid file %s names pid=%d, which is not our haproxy master: stale, ignored", h.pid_file, recorded)
        if pid is None:
            return None
        if not h.master_socket_path.exists():
            raise MasterSocketGone(pid, h.master_socket_path)
        ports = self._config_ports()
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while True:
            procs, why = await self._ready_worker(pid, ports)
            if procs is not None:
                break
            if not _alive(pid):
                log.info("haproxy master pid=%d went away during adoption", pid)
                return None
            if time.monotonic() > deadline:
                raise MasterError(
                    f"haproxy master pid={pid} is alive but {h.master_socket_path} shows no ready worker "
                    f"({why}): refusing to start a second HAProxy"
                )
            await asyncio.sleep(0.1)
        self._child = None
        self.adopted = True
        self._watch_exit(pid)
        self._mark_up(pid)
        self._wanted.set()
        worker = procs.current_worker
        log.info(
            "master adopted pid=%d worker=%d old_workers=%d server_events=%s",
            pid, worker.pid if worker else 0, len(procs.old_workers),
            "heard" if self.state.server_events else "polled (its stderr is not our FIFO)",
        )
        return procs

    async def reexec(self, before: ProcList | None) -> ProcList | None:
        """Make our master re-execute itself, with master.lock held: it reads its config from disk
        again, binds its socket again and starts a new worker. The one road to a master whose
        socket file was deleted. Returns `show proc` once the new worker is listed, else None."""
        if self.pid is None or not self.alive:
            return None
        known = {p.pid for p in (*before.workers, *before.old_workers)} if before is not None else set()
        return await self._reexec(self.pid, known)

    async def take_back(self, pid: int) -> ProcList | None:
        """Adopt master `pid`, whose socket file was removed while no daemon ran (MasterSocketGone),
        once the effective config it is to load is on disk: it re-executes, binds its socket
        again, and is adopted like any other."""
        try:
            known = {child.pid for child in psutil.Process(pid).children()}
        except psutil.Error:
            known = set()
        if await self._reexec(pid, known) is None:
            raise MasterError(
                f"haproxy master pid={pid} holds {self.settings.haproxy.master_socket_path}, which was removed, "
                "and did not bind it again on SIGUSR2: refusing to start a second HAProxy"
            )
        return await self.adopt()

    async def _reexec(self, pid: int, known: set[int]) -> ProcList | None:
        if pid not in find_masters(self.settings):
            return None
        log.warning("master pid=%d: SIGUSR2, to read its config and bind %s again",
                    pid, self.settings.haproxy.master_socket_path)
        self._signal(pid, signal.SIGUSR2)
        deadline = time.monotonic() + self.settings.reload.timeout_s
        while time.monotonic() < deadline and _alive(pid):
            with contextlib.suppress(CLIError):
                procs = await self.cli.show_proc()
                worker = procs.current_worker
                listed = procs.master is not None and procs.master.pid == pid
                if listed and worker is not None and worker.pid not in known:
                    return procs
            await asyncio.sleep(POLL_S)
        log.error("master pid=%d listed no new worker within %gs of SIGUSR2", pid, self.settings.reload.timeout_s)
        return None

    # ------------------------------------------------------------ supervision

    async def run(self) -> None:
        """Keep the master running once it is wanted: restart it with backoff when it dies."""
        await self._wanted.wait()
        delay: float | None = None
        while not self.stopping:
            if self.pid is None:
                procs: ProcList | None = None
                async with self.lock:
                    if self.stopping:
                        return
                    try:
                        procs = await self.start()
                    except MasterError as exc:
                        log.error("master start failed: %s", exc)
                    # Still under the lock: no reload may run before the new worker is recorded.
                    if procs is not None and self.on_started is not None:
                        await self.on_started(procs)
                if procs is None:
                    delay = next_backoff(delay, None)
                    await self._backoff(delay)
                    continue
            await self._wait_exit(None)
            if self.stopping:
                return
            ran_for = time.monotonic() - self._up_since
            how = self._reap()
            log.error("master exited pid=%d (%s) after %.1fs; its workers exit with it", self.pid, how, ran_for)
            self._mark_down()
            delay = next_backoff(delay, ran_for)
            await self._backoff(delay)

    async def _backoff(self, delay: float) -> None:
        self.state.master_restarts += 1
        log.warning("master restart in %gs restarts=%d", delay, self.state.master_restarts)
        await asyncio.sleep(delay)

    # ------------------------------------------------------------ stop

    async def stop(self) -> None:
        """Soft-stop (SIGUSR1), wait haproxy.stop_timeout_s, then SIGTERM, then SIGKILL."""
        self.stopping = True
        async with self.lock:
            if not self.alive or self.pid is None:
                log.info("stop: no haproxy master running")
                return
            pid = self.pid
            try:
                procs = await self.cli.show_proc()
                workers = [p.pid for p in (*procs.workers, *procs.old_workers)]
            except CLIError:
                workers = []
            timeout = self.settings.haproxy.stop_timeout_s
            log.info("master stopping pid=%d: soft-stop (SIGUSR1), waiting up to %gs", pid, timeout)
            self._signal(pid, signal.SIGUSR1)
            if not await self._wait_exit(timeout):
                log.warning("master pid=%d still running after %gs: hard-stop (SIGTERM)", pid, timeout)
                self._signal(pid, signal.SIGTERM)
                if not await self._wait_exit(HARD_STOP_WAIT_S):
                    log.warning("master pid=%d ignored SIGTERM for %gs: SIGKILL", pid, HARD_STOP_WAIT_S)
                    self._signal(pid, signal.SIGKILL)
                    await self._wait_exit(HARD_STOP_WAIT_S)
            how = self._reap()
            for worker in workers:
                # Workers leave when their master dies; make sure of it for the ones we knew.
                if psutil.pid_exists(worker):
                    with contextlib.suppress(psutil.Error):
                        proc = psutil.Process(worker)
                        if is_our_master_worker(proc.cmdline(), self.settings):
                            log.warning("worker pid=%d outlived its master: SIGKILL", worker)
                            proc.kill()
            self._mark_down()
            self.settings.haproxy.pid_file.unlink(missing_ok=True)
            log.info("master stopped pid=%d (%s)", pid, how)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _kill_group(self, pid: int) -> None:
        # A master we just started leads its own session: kill it and its workers together.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def is_our_master_worker(cmdline: Sequence[str], settings: Settings) -> bool:
    """A worker's argv repeats the master's, with `-sf <pids...>` and `-x <socket>` after a reload."""
    kept: list[str] = []
    i = 0
    while i < len(cmdline):
        arg = cmdline[i]
        if arg in ("-sf", "-st"):
            i += 1
            while i < len(cmdline) and cmdline[i].isdigit():
                i += 1
            continue
        if arg == "-x":
            i += 2
            continue
        kept.append(arg)
        i += 1
    return is_our_master(kept, settings)
