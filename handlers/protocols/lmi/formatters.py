"""LMI's output formatters: pure functions of the engine's `RequestOutput`s, to plain objects.

Non-streaming answers are one object (a one-element list under tgi_compat). Streaming answers
are one object per generated token, framed as jsonlines, SSE, or SSE in TGI's shape; the last one
also carries `generated_text` (and `details` when asked for). Key names and order follow DJL
Serving's formatters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from handlers.engine.types import RequestOutput, Token
from handlers.protocols.lmi.errors import LmiError, LmiFailure
from handlers.protocols.lmi.request import LmiRequest
from handlers.protocols.outputs import FAILED, Event, Folded, FoldedSequence, output_failure
from handlers.protocols.token_objects import END_TOKEN, token_dict, top_dicts


class StreamStyle(Enum):
    JSONLINES = "jsonlines"
    SSE = "sse"
    TGI = "tgi"  # SSE with TGI's token keys and always-present generated_text / details


def stream_style(output_formatter: str | None, tgi_compat: bool, stream: bool
                 ) -> StreamStyle | None:
    """How a request is answered, by DJL's rule (djl_python.output_formatter): a configured
    formatter applies to every request, streamed or not (`json`: one object); unset, `stream:
    true` streams jsonlines, or SSE in TGI's shape under tgi_compat. None: not streamed."""
    if output_formatter == "json" or (output_formatter is None and not stream):
        return None
    if tgi_compat:
        return StreamStyle.TGI
    return StreamStyle.SSE if output_formatter == "sse" else StreamStyle.JSONLINES


def answer_style(request: LmiRequest, output_formatter: str | None, tgi_compat: bool
                 ) -> StreamStyle | None:
    """`stream_style` for a parsed request; LmiError when it asks for several sequences and
    would be streamed (a stream carries one)."""
    style = stream_style(output_formatter, tgi_compat, request.stream)
    if style is not None and request.parameters.num_sequences > 1:
        raise LmiError("parameters.n: n and best_of > 1 are not supported with streaming")
    return style


@dataclass(frozen=True)
class RenderOptions:
    inputs: str
    details: bool = False
    prefill: bool = False
    top_tokens: bool = False
    return_full_text: bool = False
    tgi: bool = False
    n: int = 1

    @classmethod
    def for_request(cls, request: LmiRequest, tgi_compat: bool) -> RenderOptions:
        p = request.parameters
        return cls(
            inputs=request.inputs,
            details=tgi_compat if p.details is None else p.details,  # DJL's default
            prefill=p.wants_prefill,
            top_tokens=p.top_logprobs > 0,
            return_full_text=bool(p.return_full_text),
            tgi=tgi_compat,
            n=p.returned_sequences,
        )

    def generated_text(self, seq: FoldedSequence) -> str:
        return self.inputs + seq.text if self.return_full_text else seq.text


def details_dict(
    seq: FoldedSequence, acc: Folded, opts: RenderOptions, with_tokens: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
        "generated_tokens": len(seq.tokens),
        "inputs": opts.inputs,
    }
    if with_tokens:
        out["tokens"] = [token_dict(t, opts.tgi) for t in seq.tokens]
    if opts.prefill:
        out["prefill"] = [token_dict(t, opts.tgi) for t in acc.prompt_logprobs or []]
    if with_tokens and opts.top_tokens:
        out["top_tokens"] = [top_dicts(t, opts.tgi) for t in seq.tokens]
    return out


def _best_of_dict(seq: FoldedSequence, acc: Folded, opts: RenderOptions) -> dict[str, Any]:
    out = details_dict(seq, acc, opts, with_tokens=True)
    del out["inputs"]
    out["generated_text"] = opts.generated_text(seq)
    return out


def ranked(acc: Folded, n: int) -> list[FoldedSequence]:
    """The `n` best sequences by cumulative log-probability (ties keep engine order)."""
    ordered = sorted(acc.sequences.values(), key=lambda s: (-s.cumulative_logprob, s.index))
    return ordered[:n]


def render_json(acc: Folded, opts: RenderOptions) -> Any:
    """The non-streaming answer; LmiFailure when the generation failed. The best sequence is
    the main one."""
    failure = acc.failure()
    if failure is not None:
        raise LmiFailure(failure.message, failure.kind)
    best_first = ranked(acc, opts.n)
    best = best_first[0]
    result: dict[str, Any] = {"generated_text": opts.generated_text(best)}
    if opts.details:
        details = details_dict(best, acc, opts, with_tokens=True)
        if len(best_first) > 1:
            details["best_of_sequences"] = [_best_of_dict(s, acc, opts) for s in best_first[1:]]
        result["details"] = details
    return [result] if opts.tgi else result


def early_failure(output: RequestOutput) -> LmiFailure | None:
    """A first output that fails the request before any token: answered with an error status."""
    seq = next((s for s in output.outputs if s.index == 0), None)
    if seq is None or seq.tokens or seq.finish_reason not in FAILED:
        return None
    failure = output_failure(output)
    return LmiFailure(failure.message, failure.kind)


_ERROR_TOKEN = Token(id=-1, text="", logprob=-1, special=True)
_ERROR_DETAILS = {"finish_reason": "error", "generated_tokens": None, "inputs": None}


class StreamRenderer:
    """Renders one request's outputs, step by step, as the events of a token stream.

    Only sequence 0 is streamed (the request parser refuses n > 1 with streaming).
    """

    def __init__(self, opts: RenderOptions, style: StreamStyle) -> None:
        self.opts = replace(opts, tgi=style is StreamStyle.TGI)
        self.style = style
        self.acc = Folded()
        self.done = False

    def feed(self, output: RequestOutput) -> list[Event]:
        """The events for the tokens this output released (none when done)."""
        if self.done:
            return []
        self.acc.add(output)
        seq = next((s for s in output.outputs if s.index == 0), None)
        if seq is None:
            return []
        failed = seq.finish_reason in FAILED
        ends = seq.finished and not failed
        last = len(seq.tokens) - 1
        lines = [self._token_line(t, ends and i == last) for i, t in enumerate(seq.tokens)]
        if failed:
            lines.append(self.error(seq.error or "generation failed"))
        elif ends and not seq.tokens:
            lines.append(self._token_line(END_TOKEN, True))
        self.done = seq.finished
        return lines

    def error(self, message: str) -> Event:
        """The error line that ends a stream once tokens may have been sent (DJL LMI's schema)."""
        self.done = True
        line: dict[str, Any] = {
            "token": token_dict(_ERROR_TOKEN, self.opts.tgi),
            "generated_text": "",
            "details": _ERROR_DETAILS,
        }
        if self.opts.tgi:
            line["error"] = message  # what TGI clients look for to raise
        return Event(line, failure=message)

    def _token_line(self, token: Token, last: bool) -> Event:
        tgi = self.opts.tgi
        line: dict[str, Any] = {"token": token_dict(token, tgi)}
        if self.opts.top_tokens:
            line["top_tokens"] = top_dicts(token, tgi)
        if last:
            seq = self.acc.sequences[0]
            line["generated_text"] = self.opts.generated_text(seq)
            if self.opts.details:
                line["details"] = details_dict(seq, self.acc, self.opts, with_tokens=False)
        elif tgi:
            line["generated_text"] = None
        if tgi:
            line.setdefault("details", None)
        return Event(line)
