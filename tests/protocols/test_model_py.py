"""A model.py written for DJL LMI or SageMaker's inference toolkit, at LMI's entry
(handlers/djl/model_code.py, custom_entry.py), on the FakeEngine (tests/fakes.py): DJL's
decorators, base and per adapter, streamed and not; prediction and init handlers; SageMaker's
four functions; and formatters that fail, each failing its own request only.

The files are tests/model_py_files.py's, imported with whichever djl_python this process has
(DJL's, where installed; tests/e2e/test_model_py_e2e.py serves them without it too).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import boto3
import httpx
from botocore.config import Config
from fakes import FakeEngine, served_app
from model_py_files import (
    ADAPTER_INPUT,
    ADAPTER_OUTPUT,
    FORMATTERS,
    INIT_HANDLER,
    PASS_THROUGH,
    PREDICTION_HANDLER,
    SAGEMAKER_LLM,
    write,
)
from server_process import serving

from handlers.djl.model_code import load

MODEL = "fake-model"
ASKED = {"question": "the quick brown fox"}


def app_for(engine: FakeEngine, text: str, folder: Path, adapters: dict[str, str] | None = None,
            files: dict[str, str] | None = None, **settings):
    """The FakeEngine's server with `text` as the model's model.py (and `adapters`' own)."""
    write(folder / "model", text, files)
    codes = load([folder / "model"], {name: write(folder / "adapters" / name, code)
                                      for name, code in (adapters or {}).items()})
    return served_app(engine, model_code=codes, **settings)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def lines(response: httpx.Response) -> list:
    return [json.loads(line) for line in response.text.splitlines() if line]


# -- DJL's formatters -----------------------------------------------------------------------


async def test_the_formatters_read_the_users_schema_and_write_their_shape(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, FORMATTERS, tmp_path)) as http:
        answer = await http.post("/invocations", json=ASKED)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.text.endswith("}\n")  # as DJL sends it
    assert answer.json() == {"answer": " the quick brown fox", "finish_reason": "length",
                             "model": MODEL}
    (request,) = engine.requests
    assert (request.prompt, request.params.max_new_tokens) == ("the quick brown fox", 4)


async def test_a_stream_goes_through_the_output_formatter_chunk_by_chunk(tmp_path):
    async with client(app_for(FakeEngine(), FORMATTERS, tmp_path)) as http:
        answer = await http.post("/invocations", json={**ASKED, "length": 3, "stream": True})
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/jsonlines"
    assert lines(answer) == [{"token": " the"}, {"token": " quick"}, {"token": " brown"},
                             {"generated_tokens": 3}, {"done": True}]
    assert answer.text.endswith("}\n\n")  # DJL's last, empty chunk


async def test_predictions_and_the_sagemaker_routes_apply_them_too(tmp_path):
    app = app_for(FakeEngine(), FORMATTERS, tmp_path)
    async with client(app) as http:
        predictions = await http.post(f"/predictions/{MODEL}", json=ASKED)
    assert predictions.json()["answer"] == " the quick brown fox"
    with serving(app) as url:
        runtime = boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                               aws_access_key_id="x", aws_secret_access_key="x",
                               config=Config(retries={"max_attempts": 1}))
        plain = runtime.invoke_endpoint(EndpointName="any", Body=json.dumps(ASKED))
        streamed = runtime.invoke_endpoint_with_response_stream(
            EndpointName="any", Body=json.dumps({**ASKED, "length": 2, "stream": True}))
        parts = b"".join(event["PayloadPart"]["Bytes"] for event in streamed["Body"])
    assert json.loads(plain["Body"].read())["answer"] == " the quick brown fox"
    assert plain["ContentType"] == "application/json"
    assert streamed["ContentType"] == "application/jsonlines"
    assert [json.loads(line) for line in parts.splitlines() if line] == [
        {"token": " the"}, {"token": " quick"}, {"generated_tokens": 2}, {"done": True}]


async def test_the_output_formatter_gets_a_completion_or_a_chat_completion(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, PASS_THROUGH, tmp_path)) as http:
        lmi = await http.post("/invocations", json={"inputs": "one two three"})
        chat = await http.post("/invocations", json={
            "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2})
    # An LMI body is answered as the completion DJL makes of it (30 tokens, LMI's default).
    assert lmi.json()["object"] == "text_completion"
    assert lmi.json()["choices"][0]["text"].startswith(" one two three one")
    assert engine.requests[0].params.max_new_tokens == 30
    assert chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"]["content"]


MARKS = '''
from djl_python.output_formatter import output_formatter


@output_formatter
def marked(output):
    return {"formatted": output.object}
'''


async def test_only_completions_and_chat_completions_reach_the_output_formatter(tmp_path):
    async with client(app_for(FakeEngine(), MARKS, tmp_path)) as http:
        chat = await http.post("/invocations", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        messages = await http.post("/invocations", json={
            "messages": [{"role": "user", "content": "hi"}], "system": "be brief",
            "max_tokens": 2})
    assert chat.json() == {"formatted": "chat.completion"}
    assert messages.json()["type"] == "message"  # Anthropic's, which DJL hands no formatter


# -- per adapter ----------------------------------------------------------------------------


async def test_an_adapters_model_py_overrides_the_base_models_formatters(tmp_path):
    engine = FakeEngine(adapters=("alpha", "beta", "gamma"))
    app = app_for(engine, FORMATTERS, tmp_path,
                  adapters={"alpha": ADAPTER_INPUT, "beta": ADAPTER_OUTPUT})
    async with client(app) as http:
        alpha = await http.post("/invocations", json={"question": "hi there"},
                                headers={"X-Amzn-SageMaker-Adapter-Identifier": "alpha"})
        beta = await http.post("/invocations", json={"question": "hi there", "adapters": "beta"})
        gamma = await http.post("/invocations", json={"question": "hi there"},
                                params={"adapter": "gamma"})
        base = await http.post("/invocations", json={"question": "hi there"})
    # alpha's own input formatter (it counts tokens with the tokenizer it is given), the base
    # model's output formatter
    assert alpha.json()["answer"] == " alpha says hi"
    # beta's own output formatter, the base model's input formatter
    assert beta.json() == {"adapter_text": " HI THERE HI THERE"}
    # gamma has no model.py: the base model's, as the base model's requests have them
    assert gamma.json()["answer"] == base.json()["answer"] == " hi there hi there"
    assert [(r.adapter, r.params.max_new_tokens) for r in engine.requests] == [
        ("alpha", 3), ("beta", 4), ("gamma", 4), (None, 4)]


async def test_an_unregistered_adapters_model_py_no_longer_applies(tmp_path):
    engine = FakeEngine(adapters=("alpha",))
    app = app_for(engine, FORMATTERS, tmp_path, adapters={"alpha": ADAPTER_INPUT},
                  model_dir=tmp_path, adapter_roots=(tmp_path,))
    plain = tmp_path / "plain-alpha"
    plain.mkdir()
    (plain / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": "alpha"}
    async with client(app) as http:
        before = await http.post("/invocations", json={"question": "hi"}, headers=headers)
        await http.delete(f"/models/{MODEL}/adapters/alpha")
        again = await http.post(f"/models/{MODEL}/adapters",
                                params={"name": "alpha", "src": str(plain)})
        after = await http.post("/invocations", json={"question": "hi"}, headers=headers)
    assert before.json()["answer"] == " alpha says"
    assert again.status_code == 200
    assert after.json()["answer"] == " hi hi hi hi"  # the base model's formatters now


async def test_an_adapter_holding_a_model_py_is_never_registered_at_runtime(tmp_path):
    engine = FakeEngine()
    app = app_for(engine, FORMATTERS, tmp_path, model_dir=tmp_path,
                  adapter_roots=(tmp_path,))
    coded = write(tmp_path / "coded", ADAPTER_INPUT,
                  {"adapter_config.json": '{"peft_type": "LORA", "r": 4}'})
    async with client(app) as http:
        refused = await http.post(f"/models/{MODEL}/adapters",
                                  params={"name": "coded", "src": "coded"})
    assert refused.status_code == 400
    assert refused.json()["message"] == (
        "src='coded' holds a model.py: code runs only as imported at startup, from the model "
        "directory or its adapters/ folder")
    assert engine.adapters == () and str(coded) not in refused.text


# -- handlers -------------------------------------------------------------------------------


async def test_a_prediction_handler_predicts_with_the_served_model(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, PREDICTION_HANDLER, tmp_path)) as http:
        answer = await http.post("/invocations", json={"questions": ["one two", "three four"]})
    assert answer.json() == {"answers": {"0": " one two", "1": " three four"}}
    assert [r.prompt for r in engine.requests] == ["one two", "three four"]


async def test_the_served_models_refusal_keeps_its_status_and_shape(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, PREDICTION_HANDLER, tmp_path)) as http:
        answer = await http.post("/invocations", json={"questions": ["fine", "[[invalid]] x"]})
    assert answer.status_code == 424
    assert answer.json() == {"error": "inputs: the prompt carries the [[invalid]] marker",
                             "code": 424}


async def test_an_init_handlers_model_predicts_each_request(tmp_path):
    engine = FakeEngine()
    app = app_for(engine, INIT_HANDLER, tmp_path, files={"keywords.txt": "alpha beta gamma"})
    async with client(app) as http:
        answer = await http.post("/invocations", json={"text": "alpha and gamma"})
    assert answer.json() == {"matches": ["alpha", "gamma"], "loaded": 3}
    assert engine.requests == []  # its own model answered


async def test_sagemakers_four_functions_take_bytes_and_answer_in_the_accepted_type(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, SAGEMAKER_LLM, tmp_path)) as http:
        csv = await http.post("/invocations", content=b"one two three",
                              headers={"Content-Type": "text/plain", "Accept": "text/csv"})
        as_json = await http.post("/invocations", json={
            "inputs": "four five", "parameters": {"max_new_tokens": 2}})
    assert (csv.status_code, csv.text) == (200, "3,one two three")
    assert csv.headers["content-type"].startswith("text/csv")
    assert as_json.json() == {"text": " four five", "tokens": 2}
    assert as_json.headers["content-type"] == "application/json"


async def test_whole_predictions_refuse_a_stream_naming_why(tmp_path):
    async with client(app_for(FakeEngine(), SAGEMAKER_LLM, tmp_path)) as http:
        answer = await http.post("/invocations", json={"inputs": "a b", "stream": True})
    assert answer.status_code == 424
    assert answer.json()["error"] == (
        "the predict_fn (model.py of the model) failed: ValueError: model.predict answers "
        'whole responses; the body asks for a stream ("stream": true)')


# -- failures -------------------------------------------------------------------------------

RAISES_ON = '''
from djl_python.output_formatter import output_formatter


@output_formatter
def fragile(output):
    text = output if isinstance(output, str) else output.choices[0].text
    if "boom" in text:
        raise RuntimeError("cannot format boom")
    return {"ok": text.strip()[:12]}
'''

WRONG_TYPE = '''
from djl_python.output_formatter import output_formatter


@output_formatter
def as_list(output):
    return [output.choices[0].text]
'''


async def test_a_raising_input_formatter_fails_its_request_with_424(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, FORMATTERS, tmp_path)) as http:
        failed, fine = await asyncio.gather(
            http.post("/invocations", json={"inputs": "no question"}),
            http.post("/invocations", json=ASKED))
    assert (failed.status_code, failed.json()) == (424, {
        "error": "the input formatter custom_input_formatter (model.py of the model) failed: "
                 "KeyError: 'question'", "code": 424})
    assert fine.status_code == 200 and len(engine.requests) == 1


async def test_an_output_formatter_returning_the_wrong_type_fails_its_request(tmp_path):
    async with client(app_for(FakeEngine(), WRONG_TYPE, tmp_path)) as http:
        answer = await http.post("/invocations", json={"inputs": "a b"})
    assert (answer.status_code, answer.json()) == (424, {
        "error": "the output formatter as_list (model.py of the model) returned list: it must "
                 "return a dict, a str or a pydantic model", "code": 424})


async def test_a_formatter_failing_mid_stream_ends_that_stream_only(tmp_path):
    engine = FakeEngine()
    async with client(app_for(engine, RAISES_ON, tmp_path)) as http:
        broken, fine = await asyncio.gather(
            http.post("/invocations", json={"inputs": "a boom c d e f", "stream": True,
                                            "parameters": {"max_new_tokens": 6}}),
            http.post("/invocations", json={"inputs": "x y", "stream": True,
                                            "parameters": {"max_new_tokens": 2}}))
        first = await http.post("/invocations", json={"inputs": "boom", "stream": True})
    assert broken.status_code == 200
    assert lines(broken)[-1] == {
        "error": "the output formatter fragile (model.py of the model) failed: RuntimeError: "
                 "cannot format boom", "code": 424}
    assert [line["ok"][:6] for line in lines(broken)[:-1]] == ["data: "]  # " a" went out
    # the two ran together: either may have reached the engine first
    [broken_id] = [r.request_id for r in engine.requests if "boom c" in str(r.prompt)]
    assert broken_id in engine.aborted and broken_id not in engine.finished
    assert fine.status_code == 200 and lines(fine)[-1] == {"ok": "data: [DONE]"}
    # a failure before anything was sent is the request's status
    assert (first.status_code, first.json()["code"]) == (424, 424)
