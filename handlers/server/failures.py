"""Requests failing in a row: an engine that fails every request is as dead as one whose loop
died (DJL trips `/ping` after repeated errors), so readiness goes off and the supervisor hears
of it once."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class FailureStreak:
    """Counts engine requests that failed in a row; `limit` of them (0: never) trip it until
    `reset()`, calling `on_trip` once with the reason."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.count = 0
        self.tripped = False
        self.on_trip: Callable[[str], None] | None = None  # set by the supervisor

    def record(self, ok: bool) -> None:
        """One engine request ended: well (`ok`) or with the engine's error."""
        if ok:
            self.count = 0
            return
        self.count += 1
        if self.limit and self.count >= self.limit and not self.tripped:
            self.tripped = True
            reason = f"{self.count} requests in a row failed (option.max_consecutive_failures)"
            log.error("the engine is unhealthy: %s", reason)
            if self.on_trip is not None:
                self.on_trip(reason)

    def reset(self) -> None:
        self.count = 0
        self.tripped = False
