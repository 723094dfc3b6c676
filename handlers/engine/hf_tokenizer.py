"""The `Tokenizer` interface over a Hugging Face (transformers) tokenizer, with
`option.chat_template` in place of the model's own template when it is set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any

from handlers.engine.media import MediaReader
from handlers.engine.prompt_tokens import TokenBound, token_bound
from handlers.engine.types import MediaItem


class HFTokenizer:
    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int],
                 chat_template: str | None = None, media: MediaReader | None = None,
                 media_ids: Callable[[str, tuple[MediaItem, ...]], list[int]] | None = None
                 ) -> None:
        self.hf = tokenizer
        self.media = media  # a multimodal model's: what reads media parts
        self._media_ids = media_ids  # its processor's count of a prompt with media
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        self._chat_template = chat_template

    @cached_property
    def token_bound(self) -> TokenBound | None:
        """The fewest tokens a text can be (engine/prompt_tokens.py), read from the vocabulary on
        first use; None for a tokenizer without a Rust backend or without a proven bound."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        return None if backend is None else token_bound(backend)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_media_prompt(self, text: str, media: tuple[MediaItem, ...]) -> list[int]:
        if self._media_ids is None:
            raise ValueError("this model is text-only")
        return self._media_ids(text, media)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        if self._chat_template is not None:
            return self._chat_template
        return self.hf.get_chat_template(tools=tools)  # ValueError when the model has none

    def render_chat(self, template: str, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                    continue_final_message: bool,
                    variables: dict[str, Any] | None = None) -> str:
        return self.hf.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(variables or {}))
