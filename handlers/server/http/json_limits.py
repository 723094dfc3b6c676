"""Bounds on a JSON body's shape, beyond its size: how many objects and arrays it holds (each
costs ~60 bytes decoded, and validating millions of them takes seconds and gigabytes) and how
deeply they nest (past Python's recursion limit, code that walks a value recursively fails).
orjson itself refuses nesting deeper than 1024."""

from __future__ import annotations

import re
from typing import Any

MAX_CONTAINERS = 20_000  # a long chat with content parts and tools holds a few thousand
MAX_DEPTH = 100  # JSON schemas and nested tool arguments nest a few dozen deep at most

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _brackets(raw: bytes) -> int:
    return raw.count(b"{") + raw.count(b"[")


def container_count(raw: bytes) -> int:
    """At least the objects and arrays in `raw`: exact when over MAX_CONTAINERS (brackets
    inside strings are left out then; counting is cheap before, and decoding is not)."""
    count = _brackets(raw)
    return count if count <= MAX_CONTAINERS else _brackets(_STRING.sub(b"", raw))


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether containers nest more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
