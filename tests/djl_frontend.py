"""DJL Serving's Java front end (ai.djl.python.engine), as it calls `handle()`: written from
RollingBatch.java, Request.java and PyPredictor.java of djl-serving (commit d21927c4), since the
Java server cannot run here. `djl_python` itself is the real package.

- `RollingBatchFrontEnd` (RollingBatch + Request): keeps the active requests in arrival order
  and sends all of them on every call under `batch_<iii>.` keys: a new one with its properties,
  its body as `data` and a random `seed`; a running one (it got a record already) with empty
  data and no properties. Record i belongs to request i: `batch_<i>_<name>` properties become
  its response headers, `data` is appended to its response (an empty one only when `last`),
  and a `code` appends `{"code", "error"}` instead, setting the status only while nothing was
  sent. Requests whose record was `last` leave the batch. A call answered with a status other
  than 200, or with a record count other than the batch's, fails every active request and
  asks the handler to reset its batch on the next call (`reset_rollingbatch`). An exception
  from `handle()` reaches Java as DJL's Python engine answers it (python_sync_engine.py): 507
  when memory ran out, else `Output().error` (424).
- `predict_batch` (PyPredictor.batchPredict): one request is sent as it is; several go in one
  batch Input, whose answer is split by its `batch_<i>.<key>` content keys, all with the
  batch's status and properties.
"""

from __future__ import annotations

import json
import random
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
    chunks: list[bytes] = field(default_factory=list)  # each record's data, as it was sent
    last: bool = False
    started: bool = False  # got a record: later calls send it with empty data

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.body.decode().splitlines()]


@dataclass
class Call:
    """One `handle()` call: what went in and the Output that came back."""

    batch: Input
    output: Output

    @property
    def wire(self) -> tuple[int, dict[str, Any], list[tuple[str, bytes]]]:
        """The Output as DJL's Python engine sends it to Java: code, properties and content."""
        content = [(key, bytes(value)) for key, value in zip(
            self.output.content.keys, self.output.content.values, strict=True)]
        return self.output.code, dict(self.output.properties), content


def _batch_input(items: list[tuple[dict[str, Any], dict[str, bytes]]],
                 extra: dict[str, Any]) -> Input:
    batch = Input()
    batch.properties.update(extra)
    for i, (properties, content) in enumerate(items):
        for key, value in properties.items():
            batch.properties[f"batch_{i:03d}.{key}"] = value
        for key, value in content.items():
            batch.content.add(f"batch_{i:03d}.{key}", value)
    batch.properties["batch_size"] = str(len(items))
    return batch


class RollingBatchFrontEnd:
    def __init__(self, handle: Handle, seed: int = 0) -> None:
        self.handle = handle
        self.active: list[tuple[dict[str, Any], bytes, Response]] = []
        self.calls: list[Call] = []
        self._reset = False
        self._seeds = random.Random(seed)

    @property
    def batch_sizes(self) -> list[int]:
        return [int(call.batch.properties["batch_size"]) for call in self.calls]

    def submit(self, body: dict[str, Any] | bytes, request_id: str, **headers: str) -> Response:
        response = Response()
        properties = {"Content-Type": "application/json", "requestId": request_id, **headers}
        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        self.active.append((properties, data, response))
        return response

    def step(self) -> None:
        items = [({}, {"data": b""}) if response.started else
                 (properties, {"data": data, "seed": str(self._seeds.randrange(2**31)).encode()})
                 for properties, data, response in self.active]
        extra = {"reset_rollingbatch": "true"} if self._reset else {}
        self._reset = False
        batch = _batch_input(items, extra)
        output = _call(self.handle, batch)
        self.calls.append(Call(batch, output))
        if output.code != 200 or output.content.size() != len(items):
            self._fail_all(output.code)
            return
        headers: dict[int, dict[str, str]] = {}
        for key, value in output.properties.items():
            index, _, name = key.removeprefix("batch_").partition("_")
            if key.startswith("batch_") and name:
                headers.setdefault(int(index), {})[name] = value
        for i, (_, _, response) in enumerate(self.active):
            response.headers.update(headers.get(i, {}))
            _apply(response, decode_encoded_output_binary(output.content.value_at(i)))
        self.active = [entry for entry in self.active if not entry[2].last]

    def run(self, max_steps: int = 1000) -> None:
        while self.active and max_steps > 0:
            self.step()
            max_steps -= 1

    def _fail_all(self, code: int) -> None:
        for _, _, response in self.active:
            if not response.chunks:
                response.status = code
            response.last = True
            response.body += json.dumps({"code": code, "message": "Batch inference failed"}
                                        ).encode()
        self.active = []
        self._reset = True


def _call(handle: Handle, batch: Input) -> Output:
    try:
        return handle(batch)
    except Exception as exc:
        if type(exc).__name__ in ("OutOfMemoryError", "MemoryError"):
            return Output(code=507, message=str(exc))
        return Output().error(str(exc))


def _apply(response: Response, record: dict[str, str]) -> None:
    response.started = True
    response.last = record["last"].lower() == "true"
    if not record["data"] and not response.last:
        return  # nothing to send yet (a non-streamed answer is one record)
    if "code" in record:
        if not response.chunks:
            response.status = int(record["code"])
        failure = {"code": int(record["code"]), "error": record.get("error")}
        response.chunks.append(json.dumps(failure).encode())
    else:
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
        return [Response(output.code, dict(output.properties), bytes(output.content.value_at(0)),
                         last=True)]
    output = handle(_batch_input([(properties, {"data": d}) for d in data], {}))
    if output.code >= 300:
        return [Response(output.code, dict(output.properties), bytes(output.content.value_at(0)),
                         last=True) for _ in bodies]
    assert output.content.size() == len(bodies), "Batch output size mismatch"
    responses = [Response(output.code, dict(output.properties), last=True) for _ in bodies]
    for key, value in zip(output.content.keys, output.content.values, strict=True):
        match = _OUTPUT_KEY.fullmatch(key)
        assert match, f"Unexpected batch output key: {key}"
        responses[int(match[1])].body += bytes(value)
    return responses
