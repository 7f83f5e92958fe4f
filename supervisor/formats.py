"""Ages, sizes and durations as people read them: `3m 05s`, `1.5 MiB`, `250 ms`.

Shared by the status page and `haproxy-supervisor status`.
"""

from __future__ import annotations


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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_duration_ms(value: float) -> str:
    return f"{value:.0f} ms" if value < 1000 else f"{value / 1000:.1f} s"


def format_seconds(value: float) -> str:
    return format_duration_ms(value * 1000) if value >= 0.001 else f"{value * 1e6:.0f} µs"

