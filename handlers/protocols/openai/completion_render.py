"""text_completion objects (whole and streamed) from the engine's outputs (pure).

A request may hold several prompts: choice `index` is `prompt_index * n + i`, and `usage` sums
them. `echo` puts the prompt before the completion (and, with `logprobs`, its tokens' entries
first; the first prompt token has none); `suffix` is appended to every completion (a
Databricks field; streamed, in the choice's last chunk). Usage placement in streams is as in
`chat_render`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from handlers.engine.types import RequestOutput, SequenceOutput
from handlers.protocols.chat.answer import ResponseContext
from handlers.protocols.openai.accumulate import (
    add_final_usage,
    completion_tokens,
    finish_reason,
    ranked,
    stream_chunk,
    usage,
)
from handlers.protocols.openai.logprobs import CompletionLogprobs, merge
from handlers.protocols.openai.requests import CompletionRequest
from handlers.protocols.outputs import Folded


@dataclass(frozen=True)
class CompletionOptions:
    prompts: tuple[str, ...]  # the prompts' texts, for echo
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    suffix: str = ""
    include_usage: bool = False

    @classmethod
    def for_request(cls, request: CompletionRequest, prompts: list[str]) -> CompletionOptions:
        return cls(
            prompts=tuple(prompts),
            n=request.n,
            logprobs=request.logprobs,
            echo=bool(request.echo),
            suffix=request.suffix or "",
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
        )


def render_completion(ctx: ResponseContext, opts: CompletionOptions, results: list[Folded]
                      ) -> dict[str, Any]:
    choices, prompt_tokens, tokens = [], 0, 0
    for p, col in enumerate(results):
        best = ranked(col, opts.n)
        for i, choice in enumerate(best):
            text = choice.text
            logprobs = None
            if opts.logprobs is not None:
                builder = CompletionLogprobs(ctx.token_text)
                echoed = builder.prompt(col.prompt_logprobs or []) if opts.echo else None
                logprobs = builder.generated(choice.tokens)
                logprobs = merge(echoed, logprobs) if echoed else logprobs
            if opts.echo:
                text = opts.prompts[p] + text
            text += opts.suffix
            choices.append({"index": p * opts.n + i, "text": text, "logprobs": logprobs,
                            "finish_reason": finish_reason(choice.finish_reason)})
        prompt_tokens += col.prompt_token_count
        tokens += completion_tokens(best)
    return {"id": ctx.id, "object": "text_completion", "created": ctx.created,
            "model": ctx.model, "choices": choices,
            "usage": usage(prompt_tokens, tokens)}


@dataclass
class CompletionStream:
    """Turns each prompt's RequestOutputs into the text_completion chunks to send."""

    ctx: ResponseContext
    opts: CompletionOptions
    done: bool = False
    _logprobs: dict[int, CompletionLogprobs] = field(default_factory=dict)  # by choice index
    _spent: dict[int, int] = field(default_factory=dict)  # completion tokens by choice index
    _prompt_tokens: dict[int, int] = field(default_factory=dict)  # by prompt
    _finished: set[int] = field(default_factory=set)  # prompts

    def feed(self, prompt: int, output: RequestOutput) -> list[dict[str, Any]]:
        self._prompt_tokens[prompt] = output.prompt_token_count
        chunks = [c for seq in output.outputs if (c := self._choice_chunk(prompt, seq, output))]
        if output.finished:
            self._finished.add(prompt)
        if len(self._finished) == len(self.opts.prompts) and not self.done:
            self.done = True
            total = usage(sum(self._prompt_tokens.values()), sum(self._spent.values()))
            add_final_usage(chunks, total, self.opts.include_usage, self.chunk)
        return chunks

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return stream_chunk(self.ctx, "text_completion", choices, self.opts.include_usage, **extra)

    def _choice_chunk(self, prompt: int, seq: SequenceOutput, output: RequestOutput
                      ) -> dict[str, Any] | None:
        index = prompt * self.opts.n + seq.index
        self._spent[index] = seq.generated_tokens
        text, logprobs = seq.text, None
        first = index not in self._logprobs
        builder = self._logprobs.setdefault(index, CompletionLogprobs(self.ctx.token_text))
        if first and self.opts.echo:
            text = self.opts.prompts[prompt] + text
        if self.opts.logprobs is not None:
            echoed = builder.prompt(output.prompt_logprobs or []) if first and self.opts.echo \
                else None
            logprobs = builder.generated(seq.tokens)
            logprobs = merge(echoed, logprobs) if echoed else logprobs
        reason = finish_reason(seq.finish_reason)
        if reason is not None:
            text += self.opts.suffix
        if not (text or reason or (logprobs and logprobs["tokens"])):
            return None
        return self.chunk([{"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": reason}])

