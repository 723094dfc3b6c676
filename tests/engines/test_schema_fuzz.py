"""Every JSON schema is enforced or refused: through the torch engine's real grammar path on the
tiny random model, each schema ends "validates" (a finished answer parses and jsonschema, formats
included, accepts it) or "refused" (RequestValidationError before admission, naming what cannot
be enforced), never an answer that does not validate.

A hand-picked corpus covers each construct (allOf/anyOf/oneOf/not, $ref/$defs, numeric and
string bounds, patterns, formats, enum/const, nested arrays, additionalProperties, required);
hypothesis generates more from the same vocabulary. The random model writes a random walk
through the grammar; a bias towards closing quotes and brackets keeps its strings short. An
answer cut by max_new_tokens cannot validate and is not judged.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.engine.torch.engine import TorchEngine
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestValidationError,
    SamplingParams,
    StructuredOutput,
)

MAX_NEW_TOKENS = 160
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 3}


@pytest.fixture(scope="module")
def engine(loaded):
    eng = TorchEngine(loaded, max_batch_size=4)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def closing(loaded) -> dict[int, float]:
    """Logit bias towards ending strings, arrays and objects."""
    return {loaded.tokenizer.convert_tokens_to_ids(t): 10.0 for t in ('"', "}", "]")}


def outcome(engine: TorchEngine, schema: Any, seed: int, bias: dict[int, float]) -> str:
    """"refused", "validates" or "cut"; fails the test on an answer that does not validate."""
    spec = StructuredOutput("json_schema", json.dumps(schema), param="response_format")
    request = GenerationRequest(prompt="JSON:", params=SamplingParams(
        structured=spec, do_sample=True, temperature=1.0, seed=seed,
        max_new_tokens=MAX_NEW_TOKENS, logit_bias=bias))
    try:
        engine.validate(request)
    except RequestValidationError as exc:
        assert exc.field == "response_format" and "json_schema" in exc.message, exc.message
        return "refused: " + exc.message
    text, finish = asyncio.run(_generate(engine, request))
    if finish == FinishReason.LENGTH:
        return f"cut: {text}"
    assert finish == FinishReason.EOS, finish
    answer = json.loads(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(
        cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(answer))
    assert error is None, f"{text} does not validate against {json.dumps(schema)}: {error}"
    return "validates"


async def _generate(engine: TorchEngine, request: GenerationRequest) -> tuple[str, Any]:
    text, finish = "", None
    async for out in engine.generate(request):
        text += out.outputs[0].text
        finish = out.outputs[0].finish_reason or finish
    return text, finish


# --- the hand-picked corpus ------------------------------------------------------------------

VALIDATES = {
    "allOf merges a type and a bound": {"allOf": [{"type": "integer"}, {"minimum": 10},
                                                  {"maximum": 20}]},
    "allOf merges objects": {"allOf": [
        {"type": "object", "properties": {"a": DIGIT}, "required": ["a"]},
        {"properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}]},
    "allOf over a $ref": {"$defs": {"Small": {"type": "integer", "minimum": 0, "maximum": 5}},
                          "allOf": [{"$ref": "#/$defs/Small"}, {"exclusiveMinimum": 2}]},
    "$ref with siblings": {"$defs": {"N": {"type": "integer"}}, "$ref": "#/$defs/N",
                           "minimum": 3, "maximum": 4},
    "anyOf with siblings": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                            "required": ["k"], "anyOf": [
                                {"properties": {"n": DIGIT}, "required": ["n"]},
                                {"properties": {"s": SHORT}, "required": ["s"]}]},
    "oneOf of different types": {"oneOf": [DIGIT, SHORT, {"type": "null"}]},
    "oneOf told apart by a const": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": DIGIT},
         "required": ["kind", "n"]},
        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},
    "recursive $defs": {"$defs": {"node": {"type": "object", "properties": {
        "v": DIGIT, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                             "maxItems": 1}}, "required": ["v"]}}, "$ref": "#/$defs/node"},
    "definitions (draft 7)": {"definitions": {"d": DIGIT}, "type": "array",
                              "items": {"$ref": "#/definitions/d"}, "maxItems": 2},
    "number bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2},
    "integer fractional bounds": {"type": "integer", "exclusiveMinimum": 1.5, "maximum": 7.9},
    "integer multipleOf in a range": {"type": "integer", "multipleOf": 3, "minimum": 0,
                                      "maximum": 30},
    "number with a whole multipleOf": {"type": "number", "multipleOf": 5, "minimum": 0,
                                       "maximum": 50},
    "string lengths": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-c]{2,3}$"},
    "format date": {"type": "string", "format": "date"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format ipv4": {"type": "string", "format": "ipv4"},
    "enum filtered by its siblings": {"type": "string", "maxLength": 1,
                                      "enum": ["a", 1, "bb", None]},
    "const object": {"const": {"a": [1, 2]}},
    "mixed enum": {"enum": [1, 2.5, "x", True, None]},
    "nested arrays": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "items": DIGIT, "minItems": 1, "maxItems": 2}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x"]}],
                    "items": False, "minItems": 2},
    "uniqueItems of one item": {"type": "array", "items": DIGIT, "uniqueItems": True,
                                "maxItems": 1},
    "additionalProperties schema": {"type": "object", "additionalProperties": DIGIT,
                                    "maxProperties": 2},
    "required beyond properties": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                   "required": ["a", "b"],
                                   "additionalProperties": {"type": "null"}},
    "no type, object keywords": {"properties": {"a": {"const": 1}}, "required": ["a"]},
    "no type, number keywords": {"minimum": 3, "maximum": 5},
    "a property that can never appear": {"type": "object", "required": ["b"], "properties": {
        "a": {"allOf": [{"type": "integer"}, {"type": "string"}]}, "b": DIGIT}},
    "anyOf dropping a false option": {"anyOf": [False, {"type": "boolean"}]},
}

REFUSED = {
    "allOf of conflicting types": ({"allOf": [{"type": "integer"}, {"type": "string"}]},
                                   "share no value"),
    "not {}": ({"not": {}}, "'not: {}'"),
    "not": ({"type": "integer", "not": {"const": 3}}, "'not'"),
    "if/then": ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "'if'"),
    "pattern with a length": ({"type": "string", "pattern": "^a+$", "maxLength": 3},
                              "'pattern'"),
    "format with a length": ({"type": "string", "format": "email", "maxLength": 10}, "'format'"),
    "format not enforced": ({"type": "string", "format": "iri"}, "'format': 'iri'"),
    "lookahead": ({"type": "string", "pattern": "^(?!a).$"}, "'pattern'"),
    "uniqueItems": ({"type": "array", "items": DIGIT, "uniqueItems": True}, "'uniqueItems'"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "'contains'"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}},
                          "'dependentRequired'"),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": DIGIT}},
                          "'patternProperties'"),
    "overlapping oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
    "fractional multipleOf": ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    "multipleOf with one bound": ({"type": "integer", "multipleOf": 3, "minimum": 0},
                                  "'multipleOf'"),
    "remote $ref": ({"$ref": "https://example.com/s.json"}, "'$ref'"),
    "const against its type": ({"const": 1, "type": "string"}, "enum/const"),
    "required but not allowed": ({"type": "object", "properties": {"a": DIGIT},
                                  "required": ["b"], "additionalProperties": False},
                                 "required property 'b'"),
    "anyOf options all excluded": ({"type": "object", "properties": {"k": DIGIT},
                                    "additionalProperties": False, "anyOf": [
                                        {"properties": {"n": DIGIT}, "required": ["n"]},
                                        {"properties": {"s": SHORT}, "required": ["s"]}]},
                                   "no option"),
    "empty integer range": ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer"),
    "allOf over a recursive $ref": ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"},
                                                               {"type": "integer"}]}},
                                     "$ref": "#/$defs/a"}, "recursive"),
    "not a schema": ({"type": "integer", "minimum": "x"}, "not a valid JSON schema"),
}


@pytest.mark.parametrize("name", VALIDATES)
def test_an_enforced_schema_gives_answers_that_validate(engine, closing, name):
    schema = VALIDATES[name]
    for seed in range(2):
        result = outcome(engine, schema, seed, closing)
        assert result == "validates", result


@pytest.mark.parametrize("name", REFUSED)
def test_a_schema_that_cannot_be_enforced_is_refused_naming_why(engine, closing, name):
    schema, named = REFUSED[name]
    result = outcome(engine, schema, 0, closing)
    assert result.startswith("refused") and named in result, result


# --- generated schemas -----------------------------------------------------------------------

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(
    ["x", "yy", "é", "2024-01-31"]), st.lists(st.integers(0, 2), max_size=2))
BOUND = st.one_of(st.integers(-5, 12), st.floats(-5, 12).map(lambda x: round(x, 1)))


def _typed(kind: str, **optional: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just(kind)}, optional=optional)


LEAVES = st.one_of(
    _typed("integer", minimum=BOUND, maximum=BOUND, exclusiveMinimum=BOUND,
           exclusiveMaximum=BOUND, multipleOf=st.sampled_from([1, 2, 3, 0.5])),
    _typed("number", minimum=BOUND, maximum=BOUND, exclusiveMinimum=BOUND,
           exclusiveMaximum=BOUND, multipleOf=st.sampled_from([2, 0.25])),
    _typed("string", minLength=st.integers(0, 3), maxLength=st.integers(0, 5),
           pattern=st.sampled_from(["^[a-c]{1,3}$", "^x[0-9]?$", "^(ab|cd)$", "a(?=b)"]),
           format=st.sampled_from(["date", "uuid", "ipv4", "time", "iri"])),
    st.fixed_dictionaries({"enum": st.lists(VALUES, min_size=1, max_size=4)}, optional={
        "type": st.sampled_from(["string", "integer", "array", "null"]),
        "maxLength": st.integers(0, 2), "minimum": st.integers(-1, 2)}),
    st.builds(lambda v: {"const": v}, VALUES),
    st.sampled_from([{}, True, False, {"type": "boolean"}, {"type": "null"}, {"minimum": 2},
                     {"maxLength": 2}, {"required": ["a"]}, {"not": {}},
                     {"not": {"type": "null"}}, {"uniqueItems": True},
                     {"contains": {"type": "null"}}]),
)
NAMES = st.sampled_from(["a", "b", "c"])


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    lists = st.lists(children, min_size=1, max_size=3)
    return st.one_of(
        st.fixed_dictionaries({"properties": st.dictionaries(NAMES, children, max_size=3)},
                              optional={"type": st.just("object"),
                                        "required": st.lists(st.sampled_from(["a", "b", "d"]),
                                                             max_size=2, unique=True),
                                        "additionalProperties": st.one_of(st.just(False),
                                                                          children),
                                        "maxProperties": st.integers(0, 3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children,
                               "maxItems": st.integers(0, 3)},
                              optional={"minItems": st.integers(0, 2),
                                        "prefixItems": st.lists(children, max_size=2)}),
        st.fixed_dictionaries({"allOf": lists}, optional={"type": st.sampled_from(
            ["object", "integer", "string"])}),
        st.fixed_dictionaries({"anyOf": lists}, optional={"maxLength": st.integers(0, 2)}),
        st.fixed_dictionaries({"oneOf": lists}),
        st.builds(lambda child: {"$defs_here": child}, children),  # becomes a $ref
    )


def _with_defs(schema: Any) -> Any:
    """`{"$defs_here": S}` marks become `$ref`s to S in the root's `$defs`."""
    defs: dict[str, Any] = {}

    def hoist(node: Any) -> Any:
        if isinstance(node, list):
            return [hoist(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$defs_here" in node:
            name = f"d{len(defs)}"
            defs[name] = None
            defs[name] = hoist(node["$defs_here"])
            return {"$ref": f"#/$defs/{name}"}
        return {k: hoist(v) for k, v in node.items()}

    root = hoist(schema)
    if defs:
        root = {"$defs": defs, "allOf": [root]}
    return root


SCHEMAS = st.recursive(LEAVES, _extend, max_leaves=6).map(_with_defs)


def test_generated_schemas_validate_or_are_refused(engine, closing):
    seen: Counter[str] = Counter()

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(schema=SCHEMAS, seed=st.integers(0, 1000))
    def one(schema: Any, seed: int) -> None:
        seen[outcome(engine, schema, seed, closing).partition(":")[0]] += 1

    one()
    # both ends were reached, and most accepted answers finished to be judged
    assert seen["validates"] >= 8 and seen["refused"] >= 8, seen
    assert seen["cut"] <= seen["validates"], seen
