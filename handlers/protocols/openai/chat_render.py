"""chat.completion and chat.completion.chunk objects, from the engine's outputs (pure).

Streaming follows OpenAI: each choice opens with a `{"role": "assistant", "content": ""}` delta
(its content is the echoed message with vLLM's `echo`),
then content and tool-call deltas, the last carrying `finish_reason`. With a reasoning parser
(option.reasoning_parser) the thinking goes to vLLM's `reasoning_content` and `reasoning`, in the
message and as deltas of their own; tool calls are parsed from the answer only. A call streams
as OpenAI's do: its first delta has its `index`, `id`, `type` and `function.name`, the next ones
its `arguments` in pieces as they are generated (a call whose name does not come first arrives
whole in one delta). With
`stream_options.include_usage` every chunk has `"usage": null` and one more chunk with empty
`choices` carries the usage; without it the usage rides on the final chunk (as MindIE sends it).
MindIE's `full_text` variant (`option.full_text_enabled`) sends the whole text so far in every
delta and `full_text` on the final chunk. Non-streaming answers carry MindIE's `prefill_time` and
`decode_time_arr` (milliseconds).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from handlers.engine.types import RequestOutput, SequenceOutput
from handlers.protocols.chat.answer import AnswerParts, ChatOptions, ResponseContext
from handlers.protocols.chat.logprobs import chat_logprobs
from handlers.protocols.chat.tool_calls import CallDelta, ParsedCall
from handlers.protocols.openai.accumulate import (
    add_final_usage,
    completion_tokens,
    finish_reason,
    ranked,
    stream_chunk,
    timings_ms,
    usage,
)
from handlers.protocols.outputs import Folded, FoldedSequence


def tool_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """The `tool_calls` of one chunk: a call's first delta whole, then its arguments' pieces
    (those of one call in a row joined)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.name is not None:
            call = ParsedCall(delta.name, delta.arguments, delta.id)
            out.append({"index": delta.index, **tool_call(call)})
        elif out and out[-1]["index"] == delta.index:
            out[-1]["function"]["arguments"] += delta.arguments
        else:
            out.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return out


def render_chat_completion(ctx: ResponseContext, opts: ChatOptions, col: Folded
                           ) -> dict[str, Any]:
    choices = ranked(col, opts.n)
    prefill_time, decode_times = timings_ms(col)
    return {
        "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
        "choices": [_message_choice(ctx, opts, c) for c in choices],
        "usage": usage(col.prompt_token_count, completion_tokens(choices)),
        "prefill_time": prefill_time,
        "decode_time_arr": decode_times,
    }


def _message_choice(ctx: ResponseContext, opts: ChatOptions, choice: FoldedSequence
                    ) -> dict[str, Any]:
    reasoning, content, calls = AnswerParts(opts).whole(choice.text, choice.token_ids)
    content = opts.echo_text + content
    blank = (calls and not content.strip()) or (reasoning and not content)
    message = {"role": "assistant", "content": None if blank else content,
               "tool_calls": [tool_call(c) for c in calls] or None}
    if opts.reasoning_parser is not None:  # vLLM's field, under its old name and its new one
        message["reasoning_content"] = message["reasoning"] = reasoning or None
    logprobs = (chat_logprobs(choice.tokens, ctx.token_text, opts.top_logprobs)
                if opts.logprobs else None)
    return {"index": choice.index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(choice.finish_reason, bool(calls))}


@dataclass
class _ChoiceStream:
    parts: AnswerParts
    text: str = ""  # content sent so far (full_text mode)
    calls: int = 0
    completion_tokens: int = 0


@dataclass
class ChatStream:
    """Turns each RequestOutput into the chat.completion.chunk objects to send."""

    ctx: ResponseContext
    opts: ChatOptions
    done: bool = False
    _choices: dict[int, _ChoiceStream] = field(default_factory=dict)

    def feed(self, output: RequestOutput) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        for seq in output.outputs:
            chunks += self._choice_chunks(seq)
        if output.finished and not self.done:
            self.done = True
            spent = sum(c.completion_tokens for c in self._choices.values())
            total = usage(output.prompt_token_count, spent)
            add_final_usage(chunks, total, self.opts.include_usage, self.chunk)
        return chunks

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return stream_chunk(self.ctx, "chat.completion.chunk", choices, self.opts.include_usage,
                            **extra)

    def _choice_chunks(self, seq: SequenceOutput) -> list[dict[str, Any]]:
        state = self._choices.get(seq.index)
        chunks = []
        if state is None:
            state = self._choices[seq.index] = _ChoiceStream(AnswerParts(self.opts))
            if self.opts.full_text:
                state.text = self.opts.echo_text
            else:
                opening = {"role": "assistant", "content": self.opts.echo_text}
                chunks.append(self.chunk([_delta(seq.index, opening, None, None)]))
        state.completion_tokens = seq.generated_tokens
        if self.opts.tool_mode == "named":
            split = state.parts.split(seq.text, seq.finished, seq.token_ids)
            delta = self._arguments_delta(state, split.content)
            if split.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = split.reasoning
            changed = bool(delta)
        else:
            reasoning, content, calls = state.parts.feed(seq.text, seq.token_ids)
            if seq.finished:
                more_reasoning, tail, more = state.parts.finish()
                reasoning, content, calls = reasoning + more_reasoning, content + tail, calls + more
            changed = bool(reasoning or content or calls)
            delta = self._delta(state, reasoning, content, calls)
        logprobs = (chat_logprobs(seq.tokens, self.ctx.token_text, self.opts.top_logprobs)
                    if self.opts.logprobs else None)
        reason = finish_reason(seq.finish_reason, state.calls > 0)
        if changed or (logprobs and logprobs["content"]) or reason:
            extra = {"full_text": state.text} if self.opts.full_text and reason else {}
            chunks.append(self.chunk([_delta(seq.index, delta, logprobs, reason)], **extra))
        return chunks

    def _delta(self, state: _ChoiceStream, reasoning: str, content: str,
               calls: list[CallDelta]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:  # vLLM's delta field, under its old name and its new one
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if self.opts.full_text:
            state.text += content
            delta = {"role": "assistant", "content": state.text}
        elif content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = tool_call_deltas(calls)
            state.calls += sum(call.name is not None for call in calls)
        return delta

    def _arguments_delta(self, state: _ChoiceStream, text: str) -> dict[str, Any]:
        """A named call streams as OpenAI streams one: id and name first, then arguments."""
        if not text:
            return {}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not state.calls:
            state.calls = 1
            call = {"index": 0, **tool_call(ParsedCall(next(iter(self.opts.tool_names)), text))}
        return {"tool_calls": [call]}


def _delta(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
           reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

