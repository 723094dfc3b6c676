"""DJL Serving entry: serve this project's engine inside an official DJL Serving LMI container.

Put a `model.py` holding `from handlers.djl import handle` next to `serving.properties` (or set
`option.entryPoint=handlers.djl`). `option.rolling_batch=torch` runs continuous batching, one
engine step per DJL call; `option.rolling_batch=disable` (with `batch_size`) runs dynamic batches.

The service behind `handle` loads on first use: it needs DJL's `djl_python`, which only DJL's
containers carry, while this package must import without it (`handlers.djl.settings` is read by
this project's checks; lmi-serve imports a model.py holding the import above, and applies the
formatters of other model.py files: model_code.py, custom_entry.py).
"""

from __future__ import annotations

from typing import Any

# `_service` is what DJL's TestHandler resets (`_service.initialized = False`) between tests.
__all__ = ["_service", "handle"]


def handle(inputs: Any) -> Any:
    """DJL Serving's entry point: `option.entryPoint=handlers.djl`, or a model.py importing it."""
    from handlers.djl import service

    return service.handle(inputs)


def __getattr__(name: str) -> Any:
    if name == "_service":
        from handlers.djl import service

        return service._service
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
