"""KServe's V1 data plane protocol: `{"instances": [...]}` in, `{"predictions": [...]}` out, as
KServe's Hugging Face runtime answers it: a generation model predicts each instance's text, an
embedding model its vector.

An instance is a prompt string, or an object with the prompt (`text`, `prompt` or `inputs`) and
LMI's generation fields, at its top level or under `parameters`. The request's own `parameters`
apply to every instance; an instance's fields override them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from handlers.engine.types import GenerationRequest
from handlers.protocols.bodies import describe_errors
from handlers.protocols.checks import naming
from handlers.protocols.errors import ErrorKind, KServeError
from handlers.protocols.parameters import LmiParameters, to_sampling_params

PROMPT_KEYS = ("text", "prompt", "inputs")


def model_not_found(model: str) -> KServeError:
    return KServeError(f"Model with name {model} does not exist.", ErrorKind.NOT_FOUND)


def instances(body: Any) -> list[Any]:
    if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
        raise KServeError("the request body must be a JSON object with an 'instances' list")
    if not body["instances"]:
        raise KServeError("instances: must not be empty")
    return body["instances"]


def texts(body: Any) -> list[str]:
    """The instances of an embedding request: strings."""
    found = instances(body)
    for i, item in enumerate(found):
        if not isinstance(item, str) or not item:
            raise KServeError(f"instances[{i}]: expected a non-empty string (got {item!r})")
    return found


def generation_requests(body: Any) -> list[tuple[GenerationRequest, bool]]:
    """Each instance's engine request, and whether its prediction repeats its prompt
    (`return_full_text`)."""
    found = instances(body)
    shared = _request_parameters(body)
    return [_generation_request(item, i, shared) for i, item in enumerate(found)]


def _request_parameters(body: dict[str, Any]) -> LmiParameters:
    shared = body.get("parameters", {})
    if not isinstance(shared, dict):
        raise KServeError("parameters: expected an object")
    try:
        return LmiParameters.model_validate(shared)
    except ValidationError as exc:
        raise KServeError(f"parameters.{describe_errors(exc)}") from None


def _generation_request(item: Any, index: int,
                        shared: LmiParameters) -> tuple[GenerationRequest, bool]:
    where = f"instances[{index}]"
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise KServeError(f"{where}: expected a string or an object (got {item!r})")
    prompts = [key for key in PROMPT_KEYS if key in item]
    if len(prompts) != 1 or not isinstance(item[prompts[0]], str) or not item[prompts[0]]:
        raise KServeError(f"{where}: expected one non-empty prompt string in one of "
                            f"{', '.join(PROMPT_KEYS)}")
    fields = {k: v for k, v in item.items() if k not in (*PROMPT_KEYS, "parameters")}
    nested = item.get("parameters", {})
    if not isinstance(nested, dict):
        raise KServeError(f"{where}.parameters: expected an object")
    try:
        own = LmiParameters.model_validate({**fields, **nested})
    except ValidationError as exc:
        raise KServeError(f"{where}.{describe_errors(exc)}") from None
    # By field, not by key, so that an alias (`min_tokens`) overrides its field too.
    params = shared.model_copy(update=own.model_dump(exclude_unset=True))
    if params.num_beams > 1 or params.num_sequences > 1:
        raise KServeError(f"{where}: beam search, n and best_of > 1 are not supported")
    return GenerationRequest(item[prompts[0]], to_sampling_params(params)), params.return_full_text


def render_predictions(predictions: list[Any]) -> dict[str, Any]:
    return {"predictions": predictions}


# The engine's refusals name the prompt by its place in `instances`.
CHECKS = naming(KServeError, lambda i: f"instances[{i}]")
