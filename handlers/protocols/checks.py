"""What a protocol adds to the engine's checks of a request, in its own terms: how it names what
the engine refused, whether an over-long prompt keeps its end instead, and how it fits the
output's length to the context. The generation driver applies them (handlers/server/driver.py),
once per engine request, before admission."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.protocols.errors import ErrorKind, ProtocolError

Refuse = Callable[[str, ErrorKind], ProtocolError]  # a protocol's error of a given kind


@dataclass(frozen=True)
class Checks:
    # The engine's refusal of the request at this index, as the protocol's error.
    refusal: Callable[[RequestValidationError, int], ProtocolError]
    # (the validated request, the context's length): the request with its output length fitted,
    # a new request; raises the protocol's error for a length the context cannot hold.
    fit: Callable[[GenerationRequest, int], GenerationRequest] | None = None
    # (a request whose prompt the context cannot hold, the context's length): the request
    # keeping the prompt's end, to validate again; None: refused as it is.
    shorten: Callable[[GenerationRequest, int], GenerationRequest | None] | None = None


def naming(refuse: Refuse, prompt: Callable[[int], str],
           parameter: Callable[[str], str] = lambda name: f"parameters.{name}") -> Checks:
    """Checks that name the prompt `prompt(index)` and a parameter `parameter(name)`."""
    def refusal(exc: RequestValidationError, index: int) -> ProtocolError:
        field = prompt(index) if exc.field == "inputs" else parameter(exc.field)
        return refuse(f"{field}: {exc.message}", ErrorKind.VALIDATION)

    return Checks(refusal)


def with_max_new_tokens(gen: GenerationRequest, tokens: int) -> GenerationRequest:
    """The request, asking for `tokens` new tokens."""
    return replace(gen, params=replace(gen.params, max_new_tokens=tokens))
