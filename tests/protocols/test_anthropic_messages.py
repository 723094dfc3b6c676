"""Anthropic's Messages API through the official `anthropic` client: against the shared real
server on SmolLM2 (text, stop sequences, forced tool use, a tool result, streaming, token
counting, errors, `/invocations` routing), and against the FakeEngine for what needs a scripted
engine or settings of its own (the API key, overload, a failure after the stream began).

This SDK no longer sends `temperature` as a parameter; `extra_body` carries it (0: greedy).
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.engine.types import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SequenceOutput,
    Token,
)
from handlers.protocols.anthropic.render import MessageContext, MessageStream
from handlers.protocols.chat.answer import ChatOptions

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
WEATHER_INPUT = {"type": "object", "properties": {"city": {"type": "string"}},
                 "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": WEATHER_INPUT}
PARIS_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **fields) -> anthropic.types.Message:
    return client.messages.create(**{"model": MODEL, "messages": CAPITAL, "max_tokens": 12,
                                     "extra_body": GREEDY, **fields})


@pytest.fixture(scope="module")
def capital(client) -> anthropic.types.Message:
    """One greedy answer several tests compare against."""
    return create(client)


def test_a_message_answers_in_a_text_block(capital):
    assert capital.type == "message" and capital.role == "assistant" and capital.model == MODEL
    assert capital.id.startswith("msg_")
    [block] = capital.content
    assert block.type == "text" and "Paris" in block.text
    assert capital.stop_reason in ("end_turn", "max_tokens") and capital.stop_sequence is None
    assert capital.usage.input_tokens > 0 and 0 < capital.usage.output_tokens <= 12


def test_count_tokens_is_the_input_tokens_of_the_same_message(client, capital):
    counted = client.messages.count_tokens(model=MODEL, messages=CAPITAL)
    assert counted.input_tokens == capital.usage.input_tokens
    system = "You answer in one word."
    answered = create(client, system=system, max_tokens=1)
    with_system = client.messages.count_tokens(model=MODEL, messages=CAPITAL, system=system)
    assert with_system.input_tokens == answered.usage.input_tokens
    assert with_system.input_tokens != capital.usage.input_tokens  # it replaced SmolLM2's own


def test_a_stop_sequence_ends_the_text_before_it(client, capital):
    stopped = create(client, stop_sequences=["Paris", "never said"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    text = stopped.content[0].text
    assert "Paris" not in text and capital.content[0].text.startswith(text + "Paris")


def test_tool_choice_any_forces_a_tool_use_whose_input_fits_the_schema(client):
    answer = create(client, messages=PARIS_WEATHER, max_tokens=40, tools=[WEATHER],
                    tool_choice={"type": "any"})
    assert answer.stop_reason == "tool_use"
    [call] = answer.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_INPUT)
    counted = client.messages.count_tokens(model=MODEL, messages=PARIS_WEATHER, tools=[WEATHER],
                                           tool_choice={"type": "any"})
    assert counted.input_tokens == answer.usage.input_tokens


def test_a_tool_result_is_read_in_the_next_turn(client):
    called = create(client, messages=PARIS_WEATHER, max_tokens=40, tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "get_weather"})
    [call] = called.content
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": [{"type": "text", "text": "Sunny, 22 degrees Celsius"}]}
    conversation = [*PARIS_WEATHER, called.to_param(), {"role": "user", "content": [result]}]
    answer = create(client, messages=conversation, max_tokens=30, tools=[WEATHER],
                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert "22" in answer.content[0].text
    assert client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER],
                                        tool_choice={"type": "none"}
                                        ).input_tokens == answer.usage.input_tokens


def test_streamed_text_deltas_add_up_to_the_final_message(client, capital):
    with client.messages.stream(model=MODEL, messages=CAPITAL, max_tokens=12,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert "".join(deltas) == final.content[0].text == capital.content[0].text
    assert final.stop_reason == capital.stop_reason
    assert final.usage == capital.usage


def test_a_streamed_forced_tool_use_arrives_as_input_json(client):
    with client.messages.stream(model=MODEL, messages=PARIS_WEATHER, max_tokens=40,
                                tools=[WEATHER], tool_choice={"type": "any"},
                                extra_body=GREEDY) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds and set(kinds) == {"input_json_delta"}
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER_INPUT)


def test_a_missing_max_tokens_is_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, messages=CAPITAL, max_tokens=anthropic.omit)
    assert refused.value.type == "invalid_request_error"
    assert "max_tokens" in refused.value.api_message


def test_an_image_is_a_bad_request_for_a_text_model(client):
    image = {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[{"role": "user", "content": [image]}])
    assert "text-only" in refused.value.api_message


def test_another_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as refused:
        create(client, model="no-such-model")
    assert refused.value.type == "not_found_error"
    assert MODEL in refused.value.api_message


def test_invocations_routes_anthropic_bodies_and_still_routes_openai_chat(served):
    body = {"messages": CAPITAL, "max_tokens": 4, "temperature": 0}
    bedrock = httpx.post(f"{served.url}/invocations", timeout=60,
                         json={**body, "anthropic_version": "bedrock-2023-05-31"}).json()
    with_header = httpx.post(f"{served.url}/invocations", json=body, timeout=60,
                             headers={"anthropic-version": "2023-06-01"}).json()
    with_system = httpx.post(f"{served.url}/invocations", timeout=60,
                             json={**body, "system": "You are a geography teacher."}).json()
    chat = httpx.post(f"{served.url}/invocations", json=body, timeout=60).json()
    assert bedrock["type"] == with_header["type"] == with_system["type"] == "message"
    assert bedrock["content"] == with_header["content"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == bedrock["content"][0]["text"]


# -- the FakeEngine: settings and failures of its own ---------------------------------------------


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    with serving(served_app(FakeEngine(), api_key="s3cret")) as url:
        yield url


def fake_create(url: str, api_key: str = "unused", **fields) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0)
    return client.messages.create(**{"model": "fake-model", "max_tokens": 3,
                                     "messages": [{"role": "user", "content": "a b"}], **fields})


def test_with_the_api_key_on_a_wrong_key_is_an_authentication_error(keyed_url):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        fake_create(keyed_url, api_key="wrong")
    assert refused.value.status_code == 401 and refused.value.type == "authentication_error"
    assert fake_create(keyed_url, api_key="s3cret").stop_reason == "max_tokens"


def test_an_overloaded_server_is_an_overloaded_error():
    with serving(served_app(FakeEngine(), job_queue_size=0)) as url, \
            pytest.raises(anthropic.OverloadedError) as refused:
        fake_create(url)
    assert refused.value.status_code == 529 and refused.value.type == "overloaded_error"


def test_a_failure_after_the_stream_began_is_an_error_event():
    with serving(served_app(FakeEngine())) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as failed, client.messages.stream(
                model="fake-model", max_tokens=9,
                messages=[{"role": "user", "content": "a b [[error:2]]"}]) as stream:
            seen.extend(stream.text_stream)
    assert seen  # text arrived before the failure
    assert failed.value.type == "api_error" and "generation failed" in failed.value.api_message


def test_a_stop_sequence_streamed_early_in_pieces_never_reaches_the_client():
    """An engine (vLLM, asked to keep the stop sequence in its text) may stream its first
    characters before it knows they end the text: the stream holds them back."""
    stream = MessageStream(MessageContext("msg_1", "m", ChatOptions(), ("STOP",)))

    def output(text: str, reason: FinishReason | None = None) -> RequestOutput:
        seq = SequenceOutput(0, [Token(1, text, 0.0)], reason, generated_tokens=1)
        return RequestOutput("r", [seq], 3, RequestMetrics(0.0), finished=reason is not None)

    events = [event for piece, reason in [("Hello S", None), ("T", None), ("OP", FinishReason.STOP)]
              for event in stream.feed(output(piece, reason))]
    texts = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    [end] = [e["delta"] for e in events if e["type"] == "message_delta"]
    assert "".join(texts) == "Hello "
    assert end == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_a_content_block_whose_type_is_not_a_string_is_a_bad_request(keyed_url):
    """/invocations routes `messages` by their blocks' types: one that is a list (found by the
    fuzzer) is OpenAI chat's invalid request, not a server error."""
    body = {"messages": [{"role": "user", "content": [{"type": []}]}], "max_tokens": 3}
    answer = httpx.post(f"{keyed_url}/invocations", json=body, timeout=60,
                        headers={"Authorization": "Bearer s3cret"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] is not None
