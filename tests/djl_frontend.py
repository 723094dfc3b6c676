"""A double of DJL Serving's Java front end (ai.djl.python.engine): how it calls `handle()`.

- `RollingBatchFrontEnd` (RollingBatch + Request): keeps the active requests in arrival order
  and sends all of them on every call, new ones with their body and properties, running ones
  (those that got a record already) with empty data and no properties, under `batch_<iii>.`
  keys. Record i belongs to request i; `data` is appended to its response, a `code` replaces
  the response with `{"code", "error"}` and sets its status, `batch_<i>_<name>` properties
  become its response headers, and requests whose record was `last` leave the batch. A call
  that fails, or answers a different number of records, fails every active request and asks the
  handler to reset its batch on the next call.
- `predict_batch` (PyPredictor.batchPredict): one request is sent as it is; several go in one
  batch Input whose answer is split by its `batch_<i>.<key>` content keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from djl_python.inputs import Input
from djl_python.outputs import Output
from djl_python.test_model import decode_encoded_output_binary

Handle = Callable[[Input], Output | None]
_OUTPUT_KEY = re.compile(r"batch_(\d+)\.(.*)")


@dataclass
class Response:
    """What the HTTP client of one request gets."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)  # the data of each record that had some
    last: bool = False
    started: bool = False  # got a record: later calls send it with empty data


def _batch_input(items: list[tuple[dict[str, Any], bytes]], extra: dict[str, Any]) -> Input:
    batch = Input()
    batch.properties.update(extra)
    for i, (properties, data) in enumerate(items):
        for key, value in properties.items():
            batch.properties[f"batch_{i:03d}.{key}"] = value
        batch.content.add(f"batch_{i:03d}.data", data)
    batch.properties["batch_size"] = str(len(items))
    return batch


class RollingBatchFrontEnd:
    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.active: list[tuple[dict[str, Any], bytes, Response]] = []
        self.batch_sizes: list[int] = []  # one per call
        self._reset = False

    def submit(self, body: dict[str, Any], request_id: str) -> Response:
        response = Response()
        properties = {"Content-Type": "application/json", "requestId": request_id}
        self.active.append((properties, json.dumps(body).encode("utf-8"), response))
        return response

    def step(self) -> None:
        items = [({}, b"", r) if r.started else (p, d, r) for p, d, r in self.active]
        extra = {"reset_rollingbatch": "true"} if self._reset else {}
        self._reset = False
        self.batch_sizes.append(len(items))
        output = self.handle(_batch_input([(p, d) for p, d, _ in items], extra))
        if output.code != 200 or output.content.size() != len(items):
            self._fail_all(output.code)
            return
        headers: dict[int, dict[str, str]] = {}
        for key, value in output.properties.items():
            if not key.startswith("batch_"):
                continue
            index, _, name = key.removeprefix("batch_").partition("_")
            headers.setdefault(int(index), {})[name] = value
        for i, (_, _, response) in enumerate(items):
            response.headers.update(headers.get(i, {}))
            _apply(response, decode_encoded_output_binary(output.content.value_at(i)))
        self.active = [entry for entry in self.active if not entry[2].last]

    def run(self, max_steps: int = 1000) -> None:
        while self.active and max_steps > 0:
            self.step()
            max_steps -= 1

    def _fail_all(self, code: int) -> None:
        for _, _, response in self.active:
            response.status, response.last = code, True
            failure = {"code": code, "message": "Batch inference failed"}
            response.body += json.dumps(failure).encode()
        self.active = []
        self._reset = True


def _apply(response: Response, record: dict[str, str]) -> None:
    response.started = True
    response.last = record["last"].lower() == "true"
    if "code" in record:
        response.status = int(record["code"])
        failure = {"code": response.status, "error": record.get("error")}
        response.body += json.dumps(failure).encode()
    elif record["data"]:
        response.chunks.append(record["data"].encode("utf-8"))
        response.body += response.chunks[-1]


def predict_batch(handle: Handle, bodies: list[dict[str, Any]]) -> list[Response]:
    properties = {"Content-Type": "application/json"}
    data = [json.dumps(body).encode("utf-8") for body in bodies]
    if len(bodies) == 1:
        single = Input()
        single.properties.update(properties)
        single.content.add("data", data[0])
        output = handle(single)
        return [Response(output.code, dict(output.properties), output.content.value_at(0), True)]
    output = handle(_batch_input([(properties, d) for d in data], {}))
    if output.code >= 300:
        return [Response(output.code, dict(output.properties), output.content.value_at(0), True)
                for _ in bodies]
    responses = [Response(output.code, dict(output.properties), last=True) for _ in bodies]
    for key, value in zip(output.content.keys, output.content.values, strict=True):
        match = _OUTPUT_KEY.fullmatch(key)
        responses[int(match[1])].body += value
    return responses
