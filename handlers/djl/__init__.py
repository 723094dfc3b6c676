"""DJL Serving entry: serve this project's engine inside an official DJL Serving LMI container.

Put a `model.py` holding `from handlers.djl import handle` next to `serving.properties` (or set
`option.entryPoint=handlers.djl`). `option.rolling_batch=torch` runs continuous batching, one
engine step per DJL call; `option.rolling_batch=disable` (with `batch_size`) runs dynamic batches.

`handle` and `_service` load on first use: they need DJL's `djl_python`, which only DJL's
containers carry, while `handlers.djl.settings` (the properties, read by this project's checks)
must import without it.
"""

from __future__ import annotations

from typing import Any

# `_service` is what DJL's TestHandler resets (`_service.initialized = False`) between tests.
__all__ = ["_service", "handle"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from handlers.djl import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
