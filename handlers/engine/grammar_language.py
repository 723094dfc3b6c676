"""Whether a grammar's language is empty: no finite text matches it (a JSON schema whose object
must hold itself, `{"$ref": "#"}`, two `$defs` that only refer to each other). Decoding under
such a grammar can only run until `max_new_tokens`, or fail when no token fits.

xgrammar compiles these without complaint, so the check reads the grammar as xgrammar prints it
(its EBNF: `name ::= expression` lines) and finds the rules that derive some finite text, the
classic fixpoint: a rule does once one of its alternatives is all terminals and rules that do.
Literals, character classes and xgrammar's built-in matchers (`Regex("...")`) derive text, as
does a name no rule defines (never assumed empty); `*`, `?` and `{0, n}` may repeat nothing; `+` and
`{m, n}` with m >= 1 need their element; a lookahead `(= ...)` constrains what follows, not
whether text exists, and is skipped.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

_TOKEN = re.compile(r'''
    (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<look>\(=)
  | (?P<op>[()|*+?])
  | (?P<space>\s+)
''', re.VERBOSE)


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Repeat:
    item: object
    at_least: int


Expression = list[list[object]]  # alternatives, each a sequence of items
_UNDEFINED = "::undefined"  # what a name no rule defines refers to: productive


@functools.lru_cache(maxsize=256)  # a request's schema is usually one seen before
def is_empty(ebnf: str, root: str = "root") -> bool:
    """Whether no finite text matches `root` in the grammar `ebnf` (xgrammar's printing)."""
    parsed = {name: _parse(body) for name, body in _rules(ebnf)}
    rules = {name: _defined(expression, parsed) for name, expression in parsed.items()}
    productive = {_UNDEFINED}
    changed = True
    while changed:
        changed = False
        for name, expression in rules.items():
            if name not in productive and _derives(expression, productive):
                productive.add(name)
                changed = True
    return root in rules and root not in productive


def _rules(ebnf: str) -> list[tuple[str, str]]:
    rules = []
    for line in ebnf.splitlines():
        name, sep, body = line.partition("::=")
        if sep:
            rules.append((name.strip(), body))
    return rules


def _parse(body: str) -> Expression:
    tokens = [(kind, text) for match in _TOKEN.finditer(body)
              for kind, text in match.groupdict().items() if text and kind != "space"]
    expression, _ = _alternatives(tokens, 0)
    return expression


def _alternatives(tokens: list[tuple[str, str]], at: int) -> tuple[Expression, int]:
    alternatives: Expression = [[]]
    while at < len(tokens):
        kind, text = tokens[at]
        if kind == "op" and text == ")":
            return alternatives, at + 1
        if kind == "op" and text == "|":
            alternatives.append([])
            at += 1
            continue
        item, at = _item(tokens, at)
        if item is not None:
            alternatives[-1].append(item)
    return alternatives, at


def _item(tokens: list[tuple[str, str]], at: int) -> tuple[object | None, int]:
    kind, text = tokens[at]
    at += 1
    item: object | None
    if kind == "look":  # a lookahead: skipped
        _, at = _alternatives(tokens, at)
        return None, at
    if kind == "op" and text == "(":
        item, at = _alternatives(tokens, at)
    elif kind == "name" and at < len(tokens) and tokens[at] == ("op", "("):
        _, at = _alternatives(tokens, at + 1)  # a built-in matcher, Regex("...", ...)
        item = "text"
    elif kind == "name":
        item = _Ref(text)
    else:  # a literal or a character class
        item = "text"
    if at < len(tokens):
        after_kind, after = tokens[at]
        if after_kind == "op" and after in "*?+":
            return _Repeat(item, 1 if after == "+" else 0), at + 1
        if after_kind == "repeat":
            return _Repeat(item, int(after.strip("{}").split(",")[0])), at + 1
    return item, at


def _defined(item: object, rules: dict[str, Expression]) -> object:
    """`item` with its references to names no rule defines made `_UNDEFINED`."""
    if isinstance(item, _Ref):
        return item if item.name in rules else _Ref(_UNDEFINED)
    if isinstance(item, _Repeat):
        return _Repeat(_defined(item.item, rules), item.at_least)
    if isinstance(item, list):
        return [[_defined(part, rules) for part in sequence] for sequence in item]
    return item


def _derives(item: object, productive: set[str]) -> bool:
    if isinstance(item, _Ref):
        return item.name in productive
    if isinstance(item, _Repeat):
        return item.at_least == 0 or _derives(item.item, productive)
    if isinstance(item, list):  # alternatives
        return any(all(_derives(part, productive) for part in sequence) for sequence in item)
    return True  # text
