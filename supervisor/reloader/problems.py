"""How the reloader words trouble: a disk error as the shell says it, HAProxy's message on one line
(each condition is logged once, then a reminder a minute: logs.RecurringConditions)."""

from __future__ import annotations

import errno


def one_line(text: str, limit: int = 400) -> str:
    """HAProxy's message on one log line: its ALERT lines first, joined with ` | `."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    alerts = [ln for ln in lines if "ALERT" in ln] or lines
    joined = " | ".join(alerts)
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


# Errors of the disk, not of the daemon: one log line each, no traceback.
EXPECTED_IO_ERRORS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO,
    errno.EMFILE, errno.ENFILE,
})


def io_error_line(exc: OSError) -> str:
    """`<file>: <strerror>`, the way the shell says it."""
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what
