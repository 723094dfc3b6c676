"""An ordered list of (key, value) pairs whose keys may repeat or be None."""

from __future__ import annotations

from typing import Any


class PairList:
    def __init__(self) -> None:
        self.keys: list[str | None] = []
        self.values: list[Any] = []

    def add(self, key: str | None, value: Any) -> None:
        self.keys.append(key)
        self.values.append(value)

    def get(self, key: str) -> Any:
        """The first value under `key`, or None."""
        return next((v for k, v in zip(self.keys, self.values, strict=True) if k == key), None)

    def key_at(self, index: int) -> str | None:
        return self.keys[index]

    def value_at(self, index: int) -> Any:
        return self.values[index]

    def size(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys
