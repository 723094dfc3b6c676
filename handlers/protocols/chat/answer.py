"""What a chat-shaped answer is rendered from, whatever its protocol: the answer's context,
the request's options (how many choices, log-probabilities, which tools and how a call is made,
how the model's thinking is told from its answer), and the split of an output's text into
thinking, content and tool calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from handlers.engine.base import AnswerParsing
from handlers.engine.types import AnswerPiece, CallDelta, SamplingParams
from handlers.protocols.chat.errors import OpenAIError
from handlers.protocols.chat.logprobs import TokenText
from handlers.protocols.chat.prompt import echoed_text
from handlers.protocols.chat.reasoning import Split, splitter, thinking_marks
from handlers.protocols.chat.requests import ChatCompletionRequest, NamedToolChoice
from handlers.protocols.chat.tool_calls import (
    ParsedCall,
    arguments_call,
    collect_calls,
)
from handlers.protocols.chat.tool_parsers import call_parser


@dataclass(frozen=True)
class ResponseContext:
    """What every object of one answer repeats, and how to spell a token id."""

    id: str
    created: int
    model: str
    token_text: TokenText


@dataclass(frozen=True)
class ChatFormat:
    """How the served model's chat answers are read, by configuration: MindIE's full-text
    streams, its reasoning parser, its tool-call parser, whether tool_choice auto is allowed."""

    full_text: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    auto_tool_choice: bool = True
    engine_parsing: AnswerParsing | None = None  # the engine's own parsers (vLLM's), if any


PLAIN = ChatFormat()  # no parser configured


@dataclass(frozen=True)
class ChatOptions:
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    tool_mode: str = "none"  # none | auto | named | required
    tool_names: frozenset[str] = frozenset()
    include_usage: bool = False
    full_text: bool = False
    echo_text: str = ""  # `echo`: the assistant message the answer continues
    reasoning_parser: str | None = None  # option.reasoning_parser: thinking split off
    tool_parser: str | None = None  # option.tool_call_parser: how calls are written
    parallel_calls: bool = True  # parallel_tool_calls: false keeps the first call only
    tools: tuple[dict[str, Any], ...] = ()  # the offered tools, OpenAI's shape
    engine_parsing: AnswerParsing | None = None  # ChatFormat's

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, fmt: ChatFormat = PLAIN
                    ) -> ChatOptions:
        """The options of `request` served as `fmt` says; OpenAIError (tool_choice) for an
        `auto` choice that option.enable_auto_tool_choice=false refuses."""
        choice = request.tool_choice
        names = frozenset(t.function.name for t in request.tools or [])
        if isinstance(choice, NamedToolChoice):
            mode, names = "named", frozenset([choice.function.name])
        elif not names or choice == "none":
            mode = "none"
        else:
            mode = "required" if choice == "required" else "auto"
        if mode == "auto" and not fmt.auto_tool_choice:
            raise OpenAIError("tool_choice: 'auto' is off on this server "
                              "(option.enable_auto_tool_choice=false); name a function, or "
                              "'required' or 'none'", "tool_choice", code="unsupported_value")
        return cls(
            n=request.n,
            logprobs=bool(request.logprobs),
            top_logprobs=request.top_logprobs or 0,
            tool_mode=mode,
            tool_names=names,
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
            full_text=fmt.full_text,
            echo_text=echoed_text(request),
            # Thinking switched off (chat_template_kwargs): what the model says is all answer.
            reasoning_parser=fmt.reasoning_parser if request.thinking else None,
            tool_parser=fmt.tool_call_parser,
            parallel_calls=request.parallel_tool_calls is not False,
            tools=tuple(tool.model_dump(exclude_none=True) for tool in request.tools or []),
            engine_parsing=fmt.engine_parsing,
        )


class ToolExtractor:
    """Splits one choice's streamed text into content and tool calls' deltas, by `tool_mode`:
    auto reads the family's format (tool_parsers); a forced call's (constrained) output is
    JSON: the calls for `required`, read as they stream, or the named function's arguments,
    held to the end here (the chat routes stream them as they come, `AnswerParts.split`)."""

    def __init__(self, opts: ChatOptions) -> None:
        self.mode = opts.tool_mode
        self.names = set(opts.tool_names)
        self.parser = call_parser(opts.tool_parser if self.mode == "auto" else None, self.names) \
            if self.mode in ("auto", "required") else None
        self.single = not opts.parallel_calls
        self.held = ""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self.parser is not None:
            content, deltas = self.parser.feed(text)
            return content, self.allowed(deltas)
        if self.mode == "none":
            return text, []
        self.held += text
        return "", []

    def allowed(self, deltas: list[CallDelta]) -> list[CallDelta]:
        """With parallel_tool_calls false, the first call only."""
        return [d for d in deltas if d.index == 0] if self.single else deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        if self.parser is not None:
            content, deltas = self.parser.finish()
            return content, self.allowed(deltas)
        if self.mode == "named":
            call = arguments_call(next(iter(self.names)), self.held)
            return ("", [CallDelta(0, call.arguments, call.name)]) if call else (self.held, [])
        return "", []


def think_first(params: SamplingParams, options: ChatOptions, budget: int | None,
                field: str) -> None:
    """With a reasoning parser and thinking on, the engine waits for the thinking's end before
    it constrains the answer (structured output, a forced call), and thinks at most `budget`
    tokens (`field`: where the request gave it); OpenAIError for a budget nothing would read."""
    if options.reasoning_parser is None:
        if budget is not None:
            raise OpenAIError(f"{field}: this model does not think here (the server has no "
                              "option.reasoning_parser, or the request switched thinking off)",
                              field, code="unsupported_value")
        return
    params.thinking_end, params.thinking_start = thinking_marks(options.reasoning_parser)
    params.max_thinking_tokens = budget


class AnswerParts:
    """One choice's streamed text into thinking, content and tool calls' deltas: the reasoning
    parser first, so calls are parsed from the answer only (never from the thinking), then the
    tool extractor over the answer. Where the engine has its own parsers (vLLM's), they read the
    thinking, and the calls too for tool_choice auto when one is configured; they need the
    tokens' ids beside the text."""

    def __init__(self, opts: ChatOptions) -> None:
        self.engine = opts.engine_parsing.parser(
            list(opts.tools), opts.reasoning_parser is not None, opts.tool_mode == "auto") \
            if opts.engine_parsing is not None else None
        self.reasoning = splitter(opts.reasoning_parser) if self.engine is None else None
        self.tools = ToolExtractor(opts)

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str, list[CallDelta]]:
        if self.engine is not None:
            return self._engine_piece(self.engine.feed(text, token_ids, finished=False))
        split = self.reasoning.feed(text) if self.reasoning else Split(content=text)
        content, calls = self.tools.feed(split.content)
        return split.reasoning, content, calls

    def finish(self) -> tuple[str, str, list[CallDelta]]:
        if self.engine is not None:
            reasoning, content, calls = self._engine_piece(self.engine.feed("", (), True))
        else:
            split = self.reasoning.finish() if self.reasoning else Split()
            reasoning, (content, calls) = split.reasoning, self.tools.feed(split.content)
        tail, more = self._tools_finish()
        return reasoning, content + tail, calls + more

    def split(self, text: str, finished: bool, token_ids: Sequence[int] = ()) -> Split:
        """Thinking and answer only, the answer left whole (a named call's arguments, which
        stream as they are generated)."""
        if self.engine is not None:
            piece = self.engine.feed(text, token_ids, finished)
            return Split(piece.reasoning, piece.content)
        if self.reasoning is None:
            return Split(content=text)
        out = self.reasoning.feed(text)
        return out + self.reasoning.finish() if finished else out

    def whole(self, text: str, token_ids: Sequence[int] = ()
              ) -> tuple[str, str, list[ParsedCall]]:
        """A whole output's parts."""
        if self.engine is not None:
            reasoning, content, deltas = self._engine_piece(self.engine.whole(text, token_ids))
            tail, more = self._tools_finish()
            return reasoning, content + tail, collect_calls(deltas + more)
        reasoning, content, deltas = self.feed(text)
        more_reasoning, tail, more = self.finish()
        return reasoning + more_reasoning, content + tail, collect_calls(deltas + more)

    @property
    def _engine_reads_calls(self) -> bool:
        return self.engine is not None and self.engine.reads_calls

    def _tools_finish(self) -> tuple[str, list[CallDelta]]:
        """The tool extractor's end, unless the engine read the calls itself."""
        return ("", []) if self._engine_reads_calls else self.tools.finish()

    def _engine_piece(self, piece: AnswerPiece) -> tuple[str, str, list[CallDelta]]:
        """The engine's reading of a piece; its content through the tool extractor where the
        engine does not read the calls (forced calls, or no tool parser configured)."""
        if self._engine_reads_calls:
            return piece.reasoning, piece.content, self.tools.allowed(list(piece.calls))
        content, calls = self.tools.feed(piece.content)
        return piece.reasoning, content, calls
