"""LMI's output formatters: pure functions of the engine's `RequestOutput`s.

Non-streaming answers are one JSON object (a one-element array under tgi_compat). Streaming
answers are one line per generated token, as jsonlines, SSE, or SSE in TGI's shape; the last line
also carries `generated_text` (and `details` when asked for). Key names and order follow DJL
Serving's formatters; JSON is written compactly by orjson.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import orjson

from handlers.engine.types import FinishReason, RequestOutput, Token, TopToken
from handlers.protocols.lmi.accumulator import FAILED, Accumulator, SequenceState
from handlers.protocols.lmi.request import LmiRequest

# Failed inference answers 424 in DJL; an abort (server shutting down) is a 503.
FAILURE_STATUS = {FinishReason.ERROR: 424, FinishReason.ABORT: 503}


JSON_MEDIA_TYPE = "application/json"
JSONLINES_MEDIA_TYPE = "application/jsonlines"


class StreamStyle(Enum):
    JSONLINES = "jsonlines"
    SSE = "sse"
    TGI = "tgi"  # SSE with TGI's token keys and always-present generated_text / details

    @property
    def media_type(self) -> str:
        return JSONLINES_MEDIA_TYPE if self is StreamStyle.JSONLINES else "text/event-stream"


def stream_style(output_formatter: str, tgi_compat: bool) -> StreamStyle | None:
    """How `stream: true` is answered; None: not streamed (`option.output_formatter=json`)."""
    if tgi_compat:
        return StreamStyle.TGI
    if output_formatter == "json":
        return None
    return StreamStyle.SSE if output_formatter == "sse" else StreamStyle.JSONLINES


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
            return_full_text=p.return_full_text,
            tgi=tgi_compat,
            n=p.returned_sequences,
        )

    def generated_text(self, seq: SequenceState) -> str:
        return self.inputs + seq.text if self.return_full_text else seq.text


def token_dict(token: Token, tgi: bool) -> dict[str, Any]:
    """LMI: `special_token` only when true (as DJL); TGI: `special` always (as TGI)."""
    if tgi:
        return {
            "id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special
        }
    out: dict[str, Any] = {"id": token.id, "text": token.text, "log_prob": token.logprob}
    if token.special:
        out["special_token"] = True
    return out


def top_dicts(token: Token, tgi: bool) -> list[dict[str, Any]]:
    key = "logprob" if tgi else "log_prob"
    return [_top_dict(top, key) for top in token.top]


def _top_dict(top: TopToken, key: str) -> dict[str, Any]:
    return {"id": top.id, "text": top.text, key: top.logprob}


def details_dict(
    seq: SequenceState, acc: Accumulator, opts: RenderOptions, with_tokens: bool
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


def _best_of_dict(seq: SequenceState, acc: Accumulator, opts: RenderOptions) -> dict[str, Any]:
    out = details_dict(seq, acc, opts, with_tokens=True)
    del out["inputs"]
    out["generated_text"] = opts.generated_text(seq)
    return out


def error_body(message: str, status: int) -> bytes:
    """Seed 004's non-streaming error answer, plus DJL's `error` message and `code`."""
    details = {"finish_reason": "error", "generated_tokens": None, "inputs": None, "tokens": None}
    return orjson.dumps(
        {"generated_text": "", "details": details, "error": message, "code": status}
    )


def render_json(acc: Accumulator, opts: RenderOptions) -> tuple[int, bytes]:
    """The non-streaming answer: (HTTP status, body). The best sequence is the main one."""
    failure = acc.failure()
    if failure is not None:
        status = FAILURE_STATUS[failure.reason]
        return status, error_body(failure.message, status)
    ranked = acc.ranked(opts.n)
    best = ranked[0]
    result: dict[str, Any] = {"generated_text": opts.generated_text(best)}
    if opts.details:
        details = details_dict(best, acc, opts, with_tokens=True)
        if len(ranked) > 1:
            details["best_of_sequences"] = [_best_of_dict(s, acc, opts) for s in ranked[1:]]
        result["details"] = details
    return 200, orjson.dumps([result] if opts.tgi else result)


def early_failure(output: RequestOutput) -> tuple[int, bytes] | None:
    """A first output that fails the request before any token: answered with an HTTP error."""
    seq = next((s for s in output.outputs if s.index == 0), None)
    if seq is None or seq.tokens or seq.finish_reason not in FAILED:
        return None
    status = FAILURE_STATUS[seq.finish_reason]
    return status, error_body(seq.error or "generation failed", status)


# Stands in for the last token when a sequence finishes in a step that released none.
_END_TOKEN = Token(id=-1, text="", logprob=None, special=True)
_ERROR_TOKEN = Token(id=-1, text="", logprob=-1, special=True)
_ERROR_DETAILS = {"finish_reason": "error", "generated_tokens": None, "inputs": None}


class StreamRenderer:
    """Renders one request's outputs, step by step, as the bytes of a token stream.

    Only sequence 0 is streamed (the request parser refuses n > 1 with streaming).
    """

    def __init__(self, opts: RenderOptions, style: StreamStyle) -> None:
        self.opts = replace(opts, tgi=style is StreamStyle.TGI)
        self.style = style
        self.acc = Accumulator()
        self.done = False

    def feed(self, output: RequestOutput) -> bytes:
        """The lines for the tokens this output released (b"" when none, or when done)."""
        if self.done:
            return b""
        self.acc.add(output)
        seq = next((s for s in output.outputs if s.index == 0), None)
        if seq is None:
            return b""
        failed = seq.finish_reason in FAILED
        ends = seq.finished and not failed
        last = len(seq.tokens) - 1
        lines = [self._token_line(t, ends and i == last) for i, t in enumerate(seq.tokens)]
        if failed:
            lines.append(self.error(seq.error or "generation failed"))
        elif ends and not seq.tokens:
            lines.append(self._token_line(_END_TOKEN, True))
        self.done = seq.finished
        return b"".join(lines)

    def error(self, message: str) -> bytes:
        """The error line that ends a stream once tokens may have been sent (seed 004)."""
        self.done = True
        line: dict[str, Any] = {
            "token": token_dict(_ERROR_TOKEN, self.opts.tgi),
            "generated_text": "",
            "details": _ERROR_DETAILS,
        }
        if self.opts.tgi:
            line["error"] = message  # what TGI clients look for to raise
        return self._frame(line)

    def _token_line(self, token: Token, last: bool) -> bytes:
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
        return self._frame(line)

    def _frame(self, line: dict[str, Any]) -> bytes:
        body = orjson.dumps(line)
        if self.style is StreamStyle.JSONLINES:
            return body + b"\n"
        return b"data: " + body + b"\n\n"
