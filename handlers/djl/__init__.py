"""DJL Serving entry: serve this project's engine inside an official DJL Serving LMI container.

Put a `model.py` holding `from handlers.djl import handle` next to `serving.properties` (or set
`option.entryPoint=handlers.djl`). `option.rolling_batch=torch` runs continuous batching, one
engine step per DJL call; `option.rolling_batch=disable` (with `batch_size`) runs dynamic batches.
"""

from handlers.djl.service import _service, handle

# `_service` is what DJL's TestHandler resets (`_service.initialized = False`) between tests.
__all__ = ["_service", "handle"]
