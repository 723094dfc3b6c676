"""The LMI request body (`inputs`, `parameters`, `stream`); its `parameters` and their mapping
to `SamplingParams` are handlers/protocols/parameters.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from handlers.engine.types import GenerationRequest
from handlers.protocols.adapters import UnknownAdapter, adapter_named
from handlers.protocols.bodies import parse_body
from handlers.protocols.checks import Checks
from handlers.protocols.errors import ErrorKind, ProtocolError
from handlers.protocols.lmi.errors import LmiError
from handlers.protocols.parameters import LmiParameters, to_sampling_params

NOT_AN_OBJECT = "request body must be a JSON object with an 'inputs' field"


class LmiRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str = Field(min_length=1)
    parameters: LmiParameters = Field(default_factory=LmiParameters)
    stream: bool = False
    # DJL LMI's name for the LoRA adapter to run with: a name, or a list of one (per input)
    adapters: str | list[str] | None = None


def parse_lmi_request(body: Any) -> LmiRequest:
    """Validate a decoded JSON body; raise LmiError (424) naming the offending field."""
    request = parse_body(LmiRequest, body, LmiError, NOT_AN_OBJECT)
    _check_combinations(request)
    return request


def _check_combinations(request: LmiRequest) -> None:
    p = request.parameters
    if p.num_beams > 1:
        raise LmiError("parameters.num_beams: beam search is not supported; use best_of or n")
    if p.n is not None and p.best_of is not None and p.best_of < p.n:
        raise LmiError(f"parameters.best_of: must be >= n (got best_of={p.best_of}, n={p.n})")


def to_generation_request(request: LmiRequest, adapter: str | None = None
                          ) -> GenerationRequest:
    return GenerationRequest(prompt=request.inputs, params=to_sampling_params(request.parameters),
                             adapter=adapter)


def lmi_adapters(named: str | list[str] | None, inputs: int, model: str,
                 adapters: Sequence[str], error: type[ProtocolError] = LmiError
                 ) -> list[str | None]:
    """The LoRA adapter of each of `inputs` inputs, as a body's `adapters` names them: one name
    for all, or a list with one per input (DJL LMI's), where None, "" or the model's name is the
    base model. An `error` 400 when the list does not align with the inputs, 404 naming an
    adapter the engine does not serve."""
    names = named if isinstance(named, list) else [named] * inputs
    if len(names) != inputs:
        raise error(f"adapters: {len(names)} adapters for {inputs} inputs: name one per input "
                    '("" for the base model)')
    try:
        return [adapter_named(name, model, adapters) for name in names]
    except UnknownAdapter as exc:
        raise error(f"adapters: {exc.message}", ErrorKind.NOT_FOUND) from None


# The engine's refusals, the field named as the engine names it.
CHECKS = Checks(lambda exc, _: LmiError(f"{exc.field}: {exc.message}"))
