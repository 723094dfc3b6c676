"""lmi-serve with faults injected into its torch engine, for tests/e2e/test_engine_faults.py.

A request whose prompt holds a marker word makes the batcher fail there:
- FAULT_REQUEST: appending one of its tokens raises (a failure inside one request);
- FAULT_STEP: the whole step raises while it is in the batch;
- FAULT_ABORT: aborting it raises (a client that goes away, a deadline);
- FAULT_STALL: the step never returns while it is in the batch;
- FAULT_SLOW: each step takes at least SLOW_STEP_SECONDS while it is in the batch (a stream
  that outlasts a short drain limit however fast the machine is).
With LMI_FAULT_ENGINE_IMPORT set, importing the torch engine raises
(tests/engine_raising_on_import.py).
Run as `python tests/fault_server.py <lmi-serve arguments>`.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from handlers import cli
from handlers.engine import registry
from handlers.engine.loop.batcher import ContinuousBatcher

_append, _step, _abort = ContinuousBatcher._append, ContinuousBatcher.step, ContinuousBatcher.abort
SLOW_STEP_SECONDS = 0.1


def _holds(batcher: ContinuousBatcher, word: str) -> bool:
    requests = [state.request for state in batcher.states.values()] + batcher.waiting
    return any(word in request.prompt for request in requests)


def append(self: ContinuousBatcher, seq, *args, **kwargs):
    if "FAULT_REQUEST" in self.states[seq.request_id].request.prompt:
        raise RuntimeError("injected fault in one request")
    return _append(self, seq, *args, **kwargs)


def step(self: ContinuousBatcher, *args, **kwargs):
    if _holds(self, "FAULT_STEP"):
        raise RuntimeError("injected fault in the engine step")
    if _holds(self, "FAULT_STALL"):
        threading.Event().wait()  # forever: only the watchdog can end this
    if _holds(self, "FAULT_SLOW"):
        threading.Event().wait(SLOW_STEP_SECONDS)
    return _step(self, *args, **kwargs)


def abort(self: ContinuousBatcher, request_id: str):
    state = self.states.get(request_id)
    if state is not None and "FAULT_ABORT" in state.request.prompt:
        raise RuntimeError("injected fault in abort")
    return _abort(self, request_id)


ContinuousBatcher._append = append
ContinuousBatcher.step = step
ContinuousBatcher.abort = abort

if os.environ.get("LMI_FAULT_ENGINE_IMPORT"):
    registry.ENGINES["torch"] = dataclasses.replace(registry.ENGINES["torch"],
                                                    module="engine_raising_on_import")

if __name__ == "__main__":
    cli.main()
