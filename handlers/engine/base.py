"""The small interfaces every engine implements, and what protocols may ask of them.

Protocols talk to an `Engine` and its `Tokenizer` only: they never see a Hugging Face object, a
torch tensor or an engine's own loop. How an engine runs its loop is its own detail; the
composition root learns it from the registry (`EngineBuild.main_loop`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from handlers.engine.media import MediaReader
from handlers.engine.prompt_tokens import TokenBound
from handlers.engine.types import (
    AdapterActivity,
    AnswerPiece,
    EmbeddingResult,
    GenerationRequest,
    MediaItem,
    RequestOutput,
)


class Tokenizer(Protocol):
    """The model's tokenizer and chat template, as protocols use them."""

    vocab_size: int  # every id a prompt may carry is below this
    eos_token_ids: frozenset[int]
    # The fewest tokens a text can be, by its bytes, where that is proven
    # (engine/prompt_tokens.py): a prompt too long by it is refused unread. None: no bound.
    token_bound: TokenBound | None
    # What reads a multimodal model's media parts (engine/media/); None: the model reads text.
    media: MediaReader | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's token ids; special tokens (a BOS...) only when asked for, as the engines
        tokenize prompts without them."""

    def encode_media_prompt(self, text: str, media: tuple[MediaItem, ...]) -> list[int]:
        """A chat prompt's ids with its media's tokens, as the engine counts them (the model's
        processor expands each placeholder); only where `media` is set."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's string in the vocabulary (e.g. `Ġthe`), as vLLM's /tokenize reports them."""

    def chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The Jinja chat template in effect (option.chat_template, else the model's own);
        ValueError when there is none."""

    def render_chat(self, template: str, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                    continue_final_message: bool,
                    variables: dict[str, Any] | None = None) -> str:
        """The prompt text of a conversation, rendered by `template` (a `chat_template()`), with
        more `variables` for it (vLLM's chat_template_kwargs)."""


class AnswerParser(Protocol):
    """One chat answer read by an engine's own parsers, as it streams or whole."""

    reads_calls: bool  # whether it reads the tool calls too (else only the thinking)

    def feed(self, text: str, token_ids: Sequence[int], finished: bool) -> AnswerPiece: ...

    def whole(self, text: str, token_ids: Sequence[int]) -> AnswerPiece: ...


class AnswerParsing(Protocol):
    """An engine's own reading of chat answers (vLLM's reasoning and tool parsers), used in
    place of the protocols' where the engine has it, so its answers have its shapes."""

    def parser(self, tools: list[dict[str, Any]], thinking: bool, auto_tools: bool
               ) -> AnswerParser | None:
        """A parser for one answer: `tools` offered (OpenAI's shape), whether the thinking is
        split off, whether calls are read from the text (tool_choice auto); None where the
        engine has nothing to read here."""


class Engine(Protocol):
    """Generation: validate, generate, abort, health, stats, start and shutdown."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    dtype: str  # the weights' dtype, e.g. "float32" (what /info reports)
    device: str  # e.g. "cpu", "cuda"
    # How the weights are quantized as served: "none" (float), or the format (the torch
    # engine's option.quantize mode, a GGUF's type in llama.cpp, vLLM's method).
    quantization: str
    adapters: tuple[str, ...]  # the LoRA adapters a request may name (`adapter`); () for none
    answer_parsing: AnswerParsing | None  # its own reading of chat answers; None: the protocols'
    # How many engine requests of one client request (one `GenerationRequest.group`) it should
    # hold at once, the driver submitting the next as one finishes: for a scheduler that serves
    # its queue first come first served, so a bystander waits behind at most that many of each
    # client request. None: any number (its scheduler shares the batch between groups).
    group_window: int | None

    def validate(self, request: GenerationRequest) -> None:
        """Tokenize and check a request before admission; raise RequestValidationError.

        Fills `request.prompt_token_ids` (truncated as `params.truncate` asks). An `adapter` the
        engine does not serve is refused (field "adapter").
        """

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's progress; the last output has `finished=True`.

        Closing the iterator early (a client went away) aborts the request.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its batch slot and cache."""

    async def add_adapter(self, name: str, path: Path) -> None:
        """Serve the LoRA adapter in `path` as `name` from now on; AdapterError when the engine
        cannot (LoRA off, no such files, an adapter that does not fit the model)."""

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """Keep adapter `name` loaded for the batches (DJL's `pin`), or let it be evicted."""

    async def remove_adapter(self, name: str) -> None:
        """Serve `name` no more (requests running with it finish); AdapterError(missing=True)
        when it is not served."""

    async def release_session(self, session: str) -> None:
        """Stateful session `session` closed or expired: let go of what was kept for it."""

    def health(self) -> bool:
        """True while the engine can answer requests."""

    def adapter_activity(self) -> AdapterActivity | None:
        """The adapters running and waiting requests use (None: LoRA is off)."""

    def stats(self) -> dict[str, float]:
        """Gauges and counters for /metrics: running_requests, waiting_requests, prompt_tokens,
        generated_tokens, finished_requests; kv_cache_slots_in_use and kv_cache_slots_total
        where the engine has a cache of batch slots, else kv_cache_usage (0 to 1); the cache's
        shape in kv_cache_block_size and kv_cache_blocks (tokens the engine can hold, in
        blocks) once known; prefix_cache_* where it caches prefixes; kv_cache_budget_tokens,
        kv_cache_reserved_tokens(_peak) and kv_cache_budget_waits where it admits requests
        within a KV budget (loop/admission.py)."""

    async def start(self) -> None:
        """Start the engine's loop on the calling event loop's terms (after loading)."""

    async def shutdown(self) -> None:
        """Stop the loop; requests still running finish with an abort."""


@runtime_checkable
class GroupEngine(Protocol):
    """An engine that runs one client request's prompts together (dynamic batching's jobs)."""

    def submit(self, requests: list[GenerationRequest]) -> AsyncIterator[list[Pair]]:
        """Queue validated requests as one job; each item lists the (index, output) pairs that
        arrived together; closing the stream early aborts what is left."""


Pair = tuple[int, RequestOutput]  # (the request's index in its group, an output for it)


@runtime_checkable
class SteppableEngine(Protocol):
    """An engine a caller can step synchronously (the DJL entry: one step per `handle()`)."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    adapters: tuple[str, ...]  # the LoRA adapters a request may name

    def validate(self, request: GenerationRequest) -> None: ...

    def add(self, request: GenerationRequest) -> None:
        """Queue a validated request; it joins the batch at the next step."""

    def step(self) -> list[RequestOutput]:
        """Admit, prefill, decode one token for every running sequence; the outputs."""

    def cancel(self, request_id: str) -> None:
        """Finish a request now and free its slot."""

    @property
    def has_work(self) -> bool: ...


class MainThreadLoop(Protocol):
    """An engine loop that runs in the thread that calls `run_forever` (the torch engine runs
    fastest in the process's main thread)."""

    def run_forever(self) -> None: ...

    def stop(self) -> None:
        """End `run_forever` soon; safe from any thread and from signal handlers."""


@runtime_checkable
class SupervisedLoop(MainThreadLoop, Protocol):
    """A main-thread loop its supervisor can restart (after `run_forever` returned with
    `failure` set) or declare stuck (`stalled`)."""

    failure: BaseException | None  # why `run_forever` last returned; None: it was stopped

    def stalled(self) -> bool:
        """Whether the step running now has run past its time limit."""

    def restart(self, reason: str) -> None:
        """Make the loop fail with `reason`; safe from any thread."""

    def abandon(self, reason: str) -> None:
        """Fail every request now, from another thread, while the loop is stuck."""

    def reset(self) -> None:
        """Make a failed loop ready for the next `run_forever`."""


@runtime_checkable
class RevivableEngine(Protocol):
    """An engine whose loop runs in processes of its own (vLLM's engine core and workers): the
    server cannot restart a loop of it, only see it die and start it all again."""

    def dead(self) -> bool:
        """Whether the started engine died (its processes are gone or failed)."""

    async def revive(self) -> None:
        """Start the engine again, every process of it, with what it served loaded."""


@runtime_checkable
class Embedder(Protocol):
    """An embedding model's engine."""

    model_name: str
    dimension: int

    async def embed(self, texts: list[str], instruction: str | None = None,
                    truncate: bool = True) -> EmbeddingResult: ...

    def health(self) -> bool: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class EngineBuild:
    """What the registry built: the engine protocols talk to, and how its loop wants to run."""

    engine: Engine
    main_loop: MainThreadLoop | None = None  # run it in the main thread instead of `start()`
    steppable: SteppableEngine | None = None  # the same engine, stepped by the caller (DJL)
