"""The asyncio engine of the engines that step in a thread: `Engine` (base.py) over an
`EngineLoop` that steps a continuous batcher over the engine's own forward passes (a `Runner`).

Requests are validated here (in the caller's thread: tokenizing, grammars),
submitted to the loop's inbox and read back from a queue per request. torch releases the GIL
inside its kernels (llama.cpp inside its calls), so the event loop keeps serving HTTP while a
step runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.kv_budget import KVBudget
from handlers.engine.loop.batcher import ContinuousBatcher
from handlers.engine.loop.runner import Runner
from handlers.engine.loop.speculation import NgramSettings
from handlers.engine.loop.thread import EngineLoop
from handlers.engine.media import MediaLimits, MediaReader
from handlers.engine.prompt_tokens import prompt_ids
from handlers.engine.types import (
    AdapterActivity,
    AdapterError,
    EngineFailure,
    GenerationRequest,
    MediaItem,
    RequestOutput,
    RequestValidationError,
)


class Loaded(Protocol):
    """What an engine loaded besides its weights (the torch loader's and llama.cpp's)."""

    name: str
    tokenizer: Any  # transformers' (or a PlainTokenizer), with the model's chat template
    eos_token_ids: set[int]
    dtype: Any  # a torch dtype, or the name of the weights' type (a GGUF's "q4_1")
    device: Any  # a torch device
    quantization: str  # as Engine.quantization
    max_model_len: int


class AdapterSet(Protocol):
    """The LoRA adapters an engine's runner applies (the torch engine's LoraSet)."""

    max_loras: int

    @property
    def names(self) -> tuple[str, ...]: ...

    def register(self, name: str, path: Path) -> Any:
        """Read and serve `path`'s adapter as `name`; AdapterError when it cannot."""

    def unregister(self, name: str) -> Any:
        """Serve `name` no more; AdapterError(missing=True) when it is not served."""

    def pin(self, name: str, pinned: bool) -> None:
        """Keep `name` in the runner's slots once there (or not); AdapterError when it cannot."""


class PromptMedia(Protocol):
    """A multimodal model's processor (the torch engine's MediaPrompts)."""

    kinds: frozenset[str]  # the media it takes: image, video, audio

    def prepare(self, request: GenerationRequest, max_model_len: int) -> None:
        """Fill the request's prompt_token_ids (media expanded) and media_inputs;
        RequestValidationError when it cannot."""

    def token_ids(self, prompt: str, media: tuple[MediaItem, ...]) -> list[int]:
        """The prompt's ids, media expanded (what /tokenize counts)."""


class LoopEngine:
    """Continuous batching over `new_runner()`'s forward passes (each makes a fresh runner and KV
    cache: one at the start and one per restart). `loop` runs the steps; it may run in the
    caller's main thread (`EngineBuild.main_loop`) instead of `start()`'s thread."""

    def __init__(self, loaded: Loaded, new_runner: Callable[[], Runner], *,
                 max_batch_size: int = 32, max_prefill_tokens: int = 512,
                 chat_template: str | None = None, stall_timeout: float | None = None,
                 prefix_cache_bytes: int = 0, on_serve: Callable[[], None] | None = None,
                 on_stop: Callable[[], None] | None = None,
                 lora: AdapterSet | None = None, media: PromptMedia | None = None,
                 media_limits: MediaLimits | None = None, kv_budget: KVBudget | None = None,
                 speculation: NgramSettings | None = None) -> None:
        """`kv_budget`: what the running sequences' cache may take (None: no bound);
        `speculation`: n-gram proposals, verified by `new_runner()`'s VerifyingRunner."""
        self.model_name = loaded.name
        self.media = media
        reader = None if media is None else MediaReader(media.kinds,
                                                        media_limits or MediaLimits())
        self.tokenizer = HFTokenizer(loaded.tokenizer, loaded.eos_token_ids, chat_template,
                                     reader, None if media is None else media.token_ids)
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        self.device = loaded.device.type
        self.quantization = loaded.quantization
        self.max_model_len = loaded.max_model_len
        self.lora = lora
        self.loaded = loaded  # the weights, kept across restarts

        def new_batcher(counters: dict[str, int] | None) -> ContinuousBatcher:
            return ContinuousBatcher(new_runner(), loaded.tokenizer, loaded.eos_token_ids,
                                     max_batch_size, max_prefill_tokens, loaded.max_model_len,
                                     counters, prefix_cache_bytes, kv_budget, speculation)

        self.loop = EngineLoop(new_batcher, stall_timeout, on_serve, on_stop)
        self.vocab_size = self.batcher.runner.vocab_size

    answer_parsing = None  # chat answers are read by the protocols' parsers
    kv_cache_dtype: str | None = None  # the runner's KV cache dtype, where the engine says
    group_window = None  # the batcher shares its slots between client requests itself

    @property
    def adapters(self) -> tuple[str, ...]:
        return () if self.lora is None else self.lora.names

    @property
    def batcher(self) -> ContinuousBatcher:
        """The loop's batcher (replaced on a restart)."""
        return self.loop.batcher

    def health(self) -> bool:
        return self.loop.healthy()

    def validate(self, request: GenerationRequest) -> None:
        params = request.params
        if request.adapter is not None and request.adapter not in self.adapters:
            served = ", ".join(self.adapters) or "none: LoRA is off (option.enable_lora)"
            raise RequestValidationError("adapter", f"LoRA adapter {request.adapter!r} is not "
                                         f"served (served: {served})")
        ids = self._media_prompt(request) if request.media else \
            prompt_ids(request, self.tokenizer, self.max_model_len)
        if params.num_sequences > self.batcher.max_batch_size:
            raise RequestValidationError(
                "best_of" if params.best_of else "n",
                f"{params.num_sequences} sequences exceed max_rolling_batch_size "
                f"{self.batcher.max_batch_size}",
            )
        if (refusal := self.batcher.admission.refusal(len(ids), params.num_sequences)):
            raise RequestValidationError("inputs", refusal)
        if params.structured is not None:  # 1-5 ms for a new schema here, then a cache hit
            self.batcher.grammars.compile(params.structured)
        request.prompt_token_ids = ids

    def _media_prompt(self, request: GenerationRequest) -> list[int]:
        if self.media is None:
            raise RequestValidationError("messages", "this model is text-only; media content "
                                         "is not supported")
        if request.media_inputs is None:
            self.media.prepare(request, self.max_model_len)
        return list(request.prompt_token_ids or [])

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if request.prompt_token_ids is None:
            self.validate(request)
        if not self.health():
            raise EngineFailure("the engine is not running")
        sink: asyncio.Queue = asyncio.Queue()
        self.loop.submit(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller went away (disconnect, cancellation): free the slot
                self.loop.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def add_adapter(self, name: str, path: Path) -> None:
        if self.lora is None:
            raise AdapterError("LoRA is off: set option.enable_lora=true to register adapters")
        await asyncio.to_thread(self.lora.register, name, path)  # reads and checks the files

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        if self.lora is None:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        self.lora.pin(name, pinned)

    async def remove_adapter(self, name: str) -> None:
        if self.lora is None:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        self.lora.unregister(name)
        # Its kept prefixes must not serve a new adapter registered under the same name.
        self.loop.call(lambda batcher: batcher.forget_adapter(name))

    async def release_session(self, session: str) -> None:
        self.loop.call(lambda batcher: batcher.release_session(session))

    def stats(self) -> dict[str, int]:
        return self.batcher.stats()

    def adapter_activity(self) -> AdapterActivity | None:
        if self.lora is None:
            return None
        running, waiting = self.batcher.adapters_in_use
        return AdapterActivity(self.lora.max_loras, running, waiting)

    async def start(self) -> None:
        """Run the loop in a thread of its own."""
        self.loop.start()

    async def shutdown(self) -> None:
        self.loop.stop()
        await asyncio.to_thread(self.loop.join)
