"""A reasoning model's thinking in each chat protocol's own field (option.reasoning_parser), on
scripted engine output, with the real clients: OpenAI chat's `reasoning_content` (streamed as
deltas of their own), Anthropic's `thinking` blocks, the Responses API's `reasoning` items. LMI
keeps the raw text. Without a parser the text is all answer, as before."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from fakes import ScriptedEngine, served_app
from server_process import running_server, serving

MODEL = "fake-model"
THINKING = ["Okay", ", the", " user", " wants", " a", " city", "."]
ANSWER = [" Paris", " is", " the", " capital", "."]
UNCLOSED = tuple(THINKING)  # a DeepSeek-R1 output cut before it closed its thinking
CLOSED = (*THINKING, "</think>", "\n\n", *ANSWER)
TAGGED = ("<think>", *THINKING, "</think>", "\n\n", *ANSWER)
CHAT = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture
def serve():
    """`serve(script, parser)`: the URL of a server whose engine answers `script`."""
    with_servers = []

    def start(script: tuple[str, ...], parser: str | None) -> str:
        server = serving(served_app(ScriptedEngine(script=script), reasoning_parser=parser))
        with_servers.append(server)
        return server.__enter__()

    yield start
    for server in reversed(with_servers):
        server.__exit__(None, None, None)


def chat_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_deepseek_r1_output_without_a_close_is_all_reasoning(serve):
    client = chat_client(serve(UNCLOSED, "deepseek_r1"))
    message = client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message
    assert message.content is None
    assert message.reasoning_content == "".join(THINKING)  # vLLM's field (an extra here)
    assert message.model_extra["reasoning"] == "".join(THINKING)
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True) if chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        "".join(THINKING)
    assert "".join(d.content or "" for d in deltas) == ""
    assert len([d for d in deltas if d.model_extra.get("reasoning_content")]) > 1  # streamed


def test_qwen3_takes_the_same_output_as_all_answer(serve):
    client = chat_client(serve(UNCLOSED, "qwen3"))
    message = client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message
    assert message.content == "".join(THINKING) and message.reasoning_content is None


def test_openai_chat_splits_the_thinking_from_the_answer_whole_and_streamed(serve):
    client = chat_client(serve(TAGGED, "qwen3"))
    message = client.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message
    assert (message.reasoning_content, message.content) == ("".join(THINKING),
                                                            "\n\n" + "".join(ANSWER))
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert (reasoning, "".join(d.content or "" for d in deltas)) == (
        message.reasoning_content, message.content)
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(d.model_extra.get("reasoning_content") for d in deltas[first_answer:])


def test_anthropic_shows_the_thinking_as_a_thinking_block(serve):
    client = anthropic.Anthropic(base_url=serve(CLOSED, "deepseek_r1"), api_key="x")
    message = client.messages.create(model=MODEL, max_tokens=32, messages=CHAT)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "".join(THINKING)
    assert message.content[1].text == "\n\n" + "".join(ANSWER)
    with client.messages.stream(model=MODEL, max_tokens=32, messages=CHAT) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert [block.type for block in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == "".join(THINKING)
    assert any(e.type == "thinking" for e in events)  # the SDK's thinking_delta events
    assert streamed.content[1].text == message.content[1].text


def test_responses_shows_the_thinking_as_a_reasoning_item(serve):
    client = chat_client(serve(CLOSED, "deepseek_r1"))
    response = client.responses.create(model=MODEL, input="Capital of France?")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "".join(THINKING)
    assert response.output_text == "\n\n" + "".join(ANSWER)
    with client.responses.stream(model=MODEL, input="Capital of France?") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_lmi_keeps_the_raw_text_and_no_parser_keeps_it_all_answer(serve):
    url = serve(CLOSED, "deepseek_r1")
    raw = httpx.post(f"{url}/invocations", json={"inputs": "hi"}).json()["generated_text"]
    assert raw == "".join(CLOSED)
    plain = chat_client(serve(CLOSED, None)).chat.completions.create(model=MODEL, messages=CHAT)
    assert plain.choices[0].message.content == "".join(CLOSED)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


def engine_of(serve_with) -> tuple[str, ScriptedEngine]:
    engine = ScriptedEngine(script=CLOSED)
    return serve_with(engine), engine


@pytest.fixture
def serve_engine():
    servers = []

    def start(engine: ScriptedEngine, parser: str = "deepseek_r1") -> str:
        server = serving(served_app(engine, reasoning_parser=parser))
        servers.append(server)
        return server.__enter__()

    yield start
    for server in reversed(servers):
        server.__exit__(None, None, None)


def test_thinking_switched_off_per_request_makes_all_of_it_the_answer(serve_engine):
    """chat_template_kwargs' enable_thinking (vLLM's), Anthropic's `thinking: disabled` and
    the Responses API's `reasoning.effort: none` reach the template, and the output is all
    answer."""
    url, engine = engine_of(serve_engine)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat_client(url).chat.completions.create(
        model=MODEL, messages=CHAT, extra_body=off).choices[0].message
    assert message.content == "".join(CLOSED)
    assert not message.model_extra.get("reasoning_content")
    assert engine.requests[-1].prompt.endswith("<|assistant|> <think></think>")
    claude = anthropic.Anthropic(base_url=url, api_key="x")
    answer = claude.messages.create(model=MODEL, max_tokens=32, messages=CHAT,
                                    extra_body={"thinking": {"type": "disabled"}})
    assert [block.type for block in answer.content] == ["text"]
    assert engine.requests[-1].prompt.endswith("<think></think>")
    response = chat_client(url).responses.create(model=MODEL, input="hi",
                                                 reasoning={"effort": "none"})
    assert [item.type for item in response.output] == ["message"]
    assert response.reasoning.effort == "none"
    reserved = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


def test_earlier_thinking_given_back_is_dropped_from_the_prompt(serve_engine):
    url, engine = engine_of(serve_engine)
    claude = anthropic.Anthropic(base_url=url, api_key="x")
    first = claude.messages.create(model=MODEL, max_tokens=32, messages=CHAT)
    turns = [*CHAT, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": "And Spain?"}]
    claude.messages.create(model=MODEL, max_tokens=32, messages=turns)
    prompt = engine.requests[-1].prompt
    assert "Okay, the user" not in prompt and "Paris is the capital." in prompt
    client = chat_client(url)
    earlier = client.responses.create(model=MODEL, input="Capital of France?")
    later = client.responses.create(model=MODEL, input="And Spain?",
                                    previous_response_id=earlier.id)
    assert [item.type for item in later.output] == ["reasoning", "message"]
    assert "Okay, the user" not in engine.requests[-1].prompt


def test_a_thinking_budget_not_below_max_tokens_is_refused_as_anthropic_does(serve_engine):
    url, _ = engine_of(serve_engine)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens"):
        claude.messages.create(model=MODEL, max_tokens=32, messages=CHAT, extra_body={
            "thinking": {"type": "enabled", "budget_tokens": 2048}})


@pytest.fixture(scope="module")
def thinking_server(tiny_dir):
    """The tiny random model served as a DeepSeek-R1-shaped reasoning model: its thinking never
    ends by itself, so a thinking budget ends it."""
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        "option.dtype=fp32", env={"OPTION_REASONING_PARSER": "deepseek_r1"}) as url:
        yield url


def test_a_real_server_answers_unclosed_thinking_as_reasoning_only(thinking_server):
    """OPTION_REASONING_PARSER=deepseek_r1 on a served model that never closes its thinking:
    the answer is all `reasoning_content`, no `content`, streamed as reasoning deltas."""
    client = chat_client(thinking_server)
    body = {"model": "tiny-llama", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    message = client.chat.completions.create(**body).choices[0].message
    assert message.reasoning_content and message.content is None
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True)
              if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_a_json_schema_answer_after_the_thinking_validates(thinking_server):
    client = chat_client(thinking_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(2):
        message = client.chat.completions.create(
            model="tiny-llama", messages=CHAT, response_format=fmt, seed=seed, max_tokens=80,
            extra_body={"thinking_token_budget": 5}).choices[0].message
        assert message.reasoning_content  # free text, then the budget closed it
        jsonschema.validate(json.loads(message.content), PERSON)
    refused = httpx.post(f"{thinking_server}/v1/chat/completions", json={
        "messages": CHAT, "thinking_token_budget": 5,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == \
        "thinking_token_budget"


def test_a_forced_call_after_the_thinking_validates_whole_and_streamed(thinking_server):
    client = chat_client(thinking_server)
    tools = [{"type": "function", "function": {"name": "register", "parameters": PERSON}}]
    forced = {"type": "function", "function": {"name": "register"}}
    body = {"model": "tiny-llama", "messages": CHAT, "tools": tools, "tool_choice": forced,
            "max_tokens": 80, "temperature": 0, "extra_body": {"thinking_token_budget": 4}}
    message = client.chat.completions.create(**body).choices[0].message
    assert message.reasoning_content and not message.content
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), PERSON)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True)
              if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    arguments = "".join(call.function.arguments or "" for d in deltas
                        for call in d.tool_calls or [])
    assert reasoning == message.reasoning_content
    jsonschema.validate(json.loads(arguments), PERSON)
