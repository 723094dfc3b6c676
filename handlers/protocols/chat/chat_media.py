"""Media parts of chat messages, for a model that takes them: OpenAI's `image_url` (an object
with `url` and `detail`, or MindIE's plain string), `input_audio` (`data`, `format`),
`video_url` and `audio_url` (object or string). Each becomes a placeholder part of the message
(`{"type": "image"}`: what multimodal chat templates render as the model's media token) and a
`MediaItem` read by the model's `MediaReader` (engine/media/): fetched, checked, decoded.

Other protocols (Anthropic's image blocks, the Responses API's input_image) hand their media
here in these shapes, with `_where` naming the part in their own terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handlers.engine.media import MediaError, MediaReader
from handlers.engine.types import MediaItem
from handlers.protocols.chat.errors import OpenAIError

# part type -> (the media kind, the key holding its source)
PARTS = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"),
         "audio_url": ("audio", "audio_url"), "input_audio": ("audio", "input_audio")}
MEDIA_PARTS = frozenset({*PARTS, "input_image", "image", "video", "audio", "file"})
AUDIO_FORMATS = frozenset({"wav", "mp3", "flac"})


class MediaParts:
    """The media parts of one conversation, in order, as the messages are read."""

    def __init__(self, reader: MediaReader | None) -> None:
        self.reader = reader
        self._wanted: list[tuple[str, str, str]] = []  # (kind, source, where)

    def content(self, content: str | list[dict[str, Any]] | None, where: str, role: str
                ) -> str | list[dict[str, Any]]:
        """A message's content for the template: its text, or (with media) a list of text and
        placeholder parts."""
        if content is None or isinstance(content, str):
            return content or ""
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            param = part.get("_where") or f"{where}.content[{j}]"
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise OpenAIError(f"{param}.text: a text part needs a string 'text'",
                                      f"{param}.text", code="invalid_type")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in PARTS:
                parts.append(self._media(part, kind, param, role))
            else:
                raise OpenAIError(f"{param}.type: must be text, image_url, input_audio, "
                                  f"video_url or audio_url (got {kind!r})", f"{param}.type",
                                  code="invalid_value")
        if all(p["type"] == "text" for p in parts):  # text only: as a text model reads it
            return "\n".join(p["text"] for p in parts)
        return parts

    def _media(self, part: dict[str, Any], type_: str, param: str, role: str
               ) -> dict[str, Any]:
        kind, key = PARTS[type_]
        assert self.reader is not None
        if kind not in self.reader.kinds:
            taken = ", ".join(sorted(self.reader.kinds))
            raise OpenAIError(f"{param}.type: this model takes {taken} content, not {kind}",
                              f"{param}.type", code="invalid_value")
        if role != "user":
            raise OpenAIError(f"{param}.type: media parts belong in user messages",
                              f"{param}.type", code="invalid_value")
        self._wanted.append((kind, _source(part.get(key), type_, f"{param}.{key}"),
                             f"{param}.{key}"))
        return {"type": kind}

    def pending(self) -> PendingMedia | None:
        """The media parts to read, once their number is known to be allowed; None: none."""
        if not self._wanted:
            return None
        assert self.reader is not None
        try:
            self.reader.check_counts([kind for kind, _, _ in self._wanted], "messages")
        except MediaError as exc:
            raise OpenAIError(exc.message, exc.where, code="invalid_value") from None
        return PendingMedia(self.reader, tuple(self._wanted))


@dataclass(frozen=True)
class PendingMedia:
    """A prompt's media parts, to read (fetch, check, decode) in order: the server does so
    before validation, outside its shared workers (GenerationRequest.pending_media)."""

    reader: MediaReader
    wanted: tuple[tuple[str, str, str], ...]  # (kind, source, where)

    def read(self) -> tuple[MediaItem, ...]:
        """The media; MediaError naming the first part that cannot be used."""
        return tuple(self.reader.read(kind, source, where) for kind, source, where in self.wanted)

    def read_here(self) -> tuple[MediaItem, ...]:
        """The media, a part that cannot be used refused in OpenAI's terms."""
        try:
            return self.read()
        except MediaError as exc:
            raise OpenAIError(exc.message, exc.where, code="invalid_value") from None


def _source(value: Any, type_: str, param: str) -> str:
    """The reference a part holds: a string, `{"url": ...}`, or input_audio's `data`."""
    if type_ == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise OpenAIError(f"{param}: an object with base64 'data' and 'format'", param,
                              code="invalid_type")
        if value.get("format") not in AUDIO_FORMATS:
            raise OpenAIError(f"{param}.format: one of {', '.join(sorted(AUDIO_FORMATS))}",
                              f"{param}.format", code="invalid_value")
        return value["data"]
    if isinstance(value, dict):
        value = value.get("url")
        param = f"{param}.url"
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{param}: a URL, a data: URL, base64 or a server path", param,
                          code="invalid_type")
    return value
