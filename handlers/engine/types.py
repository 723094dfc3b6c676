"""The engine's request and output types: the one vocabulary every protocol and engine shares.

Protocols parse their bodies into a `GenerationRequest`; engines stream `RequestOutput`s back.
Nothing here knows about HTTP or any wire format.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why a sequence stopped, in LMI's vocabulary (protocols map it to their own)."""

    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ERROR = "error"  # the engine failed it
    ABORT = "abort"
    # What the request itself asked for left it no way on (a grammar with no continuation):
    # its own failure, answered as a refusal, never counted against the engine.
    REFUSED = "refused"


class EngineFailure(RuntimeError):
    """The engine failed as a whole (its loop died, stalled or was restarted): every request it
    held ends with this."""


@dataclass(frozen=True)
class AdapterActivity:
    """Which LoRA adapters requests run with now, as vLLM's `vllm:lora_requests_info` reports:
    `max_loras` (one batch's), those of running requests and of waiting ones."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


class AdapterError(ValueError):
    """A LoRA adapter an engine cannot serve or does not serve; `missing`: no such adapter."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.missing = missing


class RequestValidationError(ValueError):
    """A request the engine refuses before admission; `field` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the generated text to a grammar (OpenAI's `response_format`, forced tool calls).

    `kind` is one of:
    - "json_object": any JSON object (`spec` unused);
    - "json_schema": JSON valid against the JSON schema `spec` (its text), always enforced as
      OpenAI's strict mode does (properties the schema does not name are never generated);
    - "regex": text matching the regular expression `spec`;
    - "grammar": text of the EBNF grammar `spec` (llama.cpp's GBNF, starting at `root`).
    A spec the engine cannot compile is refused at validation, blamed on request field `param`.
    """

    kind: str
    spec: str = ""
    param: str = "response_format"


@dataclass
class SamplingParams:
    """Per-request decoding settings. Defaults are LMI's; 0 / 1.0 / None mean "off"."""

    max_new_tokens: int = 30
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop_sequences: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate: int | None = None  # keep only the last `truncate` prompt tokens
    top_logprobs: int = 0  # alternatives reported per generated token
    prompt_logprobs: bool = False  # log-probabilities of the prompt tokens
    n: int = 1  # sequences returned
    best_of: int | None = None  # sequences generated (>= n); the best n by log-probability win
    structured: StructuredOutput | None = None  # constrained decoding (each sequence on its own)
    watermark: bool = False  # bias sampling to a green list a detector can recognise (TGI's)
    # A reasoning model thinks first: its output is thinking until one of these texts (e.g.
    # "</think>"), and `structured` constrains only what follows. (): no thinking to wait for.
    thinking_end: tuple[str, ...] = ()
    # What opens the thinking when the model decides to think (Qwen3 writes `<think>` itself):
    # its first token is then allowed beside the grammar's. (): thinking from the first token.
    thinking_start: tuple[str, ...] = ()
    max_thinking_tokens: int | None = None  # spent: the first `thinking_end` is forced next

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.best_of or 1)


@dataclass(frozen=True)
class MediaItem:
    """An image, audio clip or video of a prompt, read and decoded (engine/media/): `data` is a
    PIL image (RGB), an (audio float32 mono samples, sampling rate) pair or a video's frames
    (uint8 [frames, height, width, 3]); `digest` is the sha256 of the bytes it came from (what
    the prefix cache keys it by); `where` the request field it came from."""

    kind: str  # image | audio | video
    data: Any
    digest: str
    where: str


@dataclass
class GenerationRequest:
    """One prompt to complete. `prompt_token_ids` is filled by `Engine.validate`."""

    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt_token_ids: list[int] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # among waiting requests, lower values are admitted first
    # The client request it is part of (the driver gives every engine request of one client
    # request the same): an engine that schedules its own batch shares it between groups
    # round-robin, so no group waits behind another's whole batch. None: a group of its own.
    group: str | None = None
    adapter: str | None = None  # a LoRA adapter the engine serves (Engine.adapters); None: base
    # A stateful session (SageMaker's): an engine that caches prefixes pins the finished
    # conversation's keys/values under it until Engine.release_session.
    session: str | None = None
    # The prompt's media, in the order of their placeholders in `prompt` (a multimodal model's
    # chat template writes one per part).
    media: tuple[MediaItem, ...] = ()
    # Media still to read (fetch, decode) into `media`: the server reads them before validation,
    # in threads of their own (a slow URL holds none of the workers other requests need).
    pending_media: Callable[[], tuple[MediaItem, ...]] | None = None
    media_inputs: MediaInputs | None = None  # what the engine made of them at validation


@dataclass(frozen=True)
class MediaInputs:
    """What an engine's processor made of a prompt's media at validation: the model's inputs
    (pixel values and the like; engine-specific), and the prompt's ids with every media token
    replaced by a key of the request's media content (negative: no real token), which is what
    a prefix cache matches, so that a kept prefix serves only the same media."""

    tensors: dict[str, Any]
    cache_ids: tuple[int, ...]


@dataclass
class TopToken:
    id: int
    text: str
    logprob: float


@dataclass
class Token:
    """One generated (or prompt) token.

    `text` is the text this token released: usually its own piece, "" while a multi-byte
    character or a possible stop string is incomplete, and the held-back text once it resolves.
    The concatenation of a sequence's token texts is always its generated text.
    """

    id: int
    text: str
    logprob: float | None
    special: bool = False
    top: list[TopToken] = field(default_factory=list)


@dataclass
class SequenceOutput:
    """What one sequence of a request produced in one engine step."""

    index: int
    tokens: list[Token]
    finish_reason: FinishReason | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0
    generated_tokens: int = 0  # total so far, including `tokens`

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    batch_size: int = 0  # running batch size when the request was last stepped

    @property
    def queue_time(self) -> float:
        return (self.first_scheduled_time or self.arrival_time) - self.arrival_time


@dataclass
class RequestOutput:
    """An engine step's progress on one request: only the sequences that moved are listed."""

    request_id: str
    outputs: list[SequenceOutput]
    prompt_token_count: int
    metrics: RequestMetrics
    finished: bool = False
    prompt_logprobs: list[Token] | None = None  # on the first output, when asked for


@dataclass(frozen=True)
class CallDelta:
    """A piece of one tool call as it streams: its first names the function (with an id where
    the model family wants its own shape), the others add to its arguments' JSON text."""

    index: int  # the call's place among the answer's calls
    arguments: str = ""
    name: str | None = None
    id: str | None = None


@dataclass(frozen=True)
class AnswerPiece:
    """A piece of a chat answer as an engine's own parsers read it (vLLM's)."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass
class EmbeddingResult:
    vectors: list[list[float]]  # one per input, in input order
    prompt_tokens: int  # tokens embedded: special and instruction tokens included, after truncation
