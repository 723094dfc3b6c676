"""vLLM's tokenizer endpoints, `POST /tokenize` and `POST /detokenize`: vLLM's bodies and
answers, OpenAI's error shape (as vLLM answers them).

`/tokenize` takes a `prompt` (special tokens added unless `add_special_tokens` is false) or chat
`messages` (with `tools`, `add_generation_prompt`, `continue_final_message`), rendered exactly as
`/v1/chat/completions` renders them and without added special tokens (the template writes its
own), so the ids are those the chat route counts as `prompt_tokens`. It answers `count`,
`max_model_len`, `tokens` and, with `return_token_strs`, `token_strs` (each id's string in the
vocabulary; null otherwise). `/detokenize` takes `tokens` and answers their text as `prompt`,
special tokens included. `model`, when given, must name the served model.

Both are bounded as a body is (413 in OpenAI's shape): a text of at most `MAX_TEXT` characters
(a second or so of tokenizing on a slow CPU), at most `MAX_IDS` ids; the server tokenizes in
its workers, never on the event loop, but one request should not hold a worker for long.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from handlers.engine.base import Tokenizer
from handlers.protocols.chat.errors import OpenAIError, check_model, validate_body
from handlers.protocols.chat.prompt import ChatPrompt, media_prompt_ids, render_chat_prompt
from handlers.protocols.chat.requests import (
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    Tool,
)
from handlers.protocols.errors import ErrorKind


class _TokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None


class TokenizePromptRequest(_TokensRequest):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_TokensRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool | None = None  # null: true unless continuing the last message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)  # as on chat
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_TokensRequest):
    tokens: list[int]


R = TypeVar("R", bound=_TokensRequest)
MAX_TEXT = 1 << 20  # characters of text to tokenize
MAX_IDS = 1 << 18  # token ids to detokenize


def _parse(kind: type[R], body: Any, model: str) -> R:
    request = validate_body(kind, body)
    check_model(request.model, model)
    return request


def tokenize(body: Any, tokenizer: Tokenizer, model: str, max_model_len: int) -> dict[str, Any]:
    is_chat = isinstance(body, dict) and "messages" in body
    request = _parse(TokenizeChatRequest if is_chat else TokenizePromptRequest, body, model)
    prompt = _chat_prompt(request, tokenizer) if isinstance(request, TokenizeChatRequest) \
        else ChatPrompt(request.prompt)
    text = prompt.text
    if len(text) > MAX_TEXT:
        field = "messages" if is_chat else "prompt"
        raise OpenAIError(f"{field}: the text to tokenize is {len(text)} characters; the "
                          f"limit is {MAX_TEXT}", field, ErrorKind.TOO_LARGE)
    # With media, the model's processor counts them (the chat template wrote special tokens).
    ids = media_prompt_ids(tokenizer, prompt) if prompt.media else \
        tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    strings = tokenizer.token_strings(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strings}


def _chat_prompt(request: TokenizeChatRequest, tokenizer: Tokenizer) -> ChatPrompt:
    if request.continue_final_message and request.add_generation_prompt:
        raise OpenAIError("continue_final_message: cannot be true with add_generation_prompt",
                          "continue_final_message", code="invalid_value")
    chat = ChatCompletionRequest.model_construct(
        messages=request.messages, tools=request.tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template_kwargs=request.chat_template_kwargs)
    return render_chat_prompt(tokenizer, chat)


def detokenize(body: Any, tokenizer: Tokenizer, model: str) -> dict[str, str]:
    request = _parse(DetokenizeRequest, body, model)
    if len(request.tokens) > MAX_IDS:
        raise OpenAIError(f"tokens: {len(request.tokens)} ids to detokenize; the limit is "
                          f"{MAX_IDS}", "tokens", ErrorKind.TOO_LARGE)
    unknown = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
    if unknown:
        raise OpenAIError(f"tokens: unknown token ids {unknown[:5]}", "tokens",
                          code="invalid_value")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}
