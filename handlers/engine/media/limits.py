"""What media a request may carry and from where: MindIE's chat API's limits by default (20
items a request; images and audio up to 20 MB, video up to 512 MB), vLLM's settings for the
rest (`option.limit_mm_per_prompt`, `option.allowed_media_domains`,
`option.allowed_local_media_path`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from handlers.config import Config

MB = 1 << 20
MAX_BYTES = {"image": 20 * MB, "audio": 20 * MB, "video": 512 * MB}
MAX_ITEMS = 20  # media parts of one request, all kinds together (MindIE's)
# Seconds a URL may take to answer in full (vLLM's VLLM_*_FETCH_TIMEOUT defaults).
FETCH_TIMEOUT = {"image": 5.0, "audio": 10.0, "video": 30.0}
MAX_FETCHES = 8  # URLs fetched at once, across requests; more wait their turn
MAX_REDIRECTS = 5
MAX_VIDEO_FRAMES = 32  # frames kept of a video, evenly spaced


class MediaError(ValueError):
    """A media part that cannot be used; `where` names the request field."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.detail = message
        self.message = f"{where}: {message}"


@dataclass(frozen=True)
class MediaLimits:
    per_prompt: dict[str, int] | None = None  # modality -> count; None: MAX_ITEMS in all
    domains: tuple[str, ...] | None = None  # hosts URLs may name; None: any
    local_path: Path | None = None  # the folder server paths may be under; None: none
    max_bytes: dict[str, int] = field(default_factory=lambda: dict(MAX_BYTES))
    timeout: dict[str, float] = field(default_factory=lambda: dict(FETCH_TIMEOUT))

    @classmethod
    def of(cls, config: Config) -> MediaLimits:
        local = config.allowed_local_media_path
        return cls(config.limit_mm_per_prompt, config.allowed_media_domains,
                   Path(local).resolve() if local else None)

    def check_counts(self, counts: Counter[str], where: str) -> None:
        """Refuse a prompt with more media than allowed (`counts`: by kind)."""
        total = sum(counts.values())
        if total > MAX_ITEMS:
            raise MediaError(where, f"{total} media parts; at most {MAX_ITEMS} per request")
        for kind, count in counts.items():
            if self.per_prompt is None:
                continue
            allowed = self.per_prompt.get(kind, 0)
            if count > allowed:
                raise MediaError(where, f"{count} {kind} parts; at most {allowed} per prompt "
                                 f"(option.limit_mm_per_prompt)")


def media_settings_given(config: Config) -> list[str]:
    """The media settings `config` sets (refused for a model that reads text only)."""
    names = ("limit_mm_per_prompt", "allowed_media_domains", "allowed_local_media_path")
    return [f"option.{name}" for name in names if getattr(config, name) is not None]
