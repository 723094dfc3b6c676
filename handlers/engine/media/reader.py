"""The one way media parts are read: their bytes from the source, checked, decoded, hashed."""

from __future__ import annotations

import hashlib
from collections import Counter

from handlers.engine.media import decode, sources
from handlers.engine.media.limits import MediaLimits
from handlers.engine.types import MediaItem


class MediaReader:
    """What a multimodal model takes (`kinds`), read within `limits`."""

    def __init__(self, kinds: frozenset[str], limits: MediaLimits) -> None:
        self.kinds = kinds
        self.limits = limits

    def check_counts(self, kinds: list[str], where: str) -> None:
        self.limits.check_counts(Counter(kinds), where)

    def read(self, kind: str, ref: str, where: str) -> MediaItem:
        """The part at `where`, of `kind`, from `ref` (a URL, a data: URL, base64 or a path)."""
        data = sources.read_bytes(ref, kind, self.limits, where)
        return MediaItem(kind, decode.decode(kind, data, where),
                         hashlib.sha256(data).hexdigest(), where)
