"""vLLM's own reading of chat answers: with option.reasoning_parser or option.tool_call_parser on
the vLLM engine, answers are split by vLLM's Parser (`vllm.parser`, what its OpenAI server
composes from the same two names), so they have the shapes vLLM's server gives them.

The parser classes are composed once at startup, where vLLM checks them against the tokenizer (a
tokenizer without `<think>` stops startup naming the setting); one parser is made per answer,
for its tools, whether it thinks and whether calls are read from its text (tool_choice auto:
forced calls are constrained JSON, read as the protocols read them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import Parser, ParserManager

from handlers.config import Config, ConfigError
from handlers.engine.types import AnswerPiece, CallDelta


class VllmAnswerParsing:
    def __init__(self, config: Config, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._model = config.model_name
        self._classes: dict[tuple[bool, bool], type[Parser] | None] = {}
        for thinking in (True, False):
            for auto in (True, False):
                self._classes[thinking, auto] = _parser_class(config, tokenizer, thinking, auto)

    def parser(self, tools: list[dict[str, Any]], thinking: bool, auto_tools: bool
               ) -> VllmAnswerParser | None:
        parser_class = self._classes[thinking, auto_tools and bool(tools)]
        if parser_class is None:
            return None
        request = ChatCompletionRequest.model_validate({
            "model": self._model, "messages": [{"role": "user", "content": ""}],
            "tools": tools or None, "tool_choice": "auto" if auto_tools and tools else "none"})
        parser = parser_class(self._tokenizer, request.tools)
        return VllmAnswerParser(parser, request, parser_class.tool_parser_cls is not None)


def _parser_class(config: Config, tokenizer: Any, thinking: bool, auto: bool
                  ) -> type[Parser] | None:
    """vLLM's composed parser for answers that think or not, with calls read or not; a
    ConfigError naming the settings where vLLM refuses them (the tokenizer lacks their tokens)."""
    reasoning = config.reasoning_parser if thinking else None
    tools = config.tool_call_parser if auto else None
    try:
        return ParserManager.get_parser(tool_parser_name=tools, reasoning_parser_name=reasoning,
                                        enable_auto_tools=auto, model_name=config.model_name,
                                        tokenizer=tokenizer)
    except (TypeError, ValueError, KeyError) as exc:
        named = [f"option.{key}={getattr(config, key)} ({config.sources[key]})"
                 for key, name in (("reasoning_parser", reasoning), ("tool_call_parser", tools))
                 if name]
        raise ConfigError(f"{' and '.join(named)}: vLLM's parser refuses this model's "
                          f"tokenizer: {exc.__cause__ or exc}") from exc


class VllmAnswerParser:
    """One answer through vLLM's parser: `feed` as it streams (the token ids beside the text,
    as vLLM's parsers find markers by their tokens), `whole` for a finished answer."""

    def __init__(self, parser: Parser, request: ChatCompletionRequest, reads_calls: bool
                 ) -> None:
        self._parser = parser
        self._request = request
        self.reads_calls = reads_calls
        # vLLM's server gives the prompt's ids first, to tell whether the answer opens in the
        # thinking; with no reasoning parser it does not, whatever the prompt.
        self._prompt: list[int] | None = [] if parser.reasoning_parser is None else None

    def feed(self, text: str, token_ids: Sequence[int], finished: bool) -> AnswerPiece:
        prompt, self._prompt = self._prompt, None
        delta = self._parser.parse_delta(text, list(token_ids), self._request, prompt,
                                         finished=finished)
        if delta is None:
            return AnswerPiece()
        calls = tuple(CallDelta(call.index, _arguments(call.function), _name(call.function),
                                call.id) for call in delta.tool_calls)
        return AnswerPiece(delta.reasoning or "", delta.content or "", calls)

    def whole(self, text: str, token_ids: Sequence[int]) -> AnswerPiece:
        reasoning, content, calls = self._parser.parse(
            text, self._request, enable_auto_tools=self.reads_calls,
            model_output_token_ids=token_ids)
        return AnswerPiece(reasoning or "", content or "", tuple(
            CallDelta(index, call.arguments, call.name, call.id)
            for index, call in enumerate(calls or [])))


def _name(function: Any) -> str | None:
    return None if function is None else function.name


def _arguments(function: Any) -> str:
    return "" if function is None else function.arguments or ""
