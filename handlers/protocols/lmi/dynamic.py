"""DJL LMI's dynamic-batch schema (`option.rolling_batch=disable`): pure functions.

The body is `{"inputs": str | [str, ...], "parameters": {...}}`; the answer is a list with one
`{"generated_text": ...}` per input, in input order (a single string is answered with a list of
one, as DJL slices its batch predictions). As in DJL, whose handler decodes each whole sequence,
the text starts with the prompt unless `return_full_text` is false. `details` and the body's
`stream` have no effect, as in DJL: details belong to rolling batch, and only
`option.enable_streaming` streams. A stream is jsonlines `{"outputs": [text, ...]}`, one entry
per input, one line per engine step. Errors are DJL's handler failure
`{"code": 424, "message": "invoke handler failure", "error": ...}`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from handlers.engine.types import GenerationRequest, RequestOutput, RequestValidationError
from handlers.protocols.bodies import parse_body
from handlers.protocols.checks import Checks
from handlers.protocols.errors import GenerationError, ProtocolError
from handlers.protocols.lmi.request import NOT_AN_OBJECT
from handlers.protocols.outputs import Event, Failure, Folded, output_failure
from handlers.protocols.parameters import LmiParameters, to_sampling_params

HANDLER_FAILURE = "invoke handler failure"


class DynamicError(ProtocolError):
    """Any refusal or failure of a dynamic-batch request: DJL's handler failure body."""

    def payload(self, status: int) -> dict[str, Any]:
        return error_body(self.message, status)

    @classmethod
    def of(cls, error: GenerationError) -> DynamicError:
        return cls(error.message, error.kind)


def _as_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of strings")
    return value


Prompts = Annotated[
    list[Annotated[str, Field(min_length=1)]], Field(min_length=1), BeforeValidator(_as_list)
]


class DynamicRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: Prompts
    parameters: LmiParameters = Field(default_factory=LmiParameters)
    # The LoRA adapter every input runs with, or one per input (DJL LMI's list form)
    adapters: str | list[str] | None = None


def parse_dynamic_request(body: Any) -> DynamicRequest:
    """Validate a decoded JSON body; raise DynamicError naming the offending field."""
    request = parse_body(DynamicRequest, body, DynamicError, NOT_AN_OBJECT)
    p = request.parameters
    if p.num_beams > 1:
        raise DynamicError("parameters.num_beams: beam search is not supported")
    if p.num_sequences > 1:
        raise DynamicError("parameters.n: n and best_of > 1 are not supported with dynamic "
                           "batching")
    return request


def to_generation_requests(request: DynamicRequest, adapters: list[str | None]
                           ) -> list[GenerationRequest]:
    """One engine request per input, with its adapter (`lmi_adapters`)."""
    return [
        GenerationRequest(prompt=prompt, params=to_sampling_params(request.parameters),
                          adapter=adapter)
        for prompt, adapter in zip(request.inputs, adapters, strict=True)
    ]


def checks(request: DynamicRequest) -> Checks:
    """The engine's refusals naming the input as pydantic would (`inputs`, or `inputs.2`
    within a list) or the parameter."""
    def refusal(exc: RequestValidationError, index: int) -> DynamicError:
        where = exc.field
        if where == "inputs" and len(request.inputs) > 1:
            where = f"inputs.{index}"
        return DynamicError(f"{where}: {exc.message}")

    return Checks(refusal)


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"code": status, "message": HANDLER_FAILURE, "error": message}


def render_answer(folded: list[Folded], request: DynamicRequest) -> list[dict[str, str]]:
    """The non-streaming answer; DynamicError when an input failed (it fails the request)."""
    for acc in folded:
        failure = acc.failure()
        if failure is not None:
            raise DynamicError(failure.message, failure.kind)
    full = request.parameters.return_full_text is not False  # DJL's: the whole sequence
    return [
        {"generated_text": (prompt if full else "") + acc.sequences[0].text}
        for prompt, acc in zip(request.inputs, folded, strict=True)
    ]


class StreamLines:
    """Renders a job's outputs as `{"outputs": [...]}` lines: each line holds the text every
    input released in one step ("" for an input with none). A failed input sets `failure`."""

    def __init__(self, inputs: int) -> None:
        self.inputs = inputs
        self.failure: Failure | None = None
        self._open = set(range(inputs))

    @property
    def done(self) -> bool:
        return not self._open or self.failure is not None

    def feed(self, pairs: list[tuple[int, RequestOutput]]) -> Event | None:
        """The line for these outputs; None when none of them released any text."""
        texts = [""] * self.inputs
        for index, output in pairs:
            texts[index] += "".join(seq.text for seq in output.outputs if seq.index == 0)
            self.failure = self.failure or output_failure(output)
            if output.finished:
                self._open.discard(index)
        return Event({"outputs": texts}) if any(texts) else None

    def error(self, message: str, status: int) -> Event:
        """The last line of a stream that failed after it began: DJL's failure body."""
        self.failure = self.failure or Failure(None, message)
        return Event(error_body(message, status), failure=message)
