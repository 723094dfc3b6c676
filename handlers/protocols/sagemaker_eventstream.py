"""AWS event-stream framing for SageMaker's `InvokeEndpointWithResponseStream`.

A frame is: total length (uint32), headers length (uint32), CRC32 of those 8 bytes, the headers,
the payload, and a CRC32 of everything before it. All integers are big-endian. Headers used here
are all strings (type 7): a 1-byte name length, the name, the type, a 2-byte value length, the
value. botocore decodes these frames with `botocore.eventstream.EventStreamBuffer`.
"""

from __future__ import annotations

import struct
import zlib

import orjson

EVENT_STREAM = "application/vnd.amazon.eventstream"
_STRING = 7
_PRELUDE = struct.Struct(">II")
_CRC = struct.Struct(">I")


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (
        struct.pack(">B", len(raw_name))
        + raw_name
        + struct.pack(">BH", _STRING, len(raw_value))
        + raw_value
    )


def encode_frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message with string headers."""
    raw_headers = b"".join(_header(name, value) for name, value in headers.items())
    total = _PRELUDE.size + _CRC.size + len(raw_headers) + len(payload) + _CRC.size
    prelude = _PRELUDE.pack(total, len(raw_headers))
    message = prelude + _CRC.pack(zlib.crc32(prelude)) + raw_headers + payload
    return message + _CRC.pack(zlib.crc32(message))


def payload_part(data: bytes) -> bytes:
    """A `PayloadPart` event: its payload is the part's `Bytes`."""
    headers = {
        ":event-type": "PayloadPart",
        ":message-type": "event",
        ":content-type": "application/octet-stream",
    }
    return encode_frame(headers, data)


def model_stream_error(message: str, error_code: str = "StreamBroken") -> bytes:
    """A `ModelStreamError` exception event; AWS's error codes are StreamBroken and
    ModelInvocationTimeExceeded."""
    headers = {
        ":exception-type": "ModelStreamError",
        ":message-type": "exception",
        ":content-type": "application/json",
    }
    return encode_frame(headers, orjson.dumps({"ErrorCode": error_code, "Message": message}))
