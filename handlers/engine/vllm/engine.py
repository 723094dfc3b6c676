"""The vLLM engine: each request is one `AsyncLLM.generate()` stream in DELTA mode, on the
server's event loop (vLLM's engine core runs in processes of its own).

Validation happens here, before admission: the prompt is tokenized with the model's tokenizer
(the same files vLLM reads), checked against the context, and the sampling settings are built
into vLLM's SamplingParams, whose own checks name the field they refuse. Health is vLLM's own
(`errored`) and forward progress: requests outstanding and no output for `stall_timeout`
seconds means stuck. LoRA adapters are vLLM's own: each is loaded at start, and a request
naming one (`GenerationRequest.adapter`) runs with its LoRARequest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from vllm import SamplingParams, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from handlers.engine.base import AnswerParsing
from handlers.engine.grammars import Grammars
from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.prompt_tokens import prompt_ids
from handlers.engine.types import (
    AdapterActivity,
    AdapterError,
    EngineFailure,
    GenerationRequest,
    RequestOutput,
    RequestValidationError,
)
from handlers.engine.vllm.outputs import OutputMapper
from handlers.engine.vllm.sampling import sampling_kwargs, structured_kwargs
from handlers.engine.vllm.scheduler_stats import SchedulerReadings

log = logging.getLogger(__name__)


class VllmEngine:
    def __init__(self, llm: Any, tokenizer: HFTokenizer, model_name: str,
                 stall_timeout: float | None = None,
                 adapters: Sequence[tuple[str, str]] = (),
                 answer_parsing: AnswerParsing | None = None,
                 readings: SchedulerReadings | None = None,
                 relaunch: Callable[[], Any] | None = None) -> None:
        self.llm = llm  # vllm.v1.engine.async_llm.AsyncLLM
        self._relaunch = relaunch  # a new AsyncLLM over the same arguments, for `revive`
        self._readings = readings or SchedulerReadings()  # its scheduler's KV-cache usage
        self.tokenizer = tokenizer
        self.answer_parsing = answer_parsing  # vLLM's reasoning and tool parsers
        self.model_name = model_name
        # LoRA adapters, (name, path): vLLM knows each by a positive id of our choosing.
        self._loras = {name: LoRARequest(name, lora_id, path)
                       for lora_id, (name, path) in enumerate(adapters, start=1)}
        self._next_lora_id = len(self._loras) + 1
        config = llm.model_config
        self.max_model_len: int = config.max_model_len
        self.dtype = str(config.dtype).removeprefix("torch.")
        self.quantization: str = config.quantization or "none"
        self.device = "cuda" if _on_cuda() else "cpu"
        self.stall_timeout = stall_timeout
        self._special = frozenset(tokenizer.hf.all_special_ids)
        # Structured-output specs are compiled here first (xgrammar, as vLLM does), so that a
        # bad one is refused before admission with the torch engine's message.
        self._grammars = Grammars(tokenizer.hf, config.get_vocab_size(), tokenizer.eos_token_ids)
        self._running: dict[str, bool] = {}  # request id -> whether it produced output yet
        self._adapter_of: dict[str, str] = {}  # request id -> its LoRA adapter, where it has one
        self._progress = time.monotonic()  # when vLLM last produced an output
        self._counters = {"prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0}
        if llm.vllm_config.cache_config.enable_prefix_caching:  # counted from its outputs
            self._counters |= {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self._started = False
        # vLLM schedules its waiting queue by priority, then first come first served: the
        # driver keeps at most one batch (max_num_seqs) of a client request's prompts in it, so
        # a later client's request waits behind at most that much of each, not all of it.
        self.group_window: int | None = llm.vllm_config.scheduler_config.max_num_seqs

    # -- the Engine interface -------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        params = request.params
        if request.adapter is not None and request.adapter not in self._loras:
            raise RequestValidationError("adapter", f"no LoRA adapter {request.adapter!r} is "
                                         f"served (adapters: {', '.join(self.adapters) or 'none'})")
        if request.media and self.tokenizer.media is None:
            raise RequestValidationError("messages", "this model is text-only; media content "
                                         "is not supported")
        if request.media and params.truncate is not None:
            raise RequestValidationError("truncate", "a prompt with media cannot be truncated")
        # Ids a client gave are checked against the vocabulary by the driver (engine/limits.py).
        # With media, vLLM's processor expands each placeholder into the media's tokens.
        ids = prompt_ids(request, self.tokenizer, self.max_model_len)
        self.sampling_params(request)  # vLLM's own checks, before admission
        if params.structured is not None:
            self._grammars.compile(params.structured)
        request.prompt_token_ids = ids

    def sampling_params(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        kwargs = sampling_kwargs(params)
        if params.structured is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(
                **structured_kwargs(params.structured))
        try:
            return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)
        except (ValueError, VLLMClientError) as exc:
            field = getattr(exc, "parameter", None) or _field_named(str(exc), kwargs)
            raise RequestValidationError(_OURS.get(field, field), str(exc)) from None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if request.prompt_token_ids is None:
            self.validate(request)
        if not self.health():
            raise EngineFailure("the vLLM engine is not running")
        rid = request.request_id
        mapper = OutputMapper(request, self.tokenizer.hf, self._special)
        stream = self.llm.generate(vllm_prompt(request), self.sampling_params(request), rid,
                                   lora_request=self._lora(request), priority=request.priority)
        self._running[rid] = False
        if request.adapter is not None:
            self._adapter_of[rid] = request.adapter
        self._counters["prompt_tokens"] += len(request.prompt_token_ids)
        try:
            async for out in stream:
                self._progress = time.monotonic()
                if not self._running[rid]:
                    self._count_prefix(out)
                self._running[rid] = True
                self._counters["generated_tokens"] += sum(len(s.token_ids) for s in out.outputs)
                yield mapper.map(out, len(self._running))
        except Exception as exc:
            raise self._failure(exc) from exc
        finally:
            self._running.pop(rid, None)
            self._adapter_of.pop(rid, None)
            self._counters["finished_requests"] += 1
            await stream.aclose()  # vLLM aborts a request whose stream closes unfinished

    def _count_prefix(self, first: Any) -> None:
        """A request's first output says how many of its prompt tokens vLLM found cached."""
        if "prefix_cache_hits" in self._counters:
            self._counters["prefix_cache_queries"] += len(first.prompt_token_ids or ())
            self._counters["prefix_cache_hits"] += first.num_cached_tokens or 0

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def health(self) -> bool:
        return self._started and not self.llm.errored and not self.stalled()

    def stalled(self) -> bool:
        return (self.stall_timeout is not None and bool(self._running)
                and time.monotonic() - self._progress > self.stall_timeout)

    def stats(self) -> dict[str, float]:
        running = sum(self._running.values())
        return {"running_requests": running, "waiting_requests": len(self._running) - running,
                **self._counters, **self._readings.stats()}

    def adapter_activity(self) -> AdapterActivity | None:
        lora = self.llm.vllm_config.lora_config
        if not lora:
            return None
        adapters = dict(self._adapter_of)
        running = {name for rid, name in adapters.items() if self._running.get(rid)}
        waiting = set(adapters.values()) - running
        return AdapterActivity(lora.max_loras, tuple(sorted(running)), tuple(sorted(waiting)))

    async def start(self) -> None:
        await self._load_adapters()
        self._started = True
        self._progress = time.monotonic()

    async def shutdown(self) -> None:
        self._started = False
        self.llm.shutdown()

    def dead(self) -> bool:
        return self._started and self.llm.errored

    async def revive(self) -> None:
        """A new AsyncLLM (engine core and workers) in place of the dead one, whose processes
        are shut down first; every adapter served, runtime ones included, loaded again."""
        if self._relaunch is None:
            raise EngineFailure("this vLLM engine cannot be started again")
        self._started = False
        self.llm.shutdown()
        self._running.clear()
        self._adapter_of.clear()
        self.llm = await asyncio.to_thread(self._relaunch)
        await self.start()

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(self._loras)

    async def add_adapter(self, name: str, path: Path) -> None:
        """Load an adapter at runtime, as vLLM's /v1/load_lora_adapter does (vLLM checks it
        against the model as it loads it)."""
        if name in self._loras:
            raise AdapterError(f"an adapter named {name!r} is served already")
        if not self.llm.vllm_config.lora_config:
            raise AdapterError("LoRA is off: set option.enable_lora=true to register adapters")
        lora = LoRARequest(name, self._next_lora_id, str(path))
        self._next_lora_id += 1
        try:
            await self.llm.add_lora(lora)
        except Exception as exc:
            raise AdapterError(f"LoRA adapter {name!r} ({path}) does not load: {exc}") from None
        self._loras[name] = lora

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        """vLLM pins an adapter for good: it has no unpinning."""
        lora = self._loras.get(name)
        if lora is None:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        if not pinned:
            raise AdapterError("vLLM cannot unpin an adapter (pin=false): remove and register "
                               "it again")
        await self.llm.pin_lora(lora.lora_int_id)

    async def remove_adapter(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is None:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        await self.llm.remove_lora(lora.lora_int_id)

    async def release_session(self, session: str) -> None:
        """Nothing to let go: vLLM's public API pins no prefix, and its own prefix cache keeps a
        session's blocks while they are recently used."""

    def _lora(self, request: GenerationRequest) -> LoRARequest | None:
        return None if request.adapter is None else self._loras[request.adapter]

    async def _load_adapters(self) -> None:
        """Load every adapter now, as vLLM's server loads its --lora-modules: one that does not
        load stops startup, rather than failing (in vLLM's engine core) its first request."""
        for lora in self._loras.values():
            try:
                await self.llm.add_lora(lora)
            except Exception as exc:
                self.llm.shutdown()
                raise EngineFailure(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}) does "
                                    f"not load: {exc}") from exc
            log.info("LoRA adapter %s loaded from %s", lora.lora_name, lora.lora_path)

    def _failure(self, exc: Exception) -> Exception:
        """What a failed stream raises: the engine's death fails every request (EngineFailure);
        vLLM refusing one request fails that request alone."""
        if self.llm.errored:
            return EngineFailure(f"the vLLM engine died ({type(exc).__name__}: {exc})")
        cause = exc.__cause__ or exc
        return RuntimeError(f"vLLM failed the request ({type(cause).__name__}: {cause})")


# vLLM's sampling field -> ours, to name what a refusal is about in the request's terms.
_OURS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
         "stop": "stop_sequences", "logprobs": "top_logprobs", "prompt_logprobs": "top_logprobs"}


def vllm_prompt(request: GenerationRequest) -> TokensPrompt:
    """The request as vLLM's prompt: its tokens, and its media as vLLM's multimodal inputs
    (PIL images, videos' frames, (samples, rate) audio), which vLLM's own processor for the
    model encodes and puts in place of the placeholders."""
    prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids or [])
    if request.media:
        data: dict[str, list[Any]] = {}
        for item in request.media:
            data.setdefault(item.kind, []).append(item.data)
        prompt["multi_modal_data"] = data
    return prompt


def _field_named(message: str, kwargs: dict[str, Any]) -> str:
    """The sampling field a vLLM error message names (vLLM's messages start with it)."""
    named = [name for name in kwargs if name in message]
    return max(named, key=len) if named else "parameters"


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
