"""How answers go on the wire: a protocol's plain objects become JSON, JSON lines or
server-sent events here, and nowhere else.

A route's answer is a `Reply` (a status and one object) or a `StreamReply` (chunks of events, one
chunk per engine step, and their framing). HTTP sends them as they are (handlers/server/http);
SageMaker's event stream wraps each framed chunk in a PayloadPart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import orjson

from handlers.protocols.errors import ErrorKind, ProtocolError
from handlers.protocols.lmi import StreamStyle
from handlers.protocols.outputs import Event
from handlers.server.status import RETRY_AFTER_SECONDS, Table

JSON_MEDIA_TYPE = "application/json"
JSONLINES_MEDIA_TYPE = "application/jsonlines"
SSE_MEDIA_TYPE = "text/event-stream"


class Framing(Enum):
    JSONLINES = "jsonlines"  # one JSON object per line
    SSE = "sse"  # `data: {json}` events
    OPENAI_SSE = "openai_sse"  # SSE ending with `data: [DONE]`
    SSE_COMPACT = "sse_compact"  # `data:{json}` events, no space (MindIE's, TGI's)
    NAMED_SSE = "named_sse"  # `event: <the object's type>` then `data: {json}` (Anthropic's)
    # Text written already (a model.py's formatter's), one line per event, then an empty line
    # (DJL's last, empty chunk).
    TEXT_LINES = "text_lines"

    @property
    def media_type(self) -> str:
        if self in (Framing.JSONLINES, Framing.TEXT_LINES):
            return JSONLINES_MEDIA_TYPE
        return SSE_MEDIA_TYPE

    def frame(self, data: Any) -> bytes:
        if self is Framing.TEXT_LINES:
            return data.encode() + b"\n"
        body = orjson.dumps(data)
        if self is Framing.JSONLINES:
            return body + b"\n"
        if self is Framing.NAMED_SSE:
            return b"event: " + data["type"].encode() + b"\ndata: " + body + b"\n\n"
        return (b"data:" if self is Framing.SSE_COMPACT else b"data: ") + body + b"\n\n"

    @property
    def trailer(self) -> bytes | None:
        return _TRAILERS.get(self)


_TRAILERS = {Framing.OPENAI_SSE: b"data: [DONE]\n\n", Framing.TEXT_LINES: b"\n"}


@dataclass
class Reply:
    """A whole answer: its status and the object to send as JSON (None: no body; bytes: a body
    written already, of `media_type`), then `tail`, raw bytes after the JSON (KServe's binary
    tensor data)."""

    status: int
    content: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    tail: bytes = b""
    media_type: str = JSON_MEDIA_TYPE

    @property
    def body(self) -> bytes:
        if isinstance(self.content, bytes):
            return self.content + self.tail
        return (b"" if self.content is None else orjson.dumps(self.content)) + self.tail

    @property
    def large(self) -> bool:
        """Whether encoding it takes long enough to matter to the event loop (orjson holds the
        GIL: 15 MB of embeddings take ~40 ms): such a body is encoded in a worker, in pieces."""
        return _weight(self.content, PIECE_WEIGHT) > PIECE_WEIGHT

    def body_in_pieces(self) -> bytes:
        """`body`, byte for byte, encoded a piece at a time: between pieces another thread (the
        event loop's) may take the GIL."""
        return (b"" if self.content is None else b"".join(_pieces(self.content))) + self.tail


@dataclass
class StreamReply:
    """A streamed answer (status 200): chunks of events, framed on the way out. Closing
    `chunks` ends what produces them (an unfinished generation is aborted)."""

    chunks: AsyncIterator[list[Event]]
    framing: Framing

    def encode(self, events: list[Event]) -> bytes:
        return b"".join(self.framing.frame(event.data) for event in events)


Answer = Reply | StreamReply

# Leaves (numbers, strings, nulls) in one piece: orjson encodes ~10,000 floats in well under 1 ms.
PIECE_WEIGHT = 10_000
_SCALARS = (str, int, float, bool, type(None))


def _weight(value: Any, limit: int) -> int:
    """The leaves under `value`, counted until more than `limit` (a list of scalars counts its
    length without a walk)."""
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, list | tuple):
        if not value or isinstance(value[0], _SCALARS):
            return len(value)
        items = value
    else:
        return 1
    total = 0
    for item in items:
        total += _weight(item, limit - total)
        if total > limit:
            break
    return total


def _pieces(value: Any) -> Iterator[bytes]:
    """orjson.dumps(value), as pieces of at most about PIECE_WEIGHT leaves each."""
    if _weight(value, PIECE_WEIGHT) <= PIECE_WEIGHT:
        yield orjson.dumps(value)
    elif isinstance(value, dict):
        for index, (key, item) in enumerate(value.items()):
            yield (b"," if index else b"{") + orjson.dumps(key) + b":"
            yield from _pieces(item)
        yield b"}"
    elif isinstance(value[0], _SCALARS):  # a long list of scalars: slices of it
        for start in range(0, len(value), PIECE_WEIGHT):
            piece = orjson.dumps(value[start:start + PIECE_WEIGHT])
            yield (b"," if start else b"[") + piece[1:-1]
        yield b"]"
    else:
        for index, item in enumerate(value):
            yield b"," if index else b"["
            yield from _pieces(item)
        yield b"]"


def error_reply(error: ProtocolError, table: Table[ErrorKind, int]) -> Reply:
    """A protocol error in its protocol's shape, with the wire's status for its kind."""
    status = table[error.kind]
    headers = _ERROR_HEADERS.get(error.kind, {})
    return Reply(status, error.payload(status), headers)


_ERROR_HEADERS = {
    ErrorKind.OVERLOADED: {"Retry-After": str(RETRY_AFTER_SECONDS)},
    # The rest of a body that stopped arriving would be read as the next request.
    ErrorKind.SLOW_BODY: {"Connection": "close"},
}


# How LMI's stream styles go on the wire (TGI's is SSE with TGI's keys).
LMI_FRAMING = {StreamStyle.JSONLINES: Framing.JSONLINES, StreamStyle.SSE: Framing.SSE,
               StreamStyle.TGI: Framing.SSE}
