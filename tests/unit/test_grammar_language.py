"""engine/grammar_language.py on grammars as xgrammar prints them: the languages with no finite
text are found, and recursive schemas that do end (trees, optional nesting) are not."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from handlers.engine.grammar_language import is_empty

TREE = {"type": "object", "required": ["kids"],
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}


def schema(value: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=False))


@pytest.mark.parametrize("grammar", [
    schema({"$ref": "#"}),
    schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a"}),
    schema({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    str(xgr.Grammar.from_ebnf('root ::= "a" root')),
    str(xgr.Grammar.from_ebnf('root ::= ("x" other)+\nother ::= "y" root')),
])
def test_a_language_with_no_finite_text_is_empty(grammar):
    assert is_empty(grammar)


@pytest.mark.parametrize("grammar", [
    schema(TREE),
    schema({"type": "object", "properties": {"a": {"$ref": "#"}}}),
    schema({"type": "array", "items": {"$ref": "#"}}),
    schema({"type": "object", "required": ["name", "tags"], "properties": {
        "name": {"type": "string", "maxLength": 12, "pattern": "^[a-z]+$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2}}}),
    schema({}),
    str(xgr.Grammar.builtin_json_grammar()),
    str(xgr.Grammar.from_regex(r"(ab)+c{2,3}\]?")),
    str(xgr.Grammar.from_ebnf('root ::= "a" root | "b"')),
])
def test_a_language_with_finite_text_is_not(grammar):
    assert not is_empty(grammar)
