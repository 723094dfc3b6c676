"""Which LoRA adapter a request selects. Each protocol names it its own way (OpenAI's and
Anthropic's `model`, LMI's `adapters`, TGI's `adapter_id`; SageMaker's adapter header sets the
body's own, handlers/server/http/invocations.py); all resolve the name here, against the
adapters the engine serves (`Engine.adapters`), and refuse an unknown one in their own shape.
"""

from __future__ import annotations

from collections.abc import Sequence


class UnknownAdapter(LookupError):
    """A name that is neither the served model's nor one of its adapters'."""

    def __init__(self, name: str, model: str, adapters: Sequence[str]) -> None:
        served = f"its LoRA adapters ({', '.join(adapters)})" if adapters else \
            "a LoRA adapter (it serves none)"
        super().__init__(f"'{name}' is neither the served model '{model}' nor {served}")
        self.name = name
        self.message = str(self)


def adapter_named(name: str | None, model: str, adapters: Sequence[str]) -> str | None:
    """The adapter `name` selects; None (the base model) for no name, "" or the served model's
    own name (as vLLM's `model` and DJL LMI's empty adapter select the base model)."""
    if not name or name == model:
        return None
    if name in adapters:
        return name
    raise UnknownAdapter(name, model, adapters)

