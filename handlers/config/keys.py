"""Every configuration key lmi-serve knows, in DJL Serving's spelling, with its parser and
default; DJL's other spellings; the environment variables LMI maps; and DJL Serving's own
front-end keys, which lmi-serve accepts and reports as having no meaning here."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handlers.config import values
from handlers.model_source import DEFAULT_EMBEDDING_ID

TEXT_EMBEDDING = "text-embedding"


class ConfigError(ValueError):
    """A setting that stops startup; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class Setting:
    """One configuration key: its DJL name, the Config field it sets, its parser and default.

    `engine`: the key tunes the engine, so it takes effect only with an engine that supports it
    (handlers/engine/registry.py); elsewhere only its default (or a value meaning the default)
    is accepted.
    """

    key: str
    field: str
    parse: values.Parser
    default: Any
    engine: bool = False


# DJL >= 0.33 runs lmi-dist as vllm; "scheduler" was DJL's own transformers batcher.
_ROLLING_BATCH = values.choice(
    "auto", "disable", "torch", "vllm", "llamacpp",
    aliases={"lmi-dist": "vllm", "scheduler": "torch"},
)
_DTYPE = values.choice(
    "auto", "fp32", "fp16", "bf16",
    aliases={"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"},
)
# vLLM's names (its `kv_cache_dtype`), and float32 (the torch engine's cache before it stored
# 16 bits); which an engine takes is the registry's question (EngineEntry.choices).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_DTYPE = values.choice(
    *KV_CACHE_DTYPES, aliases={"fp32": "float32", "fp16": "float16", "half": "float16",
                               "bf16": "bfloat16"},
)
_FORMATTER = values.choice("json", "jsonlines", "sse")
# vLLM's names of the reasoning parsers the chat protocols apply (protocols/chat/reasoning.py).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "granite")
# ... and of the tool-call parsers (protocols/chat/tool_parsers/).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
_ENGINE = values.choice("Python", "MPI")

SETTINGS: tuple[Setting, ...] = (
    Setting("option.model_id", "model_id", values.text, None),
    Setting("option.model_name", "model_name", values.model_name, None),
    Setting("option.revision", "revision", values.text, None),
    # Unset: text-embedding when option.model_id (or the model directory) is an embedding model.
    Setting("option.task", "task", values.choice("text-generation", TEXT_EMBEDDING), None),
    # The companion embedding model a text-generation server also serves: the embedded default,
    # a local sentence-transformers directory, or "none".
    Setting("option.embedding_model_id", "embedding_model_id", values.text, DEFAULT_EMBEDDING_ID),
    Setting("option.entryPoint", "entry_point", values.text, None),
    Setting("option.rolling_batch", "rolling_batch", _ROLLING_BATCH, "auto"),
    # Unset: DJL's default (json; jsonlines for `stream: true`, or SSE under tgi_compat).
    Setting("option.output_formatter", "output_formatter", _FORMATTER, None),
    Setting("option.tgi_compat", "tgi_compat", values.boolean, False),
    Setting("option.enable_streaming", "enable_streaming", values.streaming, False),
    Setting("option.full_text_enabled", "full_text_enabled", values.boolean, False),
    # How a reasoning model's thinking is told from its answer in chat-shaped answers (OpenAI,
    # Anthropic, Responses); LMI, TGI and generate keep the raw text.
    Setting("option.reasoning_parser", "reasoning_parser", values.choice(*REASONING_PARSERS),
            None),
    # How a model family writes tool calls (unset: the `<tool_call>` format, with a JSON answer
    # as a fallback); enable_auto_tool_choice=false refuses tool_choice auto, as vLLM does
    # without its flag.
    Setting("option.tool_call_parser", "tool_call_parser", values.choice(*TOOL_CALL_PARSERS),
            None),
    Setting("option.enable_auto_tool_choice", "enable_auto_tool_choice", values.boolean, None),
    Setting("option.chat_template", "chat_template", values.text, None),
    Setting("batch_size", "batch_size", values.integer(1), 1),
    Setting("max_batch_delay", "max_batch_delay", values.integer(0), 100),
    Setting("job_queue_size", "job_queue_size", values.integer(1), 1000),
    # Sequences one client request may ask for (its prompts, each times max(n, best_of)): TGI's
    # --max-client-batch-size. Never more than job_queue_size, which holds them all at once.
    Setting("option.max_client_batch_size", "max_client_batch_size", values.integer(1), 256),
    # Bytes; SageMaker's real-time payload limit (DJL's own default is 64 MiB).
    Setting("max_request_size", "max_request_size", values.integer(1), 6 * 1024 * 1024),
    # Slow and idle clients, in nginx's names and defaults (seconds): a request's line and
    # headers must arrive within client_header_timeout of the connection opening or the previous
    # answer ending (else the connection closes, with a 408 if part of them came); a body that
    # pauses longer than client_body_timeout is answered 408 and its connection closed.
    Setting("client_header_timeout", "client_header_timeout", values.integer(1), 60),
    Setting("client_body_timeout", "client_body_timeout", values.integer(1), 60),
    # HTTP connections held at once; one more is answered 503 and closed. Unset: twice
    # job_queue_size, so a full queue leaves room for health checks and idle keep-alives.
    Setting("max_connections", "max_connections", values.optional_integer, None),
    # Unset: no key (SageMaker authenticates callers upstream); set: every route but health
    # requires it. Never logged.
    Setting("option.api_key", "api_key", values.text, None),
    # The page for people (GET /ui, and GET / asked for HTML): the server's status and a
    # playground over its own routes, behind the API key's routes; false: not served (GET / is
    # TGI's health alone).
    Setting("option.enable_ui", "enable_ui", values.boolean, True),
    # Where OpenTelemetry traces of requests go (an OTLP endpoint; the wire, headers and the rest
    # are the SDK's OTEL_* variables); unset: no traces, and nothing of OpenTelemetry loaded.
    Setting("option.otlp_traces_endpoint", "otlp_traces_endpoint", values.text, None),
    # SageMaker's stateful sessions, with DJL LMI's names and defaults (on; 20 minutes); a
    # session's conversation stays pinned in the prefix cache while it is open.
    Setting("option.enable_stateful_sessions", "enable_stateful_sessions", values.boolean, True),
    Setting("option.sessions_expiration", "sessions_expiration", values.integer(1), 1200),
    Setting("option.max_sessions", "max_sessions", values.integer(1), 1000),
    # Of them, opened from one client address (the connection's, or a trusted proxy's
    # X-Forwarded-For); unset: no bound (behind SageMaker every caller shares its front end's).
    Setting("option.max_sessions_per_client", "max_sessions_per_client",
            values.optional_integer, None),
    # Models loaded at runtime (SageMaker's multi-model POST /models) at most; unset: as many
    # as memory holds. Past it, the least recently used is unloaded.
    Setting("option.max_models", "max_models", values.optional_integer, None),
    # Whether the management routes (POST /models, DJL's adapter API, vLLM's load_lora_adapter)
    # may fetch an s3:// URI or a Hugging Face Hub id at runtime; off, they read local
    # directories only (SageMaker's multi-model mode passes those, under /opt/ml/models).
    Setting("option.allow_runtime_fetch", "allow_runtime_fetch", values.boolean, False),
    Setting("option.model_loading_timeout", "model_loading_timeout", values.integer(1), 1800),
    # uvicorn's name: seconds requests get to finish once SIGTERM came; then those still running
    # end with their protocol's error and the process exits 0 (SageMaker kills at 30 s).
    Setting("timeout_graceful_shutdown", "timeout_graceful_shutdown", values.integer(0), 25),
    # Unset: no deadline (DJL's 120 s bounds one rolling-batch step, not a whole request).
    Setting("option.predict_timeout", "predict_timeout", values.optional_integer, None),
    # Failed requests in a row that turn readiness off and restart the engine (0: never).
    Setting("option.max_consecutive_failures", "max_consecutive_failures", values.integer(0), 10),
    # What the engine supports decides whether these take effect.
    Setting("engine", "engine", _ENGINE, "Python", engine=True),
    Setting("option.max_rolling_batch_size", "max_rolling_batch_size", values.integer(1), 32,
            engine=True),
    Setting("option.max_rolling_batch_prefill_tokens", "max_rolling_batch_prefill_tokens",
            values.integer(1), 512, engine=True),
    Setting("option.enable_chunked_prefill", "enable_chunked_prefill", values.boolean, True,
            engine=True),
    Setting("option.tensor_parallel_degree", "tensor_parallel_degree", values.parallel_degree, 1,
            engine=True),
    Setting("option.pipeline_parallel_degree", "pipeline_parallel_degree", values.integer(1), 1,
            engine=True),
    Setting("option.dtype", "dtype", _DTYPE, "auto", engine=True),
    Setting("option.max_model_len", "max_model_len", values.optional_integer, None, engine=True),
    # The KV cache's element type (auto: 16 bits; the engine says which and why at startup).
    Setting("option.kv_cache_dtype", "kv_cache_dtype", _KV_CACHE_DTYPE, "auto", engine=True),
    Setting("option.device", "device", values.device, "auto", engine=True),
    Setting("option.quantize", "quantize", values.text, None, engine=True),
    Setting("option.trust_remote_code", "trust_remote_code", values.boolean, False, engine=True),
    Setting("option.gpu_memory_utilization", "gpu_memory_utilization", values.fraction, 0.9,
            engine=True),
    # Bytes the KV cache may take (vLLM's kv_cache_memory_bytes; unset: the engine's own rule).
    Setting("option.kv_cache_memory_bytes", "kv_cache_memory_bytes", values.optional_integer,
            None, engine=True),
    Setting("option.enforce_eager", "enforce_eager", values.boolean, False, engine=True),
    # None: the engine's own default (vLLM caches prefixes unless told not to).
    Setting("option.enable_prefix_caching", "enable_prefix_caching", values.boolean, None,
            engine=True),
    Setting("option.disable_sliding_window", "disable_sliding_window", values.boolean, False,
            engine=True),
    Setting("option.cpu_offload_gb_per_gpu", "cpu_offload_gb_per_gpu", values.number(0), 0.0,
            engine=True),
    Setting("option.load_format", "load_format", values.text, "auto", engine=True),
    # More LoRA adapters than <model_dir>/adapters/ holds: vLLM's server option, as
    # comma-separated name=path pairs (handlers/config/adapters.py reads them).
    Setting("option.lora_modules", "lora_modules", values.text, None, engine=True),
    # LoRA as DJL LMI and vLLM name it. enable_lora unset: on when adapters are configured;
    # true without any: adapters may be registered at runtime. max_loras: the adapters one batch
    # may mix (unset: DJL LMI's 4); an adapter above max_lora_rank (unset: 16, or the largest
    # adapter's) is refused.
    Setting("option.enable_lora", "enable_lora", values.boolean, None, engine=True),
    Setting("option.max_loras", "max_loras", values.optional_integer, None, engine=True),
    Setting("option.max_lora_rank", "max_lora_rank", values.optional_integer, None, engine=True),
    # Media in chat messages (images, video, audio; engine/media/): how many of each one prompt
    # may carry (vLLM's format, image=2,video=1; unset: 20 in all, MindIE's limit), the hosts
    # media URLs may name (unset: any), and the server folder local paths may be read from
    # (unset: none may be). Only a multimodal model takes them.
    Setting("option.limit_mm_per_prompt", "limit_mm_per_prompt", values.modality_counts, None,
            engine=True),
    Setting("option.allowed_media_domains", "allowed_media_domains", values.domain_list, None,
            engine=True),
    Setting("option.allowed_local_media_path", "allowed_local_media_path", values.text, None,
            engine=True),
    # Speculative decoding: vLLM's `speculative_config` (JSON), and the older names DJL's
    # lmi-dist took, mapped onto it (settings.py: _check_speculative).
    Setting("option.speculative_config", "speculative_config", values.speculative_config, None,
            engine=True),
    Setting("option.speculative_draft_model", "speculative_draft_model", values.text, None,
            engine=True),
    Setting("option.speculative_length", "speculative_length", values.integer(1), None,
            engine=True),
    # A dead engine loop is rebuilt and restarted (true) or stops the process with exit 1.
    Setting("option.engine_restart", "engine_restart", values.boolean, True, engine=True),
    # Seconds one engine step may run before the engine counts as stuck (0: no limit).
    Setting("option.engine_stall_timeout", "engine_stall_timeout", values.integer(0), 120,
            engine=True),
)
BY_KEY = {s.key: s for s in SETTINGS}
BY_FIELD = {s.field: s for s in SETTINGS}

# Other names DJL accepts for the same settings.
KEY_ALIASES = {
    "option.engine": "engine",
    "max_dynamic_batch_size": "batch_size",
    "option.batch_size": "batch_size",
    "option.max_num_batched_tokens": "option.max_rolling_batch_prefill_tokens",
    "option.quantization": "option.quantize",
}

# Keys that configure DJL Serving's own Java front end and worker processes (how many workers,
# on which devices, its metrics and model store). Real LMI deployments set them; lmi-serve is
# one process with one engine, so it accepts them and reports, at startup, that they have no
# meaning here.
DJL_FRONT_END_KEYS = frozenset({
    "minWorkers", "maxWorkers", "gpu.minWorkers", "gpu.maxWorkers", "cpu.minWorkers",
    "cpu.maxWorkers", "max_idle_time", "load_on_devices", "required_memory_mb",
    "reserved_memory_mb", "gpu.required_memory_mb", "gpu.reserved_memory_mb",
    "log_request_metric", "metrics_aggregation", "option.mpi_mode", "option.parallel_loading",
    "option.pythonExecutable", "option.enable_venv", "option.async_mode",
    # SERVING_* variables DJL's images and launcher set for its Java front end.
    "features", "download_dir", "opts", "load_models", "model_store",
})

_KNOWN = {k.lower(): k for k in [*BY_KEY, *DJL_FRONT_END_KEYS]}
_KNOWN |= {alias.lower(): target for alias, target in KEY_ALIASES.items()}


def canonical_key(key: str, source: str) -> str:
    """DJL's own spelling of `key` (matched case-insensitively, so OPTION_ENTRYPOINT works).

    Another `option.<name>` is kept, lower-cased, as an argument the engine may take by name
    (vLLM's AsyncEngineArgs fields, as DJL LMI passes them on): `engine_args` decides.
    """
    canonical = _KNOWN.get(key.lower())
    if canonical is not None:
        return canonical
    if key.lower().startswith("option.") and len(key) > len("option."):
        return key.lower()
    raise unknown_key(key, source)


def unknown_key(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, [*BY_KEY, *DJL_FRONT_END_KEYS], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown configuration key {key!r} ({source}){hint}")


def _same(value: str) -> str:
    return value


def _negate(value: str) -> str:
    return str(not values.boolean(value)).lower()


def _mebibytes(value: str) -> str:
    return str(values.integer(1)(value) * 1024 * 1024)


def _gibibytes_or_unset(value: str) -> str:
    # vLLM's CPU build reads 0 as "not set".
    return str(values.integer(0)(value) << 30 or "")


def _gpus(value: str) -> str:
    # SageMaker sets SM_NUM_GPUS=0 on CPU instances: one device, the CPU.
    return str(max(values.integer(0)(value), 1))


# LMI's own variables, then the TGI / SageMaker aliases its entrypoint translates; earlier
# entries win, so an alias only counts when nothing above it set the key.
ENV_VARS: tuple[tuple[str, str, Callable[[str], str]], ...] = (
    ("HF_MODEL_ID", "option.model_id", _same),
    ("HF_REVISION", "option.revision", _same),
    ("HF_TASK", "option.task", _same),
    ("TENSOR_PARALLEL_DEGREE", "option.tensor_parallel_degree", _same),
    ("PIPELINE_PARALLEL_DEGREE", "option.pipeline_parallel_degree", _same),
    ("MODEL_LOADING_TIMEOUT", "option.model_loading_timeout", _same),
    ("PREDICT_TIMEOUT", "option.predict_timeout", _same),
    ("SM_NUM_GPUS", "option.tensor_parallel_degree", _gpus),
    ("MAX_CONCURRENT_REQUESTS", "job_queue_size", _same),
    ("MAX_CLIENT_BATCH_SIZE", "option.max_client_batch_size", _same),
    ("MAX_BATCH_SIZE", "option.max_rolling_batch_size", _same),
    ("MAX_BATCH_PREFILL_TOKENS", "option.max_rolling_batch_prefill_tokens", _same),
    ("HF_MODEL_QUANTIZE", "option.quantize", _same),
    ("HF_MODEL_TRUST_REMOTE_CODE", "option.trust_remote_code", _same),
    ("ENABLE_CUDA_GRAPHS", "option.enforce_eager", _negate),
    ("CUDA_MEMORY_FRACTION", "option.gpu_memory_utilization", _same),
    ("VLLM_CPU_KVCACHE_SPACE", "option.kv_cache_memory_bytes", _gibibytes_or_unset),
    ("SAGEMAKER_STARTUP_TIMEOUT", "option.model_loading_timeout", _same),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "option.predict_timeout", _same),
    ("SAGEMAKER_MAX_REQUEST_SIZE", "max_request_size", _same),
    ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "max_request_size", _mebibytes),
    ("VLLM_API_KEY", "option.api_key", _same),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "option.otlp_traces_endpoint", _same),
)
