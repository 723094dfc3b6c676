"""SageMaker's multi-model endpoint contract, as SageMaker (and a client through boto3's
`TargetModel`) drives it, on a server whose models are FakeEngines: models loaded by name
answer under it on every route that names a model, are listed, described and unloaded; a name
loaded twice is 409, a model that cannot fit is 507, an unloaded one is 404; the least recently
used gives way at option.max_models; each has its own series in /metrics. A Hub id is fetched
(from a stand-in of the Hub) only with option.allow_runtime_fetch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import openai
import pytest
from botocore.config import Config
from fakes import FakeEmbeddingEngine, FakeEngine, served_app
from hub_standin import FakeRepo, point_hub_client_at, serving_hub, use_hub_cache
from server_process import serving

from handlers.server.fleet import OVERHEAD, Fleet

TARGET = "X-Amzn-SageMaker-Target-Model"


class Built:
    """What the fleet built, by name: a FakeEngine each."""

    def __init__(self) -> None:
        self.engines: dict[str, FakeEngine] = {}

    def __call__(self, name: str, path: Path) -> FakeEngine:
        assert (path / "model.safetensors").is_file()
        self.engines[name] = FakeEngine(model_name=name)
        return self.engines[name]


def model_dir(root: Path, name: str, size: int = 1000) -> Path:
    folder = root / name / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a checkpoint's files, as the server asks
    (folder / "model.safetensors").write_bytes(b"\0" * size)
    return folder


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[str, Built, Path]]:
    built = Built()
    fleet = Fleet(built, max_models=2)
    with serving(served_app(FakeEngine(), fleet=fleet, model_roots=(tmp_path,))) as url:
        yield url, built, tmp_path


def load(url: str, name: str, path: Path | str) -> httpx.Response:
    return httpx.post(f"{url}/models", json={"model_name": name, "url": str(path)}, timeout=60)


def test_each_model_answers_under_its_own_name_on_every_route(served):
    url, built, root = served
    for name in ("alpha", "beta"):
        assert load(url, name, model_dir(root, name)).status_code == 200
    listed = httpx.get(f"{url}/models").json()
    assert listed == {"models": [
        {"modelName": "alpha", "modelUrl": str(root / "alpha" / "model"), "ready": True},
        {"modelName": "beta", "modelUrl": str(root / "beta" / "model"), "ready": True}]}
    assert httpx.get(f"{url}/models/beta").json()["modelName"] == "beta"

    invoked = httpx.post(f"{url}/models/alpha/invoke", json={"inputs": "a b"})
    assert invoked.status_code == 200 and len(built.engines["alpha"].requests) == 1
    targeted = httpx.post(f"{url}/invocations", json={"inputs": "a"}, headers={TARGET: "beta"})
    assert targeted.status_code == 200 and len(built.engines["beta"].requests) == 1
    predicted = httpx.post(f"{url}/predictions/alpha", json={"inputs": "a"})
    assert predicted.status_code == 200 and len(built.engines["alpha"].requests) == 2
    runtime = boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x",
                           config=Config(retries={"max_attempts": 1}))
    runtime.invoke_endpoint(EndpointName="mme", TargetModel="alpha",
                            Body=json.dumps({"inputs": "a"}), ContentType="application/json")
    assert len(built.engines["alpha"].requests) == 3
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    answer = chat.chat.completions.create(model="beta", messages=[{"role": "user",
                                                                   "content": "a"}])
    assert answer.model == "beta" and len(built.engines["beta"].requests) == 2
    infer = httpx.post(f"{url}/v2/models/alpha/infer", json={"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]})
    assert infer.json()["model_name"] == "alpha" and len(built.engines["alpha"].requests) == 4
    databricks = httpx.post(f"{url}/serving-endpoints/beta/invocations", json={
        "messages": [{"role": "user", "content": "a"}]})
    assert databricks.status_code == 200 and len(built.engines["beta"].requests) == 3
    names = [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]]
    assert {"fake-model", "alpha", "beta"} <= set(names)
    assert httpx.post(f"{url}/invocations", json={"inputs": "a"}).status_code == 200  # its own


def test_loading_twice_or_what_cannot_fit_is_refused_and_unloaded_is_404(served):
    url, built, root = served
    assert load(url, "alpha", model_dir(root, "alpha")).status_code == 200
    again = load(url, "alpha", root / "alpha" / "model")
    assert again.status_code == 409 and "already loaded" in again.json()["message"]
    assert load(url, "fake-model", root / "alpha" / "model").status_code == 409
    huge = model_dir(root, "huge", size=1)
    with open(huge / "model.safetensors", "r+b") as weights:  # sparse: no disk, no memory
        weights.truncate(1 << 40)  # 1 TiB
    refused = load(url, "huge", huge)
    assert refused.status_code == 507 and "huge" in refused.json()["message"]
    assert "huge" not in built.engines and httpx.get(f"{url}/models/alpha").status_code == 200
    assert httpx.delete(f"{url}/models/alpha").status_code == 200
    assert not built.engines["alpha"].ready  # its engine was shut down
    for gone in (httpx.post(f"{url}/models/alpha/invoke", json={"inputs": "a"}),
                 httpx.post(f"{url}/invocations", json={"inputs": "a"},
                            headers={TARGET: "alpha"}),
                 httpx.get(f"{url}/models/alpha"), httpx.delete(f"{url}/models/alpha")):
        assert gone.status_code == 404
    assert httpx.get(f"{url}/models").json() == {"models": []}


def test_a_model_outside_the_allowed_roots_is_never_read(served, tmp_path_factory):
    url, built, root = served
    elsewhere = model_dir(tmp_path_factory.mktemp("elsewhere"), "x")
    for source in (elsewhere, "/etc", "../../etc"):
        refused = load(url, "x", source)
        assert refused.status_code == 400 and "outside" in refused.json()["message"]
        assert str(root) not in refused.text  # the roots it may be read from are the server's
    assert load(url, "bad/name", elsewhere).status_code == 400
    assert httpx.post(f"{url}/models", json={"model_name": "x"}).status_code == 400
    assert not built.engines


def test_the_least_recently_used_gives_way_at_max_models(served):
    url, built, root = served
    for name in ("alpha", "beta"):
        load(url, name, model_dir(root, name))
    httpx.post(f"{url}/models/alpha/invoke", json={"inputs": "a"})  # beta: least recent
    assert load(url, "gamma", model_dir(root, "gamma")).status_code == 200
    assert [m["modelName"] for m in httpx.get(f"{url}/models").json()["models"]] == \
        ["alpha", "gamma"]


def test_metrics_are_labelled_by_model_and_go_with_it(served):
    url, built, root = served
    load(url, "alpha", model_dir(root, "alpha"))
    httpx.post(f"{url}/models/alpha/invoke", json={"inputs": "a"})
    metrics = httpx.get(f"{url}/metrics").text
    assert 'lmi_finished_requests_total{model="alpha"} 1.0' in metrics
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="alpha"} 1.0' in metrics
    assert 'vllm:num_requests_running{engine="0",model_name="fake-model"}' in metrics
    httpx.delete(f"{url}/models/alpha")
    assert 'model="alpha"' not in httpx.get(f"{url}/metrics").text


def test_memory_is_estimated_from_the_weight_files(tmp_path):
    folder = model_dir(tmp_path, "m", size=4000)
    (folder / "tokenizer.json").write_bytes(b"\0" * 10_000)  # not weights
    from handlers.server.fleet import weights_bytes
    assert weights_bytes(folder) == int(4000 * OVERHEAD)


def test_a_load_body_over_the_size_limit_is_refused(tmp_path):
    with serving(served_app(FakeEngine(), fleet=Fleet(Built()), max_request_size=100,
                            model_roots=(tmp_path,))) as url:
        refused = httpx.post(f"{url}/models", json={"model_name": "m", "url": "x" * 200})
    assert refused.status_code == 413 and "larger than the limit" in refused.json()["message"]


def test_a_hub_model_is_fetched_only_with_option_allow_runtime_fetch(tmp_path, monkeypatch):
    repo = model_dir(tmp_path / "repo", "m")
    with serving_hub(FakeRepo("org/m", repo)) as hub:
        point_hub_client_at(monkeypatch, hub.url)
        use_hub_cache(monkeypatch, tmp_path / "hf")
        built = Built()
        with serving(served_app(FakeEngine(), fleet=Fleet(built), model_roots=(tmp_path,))) as url:
            refused = load(url, "m", "org/m")
        assert (refused.status_code, refused.json()["message"]) == (400, (
            "url='org/m' names no local directory, and fetching from the Hugging Face Hub at "
            "runtime is off (option.allow_runtime_fetch=false)"))
        assert hub.asked == [] and not built.engines
        with serving(served_app(FakeEngine(), fleet=Fleet(built), model_roots=(tmp_path,),
                                runtime_fetch=True)) as url:
            assert load(url, "m", "org/m").status_code == 200
        assert sorted(hub.downloads) == ["org/m/config.json", "org/m/model.safetensors"]
        assert "m" in built.engines


def test_a_folder_without_a_model_is_a_400_naming_the_url(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("no weights here")
    twins = tmp_path / "twins" / "model"
    twins.mkdir(parents=True)
    for name in ("a.gguf", "b.gguf"):
        (twins / name).write_bytes(b"GGUF")
    built = Built()
    with serving(served_app(FakeEngine(), fleet=Fleet(built), model_dir=tmp_path,
                            model_roots=(tmp_path,))) as url:
        empty, several = load(url, "m", "notes"), load(url, "m", "twins/model")
    assert (empty.status_code, empty.json()) == (400, {
        "code": 400, "type": "BadRequestException", "message": "url='notes' holds no model "
        "files (config.json with *.safetensors, or one .gguf file)"})
    assert (several.status_code, several.json()["message"]) == (
        400, "url='twins/model' holds several .gguf files: name one of them")
    assert not built.engines


def test_a_load_failure_names_the_url_not_where_the_server_keeps_it(tmp_path):
    def failing(name: str, path: Path) -> FakeEngine:
        raise ValueError(f"{path / 'config.json'} is no JSON")

    model_dir(tmp_path, "broken")
    with serving(served_app(FakeEngine(), fleet=Fleet(failing), model_dir=tmp_path,
                            model_roots=(tmp_path,))) as url:
        failed = load(url, "m", "broken/model")
    assert (failed.status_code, failed.json()["message"]) == (
        500, "model 'm' failed to load: broken/model/config.json is no JSON")
    assert str(tmp_path) not in failed.text


def test_an_embedding_model_loaded_at_runtime_answers_embeddings_by_its_name(tmp_path):
    """The body's protocol follows the model a request reaches: `input` to an embedding model
    is embeddings (it was answered as a Responses request), a generation body is refused."""
    embedders: dict[str, FakeEmbeddingEngine] = {}

    def build(name: str, path: Path) -> FakeEmbeddingEngine:
        embedders[name] = FakeEmbeddingEngine()
        embedders[name].model_name = name
        return embedders[name]

    with serving(served_app(FakeEngine(), fleet=Fleet(build), model_roots=(tmp_path,))) as url:
        assert load(url, "vectors", model_dir(tmp_path, "vectors")).status_code == 200
        vector = [2.0, 9.0, 0.5, -1.0]  # "hello you": 2 words, 9 characters
        for answer in (
                httpx.post(f"{url}/models/vectors/invoke", json={"input": ["hello you"]}),
                httpx.post(f"{url}/invocations", json={"input": "hello you"},
                           headers={TARGET: "vectors"}),
                httpx.post(f"{url}/v1/embeddings", json={"input": "hello you",
                                                         "model": "vectors"}),
                httpx.post(f"{url}/serving-endpoints/vectors/invocations",
                           json={"input": "hello you"})):
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "vectors"
            assert answer.json()["data"][0]["embedding"] == vector
        kserve = httpx.post(f"{url}/v1/models/vectors:predict", json={"instances": ["hello you"]})
        assert kserve.json() == {"predictions": [vector]}

        lmi = httpx.post(f"{url}/models/vectors/invoke", json={"inputs": "a"})
        chat = httpx.post(f"{url}/models/vectors/invoke", json={
            "messages": [{"role": "user", "content": "a"}]})
        for refused, status in ((lmi, 424), (chat, 400)):  # LMI's and OpenAI's shapes
            assert refused.status_code == status and "is an embedding model" in refused.text
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "vectors", "messages": [{"role": "user", "content": "a"}]})
        assert chat.status_code == 404  # the server's own model answers to its own name only
        assert httpx.post(f"{url}/invocations", json={"inputs": "a"}).status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.delete(f"{url}/models/vectors").status_code == 200
        gone = httpx.post(f"{url}/models/vectors/invoke", json={"input": ["a"]})
        assert gone.status_code == 404
