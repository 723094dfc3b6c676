"""The engine's supervisor: it runs the engine's loop in the main thread and keeps health
truthful when the loop dies or sticks.

A loop that failed (its requests already ended with the error) is reset and run again, counted
(`option.engine_restart=true`), or ends the process with exit status 1 so that SageMaker or
Kubernetes replaces it. A step that runs past `option.engine_stall_timeout` cannot be
interrupted: its requests are failed from here, the HTTP server drains, and the process exits 1.
Requests failing in a row (`option.max_consecutive_failures`) make the loop fail the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable

from handlers.engine.base import RevivableEngine, SupervisedLoop
from handlers.server.failures import FailureStreak

log = logging.getLogger("lmi_serve")

STALL_CHECK_INTERVAL = 1.0  # seconds between looks at the running step
DRAIN_MARGIN = 5.0  # seconds past the HTTP server's own shutdown limit that it gets to end


class Supervisor:
    def __init__(self, loop: SupervisedLoop, failures: FailureStreak, restart: bool,
                 stop_server: Callable[[], None], http: threading.Thread,
                 on_restart: Callable[[], None] = lambda: None, *, drain_limit: float) -> None:
        self.loop = loop
        self.failures = failures
        self.restart = restart
        self.stop_server = stop_server
        self.http = http
        self.on_restart = on_restart
        self.drain_limit = drain_limit  # seconds the HTTP server takes at most to stop
        self.restarts = 0
        self._done = threading.Event()

    def run(self) -> int:
        """Run the loop until it is stopped (0) or fails for good (1)."""
        self.failures.on_trip = self.loop.restart
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()
        try:
            while True:
                self.loop.run_forever()
                if self.loop.failure is None:  # stop() was asked for
                    return 0
                if not self.restart:
                    log.error("the engine failed (%s); exiting with status 1 "
                              "(option.engine_restart=false)", self.loop.failure)
                    self.stop_server()
                    return 1
                self._reset()
        finally:
            self._done.set()

    def _reset(self) -> None:
        self.loop.reset()
        self.failures.reset()
        self.restarts += 1
        self.on_restart()
        log.warning("the engine was restarted after a failure (%d restart%s so far)",
                    self.restarts, "" if self.restarts == 1 else "s")

    def _watch(self) -> None:
        """Exit the process when a step sticks: nothing else can end it."""
        while not self._done.wait(STALL_CHECK_INTERVAL):
            if self.loop.stalled():
                log.error("an engine step ran past option.engine_stall_timeout: the engine is "
                          "stuck; failing its requests and exiting with status 1")
                self.loop.abandon("the engine is stuck (option.engine_stall_timeout)")
                self.stop_server()
                self.http.join(self.drain_limit + DRAIN_MARGIN)
                logging.shutdown()
                os._exit(1)


def watch_revivable(engine: RevivableEngine, loop: asyncio.AbstractEventLoop, restart: bool,
                    stop_server: Callable[[], None], done: threading.Event,
                    on_restart: Callable[[], None] = lambda: None) -> int:
    """Until `done`: an engine that died is started again on `loop`, counted
    (`option.engine_restart=true`), or the server stops and the process exits 1. Its requests
    in flight already ended with the engine's error."""
    restarts = 0
    while not done.wait(STALL_CHECK_INTERVAL):
        if not engine.dead():
            continue
        if not restart:
            log.error("the engine died; exiting with status 1 (option.engine_restart=false)")
            stop_server()
            return 1
        log.warning("the engine died: starting it again, every process of it")
        try:
            asyncio.run_coroutine_threadsafe(engine.revive(), loop).result()
        except Exception:
            log.exception("starting the engine again failed; exiting with status 1")
            stop_server()
            return 1
        restarts += 1
        on_restart()
        log.warning("the engine was restarted after a failure (%d restart%s so far)", restarts,
                    "" if restarts == 1 else "s")
    return 0
