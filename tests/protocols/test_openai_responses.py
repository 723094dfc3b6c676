"""OpenAI's Responses API (`/v1/responses`): the official `openai` client against the real
SmolLM2 server (the session's shared one, tests/served_models.py), and against the FakeEngine for
what needs no model (event shapes, the store, refusals, admission, hang-ups). Every answer is
checked against the SDK's own pydantic types, validated strictly rather than constructed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import jsonschema
import openai
import orjson
import pytest
from fakes import FakeEngine, served_app
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.openai_responses import ResponseStore, Stored
from handlers.protocols.openai_responses.items import chat_messages
from handlers.protocols.openai_responses.prepare import ITEMS

MODEL = "smollm2-135m-instruct"
CAPITAL = "What is the capital of France?"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": CITY,
           "description": "Get the current weather in a city"}
FORCED = {"type": "function", "name": "get_weather"}
ASK_WEATHER = "What is the weather in Paris, in celsius?"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


def strict(response: Response) -> Response:
    """The response as the SDK's type validates it (the client only constructs it)."""
    return Response.model_validate(response.to_dict(warnings=False))


def squeeze(kinds: list[str]) -> list[str]:
    """Event types with runs of deltas as one."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or "delta" not in k]


# -- the real SmolLM2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def create(client: openai.OpenAI, **fields) -> Response:
    return strict(client.responses.create(**{"model": MODEL, "temperature": 0,
                                             "max_output_tokens": 16, **fields}))


@pytest.fixture(scope="module")
def capital(client) -> Response:
    """One greedy answer several tests compare against."""
    return create(client, input=CAPITAL)


@pytest.mark.e2e
def test_a_response_answers_as_the_chat_route_does_for_the_same_messages(client, capital):
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16,
                                          messages=[{"role": "user", "content": CAPITAL}])
    assert capital.object == "response" and capital.id.startswith("resp_")
    assert capital.output_text and "Paris" in capital.output_text
    assert capital.output_text == chat.choices[0].message.content  # greedy: the same answer
    usage = capital.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    message = capital.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert capital.status == message.status == ("completed" if chat.choices[0].finish_reason
                                                 == "stop" else "incomplete")


@pytest.mark.e2e
def test_instructions_are_the_system_message(client):
    answer = create(client, instructions="Answer in one word.", input=CAPITAL,
                    max_output_tokens=4)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": CAPITAL}])
    assert answer.instructions == "Answer in one word."
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content


@pytest.mark.e2e
def test_a_forced_function_call_has_valid_arguments_and_its_output_goes_back(client):
    called = create(client, input=ASK_WEATHER, tools=[WEATHER], tool_choice=FORCED,
                    max_output_tokens=40)
    assert called.status == "completed" and len(called.output) == 1
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temperature": 21}'}
    answered = create(client, previous_response_id=called.id, tools=[WEATHER],
                      tool_choice="none", input=[result])
    assert answered.output[0].type == "message" and answered.output_text
    # Its prompt holds the question, the call and its output: more than the question alone.
    alone = create(client, input=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                   max_output_tokens=1)
    assert answered.usage.input_tokens > alone.usage.input_tokens + called.usage.output_tokens


@pytest.mark.e2e
def test_a_streamed_function_call_streams_its_arguments(client):
    with client.responses.stream(model=MODEL, input=ASK_WEATHER, tools=[WEATHER],
                                 tool_choice=FORCED, temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = strict(stream.get_final_response())
    kinds = squeeze([e.type for e in events])
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    deltas = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert deltas == final.output[0].arguments == events[-3].arguments
    jsonschema.validate(json.loads(deltas), CITY)


@pytest.mark.e2e
def test_a_json_schema_text_format_is_followed(client):
    answer = create(client, input="Invent a person: name, age and pet, as JSON.",
                    max_output_tokens=48, text={"format": {
                        "type": "json_schema", "name": "person", "strict": True,
                        "schema": PERSON}})
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    assert answer.text.format.type == "json_schema" and answer.text.format.name == "person"


@pytest.mark.e2e
def test_previous_response_id_continues_the_conversation(client):
    first = create(client, input="My name is Ada.", max_output_tokens=8)
    alone = create(client, input="What is my name?", max_output_tokens=1)
    second = create(client, input="What is my name?", previous_response_id=first.id,
                    max_output_tokens=8)
    assert second.previous_response_id == first.id
    # The second prompt holds the first exchange: its question and the answer's tokens at least.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = create(client, input="And again?", previous_response_id=second.id,
                   max_output_tokens=1)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


@pytest.mark.e2e
def test_a_stored_response_is_retrieved_then_deleted(client, capital):
    got = strict(client.responses.retrieve(capital.id))
    assert got.model_dump() == capital.model_dump()
    client.responses.delete(capital.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(capital.id)
    assert capital.id in missing.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(capital.id)
    with pytest.raises(openai.BadRequestError) as unknown:
        create(client, input="Hi", previous_response_id=capital.id)
    assert unknown.value.code == "previous_response_not_found"


@pytest.mark.e2e
def test_store_false_keeps_nothing(client):
    answer = create(client, input="Hi", store=False, max_output_tokens=1)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


@pytest.mark.e2e
def test_a_stream_sends_events_in_order_and_its_deltas_make_the_answer(client):
    with client.responses.stream(model=MODEL, input=CAPITAL, temperature=0,
                                 max_output_tokens=64) as stream:
        events = list(stream)
        final = strict(stream.get_final_response())
    for event in events:
        EVENTS.validate_python(event.to_dict(warnings=False))
    assert squeeze([e.type for e in events]) == [*TEXT_EVENTS, "response.completed"]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))  # strictly increasing
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text and "Paris" in text
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert strict(client.responses.retrieve(final.id)).output_text == text


@pytest.mark.e2e
def test_max_output_tokens_makes_the_response_incomplete(client):
    answer = create(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert answer.status == "incomplete" and answer.output[0].status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 3
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.",
                                          max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.e2e
@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
])
def test_bad_requests_raise_bad_request_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": CAPITAL, **fields})
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.body["message"].startswith(param)


# -- without a model ---------------------------------------------------------------------------


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], orjson.loads(lines["data"])))
    return events


def test_stream_events_are_named_numbered_and_of_the_sdks_types(url):
    body = {"input": "a b c", "max_output_tokens": 4, "stream": True,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse(reply.text)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for _, data in events:
        EVENTS.validate_python(data)
    final = Response.model_validate(events[-1][1]["response"])
    assert events[-1][0] == "response.incomplete" and final.usage.output_tokens == 4
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == final.output_text
    logprobs = final.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [lp["token"] for d in deltas for lp in d["logprobs"]]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


def test_a_failure_mid_stream_is_a_response_failed_event(url):
    body = {"input": "a b [[error:2]]", "max_output_tokens": 8, "stream": True}
    events = sse(httpx.post(f"{url}/v1/responses", json=body, timeout=30).text)
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["message"].startswith("generation failed")
    Response.model_validate(data["response"])


def test_unknown_ids_are_404_in_openais_shape(url):
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        sdk.responses.retrieve("resp_missing")
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete("resp_missing")


def test_sent_back_items_continue_without_a_store(url):
    """A client that keeps its own history sends earlier output items back as input."""
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    first = sdk.responses.create(model="fake-model", input="a b", max_output_tokens=2,
                                 store=False)
    items = [{"role": "user", "content": "a b"}, *[i.to_dict() for i in first.output],
             {"role": "user", "content": [{"type": "input_text", "text": "c d"}]}]
    again = sdk.responses.create(model="fake-model", input=items, max_output_tokens=2)
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


async def test_admission_limits_and_hang_ups_apply_as_on_the_chat_route():
    engine = FakeEngine(token_delay=0.05)
    app = served_app(engine, job_queue_size=1)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://lmi") as http:
        held = asyncio.create_task(http.post("/v1/responses", json={"input": "a b"}))
        await engine.until(lambda: bool(engine.requests))
        refused = await http.post("/v1/responses", json={"input": "c"})
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"].startswith("the server is at its limit")
    assert len(engine.requests) == 1  # the refused request never reached the engine


async def test_hanging_up_a_stream_aborts_the_request(live_fake):
    engine, base = live_fake
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as sdk:
        stream = await sdk.responses.create(model="fake-model", input="a b",
                                            max_output_tokens=50, stream=True)
        first = await anext(aiter(stream))
        await stream.close()
    assert first.type == "response.created"
    rid = engine.requests[-1].request_id
    await engine.until(lambda: rid in engine.aborted)  # aborted before its 50 tokens


def test_the_store_keeps_the_most_recently_used_responses():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(Stored({"id": name, "output": [{"type": "message"}]}, [{"role": "user"}]))
    assert store.conversation("a") == [{"role": "user"}, {"type": "message"}]  # "a" used last
    store.put(Stored({"id": "c", "output": []}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")


def test_items_become_chat_messages_with_one_system_message_first():
    items = ITEMS.validate_python([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    assert chat_messages("Be kind.", items, 0) == [
        {"role": "system", "content": "Be kind.\n\nBe brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with pytest.raises(OpenAIError) as info:  # an output answering no call of the history
        chat_messages(None, items[:1] + items[4:], 1)
    assert info.value.param == "input[0].call_id"


def test_invocations_routes_a_responses_body(served, client):
    """SageMaker's /invocations answers a Responses body as POST /v1/responses does (and keeps
    it for retrieval); an `input` alone still means embeddings while an embedding model is
    served."""
    body = {"input": "Name a color.", "max_output_tokens": 8}
    answer = httpx.post(f"{served.url}/invocations", json=body, timeout=120).json()
    assert answer["object"] == "response" and answer["usage"]["output_tokens"] <= 8
    assert client.responses.retrieve(answer["id"]).output_text == \
        answer["output"][0]["content"][0]["text"]
    embedded = httpx.post(f"{served.url}/invocations", json={"input": "Name a color."},
                          timeout=120).json()
    assert embedded["object"] == "list" and embedded["data"][0]["object"] == "embedding"
