"""Hugging Face TGI's own API (`/generate`, `/generate_stream`, `POST /`), as TGI's router v3
answers it, so `huggingface_hub.InferenceClient` and the `text-generation` client work.

Requests are `{"inputs", "parameters", "stream"}`; a missing `parameters` means TGI's defaults
with sampling on. Validation follows TGI's rules and words ("Input validation error: ..."),
with TGI's limits: best_of <= 2, 4 stop sequences, top_n_tokens <= 5. Answers use TGI's keys
(`logprob`, `special`, `seed`, `prefill` always a list), stream events carry `index` and, on the
last one, `generated_text` and `details`. Errors are `{"error", "error_type"}`. Pure: requests
in, plain objects out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from handlers.engine.base import Pair
from handlers.engine.types import (
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
)
from handlers.protocols.adapters import UnknownAdapter, adapter_named
from handlers.protocols.bodies import parse_body
from handlers.protocols.checks import Checks, with_max_new_tokens
from handlers.protocols.errors import ErrorKind, GenerationError, ProtocolError
from handlers.protocols.outputs import Event, Folded, FoldedSequence, Renderer, checked_events
from handlers.protocols.token_objects import END_TOKEN, token_dict, top_dicts

MAX_BEST_OF = 2
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
_ERROR_TYPES = {ErrorKind.FAILED: "generation", ErrorKind.TIMEOUT: "generation",
                ErrorKind.INTERNAL: "generation", ErrorKind.OVERLOADED: "overloaded",
                ErrorKind.UNAVAILABLE: "unhealthy"}
_PREFIXES = {"validation": "Input validation error: ",
             "generation": "Request failed during generation: "}


class TgiError(ProtocolError):
    """TGI's error body: `{"error": "<prefix><message>", "error_type": "<type>"}`."""

    @property
    def error_type(self) -> str:
        return _ERROR_TYPES.get(self.kind, "validation")

    def payload(self, status: int) -> dict[str, Any]:
        return {"error": _PREFIXES.get(self.error_type, "") + self.message,
                "error_type": self.error_type}

    @classmethod
    def of(cls, error: GenerationError) -> TgiError:
        if error.kind is ErrorKind.OVERLOADED:
            return cls("Model is overloaded", error.kind)
        return cls(error.message, error.kind)


class Grammar(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "json_object", "regex", "json_schema"]
    value: Any = None


class TgiParameters(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    best_of: int | None = Field(None, ge=0)
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=0, lt=2**32)
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = Field(None, ge=0)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = Field(None, ge=0, lt=2**64)
    top_n_tokens: int | None = Field(None, ge=0, lt=2**32)
    grammar: Grammar | None = None
    adapter_id: str | None = None


class TgiRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    inputs: str
    parameters: TgiParameters | None = None  # absent: TGI's defaults, with sampling on
    stream: bool = False


def parse_tgi_request(body: Any) -> TgiRequest:
    request = parse_body(TgiRequest, body, TgiError,
                         "the request body must be a JSON object with 'inputs'")
    if request.parameters is None:
        request.parameters = TgiParameters(do_sample=True)
    return request


def _sampling(p: TgiParameters) -> bool:
    return p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p,
                                                      p.typical_p))


def validate(request: TgiRequest, stream: bool) -> None:
    """TGI's checks, in TGI's order and words (each a 422 `validation` error)."""
    p = request.parameters
    best_of = p.best_of or 1
    checks = [
        (stream and best_of != 1, "`best_of` != 1 is not supported when streaming tokens"),
        (best_of > MAX_BEST_OF, f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}"),
        (best_of > 1 and not _sampling(p), "you must use sampling when `best_of` is > 1"),
        (p.temperature is not None and p.temperature <= 0,
         "`temperature` must be strictly positive"),
        (p.repetition_penalty is not None and p.repetition_penalty <= 0,
         "`repetition_penalty` must be strictly positive"),
        (p.frequency_penalty is not None and not -2 <= p.frequency_penalty <= 2,
         "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        (p.top_p is not None and not 0 < p.top_p < 1, "`top_p` must be > 0.0 and < 1.0"),
        (p.typical_p is not None and not 0 < p.typical_p < 1,
         "`typical_p` must be > 0.0 and < 1.0"),
        (p.top_k is not None and p.top_k <= 0, "`top_k` must be strictly positive"),
        (p.max_new_tokens == 0, "`max_new_tokens` must be strictly positive"),
        (len(p.stop) > MAX_STOP_SEQUENCES, f"`stop` supports up to {MAX_STOP_SEQUENCES} stop "
                                           f"sequences. Given: {len(p.stop)}"),
        (best_of > 1 and p.seed is not None, "`seed` must not be set when `best_of` > 1"),
        ((p.top_n_tokens or 0) > MAX_TOP_N_TOKENS, f"`top_n_tokens` must be >= 0 and <= "
                                                   f"{MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}"),
        (not request.inputs, "`inputs` cannot be empty"),
        (p.truncate == 0, "`truncate` must be strictly positive"),
        (stream and p.decoder_input_details,
         "`decoder_input_details` == true is not supported when streaming tokens"),
    ]
    for failed, message in checks:
        if failed:
            raise TgiError(message)


def generation_request(request: TgiRequest, model: str, adapters: Sequence[str] = ()
                       ) -> GenerationRequest:
    """`adapters`: the LoRA adapters `adapter_id` may name (`model`'s own name, or none: the
    base model)."""
    p = request.parameters
    adapter = _adapter(p.adapter_id, model, adapters)
    sampled = _sampling(p)
    seed = p.seed
    if sampled and seed is None:  # TGI reports the seed it drew, so the answer can be replayed
        seed = random.getrandbits(63)
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens or 1,  # set from the context at admission when None
        do_sample=sampled,
        temperature=p.temperature or 1.0,
        top_k=p.top_k or 0,
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        seed=seed,
        stop_sequences=list(dict.fromkeys(s for s in p.stop if s)),
        include_stop_str_in_output=True,  # TGI's generated_text keeps the stop sequence
        truncate=p.truncate,
        top_logprobs=p.top_n_tokens or 0,
        prompt_logprobs=p.decoder_input_details,
        best_of=p.best_of if (p.best_of or 1) > 1 else None,
        structured=_grammar(p.grammar),
        watermark=p.watermark,
    )
    return GenerationRequest(request.inputs, params, adapter=adapter)


def _adapter(adapter_id: str | None, model: str, adapters: Sequence[str]) -> str | None:
    # TGI itself runs an unknown adapter_id as the base model; refusing it says what is served.
    try:
        return adapter_named(adapter_id, model, adapters)
    except UnknownAdapter as exc:
        raise TgiError(f"`adapter_id`: {exc.message}", ErrorKind.NOT_FOUND) from None


def _grammar(grammar: Grammar | None) -> StructuredOutput | None:
    if grammar is None:
        return None
    value = grammar.value
    if grammar.type == "json_object":
        return StructuredOutput("json_object", param="grammar")
    if grammar.type == "regex":
        if not isinstance(value, str) or not value:
            raise TgiError("grammar is not valid: a regex grammar's value must be a string")
        return StructuredOutput("regex", value, param="grammar")
    if grammar.type == "json_schema":
        value = value.get("schema") if isinstance(value, dict) else None
    elif isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise TgiError(f"grammar is not valid: {exc}") from None
    if not isinstance(value, dict) or "properties" not in value:
        raise TgiError("grammar is not valid: Grammar must have a 'properties' field")
    return StructuredOutput("json_schema", orjson.dumps(value).decode(), param="grammar")


def checks(request: TgiRequest) -> Checks:
    """The engine's refusals named as TGI names fields, and TGI's length rules."""
    return Checks(lambda exc, _: TgiError(f"`{exc.field}`: {exc.message}"),
                  lambda gen, max_total: fit_to_context(request, gen, max_total))


def fit_to_context(request: TgiRequest, gen: GenerationRequest, max_total: int
                   ) -> GenerationRequest:
    """TGI's length rules, once the prompt is tokenized: `max_new_tokens` defaults to what the
    context has left, and input plus output must fit it."""
    given = request.parameters.max_new_tokens
    prompt = len(gen.prompt_token_ids or [])
    if given is not None and prompt + given > max_total:
        raise TgiError(f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. Given: "
                       f"{prompt} `inputs` tokens and {given} `max_new_tokens`")
    return with_max_new_tokens(gen, given if given is not None else max_total - prompt)


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendering:
    """What shapes an answer: the request's flags and the prompt's text."""

    inputs: str
    details: bool
    prefill: bool
    top_tokens: bool
    full_text: bool
    seed: int | None
    n_best: int

    @classmethod
    def of(cls, request: TgiRequest, gen: GenerationRequest, compat: bool) -> Rendering:
        p = request.parameters
        full = p.return_full_text if p.return_full_text is not None else compat
        return cls(request.inputs, p.details or p.decoder_input_details,
                   p.decoder_input_details, bool(p.top_n_tokens), full,
                   gen.params.seed if gen.params.do_sample else None, gen.params.num_sequences)

    def text(self, seq: FoldedSequence) -> str:
        return self.inputs + seq.text if self.full_text else seq.text


def _sequence_details(seq: FoldedSequence, folded: Folded, r: Rendering) -> dict[str, Any]:
    out: dict[str, Any] = {
        "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
        "generated_tokens": len(seq.tokens),
        "seed": r.seed,
        "prefill": [{"id": t.id, "text": t.text, "logprob": t.logprob}
                    for t in (folded.prompt_logprobs or [])] if r.prefill else [],
        "tokens": [token_dict(t, tgi=True) for t in seq.tokens],
    }
    if r.top_tokens:
        out["top_tokens"] = [top_dicts(t, tgi=True) for t in seq.tokens]
    return out


def render_generate(folded: Folded, r: Rendering) -> dict[str, Any]:
    """/generate's answer: the best sequence (by log-probability) at the top, the others in
    `best_of_sequences`."""
    ordered = sorted(folded.sequences.values(), key=lambda s: (-s.cumulative_logprob, s.index))
    best = ordered[0]
    answer: dict[str, Any] = {"generated_text": r.text(best)}
    if r.details:
        details = _sequence_details(best, folded, r)
        if len(ordered) > 1:  # TGI's key order: best_of_sequences before top_tokens
            top_tokens = details.pop("top_tokens", None)
            details["best_of_sequences"] = [
                {"generated_text": r.text(seq), **_sequence_details(seq, folded, r)}
                for seq in ordered[1:]]
            if top_tokens is not None:
                details["top_tokens"] = top_tokens
        answer["details"] = details
    return answer


class StreamEvents(Renderer):
    """One event per generated token; the last one carries `generated_text` and, when asked
    for, `details`. A failure is one error event."""

    def __init__(self, r: Rendering, input_length: int) -> None:
        self.r = r
        self.input_length = input_length
        self.index = 0
        self.text = ""

    def feed(self, pairs: list[Pair]) -> list[Event]:
        return checked_events(pairs, lambda _, output: self._output_events(output))

    def failed(self, error: GenerationError) -> list[Event]:
        return [error_event(TgiError.of(error))]

    def _output_events(self, output: RequestOutput) -> list[Event]:
        seq = next((s for s in output.outputs if s.index == 0), None)
        if seq is None:
            return []
        tokens = seq.tokens or ([END_TOKEN] if seq.finished else [])  # the end needs an event
        events = []
        for i, token in enumerate(tokens):
            self.index += 1
            self.text += token.text
            last = seq.finished and i == len(tokens) - 1
            event: dict[str, Any] = {"index": self.index, "token": token_dict(token, tgi=True)}
            if self.r.top_tokens:
                event["top_tokens"] = top_dicts(token, tgi=True)
            event["generated_text"] = (self.r.inputs if self.r.full_text else "") + self.text \
                if last else None
            event["details"] = {
                "finish_reason": seq.finish_reason.value, "generated_tokens": self.index,
                "seed": self.r.seed, "input_length": self.input_length,
            } if last and self.r.details else None
            events.append(Event(event))
        return events


def error_event(error: TgiError) -> Event:
    """What ends a stream that failed (TGI answers a stream's every failure so, with 200)."""
    payload = error.payload(0)
    return Event(payload, failure=payload["error"])
