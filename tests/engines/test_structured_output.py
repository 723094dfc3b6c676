"""Structured output: xgrammar-constrained decoding in the torch engine, on the tiny random model.

The random weights spread their probability almost evenly over the vocabulary, so an unbounded
JSON string would run for hundreds of tokens: the schemas bound every value (enums, maxLength,
minimum / maximum) and the grammar alone decides where the output ends.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pytest
import torch

from handlers.engine.grammars import Grammars, mask_logits
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestValidationError,
    SamplingParams,
    StructuredOutput,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "member"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}


def tool_calls_schema(functions: dict[str, dict]) -> dict:
    """What the protocol layer builds for tool_choice "required": a list of calls to the tools."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, "arguments": parameters},
              "required": ["name", "arguments"]}
             for name, parameters in functions.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def engine(loaded):
    """One engine for the module: its loop runs in its own thread, whatever the test's loop."""
    eng = TorchEngine(loaded, max_batch_size=8)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


async def run(engine, structured: StructuredOutput | None, prompt: str = "Reply in JSON:",
              **params) -> list[dict]:
    """Collect a request's sequences: their text, tokens and finish reason."""
    request = GenerationRequest(prompt=prompt,
                                params=SamplingParams(structured=structured, **params))
    seqs: dict[int, dict] = {}
    async for out in engine.generate(request):
        for s in out.outputs:
            seq = seqs.setdefault(s.index, {"text": "", "tokens": []})
            seq["text"] += s.text
            seq["tokens"] += s.tokens
            seq["finish"] = s.finish_reason
    return [seqs[i] for i in sorted(seqs)]


def sampled(seed: int, **params) -> dict:
    return {"do_sample": True, "temperature": 1.0, "seed": seed, "max_new_tokens": 120, **params}


async def test_json_schema_output_validates_for_every_seed(engine):
    runs = await asyncio.gather(*(run(engine, json_schema(PERSON), **sampled(seed))
                                  for seed in range(6)))
    for [seq] in runs:
        jsonschema.validate(json.loads(seq["text"]), PERSON)
        assert seq["finish"] == FinishReason.EOS


async def test_json_object_output_is_an_object(engine, loaded):
    # a strong bias towards closing quotes and braces keeps the random model's strings short
    closing = {loaded.tokenizer.convert_tokens_to_ids(t): 12.0 for t in ('"', "}")}
    for seed in range(3):
        [seq] = await run(engine, StructuredOutput("json_object"),
                          **sampled(seed, logit_bias=closing))
        assert isinstance(json.loads(seq["text"]), dict)
        assert seq["finish"] == FinishReason.EOS


async def test_forced_tool_call_arguments_validate(engine):
    schema = tool_calls_schema({"get_weather": WEATHER, "get_time": TIME})
    for seed in range(3):
        [seq] = await run(engine, json_schema(schema), **sampled(seed, max_new_tokens=400))
        calls = json.loads(seq["text"])
        jsonschema.validate(calls, schema)
        for call in calls:
            jsonschema.validate(call["arguments"], {"get_weather": WEATHER, "get_time": TIME}
                                [call["name"]])


async def test_every_sequence_of_a_request_follows_the_grammar(engine):
    seqs = await run(engine, json_schema(PERSON), **sampled(7, n=2))
    assert len(seqs) == 2 and seqs[0]["text"] != seqs[1]["text"]
    for seq in seqs:
        jsonschema.validate(json.loads(seq["text"]), PERSON)


async def test_unconstrained_row_is_unchanged_by_constrained_neighbours(engine):
    plain = {"max_new_tokens": 24, "ignore_eos": True}
    [alone] = await run(engine, None, "Deep learning is", **plain)
    together = await asyncio.gather(
        run(engine, json_schema(PERSON), **sampled(1)),
        run(engine, None, "Deep learning is", **plain),
        run(engine, json_schema(PERSON), **sampled(2)),
    )
    assert [t.id for t in together[1][0]["tokens"]] == [t.id for t in alone["tokens"]]
    assert together[1][0]["text"] == alone["text"]


async def test_logprobs_are_those_of_the_masked_distribution(engine):
    [seq] = await run(engine, json_schema(PERSON), **sampled(3, top_logprobs=5))
    for token in seq["tokens"]:
        assert all(math.isfinite(t.logprob) for t in token.top)
        assert sum(math.exp(t.logprob) for t in token.top) <= 1 + 1e-5
    [word] = await run(engine, StructuredOutput("grammar", 'root ::= "yes" | "no"'),
                       **sampled(3, top_logprobs=20))
    first = word["tokens"][0]
    allowed = {t.text for t in first.top}  # fewer than 20: all the grammar allows
    assert len(first.top) < 20 and allowed <= {"y", "ye", "yes", "n", "no"}
    assert first.text in allowed
    assert sum(math.exp(t.logprob) for t in first.top) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("params", [{}, {"min_new_tokens": 100}, {"ignore_eos": True}])
async def test_the_grammar_end_ends_the_sequence_without_an_eos_step(engine, loaded, params):
    [seq] = await run(engine, json_schema(PERSON), **sampled(4, **params))
    jsonschema.validate(json.loads(seq["text"]), PERSON)
    assert seq["finish"] == FinishReason.EOS
    assert loaded.tokenizer.eos_token_id not in [t.id for t in seq["tokens"]]


async def test_an_answer_that_fills_max_new_tokens_exactly_is_whole(engine):
    [free] = await run(engine, json_schema(WEATHER), **sampled(8))
    size = len(free["tokens"])
    [exact] = await run(engine, json_schema(WEATHER), **sampled(8, max_new_tokens=size))
    [short] = await run(engine, json_schema(WEATHER), **sampled(8, max_new_tokens=size - 1))
    assert exact["text"] == free["text"] and exact["finish"] == FinishReason.EOS
    assert short["finish"] == FinishReason.LENGTH and short["text"] != free["text"]


def test_a_grammar_is_over_once_nothing_but_eos_may_follow(engine, loaded):
    tokenizer = loaded.tokenizer
    grammars = engine.batcher.grammars
    call = grammars.start(json_schema(TIME))
    ids = tokenizer.encode('{"zone": "UTC"}', add_special_tokens=False)
    for token_id in ids:
        assert not call.is_over()
        assert call.accept(token_id)
    assert call.is_over()
    digits = grammars.start(StructuredOutput("regex", r"[0-9]{1,3}"))
    for digit in "123":
        assert digits.accept(tokenizer.convert_tokens_to_ids(digit))
        assert digits.is_completed() and digits.is_over() == (digit == "3")  # 3 digits at most


async def test_regex_and_ebnf_grammars(engine):
    [mail] = await run(engine, StructuredOutput("regex", r"[a-z]{1,6}@example\.(com|org)"),
                       **sampled(5))
    assert re.fullmatch(r"[a-z]{1,6}@example\.(com|org)", mail["text"])
    [answer] = await run(engine, StructuredOutput("grammar", 'root ::= "yes" | "no"'),
                         **sampled(6))
    assert answer["text"] in ("yes", "no")


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"type": "nope"}'),
    StructuredOutput("json_schema", "{not json"),
    StructuredOutput("regex", "(unclosed"),
    StructuredOutput("grammar", "root ::= "),
    StructuredOutput("yaml"),
    StructuredOutput("json_schema", '{"type": "nope"}', param="tools"),
])
async def test_a_bad_spec_is_refused_at_validation(engine, spec):
    request = GenerationRequest(prompt="hi", params=SamplingParams(structured=spec))
    with pytest.raises(RequestValidationError) as info:
        engine.validate(request)
    assert info.value.field == spec.param
    assert spec.kind in info.value.message


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"$ref": "#"}'),
    StructuredOutput("json_schema", json.dumps({
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a"})),
    StructuredOutput("grammar", "root ::= root"),
    StructuredOutput("json_schema", json.dumps({
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})),
    StructuredOutput("grammar", 'root ::= "a" root'),
])
async def test_a_spec_that_admits_no_output_is_refused_at_validation(engine, spec):
    """What no token can start would otherwise fail in the engine, step after step."""
    request = GenerationRequest(prompt="hi", params=SamplingParams(structured=spec))
    with pytest.raises(RequestValidationError, match="admits no output") as info:
        engine.validate(request)
    assert info.value.field == spec.param


async def test_a_spec_too_long_to_compile_quickly_is_refused_before_compiling(engine):
    huge = json.dumps({"enum": [f"value {i}" for i in range(30_000)]})  # ~400 KB
    request = GenerationRequest(prompt="hi", params=SamplingParams(
        structured=StructuredOutput("json_schema", huge)))
    with pytest.raises(RequestValidationError, match="at most 262144 are compiled") as info:
        engine.validate(request)
    assert info.value.field == "response_format"


def test_mask_covers_a_padded_vocabulary(loaded):
    """A model whose logits are wider than the tokenizer: the padding is never allowed."""
    vocab = len(loaded.tokenizer) + 64
    grammars = Grammars(loaded.tokenizer, vocab, {loaded.tokenizer.eos_token_id})
    logits = torch.zeros(2, vocab)
    mask_logits(logits, [grammars.start(json_schema(PERSON)), None])
    allowed = logits[0].isfinite()
    assert 0 < allowed.sum() < 100 and not allowed[len(loaded.tokenizer):].any()
    assert allowed[loaded.tokenizer.convert_tokens_to_ids("{")]
    assert (logits[1] == 0).all()


def test_json_strings_never_take_a_raw_control_character(engine, loaded):
    """xgrammar 0.2.8 lets a string with a maxLength take one; strict JSON parsers refuse it."""
    tokenizer = loaded.tokenizer
    grammar = engine.batcher.grammars.start(json_schema(PERSON))
    assert grammar.matcher.accept_string('{"name": "')
    logits = torch.zeros(1, len(tokenizer))
    mask_logits(logits, [grammar])
    [tab] = tokenizer.encode("\t", add_special_tokens=False)
    [letter] = tokenizer.encode("a", add_special_tokens=False)
    assert logits[0, tab] == -math.inf and logits[0, letter] == 0


# -- after a reasoning model's thinking ------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 6, 17])
async def test_the_grammar_applies_after_the_thinking_and_a_budget_ends_it(engine, budget):
    """A reasoning model thinks freely, then answers valid JSON: the grammar waits for the
    thinking's end. The tiny model never writes `</think>` itself, so its thinking budget (in
    tokens) closes it: exactly `budget` free tokens, then `</think>`, then the JSON."""
    for seed in range(3):
        [seq] = await run(engine, json_schema(PERSON), thinking_end=("</think>",),
                          max_thinking_tokens=budget, **sampled(seed))
        thinking, end, answer = seq["text"].partition("</think>")
        assert end, seq["text"]
        jsonschema.validate(json.loads(answer), PERSON)
        texts = [token.text for token in seq["tokens"]]
        closing = next(i for i in range(len(texts)) if "</think>" in "".join(texts[:i + 1]))
        assert closing >= budget and "".join(texts[:budget]) in thinking + "</"
        assert seq["finish"] == FinishReason.EOS


async def test_without_a_budget_an_unclosed_thinking_is_never_constrained(engine):
    [seq] = await run(engine, json_schema(PERSON), thinking_end=("</think>",),
                      **sampled(0, max_new_tokens=12))
    assert "</think>" not in seq["text"] and seq["finish"] == FinishReason.LENGTH


async def test_a_model_that_may_open_its_thinking_answers_json_either_way(engine):
    """Qwen3's way: thinking only when the model opens it. The tiny model's tokenizer spells
    `<think>` in several tokens, which cannot be allowed beside the grammar: the answer is
    constrained from its first token."""
    for seed in range(3):
        [seq] = await run(engine, json_schema(PERSON), thinking_end=("</think>",),
                          thinking_start=("<think>",), max_thinking_tokens=4, **sampled(seed))
        jsonschema.validate(json.loads(seq["text"]), PERSON)
