"""The HTML pieces the page's parts share: escaping, badges, chips, times."""

from __future__ import annotations

import html
from datetime import datetime
from typing import Any

from ..formats import format_age

# The tone of a reload result, in the chart and in the table.
RESULT_TONE = {
    "ok": "good", "runtime_applied": "good", "skipped_unchanged": "neutral", "failed": "bad", "invalid": "bad",
}
_OPERATOR_TAG = ' <span class="tag">operator</span>'


def esc(value: Any) -> str:
    return html.escape("—" if value is None else str(value), quote=True)


def badge(text: str, tone: str) -> str:
    return f'<span class="badge {tone}">{esc(text)}</span>'


def chips(keys: list[str], tone: str = "", operator: frozenset[str] = frozenset()) -> str:
    if not keys:
        return '<span class="muted">none</span>'
    return " ".join(
        f'<span class="chip {tone}">{esc(key)}{_OPERATOR_TAG if key in operator else ""}</span>' for key in keys
    )


def when(value: str | None, now: datetime, with_date: bool = True) -> str:
    """A time from the document as `2025-01-02 03:04:05` and how long ago; the exact value on hover."""
    if value is None:
        return '<span class="muted">—</span>'
    moment = datetime.fromisoformat(value)
    shown = moment.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")
    ago = format_age(max(0.0, (now - moment).total_seconds()))
    return f'<span class="when" title="{esc(value)}">{esc(shown)} <span class="muted">{esc(ago)} ago</span></span>'
