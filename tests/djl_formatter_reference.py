"""DJL LMI's vLLM handler applying a model.py (djl_python 0.36, lmi_vllm/vllm_async_service.py:
`VLLMHandler.initialize`, `preprocess_request`, `inference`), with this project's server where
vLLM would answer: the bodies `handlers.djl.custom_entry` must answer.

DJL's own code does DJL's part: `AdapterFormatterMixin` finds the model.py functions by their
decorators (DJL's service_loader) and applies the base model's or an adapter's (its
`load_adapter_custom_code`, as DJL registers the adapters of adapters/), `decode` and
`_extract_lora_adapter` read the request, `create_non_stream_output` and
`create_stream_chunk_output` write the answer, and `convert_lmi_schema_to_completion_request`
turns an LMI body into a completion request: run from DJL's source, with vLLM's
`CompletionRequest` as a plain dict (vLLM is not installed here). The handler's flow around
them is written from vllm_async_service.py (vLLM's imports keep it from loading). Where vLLM
would answer, a server of this project without the model.py answers the same request on
/v1/completions or /v1/chat/completions: its answer becomes the pydantic object DJL gets, and
its stream's SSE chunks are handed on one by one, as vLLM's generator yields them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
from djl_python.adapter_formatter_mixin import AdapterFormatterMixin
from djl_python.async_utils import (
    _extract_lora_adapter,
    create_non_stream_output,
    create_stream_chunk_output,
)
from djl_python.custom_formatter_handling import CustomFormatterError
from djl_python.encode_decode import decode
from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.test_model import decode_encoded_output_binary

from handlers.protocols.schemas.openai import ChatCompletion, Completion


def djl_function(relative: str, name: str, **names: Any) -> Any:
    """Function `name` of djl_python's module file `relative`, compiled from DJL's source
    alone, the names it uses given (its module imports vLLM)."""
    folder = Path(importlib.util.find_spec("djl_python").submodule_search_locations[0])
    path = folder / relative
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict[str, Any] = {**names}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace[name]


convert_lmi_schema_to_completion_request = djl_function(
    "lmi_vllm/request_response_utils.py", "convert_lmi_schema_to_completion_request",
    CompletionRequest=dict, Tuple=tuple)


class VllmFormatterReference(AdapterFormatterMixin):
    """`handle(inputs)` of DJL's vLLM handler, answering through the server at `url` (whose
    model's tokenizer is `tokenizer`)."""

    def __init__(self, url: str, model_name: str, tokenizer: Any) -> None:
        super().__init__()
        self.url = url
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.initialized = False

    def initialize(self, properties: dict) -> None:
        model_dir = properties.get("model_dir", ".")
        self.load_formatters(model_dir)
        adapters = Path(model_dir) / "adapters"
        for folder in sorted(adapters.iterdir()) if adapters.is_dir() else []:
            if (folder / "model.py").is_file():
                self.load_adapter_custom_code(folder.name, str(folder))
        self.initialized = True

    # The engine side of DJL's adapter registration: the answering server serves the adapters.
    async def add_lora(self, lora_name: str, lora_alias: str, lora_path: str) -> None:
        raise NotImplementedError("the answering server registers its adapters")

    async def remove_lora(self, lora_name: str, lora_alias: str) -> None:
        raise NotImplementedError("the answering server registers its adapters")

    async def pin_lora(self, lora_name: str, lora_alias: str) -> None:
        raise NotImplementedError("the answering server registers its adapters")

    def handle(self, inputs: Input) -> Output | list[Output] | None:
        if not self.initialized:
            self.initialize(inputs.get_properties())
        if inputs.is_empty():
            return None
        try:
            route, request, adapter_name = self.preprocess_request(inputs)
        except CustomFormatterError as e:
            return create_non_stream_output("", error=f"Custom formatter failed: {e}", code=424)
        if request.get("stream"):
            return self._stream(route, request, adapter_name)
        response = httpx.post(f"{self.url}{route}", json=request, timeout=60).json()
        response = (ChatCompletion if "chat" in route else Completion).model_validate(response)
        formatted = self.apply_output_formatter(response, adapter_name=adapter_name)
        if hasattr(formatted, "model_dump_json"):
            formatted = formatted.model_dump_json()
        elif hasattr(formatted, "model_dump"):
            formatted = formatted.model_dump()
        return create_non_stream_output(formatted)

    def preprocess_request(self, inputs: Input) -> tuple[str, dict, str | None]:
        raw_request = inputs.get_batches()[0]
        content_type = raw_request.get_property("Content-Type")
        decoded_payload = decode(raw_request, content_type)
        adapter_name = _extract_lora_adapter(raw_request, decoded_payload)
        decoded_payload = self.apply_input_formatter(decoded_payload, adapter_name=adapter_name,
                                                     tokenizer=self.tokenizer)
        if "model" not in decoded_payload:
            decoded_payload["model"] = self.model_name
        if adapter_name:
            decoded_payload["model"] = adapter_name
        if "prompt" in decoded_payload:
            return "/v1/completions", decoded_payload, adapter_name
        if "inputs" in decoded_payload:
            request, _details, _prompt = convert_lmi_schema_to_completion_request(
                decoded_payload)
            return "/v1/completions", request, adapter_name
        return "/v1/chat/completions", decoded_payload, adapter_name

    def _stream(self, route: str, request: dict, adapter_name: str | None) -> list[Output]:
        outputs = []
        with httpx.stream("POST", f"{self.url}{route}", json=request, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    chunk = self.apply_output_formatter(f"{line}\n\n", adapter_name=adapter_name)
                    outputs.append(create_stream_chunk_output(chunk, last_chunk=False))
        outputs.append(create_stream_chunk_output("", last_chunk=True))
        return outputs


def body(outputs: Output | list[Output]) -> tuple[bytes, str | None, int]:
    """What DJL's front end sends for the handler's Output(s): the data of each, the content
    type, and the code of a failure."""
    outputs = outputs if isinstance(outputs, list) else [outputs]
    records = [decode_encoded_output_binary(o.content.value_at(0)) for o in outputs]
    code = int(records[0].get("code", 200))
    data = b"".join(record["data"].encode() for record in records)
    if code != 200:
        data = json.dumps({"code": code, "error": records[0]["error"]}).encode()
    return data, outputs[0].properties.get("Content-Type"), code
