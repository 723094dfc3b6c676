"""The same model.py files inside DJL's own code, driven by DJL's TestHandler, give the bodies
this server gives where both apply: DJL LMI's vLLM handler's formatters
(tests/djl_formatter_reference.py, over a server of this project in vLLM's place), and DJL's own
handler for SageMaker inference-toolkit scripts (djl_python.sklearn_handler) with the four
functions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from optional_deps import need

need("djl_python", "needs DJL's djl_python 0.36.0, which no registry carries: ./dev test "
     "installs it from ../shared/vendor when that folder exists")

import djl_python.sklearn_handler as sklearn_handler  # noqa: E402
from djl_formatter_reference import (  # noqa: E402
    VllmFormatterReference,
    body,
    convert_lmi_schema_to_completion_request,
)
from djl_python.inputs import Input  # noqa: E402
from djl_python.test_model import TestHandler as DjlTestHandler  # noqa: E402
from fakes import FakeEngine, FakeTokenizer, served_app  # noqa: E402
from model_py_files import (  # noqa: E402
    ADAPTER_INPUT,
    ADAPTER_OUTPUT,
    FORMATTERS,
    PASS_THROUGH,
    SAGEMAKER_TABULAR,
    write,
)
from server_process import serving  # noqa: E402

from handlers.djl.lmi_completion import as_completion  # noqa: E402
from handlers.djl.model_code import load  # noqa: E402

MODEL = "fake-model"
ADAPTER = "X-Amzn-SageMaker-Adapter-Identifier"


def djl_request(data: bytes, **properties: str) -> Input:
    item = Input()
    item.properties.update({"Content-Type": "application/json", **properties})
    item.content.add("data", data)
    return item


def test_handler(handle, model_dir: Path) -> DjlTestHandler:
    """DJL's TestHandler over `handle` (it resets `_service.initialized`, which it needs)."""
    return DjlTestHandler(SimpleNamespace(handle=handle,
                                          _service=SimpleNamespace(initialized=True)),
                          str(model_dir))


test_handler.__test__ = False  # a helper, not a test


def both(model_dir: Path, adapters: tuple[str, ...] = ()):
    """(this server with the model.py, DJL's handler with it over a server without), served."""
    codes = load([model_dir], {name: model_dir / "adapters" / name for name in adapters})
    ours = served_app(FakeEngine(adapters=adapters), model_code=codes)
    plain = served_app(FakeEngine(adapters=adapters))
    return ours, plain


@pytest.mark.parametrize("sent", [
    {"inputs": "a b"},
    {"inputs": "a b", "parameters": {"max_new_tokens": 5, "details": True, "temperature": 0.7,
                                     "decoder_input_details": True, "do_sample": False}},
    {"inputs": "a b", "stream": True, "parameters": {
        "return_full_text": True, "top_n_tokens": 2, "truncate": 3, "ignore_eos_token": True,
        "do_sample": True, "top_k": 5, "stop": ["x"], "seed": 7}},
])
def test_an_lmi_body_becomes_the_completion_djl_makes_of_it(sent):
    djls, _details, _prompt = convert_lmi_schema_to_completion_request(
        {**copy.deepcopy(sent), "model": MODEL})
    # vLLM's own switches, and the served model's name, which this server's completions need not
    vllm_only = {"model", "return_tokens_as_token_ids"}
    expected = {k: v for k, v in djls.items() if k not in vllm_only and v is not None}
    if "stream_options" in expected:
        expected["stream_options"] = {"include_usage": True}  # less continuous_usage_stats
    assert as_completion(copy.deepcopy(sent), dynamic=False) == expected


@pytest.fixture(scope="module")
def formatted(tmp_path_factory):
    """URLs of this server and DJL's TestHandler, over FORMATTERS and two adapters' own."""
    model_dir = write(tmp_path_factory.mktemp("djl") / "model", FORMATTERS)
    write(model_dir / "adapters" / "alpha", ADAPTER_INPUT)
    write(model_dir / "adapters" / "beta", ADAPTER_OUTPUT)
    ours, plain = both(model_dir, ("alpha", "beta"))
    with serving(ours) as ours_url, serving(plain) as plain_url:
        reference = VllmFormatterReference(plain_url, MODEL, FakeTokenizer())
        yield ours_url, test_handler(reference.handle, model_dir)


@pytest.mark.parametrize(("sent", "headers"), [
    ({"question": "the quick brown fox"}, {}),
    ({"question": "the quick brown fox", "length": 3, "stream": True}, {}),
    ({"question": "hi there"}, {ADAPTER: "alpha"}),
    ({"question": "hi there", "stream": True}, {ADAPTER: "alpha"}),
    ({"question": "hi there", "adapters": "beta"}, {}),
    ({"question": "the end", "adapters": "alpha", "stream": True}, {}),
])
def test_djls_formatting_gives_the_same_bodies(formatted, sent, headers):
    url, djl = formatted
    data = json.dumps(sent).encode()
    ours = httpx.post(f"{url}/invocations", content=data, headers=headers, timeout=60)
    theirs, content_type, code = body(djl.inference(djl_request(data, **headers)))
    assert (ours.status_code, code) == (200, 200)
    assert ours.content == theirs
    assert ours.headers["content-type"] == content_type


def test_a_failing_input_formatter_is_a_424_in_both(formatted):
    url, djl = formatted
    data = json.dumps({"inputs": "no question"}).encode()
    ours = httpx.post(f"{url}/invocations", content=data, timeout=60)
    _theirs, _content_type, code = body(djl.inference(djl_request(data)))
    assert ours.status_code == code == 424


def test_a_pydantic_answer_is_sent_as_its_json_in_both(tmp_path):
    model_dir = write(tmp_path / "model", PASS_THROUGH)
    ours, plain = both(model_dir)
    sent = [{"inputs": "one two three", "parameters": {"max_new_tokens": 3, "details": True}},
            {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}]
    with serving(ours) as ours_url, serving(plain) as plain_url:
        reference = VllmFormatterReference(plain_url, MODEL, FakeTokenizer())
        djl = test_handler(reference.handle, model_dir)
        for one in sent:
            data = json.dumps(one).encode()
            answer = httpx.post(f"{ours_url}/invocations", content=data, timeout=60)
            theirs, _content_type, _code = body(djl.inference(djl_request(data)))
            assert answer.text.endswith("}\n") and theirs.endswith(b"}\n")
            unique = ("id", "created", "prefill_time", "decode_time_arr")  # each answer's own
            mine, djls = answer.json(), json.loads(theirs)
            assert {k: v for k, v in mine.items() if k not in unique} == {
                k: v for k, v in djls.items() if k not in unique}


@pytest.mark.parametrize(("sent", "content_type", "accept"), [
    (b"1,2,3\n4,5,6\n", "text/csv", "text/csv"),
    (b'{"instances": [[1, 0, 0], [0, 1, 1]]}', "application/json", "application/json"),
])
def test_sagemakers_functions_answer_as_djls_own_handler(tmp_path, monkeypatch, sent,
                                                          content_type, accept):
    model_dir = write(tmp_path / "model", SAGEMAKER_TABULAR, {"weights.json": "[0.5, 2, -1]"})
    monkeypatch.setattr(sklearn_handler, "service", sklearn_handler.SklearnHandler())
    djl = test_handler(sklearn_handler.handle, model_dir)
    theirs = djl.inference(djl_request(sent, **{"Content-Type": content_type,
                                                "Accept": accept}))
    with serving(served_app(FakeEngine(), model_code=load([model_dir], {}))) as url:
        ours = httpx.post(f"{url}/invocations", content=sent, timeout=60,
                          headers={"Content-Type": content_type, "Accept": accept})
    assert ours.status_code == theirs.code == 200
    assert ours.content == bytes(theirs.content.value_at(0))
    assert ours.headers["content-type"].split(";")[0] == theirs.properties["Content-Type"]
