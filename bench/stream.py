"""Timing an LMI `application/jsonlines` token stream, one line at a time."""

from __future__ import annotations

from typing import Any

import orjson

from bench.stats import RequestResult


def parse_line(line: str) -> dict[str, Any] | None:
    """One stream line as an object; None for a blank line. Tolerates an SSE `data:` prefix."""
    line = line.strip()
    if line.startswith("data:"):
        line = line[len("data:") :].strip()
    if not line:
        return None
    obj = orjson.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"stream line is not a JSON object: {line[:200]}")
    return obj


class StreamTimer:
    """Feeds on a request's stream lines and times its tokens.

    Every `{"token": …}` line is one generated token, except the error line the server ends a
    failed stream with (`details.finish_reason == "error"`), which records the error instead.
    """

    def __init__(self, start: float, expected_tokens: int) -> None:
        self.start = start
        self.expected_tokens = expected_tokens
        self.tokens = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.error: str | None = None

    def feed(self, line: str, now: float) -> None:
        try:
            obj = parse_line(line)
        except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
            self.fail(f"bad stream line: {exc}")
            return
        if obj is None:
            return
        details = obj.get("details") or {}
        if details.get("finish_reason") == "error" or "error" in obj:
            self.fail(str(details.get("error") or obj.get("error") or "error in stream"))
        elif "token" in obj:
            self.tokens += 1
            self.first_token = self.first_token if self.first_token is not None else now
            self.last_token = now

    def fail(self, message: str) -> None:
        self.error = self.error or message

    def result(self, done: float) -> RequestResult:
        error = self.error
        if error is None and self.tokens == 0:
            error = "stream ended without a token"
        return RequestResult(
            start=self.start,
            first_token=self.first_token,
            last_token=self.last_token,
            done=done,
            tokens=self.tokens,
            expected_tokens=self.expected_tokens,
            error=error,
        )
