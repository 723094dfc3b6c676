"""A multimodal model's Hugging Face processor (transformers' AutoProcessor) over a prompt and
its media: the model's inputs, with each placeholder its chat template wrote expanded into the
media's tokens. What the torch engine runs, and what any engine counts a prompt's tokens by."""

from __future__ import annotations

from typing import Any

import numpy as np

from handlers.engine.types import MediaItem

# A processor's attribute -> the media kind it reads.
_PARTS = {"image_processor": "image", "video_processor": "video", "feature_extractor": "audio"}


def processor_kinds(processor: Any) -> frozenset[str]:
    """The media a model's processor reads."""
    return frozenset(kind for name, kind in _PARTS.items()
                     if getattr(processor, name, None) is not None)


def processor_inputs(processor: Any, prompt: str, media: tuple[MediaItem, ...]
                     ) -> dict[str, Any]:
    """The processor's output (torch tensors) for one prompt and its media; the chat template
    wrote the prompt's special tokens, so the processor adds none."""
    rate = getattr(getattr(processor, "feature_extractor", None), "sampling_rate", None)
    kwargs: dict[str, Any] = {}
    images = [m.data for m in media if m.kind == "image"]
    videos = [m.data for m in media if m.kind == "video"]
    audio = [_resampled(*m.data, rate) for m in media if m.kind == "audio"]
    if images:
        kwargs["images"] = [images]
    if videos:
        kwargs["videos"] = [videos]
    if audio:
        kwargs["audio"] = audio
        kwargs["sampling_rate"] = rate
    return dict(processor(text=[prompt], return_tensors="pt", add_special_tokens=False,
                          **kwargs))


def prompt_token_ids(processor: Any, prompt: str, media: tuple[MediaItem, ...]) -> list[int]:
    """The prompt's tokens as the model counts them, its media's included."""
    return processor_inputs(processor, prompt, media)["input_ids"][0].tolist()


def _resampled(samples: np.ndarray, rate: int, target: int | None) -> np.ndarray:
    """Audio at the feature extractor's sampling rate (linear interpolation)."""
    if target is None or rate == target:
        return samples
    count = max(1, round(len(samples) * target / rate))
    return np.interp(np.linspace(0, len(samples) - 1, count), np.arange(len(samples)),
                     samples).astype(np.float32)
