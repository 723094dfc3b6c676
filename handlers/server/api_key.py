"""The optional API key (`option.api_key`, `--api-key`, `VLLM_API_KEY`), the same on every wire:
`Authorization: Bearer <key>` (OpenAI's clients, vLLM's) or `x-api-key: <key>` (Anthropic's).
Off when no key is set: SageMaker authenticates its callers before they reach the container."""

from __future__ import annotations

import hashlib
import hmac

UNAUTHORIZED = "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key'"


def _digest(text: str) -> bytes:
    # Compare digests: equal lengths, so the comparison's time says nothing of the key's length.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class ApiKey:
    def __init__(self, key: str) -> None:
        self._digest = _digest(key)

    def accepts(self, authorization: str | None, x_api_key: str | None) -> bool:
        """Whether either header carries the key (both are checked, in constant time)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        matches = [hmac.compare_digest(_digest(given), self._digest)
                   for given in (bearer, x_api_key) if given is not None]
        return any(matches)
