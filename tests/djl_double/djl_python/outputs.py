"""`Output`: a status, response properties, and content (or a stream) to send back to DJL.

Content values are bytes: strings are UTF-8 encoded and other values JSON-encoded. Keys given a
batch index become `batch_<i>.<key>`, the form DJL's front end splits batches by. A rolling-batch
record is a map of strings, binary-encoded: a big-endian int16 count, then for each key and
value (as `str(value)`) an int32 byte length and the UTF-8 bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from typing import Any

from djl_python.pair_list import PairList

StreamFormatter = Callable[[Any], Any]


def _outputs_lines(texts: Any) -> bytes:
    """The default stream formatter: each stream item as a `{"outputs": ...}` JSON line."""
    return (json.dumps({"outputs": texts}) + "\n").encode("utf-8")


class Output:
    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code = code
        self.message = message
        self.properties: dict[str, Any] = {}
        self.content = PairList()
        self.stream_content: Iterator[Any] | None = None
        self.stream_output_formatter: StreamFormatter | None = None

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def error(self, error: str, code: int = 424, message: str = "invoke handler failure"
              ) -> Output:
        """A failed answer whose JSON body repeats the status and message and adds `error`."""
        self.code, self.message = code, message
        self.add_property("content-type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": error})

    def add_property(self, key: str, value: Any) -> Output:
        self.properties[key] = value
        return self

    def get_properties(self) -> dict[str, Any]:
        return self.properties

    def get_property(self, key: str) -> Any:
        return self.properties.get(key)

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif not isinstance(value, bytes | bytearray):
            value = self._encode_json(value)
        self.content.add(key, bytes(value))
        return self

    def add_as_json(self, value: Any, key: str | None = None, batch_index: int | None = None
                    ) -> Output:
        return self.add(self._encode_json(value), key=key, batch_index=batch_index)

    def add_stream_content(self, stream: Iterator[Any],
                           output_formatter: StreamFormatter | None = _outputs_lines) -> Output:
        """Items are pulled after the handler returned; the formatter (if any) turns each into
        the bytes sent, else str is UTF-8 encoded and other non-bytes JSON-encoded."""
        self.stream_content = stream
        self.stream_output_formatter = output_formatter
        return self

    @staticmethod
    def _encode_json(value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")

    @staticmethod
    def binary_encode(record: dict[str, Any]) -> bytes:
        out = bytearray(struct.pack(">h", len(record)))
        for key, value in record.items():
            for text in (key, str(value)):
                raw = text.encode("utf-8")
                out += struct.pack(">i", len(raw)) + raw
        return bytes(out)
