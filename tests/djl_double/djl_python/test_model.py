"""`TestHandler`: runs a `handle()` entry in-process the way DJL Serving calls it.

`inference_batch` sends a batch in one call (dynamic batching). `inference_rolling_batch` calls
again and again with the requests still running, which come back with `{"inputs": ""}`, until
every request got a record with `last` true; it returns each request's concatenated `data`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import ModuleType

from djl_python.inputs import Input
from djl_python.outputs import Output


def load_properties(model_dir: str | None) -> dict[str, str]:
    """`<model_dir>/serving.properties`, with the `option.` prefix taken off its keys."""
    path = Path(model_dir or "") / "serving.properties"
    if not model_dir or not path.is_file():
        return {}
    properties = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            properties[key.strip().removeprefix("option.")] = value.strip()
    return properties


def create_concurrent_batch_request(inputs: list[dict], properties: list[dict] | None = None,
                                    serving_properties: dict | None = None) -> Input:
    """A batch Input: item i's properties and JSON body under `batch_<iii>_` keys."""
    batch = Input()
    batch.properties = dict(serving_properties or {})
    for i, item_properties in enumerate(properties or []):
        for key, value in item_properties.items():
            batch.properties[f"batch_{i:03d}_{key}"] = value
    for i, body in enumerate(inputs):
        batch.content.add(f"batch_{i:03d}_data", json.dumps(body).encode("utf-8"))
    batch.properties["batch_size"] = len(inputs)
    batch.function_name = batch.properties.get("handler", "handle")
    return batch


def decode_encoded_output_binary(raw: bytes) -> dict[str, str]:
    """The map `Output.binary_encode` wrote."""
    (count,), offset, record = struct.unpack_from(">h", raw), 2, {}
    for _ in range(count):
        texts = []
        for _ in range(2):
            (length,) = struct.unpack_from(">i", raw, offset)
            texts.append(raw[offset + 4 : offset + 4 + length].decode("utf-8"))
            offset += 4 + length
        record[texts[0]] = texts[1]
    return record


def read_stream(output: Output) -> list[bytes]:
    """The chunks DJL sends for a streamed Output, each item through its formatter."""
    chunks = []
    for item in output.stream_content or []:
        if output.stream_output_formatter is not None:
            item = output.stream_output_formatter(item)
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, bytes | bytearray):
            item = Output._encode_json(item)
        chunks.append(bytes(item))
    return chunks


class TestHandler:
    __test__ = False  # not a pytest class

    def __init__(self, entry_point: ModuleType, model_dir: str | None = None) -> None:
        self.module = entry_point
        self.model_dir = model_dir
        self.serving_properties = load_properties(model_dir)
        entry_point._service.initialized = False  # each handler loads the model anew

    def inference(self, inputs: Input) -> Output | None:
        inputs.properties.update(self.serving_properties)
        inputs.properties["model_dir"] = self.model_dir
        return getattr(self.module, inputs.get_function_name() or "handle")(inputs)

    def inference_batch(self, inputs: list[dict], properties: list[dict] | None = None,
                        serving_properties: dict | None = None) -> Output | None:
        return self.inference(
            create_concurrent_batch_request(inputs, properties, serving_properties))

    def inference_rolling_batch(self, inputs: list[dict], properties: list[dict] | None = None,
                                serving_properties: dict | None = None) -> dict[int, str]:
        results = {i: "" for i in range(len(inputs))}
        live = list(results)
        while live:
            output = self.inference_batch(inputs, properties, serving_properties)
            records = [decode_encoded_output_binary(v) for v in output.content.values]
            for index, record in zip(live, records, strict=True):
                results[index] += record["data"]
            live = [i for i, r in zip(live, records, strict=True) if r["last"].lower() != "true"]
            inputs, properties = [{"inputs": ""} for _ in live], None
        return results
