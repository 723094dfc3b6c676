"""The model service behind `handle()`: loads the model from DJL's properties, then answers.

DJL's first call carries only the model's properties (no content): it loads the model. Later
calls carry requests; the properties decide, as in DJL's front end, whether they come as
rolling-batch steps or as dynamic batches. Either way the engine is stepped right here, in
DJL's calling thread (`SteppableEngine`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from djl_python.inputs import Input
from djl_python.outputs import Output

from handlers.config import ConfigError, check_effects, log_config
from handlers.djl.dynamic import DynamicBatchDriver
from handlers.djl.rolling import RollingBatchDriver
from handlers.djl.settings import check_djl_effects, config_from_properties, is_rolling
from handlers.engine import registry
from handlers.engine.stepped import SteppedEngine

log = logging.getLogger(__name__)


class DjlService:
    def __init__(self) -> None:
        # DJL's TestHandler sets this back to False to load the model again.
        self.initialized = False
        self.driver: RollingBatchDriver | DynamicBatchDriver | None = None

    def initialize(self, properties: Mapping[str, Any]) -> None:
        config = config_from_properties(properties)
        log_config(config, log)
        if config.embeddings_only:
            raise ConfigError("the DJL entry serves text generation; option.task=text-embedding "
                              f"({config.embedding_source}) is served by lmi-serve")
        check_effects(config)
        check_djl_effects(config)
        built = registry.build(config)
        # An engine with no steps of its own (vLLM's) runs on an event loop of its own.
        steppable = built.steppable or SteppedEngine(built.engine)
        if is_rolling(properties):
            self.driver = RollingBatchDriver(steppable, config.output_formatter,
                                             config.tgi_compat)
        else:
            self.driver = DynamicBatchDriver(steppable, config.enable_streaming)
        log.info("DJL entry ready: %s, %s", config.model_name, type(self.driver).__name__)
        self.initialized = True

    def inference(self, inputs: Input) -> Output:
        return self.driver.inference(inputs)


_service = DjlService()


def handle(inputs: Input) -> Output | None:
    """DJL Serving's entry point: `option.entryPoint=handlers.djl`, or a model.py importing it."""
    if not _service.initialized:
        _service.initialize(inputs.get_properties())
    if inputs.is_empty():  # the initialization call
        return None
    return _service.inference(inputs)
