"""The adapter management API, its shapes and its guards, over the FakeEngine (which serves
any adapter it is given like the base model; the torch engine loads them for real in
tests/e2e/test_lora.py): DJL Serving's `/models/{m}/adapters` routes and `/adapters` short form,
vLLM's load/unload routes, the roots a source must lie in, the API key and the body limit; a
Hub id fetched (from a stand-in of the Hub) only with option.allow_runtime_fetch, and nothing
read or asked while LoRA is off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from fakes import FakeEngine, served_app
from hub_standin import FakeRepo, HubStandIn, point_hub_client_at, serving_hub, use_hub_cache
from server_process import serving

MODEL = "fake-model"
KEY = "management-key"


def adapter_dir(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    return folder


@pytest.fixture
def roots(tmp_path) -> tuple[Path, Path]:
    """(the model directory, a directory outside every root)."""
    return tmp_path / "model", tmp_path / "elsewhere"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(adapters=("sql",))


@pytest.fixture
def url(engine, roots):
    model_dir, _ = roots
    model_dir.mkdir()
    app = served_app(engine, model_dir=model_dir, adapter_roots=(model_dir,),
                     max_request_size=4096)
    with serving(app) as base:
        yield base


def test_register_use_describe_list_update_delete(url, engine, roots):
    model_dir, _ = roots
    src = adapter_dir(model_dir, "poem")
    registered = httpx.post(f"{url}/models/{MODEL}/adapters",
                            params={"name": "poem", "src": str(src)})
    assert (registered.status_code, registered.json()) == (200, {
        "status": "Adapter poem registered"})
    assert engine.adapters == ("sql", "poem")
    answer = httpx.post(f"{url}/invocations", params={"adapter": "poem"},
                        json={"inputs": "a b", "parameters": {"max_new_tokens": 2}})
    assert answer.status_code == 200 and engine.requests[-1].adapter == "poem"
    described = httpx.get(f"{url}/models/{MODEL}/adapters/poem").json()
    assert described == [{"name": "poem", "src": str(src), "pin": False}]
    assert httpx.post(f"{url}/adapters/poem/update", params={"pin": "true"}).json() == {
        "status": "Adapter poem updated"}
    listed = httpx.get(f"{url}/adapters").json()
    assert listed["adapters"][1] == {"name": "poem", "src": str(src), "pin": True}
    assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == [
        MODEL, "sql", "poem"]
    assert httpx.delete(f"{url}/models/{MODEL}/adapters/poem").json() == {
        "status": "Adapter poem unregistered"}
    gone = httpx.post(f"{url}/invocations", params={"adapter": "poem"}, json={"inputs": "a"})
    assert gone.status_code == 404 and "'poem'" in gone.json()["error"]


def test_djl_errors_name_what_is_wrong_in_djls_shape(url, roots):
    model_dir, elsewhere = roots
    missing = httpx.get(f"{url}/adapters/nope")
    assert (missing.status_code, missing.json()) == (404, {
        "code": 404, "type": "ModelNotFoundException", "message": "Adapter nope not found"})
    assert httpx.delete(f"{url}/adapters/nope").status_code == 404
    other = httpx.get(f"{url}/models/other/adapters")
    assert other.json() == {"code": 404, "type": "ModelNotFoundException",
                            "message": "Model not found: other"}
    twice = httpx.post(f"{url}/adapters", params={"name": "sql", "src": str(model_dir)})
    assert twice.status_code == 400 and "'sql' has already been loaded" in twice.text
    unknown = httpx.post(f"{url}/adapters", params={"name": "x", "src": "y", "scale": "2"})
    assert unknown.json()["message"].startswith("unknown parameter 'scale'")
    lazy = httpx.post(f"{url}/adapters", params={"name": "x", "src": "y", "preload": "false"})
    assert "preload=false is not supported" in lazy.json()["message"]


@pytest.mark.parametrize("src", ["/etc", "../elsewhere/a", "{elsewhere}/a", "{model}/link"])
def test_a_source_outside_the_allowed_roots_is_refused(url, engine, roots, src):
    """The API must not read arbitrary files: a path outside the roots, one climbing out of
    the model directory, and a symlink inside it pointing out are all refused."""
    model_dir, elsewhere = roots
    adapter_dir(elsewhere, "a")
    (model_dir / "link").symlink_to(elsewhere / "a")
    src = src.format(elsewhere=elsewhere, model=model_dir)
    refused = httpx.post(f"{url}/adapters", params={"name": "x", "src": src})
    assert refused.status_code == 400
    assert "is outside the directories adapters may be read from" in refused.json()["message"]
    assert engine.adapters == ("sql",)


@pytest.mark.parametrize(("src", "problem"), [
    ("/etc", "src='/etc' is outside the directories adapters may be read from"),
    ("../elsewhere/a", "src='../elsewhere/a' is outside the directories adapters may be read "
                       "from"),
    ("loop", "src='loop' is no usable path (it does not resolve: a symlink loop, or the home "
             "of no user)"),
    ("a/..", "src: a/..: not a Hugging Face Hub id"),
])
def test_refusals_name_what_the_client_sent_never_a_server_path(url, engine, roots, src,
                                                                 problem):
    """A 400 in each dialect naming the `src` as sent: not the roots it may be read from, not
    the path it resolved to (a symlink loop's message names it), not a traceback's 500."""
    model_dir, elsewhere = roots
    adapter_dir(elsewhere, "a")
    (model_dir / "loop").symlink_to(model_dir / "loop")
    djl, vllm = register(url, src)
    assert djl.status_code == vllm.status_code == 400, (djl.text, vllm.text)
    assert djl.json()["message"].startswith(problem)
    assert vllm.json()["error"]["message"].startswith(problem.replace("src", "lora_path", 1))
    for answer in (djl, vllm):
        assert str(model_dir.parent) not in answer.text
    assert engine.adapters == ("sql",)


def test_vllms_load_and_unload_routes(url, engine, roots):
    model_dir, _ = roots
    src = adapter_dir(model_dir, "poem")
    loaded = httpx.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "poem", "lora_path": str(src)})
    assert (loaded.status_code, loaded.text) == (
        200, "Success: LoRA adapter 'poem' added successfully.")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    assert client.completions.create(model="poem", prompt="a b", max_tokens=2).model == "poem"
    again = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": "poem", "lora_path": str(src)})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'poem' has already been loaded."
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem"})
    assert unloaded.text == "Success: LoRA adapter 'poem' removed successfully."
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'poem' cannot be found."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poem", prompt="a b", max_tokens=2)


def test_a_vllm_body_over_the_limit_is_413(url):
    padded = {"lora_name": "x", "lora_path": "y", "padding": "x" * 8192}
    response = httpx.post(f"{url}/v1/load_lora_adapter", content=orjson.dumps(padded))
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert message == "request body is larger than the limit of 4096 bytes"


def test_the_management_routes_require_the_api_key(engine, roots):
    model_dir, _ = roots
    model_dir.mkdir()
    src = adapter_dir(model_dir, "poem")
    app = served_app(engine, api_key=KEY, model_dir=model_dir, adapter_roots=(model_dir,))
    with serving(app) as base:
        for method, path, kwargs in (
                ("POST", "/adapters", {"params": {"name": "poem", "src": str(src)}}),
                ("GET", f"/models/{MODEL}/adapters", {}),
                ("DELETE", "/adapters/sql", {}),
                ("POST", "/v1/load_lora_adapter",
                 {"json": {"lora_name": "poem", "lora_path": str(src)}})):
            assert httpx.request(method, base + path, **kwargs).status_code == 401, path
        assert engine.adapters == ("sql",)
        keyed = httpx.post(f"{base}/adapters", params={"name": "poem", "src": str(src)},
                           headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200 and engine.adapters == ("sql", "poem")


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Iterator[HubStandIn]:
    """A stand-in of the Hub holding the adapter `org/poem-lora`, with a fresh HF cache."""
    with serving_hub(FakeRepo("org/poem-lora", adapter_dir(tmp_path / "repo", "poem"))) as hub:
        point_hub_client_at(monkeypatch, hub.url)
        use_hub_cache(monkeypatch, tmp_path / "hf")
        yield hub


def register(url: str, src: str) -> tuple[httpx.Response, httpx.Response]:
    """(DJL's registration, vLLM's load) of `src`."""
    djl = httpx.post(f"{url}/adapters", params={"name": "poem", "src": src}, timeout=60)
    vllm = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "poem", "lora_path": src})
    return djl, vllm


def test_a_hub_id_is_fetched_only_with_option_allow_runtime_fetch(engine, roots, hub):
    model_dir, _ = roots
    model_dir.mkdir()
    with serving(served_app(engine, model_dir=model_dir, adapter_roots=(model_dir,))) as url:
        djl, vllm = register(url, "org/poem-lora")
    off = ("names no local directory, and fetching from the Hugging Face Hub at runtime is off "
           "(option.allow_runtime_fetch=false)")
    assert (djl.status_code, djl.json()["message"]) == (400, f"src='org/poem-lora' {off}")
    assert (vllm.status_code, vllm.json()["error"]["message"]) == (
        400, f"lora_path='org/poem-lora' {off}")
    assert hub.asked == [] and engine.adapters == ("sql",)
    allowed = FakeEngine()
    with serving(served_app(allowed, model_dir=model_dir, adapter_roots=(model_dir,),
                            runtime_fetch=True)) as url:
        djl, _ = register(url, "org/poem-lora")
    assert djl.status_code == 200, djl.text
    assert hub.downloads == ["org/poem-lora/adapter_config.json"]
    assert allowed.adapters == ("poem",)


def test_with_lora_off_nothing_is_read_or_fetched(roots, hub):
    """LoRA off refuses first: not a Hub call, not a look at the roots."""
    model_dir, elsewhere = roots
    model_dir.mkdir()
    engine = FakeEngine(lora=False)
    with serving(served_app(engine, model_dir=model_dir, adapter_roots=(model_dir,),
                            runtime_fetch=True)) as url:
        answers = [*register(url, "org/poem-lora"), *register(url, str(elsewhere))]
    off = "LoRA is off: set option.enable_lora=true to register adapters"
    assert [a.status_code for a in answers] == [400] * 4
    assert [answers[0].json()["message"], answers[1].json()["error"]["message"],
            answers[2].json()["message"], answers[3].json()["error"]["message"]] == [off] * 4
    assert hub.asked == [] and not (model_dir.parent / "hf").exists()
