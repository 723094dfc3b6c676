"""Media in prompts: read from where a request says (sources.py), checked against the limits
(limits.py), decoded (decode.py), all through one `MediaReader` (reader.py) that an engine
serving a multimodal model hands its tokenizer. Every failure is a `MediaError` naming the part."""

from handlers.engine.media.limits import MediaError, MediaLimits
from handlers.engine.media.reader import MediaReader

__all__ = ["MediaError", "MediaLimits", "MediaReader"]
