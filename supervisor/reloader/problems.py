"""How the reloader reports trouble: a disk error once per condition, HAProxy's message on one line."""

from __future__ import annotations

import errno
import logging

log = logging.getLogger(__package__)


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


class ProblemLog:
    """One log line when a condition starts, or changes, and one when it is over; not one per try."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}

    def report(self, key: str, exc: OSError, message: str) -> None:
        """`message` at error level, unless `key` already failed with the same error."""
        condition = io_error_line(exc)
        if self.active.get(key) == condition:
            log.debug("%s", message)
            return
        self.active[key] = condition
        log.error("%s", message)

    def clear(self, key: str) -> None:
        if self.active.pop(key, None) is not None:
            log.info("%s: works again", key)
