"""Settings: a YAML file plus environment gates, validated into frozen dataclasses (each key:
config.example.yaml). Every problem is one SettingsError line naming the file and the key."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .files import DEFAULT_MAX_READ_BYTES, mode_bits, owner_ids, read_regular


class SettingsError(Exception):
    """Bad settings. The message is one line and names what is wrong."""


class _InRuntimeDir:
    """A file of the daemon's in `haproxy.runtime_dir`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, settings: HAProxySettings, owner: type | None = None) -> Path:
        return settings.runtime_dir / self.name


@dataclass(frozen=True)
class HAProxySettings:
    binary: str = "haproxy"
    config: Path = Path("/etc/haproxy/rendered/haproxy.cfg")
    watch: tuple[Path, ...] = ()
    runtime_dir: Path = Path("/run/haproxy-supervisor")
    master_socket: Path | None = None
    stop_timeout_s: float = 30
    max_config_bytes: int = DEFAULT_MAX_READ_BYTES
    move_stats_socket: bool = False

    @property
    def master_socket_path(self) -> Path:
        return self.master_socket or self.runtime_dir / "master.sock"

    effective_config = _InRuntimeDir("haproxy.cfg")
    stats_socket = _InRuntimeDir("stats.sock")  # where the workers' `stats socket` is with move_stats_socket
    pid_file = _InRuntimeDir("haproxy.pid")
    steer_map = _InRuntimeDir("steer.map")
    server_state_file = _InRuntimeDir("server-state")
    stderr_fifo = _InRuntimeDir("haproxy.stderr")  # the master's stderr, relayed to ours (haproxy/stderr.py)


@dataclass(frozen=True)
class ReloadSettings:
    debounce_ms: int = 200
    max_delay_ms: int = 1000
    min_interval_ms: int = 1000
    timeout_s: float = 30
    runtime_apply: bool = True
    remove_wait_s: float = 10
    remove_in_background: bool = True
    transient_hold_ms: int = 0  # for any writer but Ray Serve, such a render is what was meant
    preserve_server_state: bool = True
    retry_max_s: float = 30
    converge_grace_s: float = 60


@dataclass(frozen=True)
class OldWorkerSettings:
    max: int = 50
    poll_interval_ms: int = 250
    guard: bool = True
    no_backup: Literal["fail-fast", "keep"] = "fail-fast"
    shutdown_stuck_sessions: bool = False
    state_read_interval_s: float = 300
    hand_off: bool = False


@dataclass(frozen=True)
class DetectorSettings:
    enabled: bool = True
    poll_interval_ms: int = 100
    threshold_floor_ms: int = 200
    abort: bool = True
    hold_s: float = 5


@dataclass(frozen=True)
class ObserveSettings:
    enabled: bool = False
    error_limit: int = 3


@dataclass(frozen=True)
class StatusSettings:
    listen: str = "127.0.0.1:9180"
    token_file: Path | None = None
    header_timeout_s: float = 10
    body_timeout_s: float = 10
    max_connections: int = 100
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoggingSettings:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


@dataclass(frozen=True)
class ControllerSettings:
    runtime_socket: Path | None = None
    master_socket: Path | None = None
    idle_timeout_s: float = 10
    queue_timeout_s: float = 20  # answered before the controller's own 30 s wait ends
    socket_owner: str | None = None
    socket_mode: str = "0660"


@dataclass(frozen=True)
class Settings:
    haproxy: HAProxySettings = field(default_factory=HAProxySettings)
    reload: ReloadSettings = field(default_factory=ReloadSettings)
    old_workers: OldWorkerSettings = field(default_factory=OldWorkerSettings)
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    detector: DetectorSettings = field(default_factory=DetectorSettings)
    status: StatusSettings = field(default_factory=StatusSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    source: Path | None = None  # the settings file these came from


def listen_address(listen: str) -> tuple[str, int] | str:
    """("host", port) for TCP, or the socket path for `unix:/path`; ValueError saying what is wrong."""
    if listen.startswith("unix:"):
        if len(listen) <= len("unix:"):
            raise ValueError("unix: needs a path")
        return listen[len("unix:") :]
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not _is_decimal(port) or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port or unix:/path, got {listen!r}")
    return host.strip("[]"), int(port)


# Numbers must be > 0 (a zero or negative value is a mistake, not "off"), but these may be zero.
_ZERO_ALLOWED = {
    "detector.hold_s",
    "reload.min_interval_ms",
    "reload.transient_hold_ms",
    "reload.converge_grace_s",
    "reload.remove_wait_s",
}
# Strings read by a function that says what is wrong with a bad one.
_STRING_CHECKS = {
    "controller.socket_mode": mode_bits, "controller.socket_owner": owner_ids, "status.listen": listen_address,
}
# Paths that end up in HAProxy's `-S <path>,<bind options>`.
_SOCKET_DIRS = {"haproxy.runtime_dir", "haproxy.master_socket"}
# Upper bounds: a value above these is a typo, and past them timers overflow or never fire.
# Durations stop at a day; counts at a million.
_MAXIMUM = {"haproxy.max_config_bytes": 1 << 34}
DAY_S = 86_400


def _maximum(key: str) -> int:
    if key in _MAXIMUM:
        return _MAXIMUM[key]
    if key.endswith("_ms"):
        return DAY_S * 1000
    if key.endswith("_s"):
        return DAY_S
    return 1_000_000


# The settings file is a few hundred bytes; anything this big is not one.
MAX_SETTINGS_BYTES = 1024 * 1024

OBSERVE_GATE_ENV = ("RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED", "HAPROXY_SUPERVISOR_OBSERVE_MARK_DOWN_ENABLED")
OBSERVE_LIMIT_ENV = ("RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT", "HAPROXY_SUPERVISOR_OBSERVE_ERROR_LIMIT")

_BOOLEANS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def parse_bool(text: str) -> bool | None:
    return _BOOLEANS.get(text.strip().lower())


def decode_text(raw: bytes) -> str:
    """UTF-8 text; ValueError with one line naming the encoding problem."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError("is UTF-16 (it starts with a UTF-16 byte-order mark); save it as UTF-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load's loader, refusing a key given twice in one mapping: PyYAML silently keeps the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_settings(path: str | Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, validate and freeze the settings file, then apply the environment gates."""
    path = Path(path)
    if "\0" in str(path):
        raise SettingsError(f"{str(path)!r}: a path cannot contain a NUL byte")
    try:
        text = decode_text(read_regular(path, MAX_SETTINGS_BYTES))
    except OSError as exc:  # UnreadableFile included
        raise SettingsError(f"{path}: cannot read settings file: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SettingsError(f"{path}: settings file {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no tag runs code
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SettingsError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise SettingsError(f"{path}: invalid YAML: nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor choking, e.g. on a bad date
        raise SettingsError(f"{path}: invalid YAML: {exc}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: top level must be a mapping, got {_type_name(data)}")
    settings = dataclasses.replace(_build(Settings, data, "", path, path.resolve().parent), source=path)
    if settings.controller.runtime_socket is not None and not settings.haproxy.move_stats_socket:
        # The controller writes HAProxy's `stats socket` at the path the relay binds.
        raise SettingsError(f"{path}: controller.runtime_socket needs haproxy.move_stats_socket: true")
    return apply_environment(settings, os.environ if environ is None else environ)


def apply_environment(settings: Settings, environ: Mapping[str, str]) -> Settings:
    """The Ray Serve observe gates override the file: the first variable set of each pair wins."""
    observe = settings.observe
    if gate := next((name for name in OBSERVE_GATE_ENV if name in environ), None):
        value = parse_bool(environ[gate])
        if value is None:
            raise SettingsError(f"{gate}={environ[gate]!r}: not a boolean (use 1/0, true/false, yes/no, on/off)")
        observe = dataclasses.replace(observe, enabled=value)
    if limit := next((name for name in OBSERVE_LIMIT_ENV if name in environ), None):
        raw = environ[limit].strip()
        if not _is_decimal(raw) or not 0 < int(raw) <= _maximum("observe.error_limit"):
            raise SettingsError(f"{limit}={environ[limit]!r}: must be a positive integer")
        observe = dataclasses.replace(observe, error_limit=int(raw))
    return dataclasses.replace(settings, observe=observe)


def _is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "³", which int() refuses."""
    return text.isascii() and text.isdigit()


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _build(cls: type, data: Mapping[str, Any], prefix: str, file: Path, base: Path) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise SettingsError(f"{file}: {dotted}: unknown key")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise SettingsError(f"{file}: {dotted}: must be a mapping, got {_type_name(value)}")
            kwargs[key] = _build(hint, value, f"{dotted}.", file, base)
        else:
            kwargs[key] = _convert(hint, value, dotted, file, base)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str, file: Path, base: Path) -> Any:
    def fail(problem: str) -> typing.NoReturn:
        raise SettingsError(f"{file}: {key}: {problem}")

    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, key, file, base)
    if value is None:
        fail("must not be null")
    if origin is Literal:
        if value not in args:
            fail(f"must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            fail(f"must be a list, got {_type_name(value)}")
        return tuple(_convert(args[0], v, f"{key}[{i}]", file, base) for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            fail(f"must be true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(f"must be a number, got {value!r}")
        if hint is int and not isinstance(value, int):
            fail(f"must be a whole number, got {value!r}")
        if not math.isfinite(value):
            fail(f"must be a finite number, got {value!r}")
        if value > (top := _maximum(key)):
            fail(f"must be at most {top}, got {value:.3g}")
        if key in _ZERO_ALLOWED and value < 0:
            fail(f"must not be negative, got {value!r}")
        if key not in _ZERO_ALLOWED and value <= 0:
            fail(f"must be positive, got {value!r}")
        return hint(value)
    if hint is Path:
        if not isinstance(value, str) or not value:
            fail(f"must be a path, got {value!r}")
        if "\0" in value:
            fail("a path cannot contain a NUL byte")
        if key in _SOCKET_DIRS and "," in value:
            fail(f"cannot contain a comma: HAProxy's -S splits its argument on commas, got {value!r}")
        p = Path(value)
        return p if p.is_absolute() else base / p
    if hint is str:
        if not isinstance(value, str):
            fail(f"must be a string, got {value!r}")
        if "\0" in value:
            fail("cannot contain a NUL byte")
        try:
            _STRING_CHECKS.get(key, str)(value)
        except ValueError as exc:
            fail(str(exc))
        return value
    raise AssertionError(f"unhandled settings type {hint!r} for {key}")
