"""Triton's generate extension as MindIE Service serves it: `POST /v2/models/{m}/generate`
and `…/generate_stream` with `{"id", "text_input", "parameters"}`.

Parameters and their ranges are MindIE's, enforced: `details`, `do_sample` (absent: decided by
the other parameters), `max_new_tokens` (20), `repetition_penalty`, `seed`, `temperature`,
`top_k`, `top_p`, `typical_p`, `watermark` (the green-list watermark TGI uses), `batch_size`,
`perf_stat`, `priority` (1 highest .. 5, the default: a waiting request of higher priority is
admitted first) and `timeout` (seconds, 600: the request ends when it passes).

Each streamed event carries the text its token released (with `option.full_text_enabled`, the
whole text so far), `details` when asked for (`generated_tokens`, the running `batch_size`,
`queue_wait_time` in microseconds, `finish_reason` on the last event only, and with `perf_stat`
the measured `first_token_cost` / `decode_cost`), `prefill_time` on the first event and
`decode_time` on later ones (milliseconds). Pure: requests in, plain objects out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from handlers.engine.base import Pair
from handlers.engine.types import GenerationRequest, RequestOutput, SamplingParams
from handlers.protocols.bodies import parse_body
from handlers.protocols.errors import GenerationError, KServeError
from handlers.protocols.outputs import Event, Renderer, checked_events
from handlers.protocols.parameters import LmiParameters, to_sampling_params

UINT64 = 2**64 - 1
INT32 = 2**31 - 1
DEFAULT_PRIORITY = 5




class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    details: bool = False
    do_sample: bool | None = None
    max_new_tokens: int = Field(20, gt=0, le=INT32)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = Field(None, gt=0, le=UINT64)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0, le=INT32)
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(1, gt=0, le=INT32)
    typical_p: float | None = Field(None, gt=0, le=1)
    watermark: bool = False
    perf_stat: bool = False
    priority: int = Field(DEFAULT_PRIORITY, ge=1, le=5)
    timeout: int = Field(600, gt=0, le=3600)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")] | None \
        = None
    text_input: str | list[Any]
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


def parse_generate_request(body: Any) -> GenerateRequest:
    request = parse_body(GenerateRequest, body, KServeError,
                         "the request body must be a JSON object with 'text_input'")
    if isinstance(request.text_input, list):
        raise KServeError("text_input: this model reads text only; send a string, not a "
                            "multimodal list")
    if not request.text_input:
        raise KServeError("text_input: must not be empty")
    return request


def generation_request(request: GenerateRequest, adapter: str | None = None
                       ) -> GenerationRequest:
    p = request.parameters
    lmi = LmiParameters(max_new_tokens=p.max_new_tokens, do_sample=p.do_sample,
                        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                        typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
                        seed=p.seed)
    params: SamplingParams = to_sampling_params(lmi)
    params.watermark = p.watermark
    # The engine admits lower values first; MindIE's default, 5, is the engine's default, 0.
    return GenerationRequest(request.text_input, params, priority=p.priority - DEFAULT_PRIORITY,
                             adapter=adapter)


@dataclass
class Measures:
    """What the answer reports of a request, measured as its outputs arrive (monotonic s)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    batch_size: int = 0
    queue_wait: float = 0.0
    finish_reason: str | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between successive tokens

    def token(self, now: float) -> float | None:
        """Count one token at `now`; the gap since the previous one (None for the first)."""
        gap = None if self.last_token is None else now - self.last_token
        if gap is not None:
            self.gaps.append(gap)
        self.first_token = self.first_token or now
        self.last_token = now
        self.generated += 1
        return gap


class GenerateRenderer(Renderer):
    """The events of one request's answer, and the whole answer, from its outputs."""

    def __init__(self, request: GenerateRequest, model: str, version: str | None,
                 arrival: float, full_text: bool = False) -> None:
        self.request = request
        self.model = model
        self.version = version
        self.full_text = full_text
        self.text = ""
        self.measures = Measures(arrival)

    def feed(self, pairs: list[Pair]) -> list[Event]:
        now = time.monotonic()
        return checked_events(pairs, lambda _, output: self._output_events(output, now))

    def failed(self, error: GenerationError) -> list[Event]:
        return [error_event(error.message)]

    def _output_events(self, output: RequestOutput, now: float) -> list[Event]:
        """One event per token the output released; an empty one when it finishes the request
        without a token."""
        measures = self.measures
        measures.batch_size = output.metrics.batch_size
        measures.queue_wait = output.metrics.queue_time
        seq = next((s for s in output.outputs if s.index == 0), None)
        tokens = [] if seq is None else seq.tokens
        if seq is not None and seq.finish_reason is not None:
            measures.finish_reason = seq.finish_reason.value
        events = []
        for i, token in enumerate(tokens or ([None] if output.finished else [])):
            gap = measures.token(now) if token is not None else None
            self.text += token.text if token is not None else ""
            last = output.finished and i == max(len(tokens), 1) - 1
            events.append(Event(self._event(token.text if token else "", gap, last)))
        return events

    def _event(self, piece: str, gap: float | None, last: bool) -> dict[str, Any]:
        first = self.measures.generated == 1 and gap is None
        event: dict[str, Any] = {"id": self.request.id, "model_name": self.model,
                                 "model_version": self.version,
                                 "text_output": self.text if self.full_text else piece}
        if self.request.parameters.details:
            event["details"] = self._details(last)
        event["prefill_time"] = self._prefill_ms() if first else None
        event["decode_time"] = None if first or gap is None else round(gap * 1000, 3)
        return event

    def _details(self, last: bool) -> dict[str, Any]:
        m = self.measures
        details: dict[str, Any] = {}
        if last and m.finish_reason is not None:
            details["finish_reason"] = m.finish_reason
        perf = self.request.parameters.perf_stat
        details |= {
            "generated_tokens": m.generated,
            "first_token_cost": self._prefill_ms() if perf else None,
            "decode_cost": round(sum(m.gaps) * 1000, 3) if perf else None,
            "batch_size": m.batch_size,
            "queue_wait_time": round(m.queue_wait * 1e6),
        }
        return details

    def _prefill_ms(self) -> float | None:
        m = self.measures
        return None if m.first_token is None else round((m.first_token - m.arrival) * 1000, 3)

    def whole(self) -> dict[str, Any]:
        """The non-streaming answer: the whole text, the details of the last event, the time to
        the first token and the mean time per later token."""
        m = self.measures
        answer: dict[str, Any] = {"id": self.request.id, "model_name": self.model,
                                  "model_version": self.version, "text_output": self.text}
        if self.request.parameters.details:
            answer["details"] = self._details(last=True)
        answer["prefill_time"] = self._prefill_ms()
        answer["decode_time"] = round(sum(m.gaps) / len(m.gaps) * 1000, 3) if m.gaps else None
        return answer


def error_event(message: str) -> Event:
    """What ends a stream that failed after it began (Triton's generate_stream)."""
    return Event({"error": message}, failure=message)
