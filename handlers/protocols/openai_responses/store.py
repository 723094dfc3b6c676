"""Stored responses, for `GET /v1/responses/{id}` and `previous_response_id`.

A bounded in-memory LRU: at most `STORE_CAPACITY` responses per server process, the least
recently created or used dropped first, none surviving a restart. Memory stays bounded under
any load, at the price that a long-idle conversation can no longer be continued (its id is then
unknown, as a deleted one's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.errors import ErrorKind

STORE_CAPACITY = 1000


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object, as answered
    items: list[dict[str, Any]]  # its input items, history first

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a continuation starts from: the input items, then the output items."""
        return [*self.items, *self.response["output"]]


class ResponseStore:
    """Bounded, least recently used first out; safe from several threads (a request's prompt
    is prepared in a worker while others store theirs)."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, stored: Stored) -> None:
        key = stored.response["id"]
        with self._lock:
            self._stored[key] = stored
            self._stored.move_to_end(key)
            while len(self._stored) > self.capacity:
                self._stored.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            stored = self._stored.get(response_id)
            if stored is not None:
                self._stored.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._stored.pop(response_id, None) is not None

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        stored = self.get(response_id)
        return None if stored is None else stored.conversation


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"No response found with id {response_id!r} (not stored, deleted, or "
                       "evicted).", "response_id", ErrorKind.NOT_FOUND)
