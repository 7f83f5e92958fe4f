"""`haproxy-supervisor status`: GET /status of a running daemon, printed for people (the format_*
functions serve the page too)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from yarl import URL

from .settings import listen_address

DEFAULT_URL = "http://127.0.0.1:9180"


def format_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    total = max(0, int(seconds))  # a clock step must not show "-3s"
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m {total % 60:02d}s"
    if total < 86400:
        return f"{total // 3600}h {total % 3600 // 60:02d}m"
    return f"{total // 86400}d {total % 86400 // 3600:02d}h"


def format_bytes(value: int | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_duration_ms(value: float) -> str:
    return f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.1f} s"


def format_seconds(value: float) -> str:
    return format_duration_ms(value * 1000) if value >= 0.001 else f"{value * 1e6:.0f} µs"


class StatusFetchError(Exception):
    """The daemon could not be asked."""


def url_from_listen(listen: str) -> str:
    """The URL a local client uses for a `status.listen` value: a wildcard's is loopback."""
    address = listen_address(listen)
    if isinstance(address, str):
        return f"unix:{address}"
    host, port = address
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def status_target(url: str) -> tuple[str, str | None]:
    """(HTTP URL of /status, unix socket path or None) for a --url value."""
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if path.startswith("//"):  # unix:///run/x.sock
            path = path[2:]
        if not path:
            raise StatusFetchError(f"{url}: a unix: URL needs a socket path, e.g. unix:/run/x/status.sock")
        return "http://localhost/status", path
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise StatusFetchError(f"{url}: not an http://host:port or unix:/path URL")
    if not parsed.path.endswith("/status"):
        parsed = parsed.with_path(parsed.path.rstrip("/") + "/status")
    return str(parsed), None


async def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:
    target, socket_path = status_target(url)
    connector = aiohttp.UnixConnector(path=socket_path) if socket_path else None
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(target) as response,
        ):
            text = await response.text()
            if response.status != 200:
                raise StatusFetchError(f"{url} answered HTTP {response.status}: {text.strip()[:200]}")
            document = json.loads(text)
    except TimeoutError:
        raise StatusFetchError(f"cannot reach the daemon at {url}: no answer within {timeout:g}s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise StatusFetchError(f"cannot reach the daemon at {url}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise StatusFetchError(f"{url} did not answer JSON: {exc}") from None
    if not isinstance(document, dict):
        raise StatusFetchError(f"{url} did not answer a JSON object")
    return document


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return ("  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _first(keys: list[str], limit: int = 10) -> str:
    """Up to `limit` keys; a drain can make thousands dead and --json has them all."""
    if not keys:
        return "-"
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def format_status(doc: dict[str, Any], recent: int = 5) -> str:
    sup, hap, worker, reloads = doc["supervisor"], doc["haproxy"], doc["worker"], doc["reloads"]
    out = [
        f"supervisor  {sup['version']}  pid {sup['pid']}  up {format_age(sup['uptime_s'])}  "
        f"{'ready' if sup['ready'] else 'NOT READY'}",
        f"haproxy     {_text(hap['version'])}  master pid {_text(hap['master_pid'])}  "
        f"{'up' if hap['up'] else 'MASTER DOWN'}  binary {hap['binary']}",
        f"worker      pid {_text(worker['pid'])}  generation {_text(worker['generation'])}  "
        f"started {_text(worker['started_at'])}  config {(worker['config_sha256'] or '-')[:12]}",
        "",
    ]
    old = doc["old_workers"]
    out.append(f"old workers ({len(old)})")
    if old:
        rows = [
            [
                str(w["pid"]), _text(w["generation"]), format_age(w["age_s"]), format_bytes(w["rss_bytes"]),
                _text(w["connections"]), w["push"]["state"], _first(w["steered"]),
            ]
            for w in old
        ]
        out += _table(["PID", "GEN", "AGE", "RSS", "CONNS", "PUSH", "STEERED AWAY FROM"], rows)
        out += [f"  push to {w['pid']} failed: {w['push']['error']}" for w in old if w["push"]["error"]]
    else:
        out.append("  none")
    out.append("")
    counts = "  ".join(f"{key} {reloads[key]}" for key in ("ok", "failed", "invalid", "skipped_unchanged",
                                                            "runtime_applied"))
    out.append(f"reloads     {counts}")
    if reloads["recent"]:
        rows = [
            [r["at"], r["result"], format_duration_ms(r["duration_ms"]), (r["error"] or "").replace("\n", " ")[:80]]
            for r in reloads["recent"][:recent]
        ]
        out += _table(["AT", "RESULT", "DURATION", "ERROR"], rows)
    out.append("")
    operator = set(doc.get("operator_dead", []))
    dead = [f"{key} (operator)" if key in operator else key for key in doc["dead_servers"]]
    out.append(f"dead servers ({len(dead)}): {_first(dead, 50) if dead else 'none'}")
    return "\n".join(out) + "\n"
