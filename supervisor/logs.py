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
    """A condition that can recur thousands of times a second (a flood, a failing disk): logged when it
    starts or its cause changes, then at most once per EVERY_S with a count, and once when over."""

    EVERY_S = 60.0

    def __init__(
        self, logger: logging.Logger, level: int, message: str, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.message = message
        self.clock = clock
        self.count = 0  # times it happened since the last line
        self._logged_at: float | None = None
        self._cause: object = None  # the cause of the last line
        self._reported = False  # logged, and not yet said to be over

    def happened(self, *args: object, cause: object = None) -> None:
        self.count += 1
        now = self.clock()
        if self._logged_at is None or cause != self._cause or now - self._logged_at >= self.EVERY_S:
            times = f" ({self.count} times since the last report)" if self.count > 1 else ""
            self.logger.log(self.level, self.message + times, *args)
            self._logged_at = now
            self._cause = cause
            self.count = 0
            self._reported = True

    def over(self, message: str, *args: object) -> None:
        """Say the condition is over, once per report of it (one that flaps still logs a line a minute)."""
        if self._reported:
            self.logger.info(message, *args)
            self._reported = False


class RecurringConditions:
    """A `RecurringCondition` per thing that can fail, in the wording of its latest occurrence."""

    def __init__(self, logger: logging.Logger, level: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.level = level
        self.clock = clock
        self._by_key: dict[str, RecurringCondition] = {}

    def happened(self, key: str, cause: object, message: str) -> None:
        condition = self._by_key.get(key)
        if condition is None:
            condition = self._by_key[key] = RecurringCondition(self.logger, self.level, "%s", self.clock)
        condition.happened(message, cause=cause)

    def over(self, key: str) -> None:
        if (condition := self._by_key.get(key)) is not None:
            condition.over("%s: works again", key)
