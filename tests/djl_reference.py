"""DJL's own LMI rolling-batch handler, with this project's torch engine where vLLM would be.

DJL's LMI handlers parse a batch with `parse_input_with_formatter`, keep each request as a
`djl_python.request.Request`, render its tokens with DJL's output formatters and answer with
`rolling_batch_inference`. Only the engine underneath (VLLMRollingBatch) needs vLLM: here
`EngineRollingBatch` steps the torch engine instead and feeds DJL's requests as DJL feeds them
vLLM's outputs (rolling_batch_vllm_utils): one `Token` per generated token with its id, text and
log-prob, the finish reason on the last one, and a `Token(-1, "")` when a sequence ends in a step
that released no token. So `ReferenceHandler.handle` answers what DJL's LMI handler answers for
the same tokens: the bytes `handlers.djl` must reproduce.
"""

from __future__ import annotations

from types import SimpleNamespace

from djl_python.huggingface import HuggingFaceService
from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.properties_manager.properties import RollingBatchEnum
from djl_python.request import Request
from djl_python.request_io import Token
from djl_python.rolling_batch.rolling_batch import RollingBatch, stop_on_any_exception

from handlers.engine.base import SteppableEngine
from handlers.engine.types import RequestOutput
from handlers.protocols.lmi import parse_lmi_request, to_generation_request


class EngineRollingBatch(RollingBatch):
    def __init__(self, engine: SteppableEngine, configs: SimpleNamespace) -> None:
        super().__init__(configs)
        self.engine = engine
        self.requests: dict[str, Request] = {}  # by the engine's request id

    def reset(self) -> None:
        for request_id in self.requests:
            self.engine.cancel(request_id)
        self.requests = {}
        super().reset()

    @stop_on_any_exception
    def inference(self, new_requests: list[Request]) -> list[dict]:
        self.add_new_requests(new_requests)
        self.preprocess_requests(new_requests)
        for output in self.engine.step() if self.engine.has_work else []:
            self._feed(output)
        return self.postprocess_results()

    def preprocess_requests(self, requests: list[Request]) -> None:
        for request in requests:
            body = {"inputs": request.input_text, "parameters": request.request_input.parameters}
            generation = to_generation_request(parse_lmi_request(body))
            self.engine.validate(generation)
            self.engine.add(generation)
            self.requests[generation.request_id] = request

    def _feed(self, output: RequestOutput) -> None:
        request = self.requests[output.request_id]
        for seq in output.outputs:
            finish = seq.finish_reason.value if seq.finish_reason else None
            tokens = [Token(t.id, t.text, t.logprob, t.special or None) for t in seq.tokens]
            tokens = tokens or ([Token(-1, "")] if finish else [])
            for i, token in enumerate(tokens):
                last = finish is not None and i == len(tokens) - 1
                request.set_next_token(token, last_token=last, finish_reason=finish)
        if output.finished:
            del self.requests[output.request_id]


class ReferenceHandler:
    """`handle(inputs)` of DJL's LMI handler (djl_python.huggingface) in rolling-batch mode, its
    model service set up as `initialize` would set it up for vLLM, with `EngineRollingBatch`."""

    def __init__(self, engine: SteppableEngine, output_formatter: str | None = None,
                 tgi_compat: bool = False) -> None:
        configs = SimpleNamespace(
            rolling_batch=RollingBatchEnum.auto, input_formatter=None, bedrock_compat=False,
            output_formatter=output_formatter, tgi_compat=tgi_compat)
        self.service = HuggingFaceService()
        self.service.hf_configs = configs
        self.service.rolling_batch = EngineRollingBatch(engine, configs)
        self.service.input_format_args = {
            "configs": configs, "tokenizer": None, "adapter_registry": {},
            "rolling_batch": self.service.rolling_batch}
        self.service.initialized = True

    def handle(self, inputs: Input) -> Output:
        return self.service.inference(inputs)
