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
from handlers.engine.types import GenerationRequest, SamplingParams
from handlers.protocols.chat.answer import (
    ChatFormat,
    ChatOptions,
    ResponseContext,
    think_first,
)
from handlers.protocols.chat.errors import OpenAIError, check_model
from handlers.protocols.chat.logprobs import token_text_of
from handlers.protocols.chat.params import chat_sampling_params, sampling_params
from handlers.protocols.chat.prompt import render_chat_prompt
from handlers.protocols.chat.requests import ChatCompletionRequest
from handlers.protocols.chat.structured import structured_output
from handlers.protocols.openai.completion_render import CompletionOptions
from handlers.protocols.openai.parse import parse_chat_request, parse_completion_request
from handlers.protocols.openai.requests import CompletionRequest


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


def prepare_chat(body: Any, tokenizer: Tokenizer, model: str, fmt: ChatFormat,
                 adapters: Sequence[str] = ()) -> ChatJob:
    """`adapters`: the LoRA adapters `model` (the field) may name instead of the model; `fmt`:
    how the model's answers are read."""
    request = parse_chat_request(body)
    adapter = check_model(request.model, model, adapters)
    prompt = render_chat_prompt(tokenizer, request)
    params = chat_sampling_params(request, structured_output(request))
    options = ChatOptions.for_request(request, fmt)
    think_first(params, options, request.thinking_token_budget, "thinking_token_budget")
    gen = GenerationRequest(prompt=prompt.text, params=params, adapter=adapter,
                            **prompt.request_media())
    context = ResponseContext(f"chatcmpl-{gen.request_id}", int(time.time()), adapter or model,
                              token_text_of(tokenizer))
    return ChatJob(request, gen, context, options)


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


def completion_sampling_params(request: CompletionRequest) -> SamplingParams:
    return sampling_params(
        request,
        top_logprobs=request.logprobs or 0,
        prompt_logprobs=bool(request.echo) and request.logprobs is not None,
        best_of=request.best_of,
    )


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
