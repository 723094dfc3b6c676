"""Response objects and the Responses stream's events, from the engine's outputs (pure).

One renderer serves both answers: streamed, each engine output becomes events; whole, the
folded output is fed once and only the final response object is kept, so both carry the same
output items. The events, as the openai SDK's stream accumulator reads them, every one with a
`sequence_number` one above the last:

    response.created, response.in_progress
    per reasoning: output_item.added, content_part.added, reasoning_text.delta...,
                  reasoning_text.done, content_part.done, output_item.done
    per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta..., .done, output_item.done
    response.completed, or response.incomplete (max_output_tokens cut the output), or
    response.failed (the generation failed after the stream began)

With a reasoning parser (option.reasoning_parser) the model's thinking is a `reasoning` item
(its text a `reasoning_text` part) before the answer's items. Text and calls come apart as on
the chat route (`AnswerParts`): a call's arguments stream as they are generated. A call cut off
by `max_output_tokens` is an `incomplete` function_call item with the partial arguments. Whitespace
before a call is held back, so it opens no message of its own. Log-probabilities (`include:
["message.output_text.logprobs"]`, `top_logprobs` alternatives) are given when no tools are in
play, where the text is the whole output and each token is in it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from handlers.engine.types import FinishReason, Token
from handlers.protocols.chat.answer import AnswerParts, ChatOptions, ResponseContext
from handlers.protocols.chat.logprobs import chat_logprobs
from handlers.protocols.chat.tool_calls import arguments_call
from handlers.protocols.outputs import FoldedSequence


@dataclass(frozen=True)
class ResponseOptions:
    ctx: ResponseContext
    echo: dict[str, Any]  # the request's settings, repeated in every response object
    tools: ChatOptions  # tool_mode and the offered names, as chat has them
    logprobs: bool = False
    top_logprobs: int = 0


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_object(opts: ResponseOptions, status: str, output: list[dict[str, Any]],
                    **fields: Any) -> dict[str, Any]:
    """`fields`: usage, incomplete_details, error (null unless given)."""
    ctx = opts.ctx
    return {"id": ctx.id, "object": "response", "created_at": ctx.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": None, "model": ctx.model, "output": output,
            "usage": None, **opts.echo, **fields}


def _where(item: _Message | _Reasoning) -> dict[str, Any]:
    """Where an event of a one-part item's content points."""
    return {"item_id": item.id, "output_index": item.index, "content_index": 0}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Message:
    index: int
    id: str = field(default_factory=lambda: _item_id("msg"))
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": list(self.logprobs)}  # a copy: later deltas extend the list

    def item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                "content": content}


@dataclass
class _Reasoning:
    index: int
    id: str = field(default_factory=lambda: _item_id("rs"))
    text: str = ""

    def part(self) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": self.text}

    def item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": None, "status": status}


@dataclass
class _Call:
    index: int
    name: str
    id: str = field(default_factory=lambda: _item_id("fc"))
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: str = ""

    def item(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


class ResponsesStream:
    """Events for each output of one request; `response` is the response object as it stands
    (the whole answer once the request finished)."""

    def __init__(self, opts: ResponseOptions) -> None:
        self.opts = opts
        self.named = opts.tools.tool_mode == "named"
        self.parts = AnswerParts(opts.tools)
        self.items: list[dict[str, Any]] = []  # finished output items
        self.response = response_object(opts, "in_progress", [])
        self._reasoning: _Reasoning | None = None
        self._message: _Message | None = None
        self._call: _Call | None = None
        self._held = ""  # whitespace with no open message: text may follow, or a call
        self._sequence = -1

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def feed(self, tokens: list[Token], reason: FinishReason | None, prompt_tokens: int,
             output_tokens: int) -> list[dict[str, Any]]:
        """One sequence's new tokens (n is 1); with `reason`, the request finished."""
        text = "".join(t.text for t in tokens)
        if self.named:
            split = self.parts.split(text, reason is not None, [t.id for t in tokens])
            events = self._think(split.reasoning) if split.reasoning else []
            if split.content:
                events += self._close_reasoning("completed") + self._arguments(split.content)
        else:
            events = self._text(text, tokens, reason)
        if reason is not None:
            events += self._finish(reason, prompt_tokens, output_tokens)
        return events

    def whole(self, seq: FoldedSequence, prompt_tokens: int) -> dict[str, Any]:
        """The response object of a finished request, not streamed."""
        self.feed(seq.tokens, seq.finish_reason or FinishReason.EOS, prompt_tokens,
                  seq.generated_tokens)
        return self.response

    def fail(self, message: str) -> list[dict[str, Any]]:
        self.response = response_object(self.opts, "failed", self.items,
                                        error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=self.response)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence, **fields}

    def _text(self, text: str, tokens: list[Token], reason: FinishReason | None
              ) -> list[dict[str, Any]]:
        reasoning, content, calls = self.parts.feed(text, [t.id for t in tokens])
        if reason is not None:
            more_reasoning, tail, more = self.parts.finish()
            reasoning, content, calls = reasoning + more_reasoning, content + tail, calls + more
        events = self._think(reasoning) if reasoning else []
        if content or calls:
            events += self._close_reasoning("completed")
        events += self._content(content, self._logprobs(tokens)) if content else []
        for call in calls:
            if call.name is not None:
                self._held = ""
                events += self._close_message("completed") + self._close_call("completed") \
                    + self._open_call(call.name)
            events += self._arguments(call.arguments)
        return events

    def _think(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._reasoning is None:
            self._reasoning = _Reasoning(len(self.items))
            events = self._open_part_item(self._reasoning)
        item = self._reasoning
        item.text += text
        return events + [self._event("response.reasoning_text.delta", **_where(item),
                                     delta=text)]

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        return self._close_part_item(item, status, "response.reasoning_text.done",
                                     text=item.text)

    def _logprobs(self, tokens: list[Token]) -> list[dict[str, Any]]:
        """Per token, when asked for and the text is the whole output (no tools in play)."""
        if not self.opts.logprobs or self.opts.tools.tool_mode != "none" \
                or self.opts.tools.reasoning_parser is not None:
            return []
        return chat_logprobs(tokens, self.opts.ctx.token_text, self.opts.top_logprobs)["content"]

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._message is None:
            if self.opts.tools.tool_mode != "none" and not (self._held + text).strip():
                self._held += text
                return events
            text, self._held = self._held + text, ""
            events = self._close_call("completed") + self._open_message()
        message = self._message
        assert message is not None
        message.text += text
        message.logprobs += logprobs
        events.append(self._event("response.output_text.delta", **_where(message), delta=text,
                                  logprobs=logprobs))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = _Message(len(self.items))
        return self._open_part_item(self._message)

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        return self._close_part_item(message, status, "response.output_text.done",
                                     text=message.text, logprobs=message.logprobs)

    def _open_part_item(self, item: _Message | _Reasoning) -> list[dict[str, Any]]:
        """An item of one content part (a message's text, a reasoning's), opened."""
        return [self._event("response.output_item.added", output_index=item.index,
                            item=item.item("in_progress", [])),
                self._event("response.content_part.added", **_where(item), part=item.part())]

    def _close_part_item(self, item: _Message | _Reasoning, status: str, done: str,
                         **whole: Any) -> list[dict[str, Any]]:
        """Its part's `done` event with the `whole` of it, then the part's and the item's."""
        closed = item.item(status, [item.part()])
        self.items.append(closed)
        return [self._event(done, **_where(item), **whole),
                self._event("response.content_part.done", **_where(item), part=item.part()),
                self._event("response.output_item.done", output_index=item.index,
                            item=closed)]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        """A call's arguments, streamed as they are generated (a named function's call opened
        with its first piece)."""
        events = [] if self._call else self._open_call(next(iter(self.opts.tools.tool_names)))
        if text:
            assert self._call is not None
            self._call.arguments += text
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._call.id, output_index=self._call.index,
                                      delta=text))
        return events

    def _open_call(self, name: str) -> list[dict[str, Any]]:
        call = self._call = _Call(len(self.items), name)
        return [self._event("response.output_item.added", output_index=call.index,
                            item=call.item("in_progress"))]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        call, self._call = self._call, None
        if call is None:
            return []
        if arguments_call(call.name, call.arguments) is None:
            status = "incomplete"  # cut off: the arguments do not parse
        item = call.item(status)
        self.items.append(item)
        return [self._event("response.function_call_arguments.done", item_id=call.id,
                            output_index=call.index, arguments=call.arguments),
                self._event("response.output_item.done", output_index=call.index, item=item)]

    def _finish(self, reason: FinishReason, prompt_tokens: int, output_tokens: int
                ) -> list[dict[str, Any]]:
        cut = reason is FinishReason.LENGTH
        status = "incomplete" if cut else "completed"
        events = self._close_reasoning(status) + self._close_call(status) + \
            self._close_message(status)
        if not any(item["type"] != "reasoning" for item in self.items):
            # nothing was said: one empty message, as OpenAI answers
            events += self._open_message()
            if self._held:
                held, self._held = self._held, ""
                events += self._content(held, [])
            events += self._close_message(status)
        incomplete = {"reason": "max_output_tokens"} if cut else None
        self.response = response_object(self.opts, status, self.items,
                                        usage=usage(prompt_tokens, output_tokens),
                                        incomplete_details=incomplete)
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self.response)]
