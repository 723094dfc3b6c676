"""A JSON schema rewritten into the forms xgrammar 0.2.8 enforces, or refused naming what it
cannot enforce: an answer under a schema either validates or is never generated.

xgrammar's converter enforces some keywords, ignores others without a word, and reads a schema
by precedence (`$ref`, then `const`, `enum`, `anyOf`, `oneOf`, `allOf`, then the type's
keywords), dropping whatever stands beside the first it finds: `{"allOf": [A, B]}` compiles to
any JSON value, `{"type": "integer", "not": ...}` to any integer. Where it narrows a schema
(strict mode: no property the schema does not name; no escapes in a patterned string) its
answers still validate. So, here:

- `allOf` parts, and a `$ref`'s siblings, are merged into one schema (types intersect, bounds
  tighten, properties merge); what does not merge (two patterns) is refused;
- siblings of `anyOf`/`oneOf` go into each option; a `oneOf` stays only when its options
  provably share no value (it is then an `anyOf`);
- an `enum`/`const` keeps the values that satisfy its siblings, checked with jsonschema;
- a schema without `type` gets the types its keywords constrain (xgrammar reads it as any value);
- a required property the schema does not describe is described by `additionalProperties`;
- integer bounds are made whole, inclusive; a `number` with a whole `multipleOf` is an integer.

Every keyword jsonschema validates is handled so or refused (the allowlist is `_HANDLED`, the
limits below are xgrammar's). A schema no value satisfies is refused as such.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import jsonschema
import referencing

from handlers.engine.types import RequestValidationError

Schema = dict[str, Any]
NEVER = False  # `items` / `additionalProperties`: nothing more is allowed

_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_BY_TYPE = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties",
               "maxProperties"),
}
_APPLICATORS = ("$ref", "allOf", "anyOf", "oneOf")
_HANDLED = {"type", "enum", "const", "uniqueItems", *_APPLICATORS,
            *(key for keys in _BY_TYPE.values() for key in keys)}
# What jsonschema checks, in any draft: each is handled, or refused.
_DRAFTS = (jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator,
           jsonschema.Draft201909Validator, jsonschema.Draft202012Validator)
_CHECKED = {key for draft in _DRAFTS for key in draft.VALIDATORS}
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
# xgrammar's string formats (others are ignored by it); its multipleOf limits for integers.
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
           "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
MAX_MULTIPLE_OF = 1024
MAX_MULTIPLE_OF_RANGE = 10_000
MAX_OPTIONS = 64  # anyOf options after distributing siblings and merging
_LOCAL_REF = re.compile(r"#(?:/(\$defs|definitions)/([^/~%]+))?")
# Regular-expression constructs xgrammar compiles but does not honour: lookarounds, inline flags
# (verbose mode changes what a space means), word boundaries.
_REGEX_UNHONOURED = re.compile(r"\\[bBAZz]|\\.|\(\?(?!:|P<).?")


class Refused(ValueError):
    """The schema holds what constrained decoding cannot enforce; the message names it."""


class Unsatisfiable(Refused):
    """No JSON value satisfies the schema (or the part named)."""


@functools.lru_cache(maxsize=256)  # a request's schema is usually one seen before
def enforced_text(text: str, param: str) -> str:
    """The JSON schema `text` as xgrammar enforces it (JSON text); RequestValidationError
    blamed on `param` when it cannot be enforced or admits no value."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise RequestValidationError(param, f"the json_schema is not JSON: {exc}") from None
    try:
        return json.dumps(enforced(schema), ensure_ascii=False)
    except Refused as exc:
        raise RequestValidationError(param, f"the json_schema {exc}") from None
    except RecursionError:
        raise RequestValidationError(param, "the json_schema is nested too deeply") from None


def enforced(schema: Any) -> Schema:
    """`schema` in the forms xgrammar enforces; raises Refused (Unsatisfiable) naming why not."""
    return _Rewriter(schema).result()


class _Rewriter:
    def __init__(self, root: Any) -> None:
        if not isinstance(root, dict | bool):
            raise Refused(f"must be an object or a boolean (got {json.dumps(root)[:80]})")
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(root)
        except jsonschema.exceptions.SchemaError as exc:
            raise Refused(f"is not a valid JSON schema: {exc.message} (at "
                          f"{_pointer(exc.path)})") from None
        self._root = root
        # The judge of concrete values (enums): no reference leaves the schema.
        self._judge = cls(root, registry=referencing.Registry(),
                          format_checker=cls.FORMAT_CHECKER)
        self._refs: dict[str, Any] = {}  # ref -> its rewritten target; None while rewriting
        self._emitted: dict[str, Any] = {}

    def result(self) -> Schema:
        out = dict(self._emit(self._node(self._root, "#"), "#"))
        for ref in self._refs:
            match = _LOCAL_REF.fullmatch(ref)
            if match and match[1]:
                out.setdefault(match[1], {})[match[2]] = self._emit_ref(ref)
        return out

    # -- reading a schema into its normal form ----------------------------------------------

    def _node(self, schema: Any, where: str) -> Any:
        """`schema` as one of: {} (any value), NEVER, {"$ref"}, {"enum"}, {"anyOf"} or a plain
        schema of `type` (a list, or absent for any) and its types' keywords."""
        if schema is True:
            return {}
        if schema is False:
            raise Unsatisfiable(f"is false at {where}: no value satisfies it")
        if "enum" in schema or "const" in schema:
            return self._values(schema, where)
        self._refuse_unhandled(schema, where)
        node = self._plain(schema, where)
        if "$ref" in schema:
            node = self._merge(node, self._ref(schema["$ref"], where), where)
        for i, part in enumerate(schema.get("allOf", ())):
            node = self._merge(node, self._node(part, f"{where}/allOf/{i}"), f"{where}/allOf")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = self._options(schema[key], f"{where}/{key}")
                if key == "oneOf":
                    self._require_disjoint(options, f"{where}/oneOf")
                node = self._merge(node, {"anyOf": options}, f"{where}/{key}")
        return node

    def _options(self, schemas: list[Any], where: str) -> list[Any]:
        """The options that admit some value (one that admits none never matches)."""
        options = []
        for i, option in enumerate(schemas):
            try:
                options.append(self._node(option, f"{where}/{i}"))
            except Unsatisfiable:
                continue
        if not options:
            raise Unsatisfiable(f"at {where}: no option admits a value")
        return options

    def _refuse_unhandled(self, schema: Schema, where: str) -> None:
        for key in schema:
            if key == "not" and schema["not"] in ({}, True):
                raise Unsatisfiable(f"'not: {{}}' at {where} admits no value")
            if key == "uniqueItems" and schema[key] and schema.get("maxItems", 2) > 1:
                raise Refused(f"'uniqueItems' at {where} cannot be enforced by constrained "
                              "decoding (drop it, or use maxItems 1)")
            if key == "items" and isinstance(schema[key], list):
                raise Refused(f"'items' as a list at {where} cannot be enforced: use prefixItems")
            if key in _CHECKED and key not in _HANDLED:
                raise Refused(f"'{key}' at {where} cannot be enforced by constrained decoding")

    def _plain(self, schema: Schema, where: str) -> Schema:
        node: Schema = {}
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            node["type"] = _normal_types(types)
        for key in _BY_TYPE["number"] + _BY_TYPE["string"] + ("minItems", "maxItems",
                                                                "minProperties", "maxProperties"):
            if key in schema:
                node[key] = schema[key]
        if "required" in schema:
            node["required"] = list(dict.fromkeys(schema["required"]))
        if "properties" in schema:
            node["properties"] = {name: _or_never(self._node, sub, f"{where}/properties/{name}")
                                  for name, sub in schema["properties"].items()}
        for key in ("additionalProperties", "items"):
            if key in schema:
                node[key] = _or_never(self._node, schema[key], f"{where}/{key}")
        if "prefixItems" in schema:
            node["prefixItems"] = [self._node(sub, f"{where}/prefixItems/{i}")
                                   for i, sub in enumerate(schema["prefixItems"])]
        return node

    def _values(self, schema: Schema, where: str) -> Schema:
        """An enum (or const): its values that satisfy the schema's other keywords, which
        jsonschema checks exactly whatever they are."""
        values = list(schema.get("enum", [schema.get("const")]))
        if "const" in schema:
            values = [v for v in values if _same(v, schema["const"])]
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
        return self._kept(values, rest, where)

    def _kept(self, values: list[Any], schema: Any, where: str) -> Schema:
        judge = self._judge.evolve(schema=schema)
        try:
            kept = [v for v in values if judge.is_valid(v)]
        except referencing.exceptions.Unresolvable as exc:
            raise Refused(f"refers at {where} to {exc.ref!r}, which is not in the schema") \
                from None
        unique = list({_json_key(v): v for v in reversed(kept)}.values())[::-1]
        if not unique:
            raise Unsatisfiable(f"enum/const at {where}: none of its values satisfies the "
                                "schema's other keywords")
        return {"enum": unique}

    def _ref(self, ref: str, where: str) -> Schema:
        match = _LOCAL_REF.fullmatch(ref)
        if not match:
            raise Refused(f"'$ref': {ref!r} at {where} is not followed: only '#', "
                          "'#/$defs/NAME' and '#/definitions/NAME' are")
        if ref not in self._refs:
            target = self._root.get(match[1], {}).get(match[2]) if match[1] else self._root
            if target is None:
                raise Refused(f"'$ref': {ref!r} at {where} names no definition")
            self._refs[ref] = None  # while rewriting: a reference back to it stays a $ref
            try:
                self._refs[ref] = self._node(target, ref)
            except Refused:
                del self._refs[ref]
                raise
        return {"$ref": ref}

    def _target(self, node: Schema, where: str) -> Any:
        """What a {"$ref"} stands for, to merge it with something else."""
        seen = set()
        while isinstance(node, dict) and "$ref" in node:
            ref = node["$ref"]
            if ref in seen or self._refs[ref] is None:
                raise Refused(f"'$ref': {ref!r} at {where} is recursive: its siblings or allOf "
                              "parts cannot be merged into it")
            seen.add(ref)
            node = self._refs[ref]
        return node

    # -- merging (allOf) ----------------------------------------------------------------------

    def _merge(self, a: Any, b: Any, where: str) -> Any:
        if a == {}:
            return b
        if b == {}:
            return a
        if NEVER in (a, b):
            raise Unsatisfiable(f"allOf at {where}: a part admits no value")
        if "$ref" in a or "$ref" in b:
            return self._merge(self._target(a, where), self._target(b, where), where)
        if "enum" in a or "enum" in b:
            values, other = (a, b) if "enum" in a else (b, a)
            return self._kept(values["enum"], other, where)
        if "anyOf" in a or "anyOf" in b:
            return self._distribute(a, b, where)
        return _merge_plain(a, b, where, self._merge)

    def _distribute(self, a: Schema, b: Schema, where: str) -> Any:
        choice, other = (a, b) if "anyOf" in a else (b, a)
        options = []
        for option in choice["anyOf"]:
            try:
                options.append(self._merge(option, other, where))
            except Unsatisfiable:
                continue  # this option cannot hold: the others may
        if not options:
            raise Unsatisfiable(f"anyOf at {where}: no option satisfies the schema's other "
                                "keywords")
        flat = [o for option in options for o in option.get("anyOf", [option])]
        if len(flat) > MAX_OPTIONS:
            raise Refused(f"at {where} combines into {len(flat)} alternatives; at most "
                          f"{MAX_OPTIONS} are compiled")
        return flat[0] if len(flat) == 1 else {"anyOf": flat}

    # -- oneOf ----------------------------------------------------------------------------------

    def _require_disjoint(self, options: list[Any], where: str) -> None:
        for i, a in enumerate(options):
            for j in range(i + 1, len(options)):
                if not self._disjoint(a, options[j], where):
                    raise Refused(f"'oneOf' at {where}: options {i} and {j} may both match a "
                                  "value, which constrained decoding cannot exclude (use anyOf, "
                                  "or options of different types or const values)")

    def _disjoint(self, a: Any, b: Any, where: str) -> bool:
        a, b = self._target(a, where), self._target(b, where)
        if NEVER in (a, b):
            return True
        if "enum" in a or "enum" in b:
            values, other = (a, b) if "enum" in a else (b, a)
            judge = self._judge.evolve(schema=other)
            return not any(judge.is_valid(v) for v in values["enum"])
        if "anyOf" in a or "anyOf" in b:
            choice, other = (a, b) if "anyOf" in a else (b, a)
            return all(self._disjoint(option, other, where) for option in choice["anyOf"])
        if not _types_meet(a.get("type"), b.get("type")):
            return True
        # Objects told apart by a property both require (a discriminator).
        common = set(a.get("required", ())) & set(b.get("required", ()))
        props_a, props_b = a.get("properties", {}), b.get("properties", {})
        return any(name in props_a and name in props_b and
                   self._disjoint(props_a[name], props_b[name], where) for name in common)

    # -- writing the schema xgrammar reads -------------------------------------------------------

    def _emit(self, node: Any, where: str) -> Any:
        if node is NEVER or node == {} or "$ref" in node or "enum" in node:
            return node
        if "anyOf" in node:
            options = []
            for i, option in enumerate(node["anyOf"]):
                try:
                    options.append(self._emit(option, f"{where}/anyOf/{i}"))
                except Unsatisfiable:
                    continue
            if not options:
                raise Unsatisfiable(f"at {where}: no option admits a value")
            return options[0] if len(options) == 1 else {"anyOf": options}
        return _emit_plain(node, where, self._emit)

    def _emit_ref(self, ref: str) -> Any:
        if ref not in self._emitted:
            self._emitted[ref] = self._emit(self._refs[ref], ref)
        return self._emitted[ref]


def _merge_plain(a: Schema, b: Schema, where: str, merge: Any) -> Schema:
    out = {**a, **b}
    if "type" in a and "type" in b:
        out["type"] = _meet(a["type"], b["type"])
        if not out["type"]:
            raise Unsatisfiable(f"allOf at {where}: its parts' types ({', '.join(a['type'])} "
                                f"and {', '.join(b['type'])}) share no value")
    for key in _LOWER:
        if key in a and key in b:
            out[key] = max(a[key], b[key])
    for key in _UPPER:
        if key in a and key in b:
            out[key] = min(a[key], b[key])
    if "multipleOf" in a and "multipleOf" in b and a["multipleOf"] != b["multipleOf"]:
        steps = (a["multipleOf"], b["multipleOf"])
        if any(step != int(step) for step in steps):
            raise Refused(f"allOf at {where}: two fractional 'multipleOf' cannot be combined")
        out["multipleOf"] = math.lcm(*(int(step) for step in steps))
    for key in ("pattern", "format"):
        if key in a and key in b and a[key] != b[key]:
            raise Refused(f"allOf at {where}: two different '{key}' values cannot be combined")
    if "required" in a and "required" in b:
        out["required"] = list(dict.fromkeys(a["required"] + b["required"]))
    if any(k in a or k in b for k in ("properties", "additionalProperties")):
        _merge_properties(out, a, b, where, merge)
    if any(k in a or k in b for k in ("items", "prefixItems")):
        _merge_items(out, a, b, where, merge)
    return out


def _merge_properties(out: Schema, a: Schema, b: Schema, where: str, merge: Any) -> None:
    """Each side's properties also satisfy the other's additionalProperties."""
    names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
    out["properties"] = {name: _or_never(merge, _property(a, name), _property(b, name),
                                         f"{where}/properties/{name}") for name in names}
    extra_a, extra_b = a.get("additionalProperties", {}), b.get("additionalProperties", {})
    if extra_a != {} or extra_b != {}:
        out["additionalProperties"] = _or_never(merge, extra_a, extra_b,
                                                f"{where}/additionalProperties")


def _property(node: Schema, name: str) -> Any:
    if name in node.get("properties", {}):
        return node["properties"][name]
    return node.get("additionalProperties", {})


def _merge_items(out: Schema, a: Schema, b: Schema, where: str, merge: Any) -> None:
    if "prefixItems" in a and "prefixItems" in b:
        raise Refused(f"allOf at {where}: two 'prefixItems' cannot be combined")
    rest_a, rest_b = a.get("items", {}), b.get("items", {})
    if "prefixItems" in a or "prefixItems" in b:
        tuple_side, other = (a, rest_b) if "prefixItems" in a else (b, rest_a)
        if other is NEVER:
            raise Refused(f"allOf at {where}: prefixItems beside 'items: false' cannot be "
                          "combined")
        out["prefixItems"] = [merge(item, other, f"{where}/prefixItems/{i}")
                              for i, item in enumerate(tuple_side["prefixItems"])]
    if rest_a != {} or rest_b != {}:
        out["items"] = _or_never(merge, rest_a, rest_b, f"{where}/items")


def _emit_plain(node: Schema, where: str, emit: Any) -> Schema:
    out = dict(node)
    types = set(out["type"]) if "type" in out else _implied_types(out)
    if "multipleOf" in out and types & {"number", "integer"}:
        types = _whole_multiples(out, types, where)
    if types == {"integer"}:
        _whole_bounds(out, where)
    elif "number" in types:
        _tightest_bounds(out)
    if "string" in types:
        _check_string(out, where)
    # explicit: xgrammar reads a type-less schema with constraints as any value
    out["type"] = sorted(types)[0] if len(types) == 1 else sorted(types)
    for key in ("items", "additionalProperties"):
        if key in out:
            out[key] = _or_never(emit, out[key], f"{where}/{key}")
    if "properties" in out:
        out["properties"] = {name: _or_never(emit, sub, f"{where}/properties/{name}")
                             for name, sub in out["properties"].items()}
    if "object" in types:
        _describe_required(out, where)
    if "prefixItems" in out:
        out["prefixItems"] = [emit(sub, f"{where}/prefixItems/{i}")
                              for i, sub in enumerate(out["prefixItems"])]
    return out


def _or_never(make: Any, *args: Any) -> Any:
    """`make(*args)`, or NEVER where it admits no value: a property that cannot appear, an
    array that can hold no (more) items."""
    if args[0] is NEVER:
        return NEVER
    try:
        return make(*args)
    except Unsatisfiable:
        return NEVER


def _implied_types(node: Schema) -> set[str]:
    """The types a type-less schema's keywords constrain (all types where they constrain
    several or none: the others are left free by them)."""
    families = {family for family, keys in _BY_TYPE.items() if any(k in node for k in keys)}
    return families if len(families) == 1 else set(_TYPES) - {"integer"}


def _whole_multiples(node: Schema, types: set[str], where: str) -> set[str]:
    step = node["multipleOf"]
    if step != int(step) or step > MAX_MULTIPLE_OF:
        raise Refused(f"'multipleOf' {step} at {where} cannot be enforced: only whole "
                      f"multiples up to {MAX_MULTIPLE_OF} are")
    node["multipleOf"] = int(step)
    types = (types - {"number"}) | {"integer"}  # whole multiples are integers
    low, high = _whole_range(node)
    if (low is None) != (high is None) or (
            low is not None and high is not None and high - low > MAX_MULTIPLE_OF_RANGE):
        raise Refused(f"'multipleOf' at {where} is enforced without bounds or between "
                      f"bounds at most {MAX_MULTIPLE_OF_RANGE} apart, not with these")
    return types


def _whole_bounds(node: Schema, where: str) -> None:
    low, high = _whole_range(node)
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        node.pop(key, None)
    if low is not None:
        node["minimum"] = low
    if high is not None:
        node["maximum"] = high
    if low is not None and high is not None and low > high:
        raise Unsatisfiable(f"at {where}: no integer lies between its bounds")


def _whole_range(node: Schema) -> tuple[int | None, int | None]:
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    if "exclusiveMinimum" in node:
        lows.append(math.floor(node["exclusiveMinimum"]) + 1)
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    if "exclusiveMaximum" in node:
        highs.append(math.ceil(node["exclusiveMaximum"]) - 1)
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _tightest_bounds(node: Schema) -> None:
    """One lower and one upper bound, the tighter of the inclusive and the exclusive."""
    for inclusive, exclusive, tighter in (("minimum", "exclusiveMinimum", max),
                                          ("maximum", "exclusiveMaximum", min)):
        if inclusive in node and exclusive in node:
            if tighter(node[inclusive], node[exclusive]) == node[exclusive]:
                del node[inclusive]
            else:
                del node[exclusive]


def _check_string(node: Schema, where: str) -> None:
    lengths = "minLength" in node or "maxLength" in node
    if "format" in node and node["format"] not in FORMATS:
        raise Refused(f"'format': {node['format']!r} at {where} cannot be enforced (the "
                      f"formats enforced: {', '.join(sorted(FORMATS))})")
    if "pattern" in node and ("format" in node or lengths):
        raise Refused(f"'pattern' at {where} is enforced alone: not with 'format', "
                      "'minLength' or 'maxLength'")
    if "format" in node and lengths:
        raise Refused(f"'format' at {where} is enforced alone: not with 'minLength' or "
                      "'maxLength'")
    if "pattern" in node:
        found = [m[0] for m in _REGEX_UNHONOURED.finditer(node["pattern"])
                 if m[0].startswith("(?") or m[0][1] in "bBAZz"]
        if found:
            raise Refused(f"'pattern' at {where}: {found[0]!r} (lookarounds, inline flags, "
                          "anchors other than ^ and $, word boundaries) cannot be enforced")


def _describe_required(node: Schema, where: str) -> None:
    """xgrammar generates only the properties a schema describes: describe each required one;
    a property that may not appear is left out (unless additionalProperties would let xgrammar
    generate it)."""
    properties = dict(node.get("properties", {}))
    extra = node.get("additionalProperties", {})
    for name in node.get("required", ()):
        if properties.get(name, extra) is NEVER:
            raise Unsatisfiable(f"at {where}: required property {name!r} may not appear")
        properties.setdefault(name, extra)
    for name in [n for n, sub in properties.items() if sub is NEVER]:
        if "additionalProperties" in node and extra is not NEVER:
            raise Refused(f"at {where}: property {name!r}, which may not appear, cannot be "
                          "kept out beside additionalProperties")
        del properties[name]
    node["properties"] = properties
    if not properties:
        del node["properties"]


def _normal_types(types: list[str]) -> list[str]:
    kept = set(types)
    if "number" in kept:
        kept.discard("integer")
    return sorted(kept)


def _meet(a: list[str], b: list[str]) -> list[str]:
    """The types both allow (an integer is a number)."""
    both = set(a) & set(b)
    if "number" in a and "integer" in b or "integer" in a and "number" in b:
        both.add("integer")
    return _normal_types(sorted(both))


def _types_meet(a: list[str] | None, b: list[str] | None) -> bool:
    return a is None or b is None or bool(_meet(a, b))


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    return _json_key(a) == _json_key(b)


def _json_key(value: Any) -> str:
    def whole(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        return [whole(x) for x in v] if isinstance(v, list) else v
    return json.dumps(whole(value), sort_keys=True)


def _pointer(path: Any) -> str:
    return "#" + "".join(f"/{part}" for part in path)
