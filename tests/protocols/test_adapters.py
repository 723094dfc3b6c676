"""LoRA adapters without vLLM: finding them (the model directory's `adapters/`, and
option.lora_modules), sizing vLLM's LoRA arguments for them, refusing them where no engine
serves them, and each protocol selecting one, on the FakeEngine advertising adapters. The
vllm engine serves them for real in tests/engines/test_vllm_engine.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.config import (
    ConfigError,
    check_effects,
    load_config,
    parse_args,
    with_source_adapters,
)
from handlers.engine import registry
from handlers.engine.types import GenerationRequest, RequestValidationError
from handlers.engine.vllm.args import engine_kwargs

MODEL = "fake-model"
HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
FIELDS: dict[str, Any] = {  # the LoRA fields of vLLM 0.32's AsyncEngineArgs
    "enable_lora": bool, "max_loras": int, "max_cpu_loras": int | None,
    "max_lora_rank": Literal[1, 8, 16, 32, 64, 128, 256, 320, 512],
}


def write_adapter(folder: Path, r: int = 8, **config: Any) -> Path:
    """A LoRA adapter's files as PEFT saves them (the weights' content is not read here)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "target_modules": ["q_proj", "v_proj"], **config}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def config(model_dir: Path, *options: str):
    argv = ["--model-dir", str(model_dir)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env={})


def vllm_kwargs(model_dir: Path, *options: str) -> dict[str, Any]:
    return engine_kwargs(config(model_dir, "option.rolling_batch=vllm", *options), "/m",
                         FIELDS, 1)


@pytest.fixture
def optional_engines_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object()
                        if name in ("vllm", "llama_cpp") else find_spec(name, *a))


# -- finding them ----------------------------------------------------------------------------------


def test_the_model_directory_and_option_lora_modules_name_the_adapters(tmp_path):
    write_adapter(tmp_path / "adapters" / "sql", r=8)
    (tmp_path / "adapters" / "notes").mkdir()  # no adapter_config.json: not an adapter
    elsewhere = write_adapter(tmp_path / "extra" / "chat", r=12, rank_pattern={"q_proj": 40})
    write_adapter(tmp_path / "more" / "poem", r=4)
    chosen = config(tmp_path, f"option.lora_modules=chat={elsewhere}, poem=more/poem")
    assert [(a.name, a.rank) for a in chosen.adapters] == [("sql", 8), ("chat", 40),
                                                           ("poem", 4)]
    assert chosen.adapters[2].path == (tmp_path / "more" / "poem").resolve()  # relative: here
    assert chosen.adapters[0].source == f"found in {tmp_path / 'adapters'}"
    assert chosen.adapters[1].source == "option.lora_modules (command line)"
    # vLLM's --lora-modules separates its pairs with spaces; AWS's vLLM image sets SM_VLLM_*
    assert len(config(tmp_path, "option.lora_modules=a=more/poem b=more/poem").adapters) == 3
    from_env = load_config(parse_args(["--model-dir", str(tmp_path)]),
                           env={"SM_VLLM_LORA_MODULES": "poem=more/poem"})
    assert [a.name for a in from_env.adapters] == ["sql", "poem"]


def test_the_model_files_own_adapters_folder_counts_too(tmp_path):
    """DJL LMI finds `adapters/` beside serving.properties or in the directory of an s3://
    model_id: once the engine has the model's files, their adapters join the configured ones,
    with LoRA's limits sized for all."""
    write_adapter(tmp_path / "adapters" / "sql", r=8)
    fetched = tmp_path / "fetched"
    write_adapter(fetched / "adapters" / "poem", r=32)
    given = config(tmp_path)
    served = with_source_adapters(given, fetched)
    assert [a.name for a in served.adapters] == ["sql", "poem"]
    assert (served.lora.max_loras, served.lora.max_rank) == (4, 32)
    assert with_source_adapters(given, tmp_path) is given  # the model directory: counted already
    write_adapter(fetched / "adapters" / "sql")
    with pytest.raises(ConfigError, match="LoRA adapter 'sql' is named twice"):
        with_source_adapters(given, fetched)


def write_broken(root: Path, name: str, kind: str) -> None:
    folder = write_adapter(root / name)
    if kind == "json":
        (folder / "adapter_config.json").write_text("{not json")
    elif kind == "weights":
        (folder / "adapter_model.safetensors").unlink()
    elif kind == "peft":
        (folder / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    elif kind == "rank":
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')


@pytest.mark.parametrize(("kind", "message"), [
    ("json", "cannot read its adapter_config.json"),
    ("weights", "holds no adapter weights (adapter_model.safetensors or"),
    ("peft", "describes no LoRA adapter (peft_type 'PREFIX_TUNING')"),
    ("rank", "has no positive integer rank `r`"),
])
def test_an_unreadable_adapter_stops_startup_naming_it(tmp_path, kind, message):
    write_broken(tmp_path / "adapters", "broken", kind)
    with pytest.raises(ConfigError, match="LoRA adapter 'broken' ") as refused:
        config(tmp_path)
    assert message in str(refused.value)


@pytest.mark.parametrize(("modules", "message"), [
    ("ghost=/no/such/dir", "LoRA adapter 'ghost' (/no/such/dir, option.lora_modules (command "
                           "line)): no such directory"),
    ("just-a-path", "'just-a-path' is not a name=path pair"),
    ("sql=adapters/sql", "LoRA adapter 'sql' is named twice"),
    (f"{MODEL}=adapters/sql", f"LoRA adapter '{MODEL}' (option.lora_modules (command line)) "
                              "has the served model's name"),
    ("a/b=adapters/sql", "its name is unusable"),
])
def test_a_missing_or_ambiguous_adapter_stops_startup(tmp_path, modules, message):
    write_adapter(tmp_path / "adapters" / "sql")
    with pytest.raises(ConfigError) as refused:
        config(tmp_path, f"option.model_name={MODEL}", f"option.lora_modules={modules}")
    assert message in str(refused.value)


# -- vLLM's LoRA arguments -------------------------------------------------------------------------


def test_adapters_turn_vllms_lora_on_sized_for_them(tmp_path):
    assert "enable_lora" not in vllm_kwargs(tmp_path)  # none: vLLM's defaults
    write_adapter(tmp_path / "adapters" / "a", r=8)
    write_adapter(tmp_path / "adapters" / "b", r=12)  # no such rank in vLLM: the next one up
    got = vllm_kwargs(tmp_path)
    # DJL LMI's max_loras (4: the adapters one batch mixes); vLLM's rank that holds 12
    assert (got["enable_lora"], got["max_loras"], got["max_lora_rank"]) == (True, 4, 16)


def test_lora_settings_given_stay(tmp_path):
    write_adapter(tmp_path / "adapters" / "a", r=8)
    write_adapter(tmp_path / "adapters" / "b", r=8)
    got = vllm_kwargs(tmp_path, "option.max_loras=1", "option.max_lora_rank=64",
                      "option.enable_lora=true")
    assert (got["enable_lora"], got["max_loras"], got["max_lora_rank"]) == (True, 1, 64)
    # LoRA on without adapters: they are registered at runtime
    assert vllm_kwargs(tmp_path / "adapters" / "a", "option.enable_lora=true")["enable_lora"]


@pytest.mark.parametrize(("options", "rank", "message"), [
    (["option.enable_lora=false"], 8, "option.enable_lora=false (command line) turns LoRA off, "
                                      "but LoRA adapter 'a' (found in"),
    (["option.max_lora_rank=8"], 16, "option.max_lora_rank=8 (command line) is below the rank "
                                     "16 of LoRA adapter 'a'"),
    ([], 600, "LoRA rank 600 is above the largest vLLM serves, 512"),
])
def test_lora_arguments_that_cannot_serve_the_adapters_stop_startup(tmp_path, options, rank,
                                                                    message):
    write_adapter(tmp_path / "adapters" / "a", r=rank)
    with pytest.raises(ConfigError) as refused:
        vllm_kwargs(tmp_path, *options)
    assert message in str(refused.value)


def test_lora_limits_without_lora_have_no_effect_and_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"option.max_loras=2 \(command line\) has no effect "
                                          "with LoRA off"):
        config(tmp_path, "option.max_loras=2")


# -- the torch and vllm engines serve them, llama.cpp does not -------------------------------------


def test_the_torch_and_vllm_engines_serve_adapters_and_llamacpp_does_not(tmp_path,
                                                                          optional_engines_installed):
    write_adapter(tmp_path / "more" / "poem")
    write_adapter(tmp_path / "adapters" / "sql")
    for engine in ("torch", "vllm"):
        assert registry.check(config(tmp_path, f"option.rolling_batch={engine}",
                                     "option.lora_modules=poem=more/poem")).name == engine
    with pytest.raises(ConfigError, match=r"option.lora_modules=poem=more/poem \(command line\) "
                                          r"is not supported by the llamacpp engine"):
        registry.check(config(tmp_path, "option.rolling_batch=llamacpp",
                              "option.lora_modules=poem=more/poem"))


def test_an_embedding_server_refuses_adapters(tmp_path):
    write_adapter(tmp_path / "adapters" / "sql")
    with pytest.raises(ConfigError, match="LoRA adapter 'sql' .* would have no effect"):
        check_effects(config(tmp_path, "option.task=text-embedding"))


def test_a_torch_engine_without_lora_refuses_a_request_naming_an_adapter(tmp_path):
    from tiny_model import make_tiny_model_dir

    from handlers.engine.torch.engine import TorchEngine
    from handlers.engine.torch.loader import load_model

    engine = TorchEngine(load_model(make_tiny_model_dir(tmp_path), dtype="fp32"))
    assert engine.adapters == ()
    with pytest.raises(RequestValidationError) as refused:
        engine.validate(GenerationRequest("Hello", adapter="sql"))
    assert refused.value.field == "adapter" and "'sql'" in refused.value.message


# -- selecting one, in each protocol's way ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(adapters=("sql", "poem"))


def adapter_of(engine: FakeEngine) -> str | None:
    return engine.requests[-1].adapter


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
])
def test_openai_model_names_an_adapter_or_the_model(url, engine, path, body):
    answer = httpx.post(f"{url}{path}", json={**body, "model": "sql"})
    assert answer.status_code == 200 and answer.json()["model"] == "sql"  # vLLM echoes it
    assert adapter_of(engine) == "sql"
    for model in (MODEL, None):
        named = {"model": model} if model else {}
        assert httpx.post(f"{url}{path}", json={**body, **named}).json()["model"] == MODEL
        assert adapter_of(engine) is None


def test_openai_unknown_model_is_a_404_naming_it_and_the_adapters(url):
    answer = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == ("The model 'nope' does not exist; this server serves "
                                f"'{MODEL}' and its LoRA adapters sql, poem.")


def test_anthropic_model_names_an_adapter(url, engine):
    body = {"model": "poem", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{url}/v1/messages", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == "poem"
    assert adapter_of(engine) == "poem"
    assert httpx.post(f"{url}/v1/messages", json={**body, "model": "nope"}).status_code == 404


def test_lmi_adapters_names_an_adapter(url, engine):
    body = {"inputs": "hi there", "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/invocations", json={**body, "adapters": "sql"}).status_code == 200
    assert adapter_of(engine) == "sql"
    for base in ("", MODEL):  # DJL's empty adapter, and the model's own name: the base model
        assert httpx.post(f"{url}/invocations", json={**body, "adapters": base}).status_code == 200
        assert adapter_of(engine) is None
    unknown = httpx.post(f"{url}/invocations", json={**body, "adapters": "nope"})
    assert unknown.status_code == 404
    assert unknown.json() == {"error": "adapters: 'nope' is neither the served model "
                                       f"'{MODEL}' nor its LoRA adapters (sql, poem)",
                              "code": 404}


def test_tgi_adapter_id_names_an_adapter(url, engine):
    body = {"inputs": "hi there", "parameters": {"max_new_tokens": 2, "adapter_id": "poem"}}
    assert httpx.post(f"{url}/generate", json=body).status_code == 200
    assert adapter_of(engine) == "poem"
    body["parameters"]["adapter_id"] = "nope"
    unknown = httpx.post(f"{url}/generate", json=body)
    assert unknown.status_code == 404 and "`adapter_id`: 'nope' is neither" in unknown.text
    events = httpx.post(f"{url}/generate_stream", json=body).text  # TGI streams its errors
    assert "`adapter_id`: 'nope'" in events


@pytest.mark.parametrize("path", ["/invocations", f"/predictions/{MODEL}",
                                  "/endpoints/any/invocations",
                                  "/endpoints/any/invocations-response-stream"])
@pytest.mark.parametrize("body", [{"inputs": "hi", "adapters": "poem"}, {**CHAT, "model": MODEL},
                                  {"prompt": "hi", "max_tokens": 2}])
def test_sagemakers_header_names_the_adapter_whatever_the_body(url, engine, path, body):
    answer = httpx.post(f"{url}{path}", json=body, headers={HEADER: "sql"})
    assert answer.status_code == 200 and adapter_of(engine) == "sql"  # over the body's own


@pytest.mark.parametrize(("where", "how"), [
    ("query", {"params": {"adapter": "poem"}}),
    ("custom attributes", {"headers": {"X-Amzn-SageMaker-Custom-Attributes":
                                       "trace=1;adapter=poem"}}),
])
def test_djls_query_and_custom_attributes_name_the_adapter(url, engine, where, how):
    """DJL's "Calling Adapters": `?adapter=` and `adapter=` in SageMaker's custom attributes,
    whatever the body speaks; SageMaker's adapter header goes first."""
    for body in ({"inputs": "hi"}, CHAT):
        assert httpx.post(f"{url}/invocations", json=body, **how).status_code == 200, where
        assert adapter_of(engine) == "poem"
    first = {**how, "headers": {**how.get("headers", {}), HEADER: "sql"}}
    both = httpx.post(f"{url}/invocations", json={"inputs": "hi"}, **first)
    assert both.status_code == 200 and adapter_of(engine) == "sql"


def test_lmis_list_of_adapters_aligns_with_the_inputs():
    engine = FakeEngine(adapters=("sql", "poem"))
    with serving(served_app(engine, dynamic=(4, 1, False))) as dynamic:
        body = {"inputs": ["a b", "c d", "e f"], "adapters": ["sql", "", "poem"],
                "parameters": {"max_new_tokens": 2}}
        assert httpx.post(f"{dynamic}/invocations", json=body).status_code == 200
        assert [r.adapter for r in engine.requests[-3:]] == ["sql", None, "poem"]
        short = httpx.post(f"{dynamic}/invocations", json={**body, "adapters": ["sql"]})
        assert short.status_code == 424
        assert "adapters: 1 adapters for 3 inputs" in short.text


def test_kserve_generate_and_databricks_name_the_adapter_by_model(url, engine):
    """A model path naming an adapter serves it, as its model of its own: Triton's generate,
    KServe V2's infer and a Databricks endpoint."""
    answer = httpx.post(f"{url}/v2/models/poem/generate", json={"text_input": "hi"})
    assert answer.status_code == 200 and answer.json()["model_name"] == "poem"
    assert adapter_of(engine) == "poem"
    infer = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                         "data": ["hi"]}]}
    assert httpx.post(f"{url}/v2/models/sql/infer", json=infer).status_code == 200
    assert adapter_of(engine) == "sql"
    assert httpx.post(f"{url}/serving-endpoints/poem/invocations", json=CHAT).status_code == 200
    assert adapter_of(engine) == "poem"
    missing = httpx.post(f"{url}/v2/models/nope/generate", json={"text_input": "hi"})
    assert missing.status_code == 404 and "sql, poem" in missing.text


def test_sagemakers_header_naming_no_adapter_is_a_404(url):
    lmi = httpx.post(f"{url}/invocations", json={"inputs": "hi"}, headers={HEADER: "nope"})
    assert lmi.status_code == 404 and "'nope' is neither" in lmi.json()["error"]
    chat = httpx.post(f"{url}/invocations", json=CHAT, headers={HEADER: "nope"})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    runtime = httpx.post(f"{url}/endpoints/any/invocations", json=CHAT, headers={HEADER: "nope"})
    assert runtime.status_code == 424 and runtime.json()["OriginalStatusCode"] == 404


def test_models_lists_each_adapter_beside_its_base_model(url):
    models = httpx.get(f"{url}/v1/models").json()
    assert [(m["id"], m.get("parent")) for m in models["data"]] == [
        (MODEL, None), ("sql", MODEL), ("poem", MODEL)]
    assert all(m["object"] == "model" and m["owned_by"] for m in models["data"])
    assert models["models"] == [MODEL]  # KServe's: the models its routes serve


def test_a_server_without_adapters_refuses_any():
    plain = FakeEngine()
    with serving(served_app(plain)) as url:
        lmi = httpx.post(f"{url}/invocations", json={"inputs": "hi", "adapters": "sql"})
        assert lmi.status_code == 404 and "(it serves none)" in lmi.text
        tgi = httpx.post(f"{url}/generate", json={"inputs": "hi",
                                                  "parameters": {"adapter_id": "sql"}})
        assert tgi.status_code == 404
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]
    batched = FakeEngine()
    with serving(served_app(batched, dynamic=(2, 10, False))) as url:  # LMI's dynamic batching
        dynamic = httpx.post(f"{url}/invocations", json={"inputs": ["a", "b"], "adapters": "x"})
        assert dynamic.status_code == 404 and "adapters: 'x' is neither" in dynamic.text
    assert not plain.requests and not batched.requests
