"""`Input`: one request, or a batch of them flattened into one object.

A batch has the property `batch_size`; item i's properties and content are stored under keys
prefixed `batch_NNN` and one separator (`_` from djl_python's test helpers, `.` from DJL's
Java front end).
"""

from __future__ import annotations

import json
import re
from typing import Any

from djl_python.pair_list import PairList

_BATCH_KEY = re.compile(r"batch_(\d+)[._](.+)")


class Input:
    def __init__(self) -> None:
        self.function_name: str | None = None
        self.properties: dict[str, Any] = {}
        self.content = PairList()

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", 1))

    def get_batches(self) -> list[Input]:
        if not self.is_batch():
            return [self]
        batch = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if match := _BATCH_KEY.fullmatch(key):
                batch[int(match[1])].properties[match[2]] = value
        for key, value in zip(self.content.keys, self.content.values, strict=True):
            match = _BATCH_KEY.fullmatch(key)
            batch[int(match[1])].content.add(match[2], value)
        return batch

    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict[str, Any]:
        return self.properties

    def get_property(self, key: str) -> Any:
        """Case-insensitive, as HTTP header names are."""
        return next((v for k, v in self.properties.items() if k.lower() == key.lower()), None)

    def get_content(self) -> PairList:
        return self.content

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def get_as_bytes(self, key: str | None = None) -> bytes | None:
        """The value under `key`; without one, under "data", else the first value."""
        if self.content.is_empty():
            return None
        if key is not None:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"no content under {key!r}")
            return value
        value = self.content.get("data")
        return self.content.value_at(0) if value is None else value

    def get_as_string(self, key: str | None = None) -> str:
        return self.get_as_bytes(key).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        return json.loads(self.get_as_string(key))
