"""The OpenAI protocol without a model: validation, conversion, chat prompts, answers rendered
from hand-made engine outputs, tool calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    RequestValidationError,
    SequenceOutput,
    Token,
    TopToken,
)
from handlers.protocols.chat.admit import engine_refusal, fit_to_context
from handlers.protocols.chat.answer import (
    PLAIN,
    ChatOptions,
    ResponseContext,
    ToolExtractor,
)
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.chat.structured import (
    MAX_PARALLEL_CALLS,
    required_calls_schema,
    structured_output,
)
from handlers.protocols.chat.tool_calls import collect_calls, format_call
from handlers.protocols.chat.tool_parsers import call_parser
from handlers.protocols.openai import (
    ChatStream,
    CompletionOptions,
    CompletionStream,
    prepare_chat,
    prepare_completion,
    render_chat_completion,
    render_completion,
)
from handlers.protocols.openai.parse import parse_chat_request, parse_completion_request
from handlers.protocols.outputs import Folded
from handlers.server.status import HTTP

MODEL = "test-model"
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                  "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}")


def tokenizer(template: str = PLAIN_TEMPLATE) -> HFTokenizer:
    vocab = {w: i for i, w in enumerate(["[UNK]", "hi", "Paris", "is", "nice", "<|end|>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = template
    return HFTokenizer(tok, eos_token_ids=[5])


def status(error: OpenAIError) -> int:
    """The HTTP status the server answers the error with."""
    return HTTP[error.kind]


def refusal(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body)
    return info.value


def chat_refusal(**fields) -> OpenAIError:
    return refusal(parse_chat_request, {"messages": USER, **fields})


def completion_refusal(**fields) -> OpenAIError:
    return refusal(parse_completion_request, {"prompt": "hi", **fields})


# -- validation: 400s that name the field ---------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
    ({"stop": ["x" * 20000, "y" * 20000]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stream": "yes please"}, "stream"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER] * 33}, "tools"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools[0].type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_chat_out_of_range_fields_are_400s_naming_the_field(fields, param):
    error = chat_refusal(**fields)
    assert (status(error), error.param) == (400, param)
    assert error.message.startswith(param)


def test_error_payload_is_openais_shape():
    error = chat_refusal(temperature=3)
    assert error.payload(status(error)) == {"error": {
        "message": "temperature: Input should be less than or equal to 2 (got 3)",
        "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
])
def test_bad_message_lists(body, param):
    assert refusal(parse_chat_request, body).param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
])
def test_completion_refusals(fields, param):
    error = completion_refusal(**fields)
    assert (status(error), error.param) == (400, param)


def test_suffix_is_appended_to_every_completion_whole_and_streamed():
    """Databricks' Foundation Model API: a string appended to the end of every completion."""
    opts = CompletionOptions(prompts=("a",), n=2, suffix="<END>")
    col = collect(out(seq(0, [tok(1, " x")], FinishReason.LENGTH),
                      seq(1, [tok(2, " y")], FinishReason.EOS), finished=True))
    assert [c["text"] for c in render_completion(CTX, opts, [col])["choices"]] == [
        " x<END>", " y<END>"]
    stream = CompletionStream(CTX, opts)
    chunks = stream.feed(0, out(seq(0, [tok(1, " x")]), seq(1, [tok(2, " y")])))
    chunks += stream.feed(0, out(seq(0, [tok(3, " z")], FinishReason.LENGTH),
                                 seq(1, [], FinishReason.EOS), finished=True))
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts == [" x", " y", " z<END>", "<END>"]


def test_unknown_fields_are_ignored_and_listed():
    request = parse_chat_request({"messages": USER, "frobnicate": 1, "user": "u1"})
    assert request.ignored_fields == ["frobnicate"]


def test_null_means_default():
    body = {"messages": USER, "temperature": None, "stream": None, "stop": None, "top_k": None,
            "seed": None, "n": None, "skip_special_tokens": None, "repetition_penalty": None}
    params = prepare_chat(body, tokenizer(), MODEL, PLAIN).gen.params
    assert params.do_sample and params.temperature == 1.0 and params.stop_sequences == []
    assert params.skip_special_tokens and params.repetition_penalty == 1.0 and params.n == 1


# -- conversion -----------------------------------------------------------------------------------

def chat_params(**fields):
    return prepare_chat({"messages": USER, **fields}, tokenizer(), MODEL, PLAIN).gen.params


def test_sampling_fields_reach_the_engine():
    params = chat_params(temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, seed=7, n=2,
                         presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                         stop="END", stop_token_ids=[5], logit_bias={"3": -100},
                         ignore_eos=True, include_stop_str_in_output=True,
                         skip_special_tokens=False, min_tokens=2, logprobs=True, top_logprobs=4)
    assert params.do_sample and params.temperature == 0.5
    assert (params.top_p, params.top_k, params.min_p, params.seed, params.n) == (0.9, 40, 0.1, 7, 2)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.2
    assert params.stop_sequences == ["END"] and params.stop_token_ids == [5]
    assert params.logit_bias == {3: -100}
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert (params.min_new_tokens, params.top_logprobs) == (2, 4)


def test_openai_samples_by_default_and_temperature_zero_is_greedy():
    assert chat_params().do_sample
    assert not chat_params(temperature=0).do_sample
    assert chat_params(top_k=-1).top_k == 0


def test_top_logprobs_only_with_logprobs():
    assert chat_params(logprobs=False).top_logprobs == 0
    assert chat_params(logprobs=True, top_logprobs=3).top_logprobs == 3


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs():
    job = prepare_completion({"prompt": "hi", "echo": True, "logprobs": 2}, tokenizer(), MODEL)
    assert job.gens[0].params.prompt_logprobs and job.gens[0].params.top_logprobs == 2
    plain = prepare_completion({"prompt": "hi", "echo": True}, tokenizer(), MODEL)
    assert not plain.gens[0].params.prompt_logprobs


def test_completion_prompt_forms():
    tok = tokenizer()
    assert [g.prompt for g in prepare_completion({"prompt": ["a", "b"]}, tok, MODEL).gens] == [
        "a", "b"]
    ids = prepare_completion({"prompt": [1, 2]}, tok, MODEL).gens
    assert [g.prompt_token_ids for g in ids] == [[1, 2]]
    lists = prepare_completion({"prompt": [[1], [2, 3]]}, tok, MODEL).gens
    assert [g.prompt_token_ids for g in lists] == [[1], [2, 3]]
    with pytest.raises(OpenAIError) as info:
        prepare_completion({"prompt": [[1], [99]]}, tok, MODEL)
    assert info.value.param == "prompt[1]"


def test_another_model_is_a_404():
    with pytest.raises(OpenAIError) as info:
        prepare_chat({"messages": USER, "model": "gpt-4"}, tokenizer(), MODEL, PLAIN)
    assert (status(info.value), info.value.param, info.value.code) == (
        404, "model", "model_not_found")
    assert prepare_chat({"messages": USER, "model": MODEL}, tokenizer(), MODEL, PLAIN)


def validated(job_gen: GenerationRequest, prompt_tokens: int) -> GenerationRequest:
    job_gen.prompt_token_ids = list(range(prompt_tokens))
    return job_gen


def test_output_length_null_is_up_to_the_context():
    job = prepare_chat({"messages": USER}, tokenizer(), MODEL, PLAIN)
    asked = job.gen.params.max_new_tokens
    fitted = fit_to_context(validated(job.gen, 10), job.request, 64)
    assert fitted.params.max_new_tokens == 54
    assert job.gen.params.max_new_tokens == asked  # a new request: the one given is unchanged


def test_output_length_beyond_the_context_names_the_field():
    job = prepare_chat({"messages": USER, "max_completion_tokens": 60, "max_tokens": 5},
                       tokenizer(), MODEL, PLAIN)
    with pytest.raises(OpenAIError) as info:
        fit_to_context(validated(job.gen, 10), job.request, 64)
    assert (info.value.param, info.value.code) == ("max_completion_tokens",
                                                   "context_length_exceeded")


def test_completions_default_to_16_tokens_and_null_means_the_context():
    job = prepare_completion({"prompt": "hi"}, tokenizer(), MODEL)
    fitted = fit_to_context(validated(job.gens[0], 4), job.request, 64)
    assert fitted.params.max_new_tokens == 16
    job = prepare_completion({"prompt": "hi", "max_tokens": None}, tokenizer(), MODEL)
    fitted = fit_to_context(validated(job.gens[0], 4), job.request, 64)
    assert fitted.params.max_new_tokens == 60


def test_engine_refusals_name_the_openai_field():
    long = engine_refusal(RequestValidationError(
        "inputs", "the prompt is 99 tokens, but the model's context is 64 tokens"), "messages")
    assert (long.param, long.code) == ("messages", "context_length_exceeded")
    bias = engine_refusal(RequestValidationError("logit_bias", "has an unknown id"), "prompt")
    assert (status(bias), bias.param) == (400, "logit_bias")


# -- chat prompts ---------------------------------------------------------------------------------

def prompt_of(messages, template: str = PLAIN_TEMPLATE, **fields) -> str:
    return prepare_chat({"messages": messages, **fields}, tokenizer(template), MODEL,
                        PLAIN).gen.prompt


def test_chat_template_renders_roles_and_text_parts():
    prompt = prompt_of([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text",
                                                                       "text": "two"}]},
        {"role": "assistant", "content": "ok"},
    ])
    assert prompt == "<system>be brief\n<user>one\ntwo\n<assistant>ok\n<assistant>"


PREFILLED = [*USER, {"role": "assistant", "content": "The answer is"}]


def test_continue_final_message_leaves_the_answer_open():
    assert prompt_of(PREFILLED, continue_final_message=True) == "<user>hi\n<assistant>The answer is"
    assert prompt_of(USER, add_generation_prompt=False) == "<user>hi\n"
    with pytest.raises(OpenAIError) as info:
        prompt_of(PREFILLED, continue_final_message=True, add_generation_prompt=True)
    assert info.value.param == "continue_final_message"


def test_echo_starts_the_answer_with_the_assistant_message_it_continues():
    def options(messages, **fields):
        request = parse_chat_request({"messages": messages, **fields})
        return ChatOptions.for_request(request)

    opts = options(PREFILLED, echo=True, continue_final_message=True)
    assert opts.echo_text == "The answer is"
    assert options(PREFILLED).echo_text == options([*PREFILLED, *USER], echo=True).echo_text == ""
    col = collect(out(seq(0, [tok(1, " 42")], FinishReason.EOS), finished=True))
    message = render_chat_completion(CTX, opts, col)["choices"][0]["message"]
    assert message["content"] == "The answer is 42"
    chunks = stream_chunks(opts, *TWO_STEPS)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "The answer is"}


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([*USER, {"role": "system", "content": "late"}], "messages[1].role", "only come first"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", "required"),
    ([{"role": "user", "content": None}], "messages[0].content", "required"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
     "messages[0].content[0].type", "text-only"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[0].type", "text-only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "text"),
])
def test_bad_messages_are_400s(messages, param, words):
    with pytest.raises(OpenAIError) as info:
        prompt_of(messages)
    assert info.value.param == param and words in info.value.message


def test_template_errors_are_400s():
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(OpenAIError) as info:
        prompt_of(USER, template)
    assert info.value.param == "messages" and "roles must alternate" in info.value.message


def test_tools_go_through_a_template_that_renders_them():
    prompt = prompt_of(USER, TOOLS_TEMPLATE, tools=[WEATHER])
    assert prompt.startswith("<tools>[") and '"get_weather"' in prompt
    assert "<tool_call>" not in prompt


def test_tools_go_into_the_system_message_when_the_template_ignores_them():
    prompt = prompt_of([{"role": "system", "content": "be brief"}, *USER], tools=[WEATHER])
    system = prompt.split("\n<user>")[0]
    assert system.startswith("<system>be brief\n\n") and "<tool_call>" in system
    assert '"name": "get_weather"' in system
    assert prompt_of(USER, tools=[WEATHER]).startswith("<system>")


def test_templates_with_transformers_own_tags_still_get_tools():
    template = TOOLS_TEMPLATE.replace("{{ m['content'] }}",
                                      "{% generation %}{{ m['content'] }}{% endgeneration %}")
    assert '"get_weather"' in prompt_of(USER, template, tools=[WEATHER]).split("\n")[0]


def test_tool_choice_none_hides_the_tools():
    assert prompt_of(USER, tools=[WEATHER], tool_choice="none") == prompt_of(USER)


def test_past_tool_calls_and_results_are_rendered():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plain = prompt_of(messages)
    assert format_call("get_weather", {"city": "Paris"}) in plain and "<tool>sunny" in plain
    native = prompt_of(messages, TOOLS_TEMPLATE)
    assert '"arguments": {"city": "Paris"}' in native


# -- structured output specs ----------------------------------------------------------------------

def structured(**fields):
    return structured_output(parse_chat_request({"messages": USER, **fields}))


def test_named_tool_choice_constrains_to_the_functions_parameters():
    spec = structured(tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}})
    assert spec.kind == "json_schema" and spec.param == "tools[0].function.parameters"
    assert json.loads(spec.spec) == WEATHER["function"]["parameters"]


def test_required_tool_choice_schema_accepts_only_offered_calls():
    other = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    spec = structured(tools=[WEATHER, other], tool_choice="required")
    schema = json.loads(spec.spec)
    assert schema == required_calls_schema(parse_chat_request(
        {"messages": USER, "tools": [WEATHER, other]}).tools)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "now", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],
                [{"name": "delete_all", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(structured(tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False).spec)
    assert single["maxItems"] == 1
    too_many = [{"name": "now", "arguments": {}}] * (MAX_PARALLEL_CALLS + 1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(too_many, schema)


def test_required_calls_keep_each_functions_own_definitions():
    """Each function's `$ref`s name its own root and `$defs`; called together, two functions
    that both define `Place` (differently) must each keep theirs."""
    def place(limit: int) -> dict:
        return {"type": "object", "properties": {"city": {"type": "string", "maxLength": limit}},
                "required": ["city"]}
    trip = {"type": "function", "function": {"name": "trip", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"},
                                         "back": {"$ref": "#"}},
        "$defs": {"Place": place(3)}}}}
    stay = {"type": "function", "function": {"name": "stay", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/definitions/Place"}},
        "required": ["at"], "definitions": {"Place": place(8)}}}}
    schema = json.loads(structured(tools=[trip, stay], tool_choice="required").spec)
    jsonschema.validate([{"name": "trip", "arguments": {"to": {"city": "Rio"},
                                                        "back": {"to": {"city": "Oz"}}}},
                         {"name": "stay", "arguments": {"at": {"city": "Augsburg"}}}], schema)
    for bad in ({"name": "trip", "arguments": {"to": {"city": "Paris"}}},
                {"name": "trip", "arguments": {"back": {"to": {"city": "Paris"}}}},
                {"name": "stay", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": ["object", "null"]}])
def test_a_tool_whose_parameters_are_not_an_object_is_refused(parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    error = chat_refusal(tools=[tool], tool_choice="required")
    assert status(error) == 400 and error.param == "tools[0].function.parameters"
    assert 'parameters must be a JSON schema of type "object"' in error.message


def test_a_forced_call_of_parameters_without_a_type_is_an_object():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}
    spec = structured(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(spec.spec)["type"] == "object"


def test_response_format_specs():
    assert structured(response_format={"type": "json_object"}).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = structured(response_format={"type": "json_schema",
                                       "json_schema": {"name": "r", "schema": schema}})
    assert (spec.kind, json.loads(spec.spec)) == ("json_schema", schema)
    assert structured(response_format={"type": "text"}) is None
    assert structured(tools=[WEATHER]) is None  # auto: the model chooses, nothing is forced


# -- tool-call parsing ----------------------------------------------------------------------------

NAMES = {"get_weather"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse_all(text: str, pieces: int = 1) -> tuple[str, list]:
    parser, content, deltas = call_parser(None, NAMES), "", []
    size = max(1, len(text) // pieces)
    for start in range(0, len(text), size):
        more, found = parser.feed(text[start:start + size])
        content, deltas = content + more, deltas + found
    more, found = parser.finish()
    return content + more, collect_calls(deltas + found)


@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_tool_call_blocks_parse_however_the_text_arrives(pieces):
    content, calls = parse_all(f"Let me check.\n{CALL}\n{CALL}", pieces)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})] * 2


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    ' [{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # unclosed
])
def test_bare_json_and_unclosed_calls(text):
    content, calls = parse_all(text, 5)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("text", [
    "The weather is <b>nice</b> {not json} today.",
    '{"name": "delete_everything", "arguments": {}}',
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    "ends with a partial tag <tool_",
])
def test_text_that_is_not_a_call_stays_text(text):
    assert parse_all(text, 4) == (text, [])


def test_text_is_released_as_soon_as_it_cannot_be_a_call():
    parser = call_parser(None, NAMES)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box> there") == ("<toolbox> there", [])


def test_forced_calls_are_read_from_constrained_output():
    named = ToolExtractor(ChatOptions(tool_mode="named", tool_names=frozenset(NAMES)))
    assert named.feed('{"city": "Oslo"}') == ("", [])
    assert [(c.name, c.arguments) for c in named.finish()[1]] == [
        ("get_weather", '{"city": "Oslo"}')]
    required = ToolExtractor(ChatOptions(tool_mode="required", tool_names=frozenset(NAMES)))
    _, deltas = required.feed('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert [c.name for c in collect_calls(deltas + required.finish()[1])] == ["get_weather"]


# -- rendering from engine outputs ----------------------------------------------------------------

def tok(token_id: int, text: str, logprob: float = -0.5, top: int = 0) -> Token:
    alts = [TopToken(token_id + k, f"alt{k}", logprob - k) for k in range(top)]
    return Token(token_id, text, logprob, top=alts)


def seq(index: int, tokens: list[Token], reason: FinishReason | None = None,
        generated: int = 0) -> SequenceOutput:
    return SequenceOutput(index, tokens, reason, None, sum(t.logprob or 0 for t in tokens),
                          generated or len(tokens))


def out(*seqs: SequenceOutput, finished: bool = False, prompt_logprobs=None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=100.0, first_token_time=100.25)
    return RequestOutput("r1", list(seqs), 7, metrics, finished, prompt_logprobs)


CTX = ResponseContext("chatcmpl-1", 1700000000, MODEL, lambda i: f"<{i}>")


def collect(*outputs: RequestOutput, start: float = 100.25) -> Folded:
    col = Folded()
    for k, output in enumerate(outputs):
        col.add(output, start + 0.05 * k)
    return col


def test_chat_completion_object():
    col = collect(out(seq(0, [tok(1, "Paris")])),
                  out(seq(0, [tok(2, " is"), tok(3, " nice")], FinishReason.EOS, 3),
                      finished=True))
    body = render_chat_completion(CTX, ChatOptions(), col)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1"
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "Paris is nice",
                                            "tool_calls": None}}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    # two tokens in one output share the 50 ms since the previous one: one time per token
    assert body["prefill_time"] == 250.0 and body["decode_time_arr"] == [25.0, 25.0]


def test_finish_reasons():
    for reason, expected in [(FinishReason.EOS, "stop"), (FinishReason.STOP, "stop"),
                             (FinishReason.LENGTH, "length")]:
        body = render_chat_completion(CTX, ChatOptions(),
                                      collect(out(seq(0, [tok(1, "x")], reason), finished=True)))
        assert body["choices"][0]["finish_reason"] == expected


def test_chat_logprobs_shape():
    col = collect(out(seq(0, [tok(1, "Pa", top=2), Token(1, "ris", None)], FinishReason.LENGTH,
                          1), finished=True))
    body = render_chat_completion(CTX, ChatOptions(logprobs=True, top_logprobs=2), col)
    content = body["choices"][0]["logprobs"]["content"]
    assert content == [{"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>"), "top_logprobs": [
        {"token": "alt0", "logprob": -0.5, "bytes": list(b"alt0")},
        {"token": "alt1", "logprob": -1.5, "bytes": list(b"alt1")}]}]


def test_n_choices_with_best_of_ranking():
    col = collect(out(seq(0, [tok(1, "a", -3.0)], FinishReason.LENGTH),
                      seq(1, [tok(2, "b", -1.0)], FinishReason.LENGTH),
                      seq(2, [tok(3, "c", -2.0)], FinishReason.LENGTH), finished=True))
    opts = CompletionOptions(prompts=("p",), n=2)
    body = render_completion(CTX, opts, [col])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "b"), (1, "c")]
    assert body["usage"]["completion_tokens"] == 2


def test_chat_tool_call_answer():
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    col = collect(out(seq(0, [tok(1, text)], FinishReason.EOS), finished=True))
    opts = ChatOptions(tool_mode="auto", tool_names=frozenset(NAMES))
    choice = render_chat_completion(CTX, opts, col)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    cut = collect(out(seq(0, [tok(1, text)], FinishReason.LENGTH), finished=True))
    assert render_chat_completion(CTX, opts, cut)["choices"][0]["finish_reason"] == "length"


def stream_chunks(opts: ChatOptions, *outputs: RequestOutput) -> list[dict]:
    stream = ChatStream(CTX, opts)
    chunks = [c for o in outputs for c in stream.feed(o)]
    assert stream.done
    return chunks


TWO_STEPS = (out(seq(0, [tok(1, "Hello")])),
             out(seq(0, [tok(2, " there")], FinishReason.EOS, 2), finished=True))


def test_chat_stream_with_include_usage():
    chunks = stream_chunks(ChatOptions(include_usage=True), *TWO_STEPS)
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hello"},
                      {"content": " there"}, None]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_chat_stream_without_include_usage_puts_usage_on_the_final_chunk():
    chunks = stream_chunks(ChatOptions(), *TWO_STEPS)
    assert ["usage" in c for c in chunks] == [False, False, True]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_mindie_full_text_stream():
    chunks = stream_chunks(ChatOptions(full_text=True), *TWO_STEPS)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Hello"}, {"role": "assistant", "content": "Hello there"}]
    assert chunks[-1]["full_text"] == "Hello there" and "full_text" not in chunks[0]


def test_chat_stream_n2_opens_each_choice():
    chunks = stream_chunks(ChatOptions(n=2), out(seq(0, [tok(1, "a")]), seq(1, [tok(2, "b")])),
                           out(seq(0, [], FinishReason.LENGTH, 1),
                               seq(1, [], FinishReason.LENGTH, 1), finished=True))
    by_index: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["delta"].get(
                "content", "")
    assert by_index == {0: "a", 1: "b"}
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_chat_stream_tool_call_deltas():
    opts = ChatOptions(tool_mode="auto", tool_names=frozenset(NAMES))
    pieces = ["<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Rome"}}',
              "</tool_call>"]
    outputs = [out(seq(0, [tok(i, p)])) for i, p in enumerate(pieces)]
    outputs.append(out(seq(0, [], FinishReason.EOS, 4), finished=True))
    chunks = stream_chunks(opts, *outputs)
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_chat_stream_named_call_streams_its_arguments():
    opts = ChatOptions(tool_mode="named", tool_names=frozenset(NAMES))
    pieces = ['{"city"', ': "Rome"}']
    outputs = [out(seq(0, [tok(i, p)])) for i, p in enumerate(pieces)]
    outputs.append(out(seq(0, [], FinishReason.EOS, 2), finished=True))
    chunks = stream_chunks(opts, *outputs)
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert [c["index"] for c in calls] == [0, 0] and "id" not in calls[1]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_echo_and_logprobs():
    prompt = [Token(4, "hi", None), Token(5, " there", -2.0)]
    col = collect(out(seq(0, [tok(1, " you", top=1)], FinishReason.LENGTH), finished=True,
                      prompt_logprobs=prompt))
    opts = CompletionOptions(prompts=("hi there",), logprobs=1, echo=True)
    choice = render_completion(CTX, opts, [col])["choices"][0]
    assert choice["text"] == "hi there you"
    assert choice["logprobs"] == {
        "tokens": ["<4>", "<5>", "<1>"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"<5>": -2.0}, {"alt0": -0.5, "<1>": -0.5}],
        "text_offset": [0, 3, 6],
    }


def test_completion_stream_with_several_prompts():
    stream = CompletionStream(CTX, CompletionOptions(prompts=("a", "b"), n=1, echo=True,
                                                     include_usage=True))
    chunks = stream.feed(1, out(seq(0, [tok(1, " B")], FinishReason.LENGTH), finished=True))
    assert not stream.done
    chunks += stream.feed(0, out(seq(0, [tok(2, " A")], FinishReason.LENGTH), finished=True))
    assert stream.done
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks if c["choices"]]
    assert texts == [(1, "b B"), (0, "a A")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 14
