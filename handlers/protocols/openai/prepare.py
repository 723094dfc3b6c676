"""From a decoded body to what the server runs: engine requests plus how to render answers.

The driver then has the engine validate (tokenize) each `GenerationRequest`, and `admit.checks`
fits its output length. Everything here raises `OpenAIError` naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from handlers.engine.base import Tokenizer
from handlers.engine.types import GenerationRequest
from handlers.protocols.adapters import UnknownAdapter, adapter_named
from handlers.protocols.openai.accumulate import ResponseContext
from handlers.protocols.openai.chat_prompt import render_chat_prompt
from handlers.protocols.openai.chat_render import ChatOptions
from handlers.protocols.openai.completion_render import CompletionOptions
from handlers.protocols.openai.errors import OpenAIError, model_not_found
from handlers.protocols.openai.logprobs import TokenText
from handlers.protocols.openai.params import chat_sampling_params, completion_sampling_params
from handlers.protocols.openai.parse import parse_chat_request, parse_completion_request
from handlers.protocols.openai.requests import ChatCompletionRequest, CompletionRequest
from handlers.protocols.openai.structured import structured_output


@dataclass
class ChatJob:
    request: ChatCompletionRequest
    gen: GenerationRequest
    context: ResponseContext
    options: ChatOptions


@dataclass
class CompletionJob:
    request: CompletionRequest
    gens: list[GenerationRequest]  # one per prompt
    context: ResponseContext
    options: CompletionOptions


def prepare_chat(body: Any, tokenizer: Tokenizer, model: str, full_text_enabled: bool,
                 adapters: Sequence[str] = ()) -> ChatJob:
    """`adapters`: the LoRA adapters `model` (the field) may name instead of the model."""
    request = parse_chat_request(body)
    adapter = check_model(request.model, model, adapters)
    prompt = render_chat_prompt(tokenizer, request)
    params = chat_sampling_params(request, structured_output(request))
    gen = GenerationRequest(prompt=prompt, params=params, adapter=adapter)
    context = ResponseContext(f"chatcmpl-{gen.request_id}", int(time.time()), adapter or model,
                              token_text_of(tokenizer))
    return ChatJob(request, gen, context, ChatOptions.for_request(request, full_text_enabled))


def prepare_completion(body: Any, tokenizer: Tokenizer, model: str,
                       adapters: Sequence[str] = ()) -> CompletionJob:
    request = parse_completion_request(body)
    adapter = check_model(request.model, model, adapters)
    prompts = prompt_list(request.prompt, tokenizer)
    gens = [GenerationRequest(prompt=text, params=completion_sampling_params(request),
                              prompt_token_ids=ids, adapter=adapter) for text, ids in prompts]
    context = ResponseContext(f"cmpl-{gens[0].request_id}", int(time.time()), adapter or model,
                              token_text_of(tokenizer))
    options = CompletionOptions.for_request(request, [text for text, _ in prompts])
    return CompletionJob(request, gens, context, options)


def check_model(requested: str | None, served: str, adapters: Sequence[str] = ()
                ) -> str | None:
    """The LoRA adapter `model` names (None: the served model, as when it is absent); 404 for
    any other model. The answer's `model` echoes the adapter, as vLLM's does."""
    try:
        return adapter_named(requested, served, adapters)
    except UnknownAdapter:
        raise model_not_found(requested, served, adapters) from None


def prompt_list(prompt: str | list[Any], tokenizer: Tokenizer
                ) -> list[tuple[str, list[int] | None]]:
    """Each prompt as (text, token ids or None): a string, strings, ids, or lists of ids."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    lists = [prompt] if all(isinstance(p, int) for p in prompt) else prompt
    out = []
    for i, ids in enumerate(lists):
        bad = [t for t in ids if t < 0 or t >= tokenizer.vocab_size]
        if not ids or bad:
            where = f"prompt[{i}]" if lists is prompt else "prompt"
            what = f"unknown token ids {bad[:5]}" if bad else "an empty prompt"
            raise OpenAIError(f"{where}: {what}", where, code="invalid_value")
        out.append((tokenizer.decode(ids, skip_special_tokens=False), list(ids)))
    return out


def token_text_of(tokenizer: Tokenizer) -> TokenText:
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return token_text
