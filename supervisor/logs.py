"""Logging set-up: plain text for a terminal or journald, JSON lines for collectors."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable

from .settings import LoggingSettings


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(settings: LoggingSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.format == "json":
        handler.setFormatter(JSONFormatter())
    else:
        # journald adds its own timestamps; keep the line short and greppable.
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level.upper())


class RecurringCondition:
    """A condition that can recur thousands of times a second (a flood, a resource running
    out, a socket that keeps failing): logged when it starts, then at most once per `every_s`
    with how often it happened meanwhile, and once when it is over."""

    def __init__(
        self, logger: logging.Logger, level: int, message: str, every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.message = message
        self.every_s = every_s
        self.clock = clock
        self.count = 0  # times it happened since the last line
        self._logged_at: float | None = None
        self._reported = False  # logged, and not yet said to be over

    def happened(self, *args: object) -> None:
        self.count += 1
        now = self.clock()
        if self._logged_at is None or now - self._logged_at >= self.every_s:
            times = f" ({self.count} times since the last report)" if self.count > 1 else ""
            self.logger.log(self.level, self.message + times, *args)
            self._logged_at = now
            self.count = 0
            self._reported = True

    def over(self, message: str, *args: object) -> None:
        """Say the condition is over, once per report of it. A condition that flaps (a flood at
        the limit) still makes at most one line a minute: its next start waits for that."""
        if self._reported:
            self.logger.info(message, *args)
            self._reported = False
