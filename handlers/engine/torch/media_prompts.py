"""A vision-language (or audio-language) model's prompts: the prompt text, with the placeholders
its chat template wrote, and the request's media go through the model's own processor
(transformers' AutoProcessor), which expands each placeholder into the media's tokens and makes
the vision (audio) encoder's inputs. Validation does this, in a worker thread; the encoder runs
in the engine's prefill (`prompt_embeddings`)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from handlers.engine.media.processor import (
    processor_inputs,
    processor_kinds,
    prompt_token_ids,
)
from handlers.engine.types import GenerationRequest, MediaInputs, MediaItem, RequestValidationError


class MediaPrompts:
    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.kinds = processor_kinds(processor)
        tokenizer = processor.tokenizer
        self.media_ids = frozenset(
            tokenizer.convert_tokens_to_ids(token) for name in ("image_token", "video_token",
                                                                "audio_token")
            if isinstance(token := getattr(processor, name, None), str))

    def prepare(self, request: GenerationRequest, max_model_len: int) -> None:
        """Fill `prompt_token_ids` (media tokens expanded) and `media_inputs`."""
        if request.params.truncate is not None:
            raise RequestValidationError("truncate", "a prompt with media cannot be truncated")
        try:
            tensors = self.inputs(request.prompt, request.media)
        except (ValueError, TypeError, IndexError) as exc:
            raise RequestValidationError("messages", f"the model's processor refused the "
                                         f"prompt's media: {exc}") from None
        ids = tensors["input_ids"][0].tolist()
        if len(ids) >= max_model_len:
            raise RequestValidationError(
                "inputs", f"the prompt is {len(ids)} tokens with its media, but the model's "
                f"context is {max_model_len} tokens (prompt and generated tokens together)")
        request.prompt_token_ids = ids
        request.media_inputs = MediaInputs(tensors, self._cache_ids(ids, request.media))

    def inputs(self, prompt: str, media: tuple[MediaItem, ...]) -> dict[str, Any]:
        """The processor's output for one prompt and its media, as transformers' generate takes
        it (the tests' reference calls this too)."""
        return processor_inputs(self.processor, prompt, media)

    def token_ids(self, prompt: str, media: tuple[MediaItem, ...]) -> list[int]:
        return prompt_token_ids(self.processor, prompt, media)

    def _cache_ids(self, ids: list[int], media: tuple[MediaItem, ...]) -> tuple[int, ...]:
        digest = hashlib.sha256("".join(m.digest for m in media).encode()).digest()
        key = -1 - int.from_bytes(digest[:7], "big")
        return tuple(key if i in self.media_ids else i for i in ids)


def _on(value: Any, model: nn.Module) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(model.device, model.dtype if value.is_floating_point() else None)


class _Embedded(Exception):
    def __init__(self, embeds: torch.Tensor) -> None:
        super().__init__("captured")
        self.embeds = embeds


@torch.inference_mode()
def prompt_embeddings(model: nn.Module, inputs: MediaInputs) -> torch.Tensor:
    """The prompt's input embeddings [tokens, hidden], media merged in: the model's own forward
    runs its encoders and merges their features, and stops where its language model would start
    (a hook takes the embeddings there), so every family merges its own way."""
    decoder = model.get_decoder()

    def capture(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        raise _Embedded(kwargs["inputs_embeds"])

    handle = decoder.register_forward_pre_hook(capture, with_kwargs=True)
    tensors = {k: _on(v, model) for k, v in inputs.tensors.items()}
    try:
        model.model(**tensors)
    except _Embedded as done:
        return done.embeds[0]
    finally:
        handle.remove()
    raise RuntimeError("the model's forward never reached its language model")
