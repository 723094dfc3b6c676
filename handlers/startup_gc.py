"""Python's cyclic garbage collector while the server starts, and once it has.

A start creates most of the objects the process will ever hold (torch's modules, the model,
transformers' for the embedding model) and few cycles among them, yet the collector walks them
all again and again while they are made: ~0.35 s of a 2.3 s start went to its full collections.
So it is off until every model is loaded; then what the start built is frozen (moved where
collections never look) and collection resumes. Frozen, those objects also leave out of the
full collections of a running server, which otherwise hold the GIL ~0.35 s each once the
embedding model's imports are in. The few cycles the start left unreachable (~7,000 objects
for torch's imports) stay frozen with the rest.
"""

from __future__ import annotations

import gc
from types import TracebackType


class StartupCollection:
    """`with StartupCollection() as startup:` turns collection off; `startup.loaded()` freezes
    what exists and turns it back on. Leaving the block turns it on where `loaded` never ran
    (a failed or stopped start), so nothing outlives the start with collection off."""

    def __enter__(self) -> StartupCollection:
        self._resumed = False
        self._was_enabled = gc.isenabled()
        gc.disable()
        return self

    def loaded(self) -> None:
        if not self._resumed:
            gc.freeze()
            self._resume()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if not self._resumed:
            self._resume()

    def _resume(self) -> None:
        self._resumed = True
        if self._was_enabled:
            gc.enable()
