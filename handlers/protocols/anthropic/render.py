"""Anthropic `message` objects and stream events, from the engine's outputs (pure).

Text is one `text` block; tool calls (read from the output as chat completions read them) are
`tool_use` blocks with `id`, `name` and `input`. With a reasoning parser
(option.reasoning_parser) the model's thinking comes first as a `thinking` block (streamed as
`thinking_delta`s, closed by a `signature_delta`: the signature is empty, as this server signs
nothing). `stop_reason`: `max_tokens` when the cap cut the output, else `tool_use` when a call
was made, `stop_sequence` (with `stop_sequence` set) when one matched, else `end_turn`. The
engine is asked to keep a matched stop sequence at the text's end, to tell which one matched; it
is cut off here. A stream holds back a tail of text that may begin a stop sequence, as an engine
may stream its first characters before it knows it matched.

A stream is Anthropic's: `message_start`, then per block `content_block_start`,
`content_block_delta` (`text_delta`, or a call's input in `input_json_delta` pieces as it is
generated) and `content_block_stop`, then `message_delta` (stop reason and output tokens) and
`message_stop`. The wire names each event by its `type`. A call cut off by max_tokens keeps the
input read so far (as the SDK's stream accumulator reads partial JSON).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

from handlers.engine.types import FinishReason, RequestOutput, SequenceOutput
from handlers.protocols.chat.answer import AnswerParts, ChatOptions
from handlers.protocols.chat.tool_calls import CallDelta
from handlers.protocols.outputs import Folded


@dataclass(frozen=True)
class MessageContext:
    id: str
    model: str
    options: ChatOptions  # the tool mode and names, as the chat request has them
    stop_sequences: tuple[str, ...]


def matched_stop(text: str, reason: FinishReason | None, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended `text`: of those it ends with, the longest (the engine's
    matcher prefers the one that began first)."""
    if reason is not FinishReason.STOP:
        return None
    return max((s for s in stops if text.endswith(s)), key=len, default=None)


def stop_reason(reason: FinishReason | None, stop: str | None, calls: bool) -> str:
    if reason is FinishReason.LENGTH:
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"


def tool_use_block(name: str, arguments: str = "{}") -> dict[str, Any]:
    """A call's block with its `input` (empty where a stream's deltas carry it)."""
    try:  # a call cut off keeps what was read, as the SDK's stream accumulator does
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        value = None
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name,
            "input": value if isinstance(value, dict) else {}}


def thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def message(ctx: MessageContext, content: list[dict[str, Any]], reason: str | None,
            stop: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": ctx.id, "type": "message", "role": "assistant", "model": ctx.model,
            "content": content, "stop_reason": reason, "stop_sequence": stop,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def render_message(ctx: MessageContext, col: Folded) -> dict[str, Any]:
    seq = col.sequences[0]
    text = seq.text
    stop = matched_stop(text, seq.finish_reason, ctx.stop_sequences)
    reasoning, content, calls = AnswerParts(ctx.options).whole(
        text.removesuffix(stop or ""), seq.token_ids)
    shown = bool(content.strip() if calls else content)  # no blank text beside a tool call
    blocks = [thinking_block(reasoning)] if reasoning else []
    blocks += [{"type": "text", "text": content}] if shown else []
    blocks += [tool_use_block(call.name, call.arguments) for call in calls]
    return message(ctx, blocks, stop_reason(seq.finish_reason, stop, bool(calls)), stop,
                   col.prompt_token_count, seq.generated_tokens)


@dataclass
class MessageStream:
    """Turns each RequestOutput into the stream events to send."""

    ctx: MessageContext
    parts: AnswerParts = field(init=False)
    started: bool = False  # message_start sent
    text: str = ""  # all text so far, to find the stop sequence at the end
    held: str = ""  # a tail that may begin a stop sequence
    blocks: int = 0  # content blocks started
    open_block: str | None = None  # the block open: "thinking", "text" or "tool_use"
    calls: int = 0

    def __post_init__(self) -> None:
        self.parts = AnswerParts(self.ctx.options)

    def feed(self, output: RequestOutput) -> list[dict[str, Any]]:
        events = []
        if not self.started:
            self.started = True
            opening = message(self.ctx, [], None, None, output.prompt_token_count, 0)
            events.append({"type": "message_start", "message": opening})
        return events + [event for seq in output.outputs for event in self._sequence(seq)]

    def _sequence(self, seq: SequenceOutput) -> list[dict[str, Any]]:
        self.text += seq.text
        stop = matched_stop(self.text, seq.finish_reason, self.ctx.stop_sequences)
        reasoning, content, calls = self.parts.feed(self._release(seq.text, seq.finished, stop),
                                                    seq.token_ids)
        if seq.finished:
            more_reasoning, tail, more = self.parts.finish()
            reasoning, content, calls = reasoning + more_reasoning, content + tail, calls + more
        events = self._delta("thinking", reasoning) + self._delta("text", content)
        for call in calls:
            events += self._tool_use(call)
        if not seq.finished:
            return events
        delta = {"stop_reason": stop_reason(seq.finish_reason, stop, self.calls > 0),
                 "stop_sequence": stop}
        return events + self._close() + [
            {"type": "message_delta", "delta": delta,
             "usage": {"output_tokens": seq.generated_tokens}},
            {"type": "message_stop"}]

    def _release(self, piece: str, finished: bool, stop: str | None) -> str:
        """The text that can go out now: at the end all of it but the stop sequence, before it
        all but a tail that may begin one."""
        pending = self.held + piece
        cut = len(pending) if finished else _possible_stop_start(pending, self.ctx.stop_sequences)
        self.held = pending[cut:]
        return pending[:cut].removesuffix(stop or "")

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`text` into the open block of `kind` ("thinking" or "text"), opening it first."""
        if not text:
            return []
        events = []
        if self.open_block != kind:
            events += self._close()
            empty = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append(self._block_start(empty))
            self.open_block = kind
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [{"type": "content_block_delta", "index": self.blocks - 1,
                          "delta": delta}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open_block is None:
            return []
        events = []
        if self.open_block == "thinking":  # Anthropic closes a thinking block with its signature
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self.open_block = None
        return [*events, {"type": "content_block_stop", "index": self.blocks - 1}]

    def _tool_use(self, call: CallDelta) -> list[dict[str, Any]]:
        """A call's first delta opens its block; its arguments go out as they come."""
        events = []
        if call.name is not None:
            self.calls += 1
            events += self._close() + [self._block_start(tool_use_block(call.name))]
            self.open_block = "tool_use"
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": delta})
        return events

    def _block_start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.blocks += 1
        return {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}


def _possible_stop_start(text: str, stops: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that is a proper prefix of a stop sequence begins."""
    longest = max(map(len, stops), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        if any(stop.startswith(text[start:]) for stop in stops):
            return start
    return len(text)
