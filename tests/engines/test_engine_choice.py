"""Which engine `option.rolling_batch` runs, decided before anything loads: `auto` is the
llama.cpp engine for a GGUF model on the CPU where llama-cpp-python is installed, else torch;
`llamacpp` takes only the settings that take effect with it."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from tiny_model import make_tiny_model_dir

from handlers.config import ConfigError, load_config, parse_args
from handlers.engine import registry

INSTALLED = importlib.util.find_spec("llama_cpp") is not None


def config(model_dir: Path, *options: str):
    argv = ["--model-dir", str(model_dir)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env={})


@pytest.fixture
def llama_cpp_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else find_spec(name, *a))
    monkeypatch.setattr(registry, "_gpu_count", lambda: 0)


@pytest.fixture
def llama_cpp_missing(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a))


def test_auto_runs_llama_cpp_for_the_embedded_gguf_when_installed(tmp_path, llama_cpp_installed):
    chosen = config(tmp_path)
    assert registry.check(chosen).name == "llamacpp"
    assert registry.auto_engine(chosen) == (
        "llamacpp", "a GGUF model on the CPU, and llama-cpp-python is installed")
    named = config(tmp_path, "option.model_id=/models/Other.Q8_0.gguf")
    assert registry.check(named).name == "llamacpp"
    # What the torch engine's compiled step turns off, llama.cpp never does: still llama.cpp.
    assert registry.check(config(tmp_path, "option.enforce_eager=true")).name == "llamacpp"


def test_auto_logs_its_choice(tmp_path, llama_cpp_installed, caplog, monkeypatch):
    monkeypatch.setattr(registry.importlib, "import_module", lambda name: None)
    with caplog.at_level(logging.INFO, logger="handlers.engine.registry"):
        registry.loader(config(tmp_path))
    assert "option.rolling_batch=auto: the llamacpp engine (a GGUF model on the CPU" in caplog.text


def test_auto_runs_torch_otherwise(tmp_path, llama_cpp_installed, monkeypatch):
    hf_model = make_tiny_model_dir(tmp_path / "hf")
    assert registry.auto_engine(config(hf_model)) == ("torch", "the model is not a GGUF file")
    assert registry.auto_engine(config(tmp_path, "option.dtype=bf16")) == (
        "torch", "set: option.dtype, which only the torch engine supports")
    assert registry.check(config(tmp_path, "option.dtype=bf16")).name == "torch"
    assert registry.check(config(tmp_path, "option.rolling_batch=disable")).name == "torch"
    monkeypatch.setattr(registry, "_gpu_count", lambda: 1)
    assert registry.auto_engine(config(tmp_path))[0] == "torch"


def test_auto_runs_torch_for_a_kv_cache_llama_cpp_cannot_store(tmp_path, llama_cpp_installed):
    chosen = config(tmp_path, "option.kv_cache_dtype=fp8_e5m2")
    assert registry.auto_engine(chosen) == (
        "torch", "set: option.kv_cache_dtype=fp8_e5m2, which only the torch engine supports")
    assert registry.auto_engine(config(tmp_path, "option.kv_cache_dtype=fp8"))[0] == "llamacpp"


def test_auto_runs_torch_without_llama_cpp(tmp_path, llama_cpp_missing):
    assert registry.auto_engine(config(tmp_path)) == (
        "torch", "llama-cpp-python is not installed (the `llamacpp` extra)")


def test_llamacpp_without_llama_cpp_stops_startup(tmp_path, llama_cpp_missing):
    with pytest.raises(ConfigError, match="needs llama-cpp-python: install the `llamacpp` extra"):
        registry.check(config(tmp_path, "option.rolling_batch=llamacpp"))


@pytest.mark.parametrize("option", ["option.max_rolling_batch_size=4",
                                    "option.max_rolling_batch_prefill_tokens=256",
                                    "option.max_model_len=1024", "option.engine_restart=false",
                                    "option.engine_stall_timeout=30", "option.device=cpu",
                                    "option.enable_chunked_prefill=false",
                                    "option.enforce_eager=true",  # it compiles nothing
                                    "option.kv_cache_dtype=fp8", "option.kv_cache_dtype=bf16",
                                    "option.kv_cache_dtype=float32"])
def test_llamacpp_takes_its_settings(tmp_path, llama_cpp_installed, option):
    assert registry.check(config(tmp_path, "option.rolling_batch=llamacpp", option)).name == \
        "llamacpp"


@pytest.mark.parametrize(("option", "message"), [
    ("option.dtype=bf16", "option.dtype=bf16 (command line) is not supported by the llamacpp "
                          "engine (supported by: torch, vllm)"),
    ("option.trust_remote_code=true", "is not supported by the llamacpp engine"),
    ("option.quantize=awq", "is not supported by the llamacpp engine"),
    ("option.device=cuda", "the llamacpp engine runs on the CPU only"),
    ("option.kv_cache_dtype=fp8_e4m3", "option.kv_cache_dtype=fp8_e4m3 (command line) is not "
                                       "supported by the llamacpp engine, which takes auto, "
                                       "float32, float16, bfloat16, fp8"),
])
def test_llamacpp_refuses_other_settings(tmp_path, llama_cpp_installed, option, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry.check(config(tmp_path, "option.rolling_batch=llamacpp", option))
