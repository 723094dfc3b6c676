"""TGI's routes with the clients TGI users have: `huggingface_hub.InferenceClient` (which posts
to `/`) and the `text-generation` client, plus plain HTTP, against a running server on the
FakeEngine (its answer echoes the prompt's words) and on the real SmolLM2."""

from __future__ import annotations

import asyncio
import re

import httpx
import jsonschema
import orjson
import pytest
import text_generation
from fakes import FakeEngine, served_app
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors
from server_process import serving

from handlers.engine.loop.watermark import z_score


@pytest.fixture(scope="module")
def hub(url) -> InferenceClient:
    return InferenceClient(model=url)


@pytest.fixture(scope="module")
def tgi(url) -> text_generation.Client:
    return text_generation.Client(url)


def sse(response: httpx.Response) -> list[dict]:
    chunks = response.text.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1])
    return [orjson.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


# --- huggingface_hub ----------------------------------------------------------------------------


def test_hub_client_text_and_tgis_full_text_default(hub):
    assert hub.text_generation("a b c", max_new_tokens=3) == "a b c a b c"  # POST / prepends
    assert hub.text_generation("a b c", max_new_tokens=3, return_full_text=False) == " a b c"


def test_hub_client_details(hub):
    out = hub.text_generation("a b", max_new_tokens=3, details=True, return_full_text=False,
                              decoder_input_details=True, top_n_tokens=2)
    details = out.details
    assert out.generated_text == " a b a"
    assert (details.finish_reason, details.generated_tokens, details.seed) == ("length", 3, None)
    assert [t.text for t in details.tokens] == [" a", " b", " a"]
    assert all(t.special is False and t.logprob == -1.0 for t in details.tokens)
    assert [t.text for t in details.prefill] == ["a", "b"] and details.prefill[0].logprob is None
    assert [len(top) for top in details.top_tokens] == [2, 2, 2]


def test_hub_client_streams_token_by_token(hub):
    assert list(hub.text_generation("x y", max_new_tokens=3, stream=True)) == [" x", " y", " x"]
    events = list(hub.text_generation("x y", max_new_tokens=2, stream=True, details=True,
                                      return_full_text=False))
    assert [e.token.text for e in events] == [" x", " y"]
    assert events[0].generated_text is None and events[0].details is None
    assert events[-1].generated_text == " x y"
    assert (events[-1].details.finish_reason, events[-1].details.generated_tokens) == (
        "length", 2)


def test_a_sampled_answer_reports_its_seed(hub):
    out = hub.text_generation("a", max_new_tokens=1, details=True, do_sample=True)
    assert isinstance(out.details.seed, int)
    assert hub.text_generation("a", max_new_tokens=1, details=True, seed=42,
                               temperature=0.5).details.seed == 42


@pytest.mark.parametrize("stream", [False, True])
def test_hub_client_raises_tgis_validation_and_generation_errors(hub, stream):
    def call(prompt: str, **fields):
        answer = hub.text_generation(prompt, max_new_tokens=2, stream=stream, **fields)
        return list(answer) if stream else answer

    with pytest.raises(hub_errors.ValidationError, match="`temperature` must be strictly"):
        call("a", temperature=0)
    with pytest.raises(hub_errors.ValidationError, match="`top_p` must be > 0.0 and < 1.0"):
        call("a", top_p=1.0)
    with pytest.raises(hub_errors.GenerationError, match="scripted error after 1 tokens"):
        call("a [[error:1]]")


# --- text-generation ----------------------------------------------------------------------------


def test_text_generation_client_generate_and_stream(tgi):
    response = tgi.generate("p q", max_new_tokens=3)
    assert response.generated_text == " p q p"
    assert [t.text for t in response.details.tokens] == [" p", " q", " p"]
    assert response.details.finish_reason == "length" and response.details.prefill == []
    pieces = [r.token.text for r in tgi.generate_stream("p q", max_new_tokens=3)]
    assert "".join(pieces) == response.generated_text


def test_text_generation_client_best_of_and_stop(tgi, engine):
    response = tgi.generate("a b c", max_new_tokens=4, best_of=2, do_sample=True)
    assert len(response.details.best_of_sequences) == 1
    tgi.generate("a b c", max_new_tokens=9, stop_sequences=[" c"])
    params = engine.requests[-1].params
    assert params.stop_sequences == [" c"] and params.include_stop_str_in_output  # TGI keeps it


def test_text_generation_client_errors(tgi):
    with pytest.raises(text_generation.errors.ValidationError, match="`best_of` must be"):
        tgi.generate("a", best_of=3, do_sample=True)
    with pytest.raises(text_generation.errors.GenerationError, match="scripted error"):
        tgi.generate("a [[error:0]]")
    with pytest.raises(text_generation.errors.GenerationError, match="scripted error"):
        list(tgi.generate_stream("a [[error:1]]"))


# --- plain HTTP ---------------------------------------------------------------------------------


def test_generate_is_an_object_and_compat_a_list_of_one(url):
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/generate", json=body).json() == {"generated_text": " a b"}
    assert httpx.post(f"{url}/", json=body).json() == [{"generated_text": "a b a b"}]


def test_generate_stream_events_in_tgis_shape(url):
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 2, "details": True}}
    response = httpx.post(f"{url}/generate_stream", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    first, last = sse(response)
    assert list(first) == ["index", "token", "generated_text", "details"]
    assert (first["index"], first["generated_text"], first["details"]) == (1, None, None)
    assert list(first["token"]) == ["id", "text", "logprob", "special"]
    assert (first["token"]["text"], first["token"]["special"]) == (" a", False)
    assert last["index"] == 2 and last["generated_text"] == " a b"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 2, "seed": None,
                               "input_length": 2}
    compat = httpx.post(f"{url}/", json={**body, "stream": True})
    assert sse(compat)[-1]["generated_text"] == " a b"


def test_info_and_health(url):
    info = httpx.get(f"{url}/info").json()
    assert info["model_id"] == "fake-model" and info["max_total_tokens"] == 64
    assert info["max_input_tokens"] == 63 and info["model_dtype"] == "float32"
    assert info["max_best_of"] == 2 and info["version"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.content == b""
    with serving(served_app(FakeEngine(), loaded=False)) as loading:
        unhealthy = httpx.get(f"{loading}/health")
    assert unhealthy.status_code == 503 and unhealthy.json()["error_type"] == "healthcheck"


@pytest.mark.parametrize(("body", "message"), [
    ({"inputs": 5}, "inputs: Input should be a valid string"),
    ({"parameters": {}}, "inputs: Field required"),
    ({"inputs": "a", "parameters": {"max_new_tokens": "3"}}, "parameters.max_new_tokens"),
    ({"inputs": "a", "parameters": {"stop": None}}, "parameters.stop"),
    ({"inputs": "", "parameters": {}}, "`inputs` cannot be empty"),
    ({"inputs": "a", "parameters": {"best_of": 3, "do_sample": True}}, "`best_of` must be > 0"),
    ({"inputs": "a", "parameters": {"top_n_tokens": 6}}, "`top_n_tokens` must be >= 0 and <= 5"),
    ({"inputs": "a", "parameters": {"stop": ["1", "2", "3", "4", "5"]}},
     "`stop` supports up to 4 stop sequences"),
    ({"inputs": "a", "parameters": {"max_new_tokens": 100}},
     "`inputs` tokens + `max_new_tokens` must be <= 64. Given: 1 `inputs` tokens and 100"),
    ({"inputs": "a", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}},
     "Grammar must have a 'properties' field"),
    ({"inputs": "a", "parameters": {"grammar": {"type": "xml", "value": "x"}}},
     "parameters.grammar.type"),
    ({"inputs": "a", "parameters": {"truncate": 0}}, "`truncate` must be strictly positive"),
])
def test_bad_requests_are_422_validation_errors(url, body, message):
    response = httpx.post(f"{url}/generate", json=body)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation" and message in response.json()["error"]


def test_broken_json_is_a_422_and_a_stream_reports_validation_as_an_event(url):
    broken = httpx.post(f"{url}/generate", content=b"{oops")
    assert broken.status_code == 422 and broken.json()["error_type"] == "validation"
    response = httpx.post(f"{url}/generate_stream", json={
        "inputs": "a", "parameters": {"best_of": 2, "do_sample": True}})
    assert response.status_code == 200
    assert sse(response) == [{"error": "Input validation error: `best_of` != 1 is not supported "
                                       "when streaming tokens", "error_type": "validation"}]


async def test_an_overloaded_server_answers_429_and_the_stream_an_event():
    engine = FakeEngine(token_delay=0.05)
    app = served_app(engine, job_queue_size=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        held = asyncio.create_task(http.post("/generate", json={
            "inputs": "a", "parameters": {"max_new_tokens": 50}}))
        await engine.until(lambda: bool(engine.requests))
        refused = await http.post("/generate", json={"inputs": "b"})
        stream = await http.post("/generate_stream", json={"inputs": "b"})
        held.cancel()
    assert refused.status_code == 429
    assert refused.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert sse(stream) == [{"error": "Model is overloaded", "error_type": "overloaded"}]


# --- the real model -----------------------------------------------------------------------------


@pytest.mark.e2e
def test_smollm2_stream_pieces_make_the_whole_answer(served):
    client = InferenceClient(model=served.url, timeout=120)
    prompt = "The capital of France is"
    whole = client.text_generation(prompt, max_new_tokens=12, details=True,
                                   return_full_text=False)
    pieces = list(client.text_generation(prompt, max_new_tokens=12, stream=True,
                                         return_full_text=False))
    assert "".join(pieces) == whole.generated_text and "Paris" in whole.generated_text
    assert len(whole.details.tokens) == whole.details.generated_tokens


@pytest.mark.e2e
def test_smollm2_grammars_constrain_the_answer(served):
    client = text_generation.Client(served.url, timeout=120)
    phone = client.generate("My phone number is", max_new_tokens=12, grammar={
        "type": "regex", "value": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", phone.generated_text)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"]}
    answer = client.generate("Describe Paris as JSON:", max_new_tokens=60,
                             grammar={"type": "json", "value": schema})
    assert answer.details.finish_reason != "length"
    jsonschema.validate(orjson.loads(answer.generated_text), schema)


@pytest.mark.e2e
def test_smollm2_watermarked_text_is_detected_and_plain_text_is_not(served):
    client = text_generation.Client(served.url, timeout=300)
    prompt = "Write a story about a dragon who learns to paint."
    vocab = 49152  # SmolLM2-135M's vocabulary: the width of its logits

    def ids(watermark: bool) -> list[int]:
        answer = client.generate(prompt, max_new_tokens=120, do_sample=True, seed=7,
                                 temperature=1.0, watermark=watermark)
        return [t.id for t in answer.details.tokens]

    previous = client.generate(prompt, max_new_tokens=1, decoder_input_details=True) \
        .details.prefill[-1].id
    assert z_score(ids(True), previous, vocab) > 4
    assert z_score(ids(False), previous, vocab) < 4
