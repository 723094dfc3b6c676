"""Models from S3 (`option.model_id=s3://bucket/prefix`), fetched with boto3 from a moto S3
server into the cache directory: a whole copy or none, reused while the objects are unchanged,
served from the cache when S3 cannot be reached, and a clear startup error otherwise. An object
key or a URI that would put a file outside the cache fails the fetch, naming it, with nothing
written: at startup, through `POST /models` and through the adapter routes. Those routes fetch
only with option.allow_runtime_fetch=true, and an adapter route with LoRA off refuses before
S3 is asked."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from fakes import FakeEngine, served_app
from moto.server import ThreadedMotoServer
from server_process import free_port, running_server, serving

from handlers.model_fetch import MANIFEST, FetchError, fetch_s3
from handlers.model_source import ModelSourceError, model_files_in, resolve_model_source
from handlers.server.fleet import Fleet

URI = "s3://models/tiny-model"
# Keys whose `..` segments climb from the download's staging folder
# (<tmp>/cache/s3/models/.<prefix>.XXXX) to the test's own <tmp>: each names a file there.
CLIMBING = {"evil-model": "evil-model/../../../../escaped.txt",
            "evil-adapter": "evil-adapter/../../../../escaped.txt"}


@pytest.fixture(scope="module")
def s3_env(tiny_dir) -> Iterator[dict[str, str]]:
    """A moto S3 server holding the tiny model under s3://models/tiny-model/."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")
    client.create_bucket(Bucket="models")
    for path in sorted(tiny_dir.iterdir()):
        client.upload_file(str(path), "models", f"tiny-model/{path.name}")
        client.upload_file(str(path), "models", f"evil-model/{path.name}")
    for adapter in ("evil-adapter", "good-adapter"):
        client.put_object(Bucket="models", Key=f"{adapter}/adapter_config.json",
                          Body=b'{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    for key in (*CLIMBING.values(), "../../../outside/notes.txt"):
        client.put_object(Bucket="models", Key=key, Body=b"written outside the cache")
    try:
        yield env
    finally:
        server.stop()


@pytest.fixture
def aws(s3_env, monkeypatch, tmp_path) -> Path:
    """This process talks to the moto server; the cache is a fresh directory."""
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LMI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_objects_become_a_loadable_model_directory(aws, tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="handlers.model_fetch"):
        source = resolve_model_source(URI, tiny_dir.parent)
    assert source == aws / "s3" / "models" / "tiny-model" and model_files_in(source) == source
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert sorted(p.name for p in source.iterdir() if p.name != MANIFEST) == files
    assert ((source / "model.safetensors").read_bytes()
            == (tiny_dir / "model.safetensors").read_bytes())
    assert f"fetching {URI}: {len(files)} of {len(files)} files" in caplog.text


def test_an_unchanged_copy_is_reused_and_a_changed_one_fetched_again(aws, s3_env, tiny_dir, caplog):
    first = fetch_s3(URI)
    with caplog.at_level(logging.INFO, logger="handlers.model_fetch"):
        assert fetch_s3(URI) == first
    assert "cached in" in caplog.text and "fetching" not in caplog.text
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    client.put_object(Bucket="models", Key="tiny-model/notes.txt", Body=b"v2")
    try:
        assert (fetch_s3(URI) / "notes.txt").read_bytes() == b"v2"
    finally:
        client.delete_object(Bucket="models", Key="tiny-model/notes.txt")


def test_a_cached_copy_serves_when_s3_cannot_be_reached(aws, monkeypatch, caplog):
    fetched = fetch_s3(URI)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with caplog.at_level(logging.WARNING, logger="handlers.model_fetch"):
        assert fetch_s3(URI) == fetched
    assert "serving the cached copy" in caplog.text


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://no-such-bucket/model", "option.model_id s3://no-such-bucket/model: cannot list it"),
    ("s3://models/nothing-here", "option.model_id s3://models/nothing-here: no objects under it"),
])
def test_a_source_that_cannot_be_fetched_is_named(aws, tmp_path, uri, message):
    with pytest.raises(ModelSourceError, match=message):
        resolve_model_source(uri, tmp_path)


def test_a_download_that_fails_midway_leaves_no_model_behind(aws, monkeypatch):
    real = boto3.client

    def failing_client(*args, **kwargs):
        client = real(*args, **kwargs)
        download = client.download_file
        calls = []

        def download_file(*a, **k):
            calls.append(a)
            if len(calls) == 2:
                raise OSError("disk full")
            return download(*a, **k)

        client.download_file = download_file
        return client

    monkeypatch.setattr(boto3, "client", failing_client)
    with pytest.raises(FetchError, match="the download failed"):
        fetch_s3(URI)
    bucket_dir = aws / "s3" / "models"
    assert not any(bucket_dir.iterdir())  # no half copy, no staging directory


@pytest.mark.e2e
def test_the_server_serves_a_model_from_s3(s3_env, tmp_path):
    env = {**s3_env, "LMI_CACHE_DIR": str(tmp_path / "cache")}
    options = (f"option.model_id={URI}", "option.embedding_model_id=none")
    with running_server(*options, env=env, log_path=tmp_path / "server.log") as url:
        models = httpx.get(f"{url}/v1/models").json()["models"]
        answer = httpx.post(f"{url}/invocations", timeout=60, json={
            "inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}})
    assert models == ["tiny-model"]
    assert answer.status_code == 200 and answer.json()["generated_text"]
    assert f"fetching {URI}" in (tmp_path / "server.log").read_text()


@pytest.mark.e2e
def test_a_missing_bucket_stops_startup_naming_it(s3_env, tmp_path):
    env = {**s3_env, "LMI_CACHE_DIR": str(tmp_path / "cache"), "AWS_MAX_ATTEMPTS": "1"}
    argv = [sys.executable, "-m", "handlers.cli", "--port", str(free_port()), "--grpc-port", "0",
            "--option", "option.model_id=s3://no-such-bucket/model",
            "--option", "option.embedding_model_id=none"]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "option.model_id s3://no-such-bucket/model: cannot list it" in done.stdout


def test_an_adapter_named_by_an_s3_uri_is_fetched_into_the_cache(aws, s3_env, tmp_path):
    """option.lora_modules=name=s3://…: the adapter is fetched as a model is, then read from
    the cache like a local one; one that cannot be fetched stops startup naming it."""
    from handlers.config import ConfigError, load_config, parse_args

    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")
    client.put_object(Bucket="models", Key="adapters/poem/adapter_config.json",
                      Body=b'{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    client.put_object(Bucket="models", Key="adapters/poem/adapter_model.safetensors", Body=b"")

    def configured(uri: str):
        argv = ["--model-dir", str(tmp_path), "--option", f"option.lora_modules=poem={uri}"]
        return load_config(parse_args(argv), env={})

    [adapter] = configured("s3://models/adapters/poem").adapters
    assert adapter.path == aws / "s3" / "models" / "adapters" / "poem" and adapter.rank == 8
    assert adapter.source.endswith("fetched from s3://models/adapters/poem")
    with pytest.raises(ConfigError, match=r"LoRA adapter 'poem' \(s3://nowhere/x, "):
        configured("s3://nowhere/x")


def files_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_a_key_climbing_out_of_the_cache_fails_the_fetch_and_writes_nothing(aws, tmp_path):
    with pytest.raises(FetchError, match=re.escape(
            f"s3://models/evil-model: the object key {CLIMBING['evil-model']!r} would be written "
            "outside its folder in the cache; nothing was fetched")):
        fetch_s3("s3://models/evil-model")
    assert not (tmp_path / "escaped.txt").exists()
    assert files_in(aws) == []  # not one of the model's good files either


@pytest.mark.parametrize("uri", ["s3://models/../../../outside", "s3://models//outside",
                                 "s3://../models"])
def test_a_uri_whose_prefix_or_bucket_climbs_out_is_refused_unfetched(aws, tmp_path, uri):
    with pytest.raises(FetchError, match=re.escape(
            f"{uri}: its bucket and prefix name no folder inside the cache")):
        fetch_s3(uri)
    assert not (tmp_path / "outside").exists() and files_in(aws) == []


@pytest.mark.e2e
def test_a_climbing_key_stops_startup_naming_it(s3_env, tmp_path):
    env = {**s3_env, "LMI_CACHE_DIR": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "handlers.cli", "--port", str(free_port()), "--grpc-port", "0",
            "--option", "option.model_id=s3://models/evil-model",
            "--option", "option.embedding_model_id=none"]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert (f"option.model_id s3://models/evil-model: the object key "
            f"{CLIMBING['evil-model']!r} would be written outside") in done.stdout + done.stderr
    assert not (tmp_path / "escaped.txt").exists() and files_in(tmp_path / "cache") == []


@contextlib.contextmanager
def managing(engine: FakeEngine, cache: Path, **settings) -> Iterator[str]:
    """A server over `engine` that loads models at runtime (FakeEngines, by name) and takes
    adapters, from the folder that holds `cache`."""
    fleet = Fleet(lambda name, path: FakeEngine(model_name=name))
    root = cache.parent
    with serving(served_app(engine, fleet=fleet, model_dir=root, adapter_roots=(root,),
                            model_roots=(root,), **settings)) as url:
        yield url


@pytest.fixture
def management(aws) -> Iterator[tuple[str, FakeEngine]]:
    """A server over a FakeEngine that may fetch models and adapters at runtime."""
    engine = FakeEngine()
    with managing(engine, aws, runtime_fetch=True) as url:
        yield url, engine


def s3_calls(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The requests the moto server answered (werkzeug's access lines)."""
    return [r.getMessage() for r in caplog.records if r.name == "werkzeug"]


def test_the_management_routes_refuse_a_climbing_key_naming_it(management, aws, tmp_path):
    url, engine = management
    model = httpx.post(f"{url}/models", timeout=60,
                       json={"model_name": "evil", "url": "s3://models/evil-model"})
    adapter = httpx.post(f"{url}/adapters", timeout=60,
                         params={"name": "evil", "src": "s3://models/evil-adapter"})
    vllm = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "evil", "lora_path": "s3://models/evil-adapter"})
    for answer, message, key in ((model, model.json().get("message"), "evil-model"),
                                 (adapter, adapter.json().get("message"), "evil-adapter"),
                                 (vllm, vllm.json()["error"]["message"], "evil-adapter")):
        assert answer.status_code == 400, answer.text
        assert f"the object key {CLIMBING[key]!r} would be written outside" in message
        assert str(tmp_path) not in answer.text
    assert not (tmp_path / "escaped.txt").exists() and files_in(aws) == []
    assert engine.adapters == () and httpx.get(f"{url}/models").json() == {"models": []}


def test_runtime_fetches_are_off_by_default_and_refused_before_s3_is_asked(aws, caplog):
    caplog.set_level(logging.INFO, logger="werkzeug")
    engine = FakeEngine()
    with managing(engine, aws) as url:
        model = httpx.post(f"{url}/models", json={"model_name": "m", "url": URI})
        adapter = httpx.post(f"{url}/models/fake-model/adapters",
                             params={"name": "a", "src": "s3://models/good-adapter"})
        vllm = httpx.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": "s3://models/good-adapter"})
    off = "names no local directory, and fetching from S3 at runtime is off " \
          "(option.allow_runtime_fetch=false)"
    assert (model.status_code, model.json()) == (400, {
        "code": 400, "type": "BadRequestException", "message": f"url={URI!r} {off}"})
    assert (adapter.status_code, adapter.json()["message"]) == (
        400, f"src='s3://models/good-adapter' {off}")
    assert (vllm.status_code, vllm.json()["error"]["message"]) == (
        400, f"lora_path='s3://models/good-adapter' {off}")
    assert s3_calls(caplog) == [] and not aws.exists()
    assert engine.adapters == ()


def test_with_lora_off_an_adapter_is_refused_before_s3_is_asked(aws, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="werkzeug")
    with managing(FakeEngine(lora=False), aws, runtime_fetch=True) as url:
        djl = httpx.post(f"{url}/adapters", params={"name": "a", "src": "s3://models/evil-adapter"})
        vllm = httpx.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": "a", "lora_path": "s3://models/evil-adapter"})
    off = "LoRA is off: set option.enable_lora=true to register adapters"
    assert (djl.status_code, djl.json()["message"]) == (400, off)
    assert (vllm.status_code, vllm.json()["error"]["message"]) == (400, off)
    assert s3_calls(caplog) == [] and not aws.exists()
    assert not (tmp_path / "escaped.txt").exists()


def test_with_option_allow_runtime_fetch_models_and_adapters_come_from_s3(management, aws):
    url, engine = management
    model = httpx.post(f"{url}/models", timeout=60, json={"model_name": "m", "url": URI})
    adapter = httpx.post(f"{url}/adapters", timeout=60,
                         params={"name": "a", "src": "s3://models/good-adapter"})
    assert model.status_code == 200 and adapter.status_code == 200, (model.text, adapter.text)
    assert (aws / "s3" / "models" / "tiny-model" / "model.safetensors").is_file()
    assert (aws / "s3" / "models" / "good-adapter" / "adapter_config.json").is_file()
    assert httpx.post(f"{url}/models/m/invoke", json={"inputs": "a"}).status_code == 200
    assert engine.adapters == ("a",)


@pytest.mark.e2e
def test_a_real_server_fetches_at_runtime_with_option_allow_runtime_fetch(s3_env, tiny_dir,
                                                                          tmp_path, caplog):
    """The key, set in serving.properties' way, reaches the routes of a real server: a model
    comes from S3 through POST /models; a climbing key is refused naming it, writing nothing;
    an adapter is refused before S3 is asked while the torch engine's LoRA is off."""
    caplog.set_level(logging.INFO, logger="werkzeug")
    cache = tmp_path / "cache"
    options = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
               "option.allow_runtime_fetch=true", "option.dtype=fp32")
    with running_server(*options, env={**s3_env, "LMI_CACHE_DIR": str(cache)},
                        log_path=tmp_path / "server.log") as url:
        before = len(s3_calls(caplog))
        adapter = httpx.post(f"{url}/adapters", params={"name": "a", "src": "s3://models/x"})
        assert len(s3_calls(caplog)) == before
        evil = httpx.post(f"{url}/models", timeout=120,
                          json={"model_name": "evil", "url": "s3://models/evil-model"})
        loaded = httpx.post(f"{url}/models", timeout=300, json={"model_name": "m", "url": URI})
        invoked = httpx.post(f"{url}/models/m/invoke", timeout=120, json={
            "inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert (adapter.status_code, adapter.json()["message"]) == (
        400, "LoRA is off: set option.enable_lora=true to register adapters")
    assert evil.status_code == 400
    assert f"the object key {CLIMBING['evil-model']!r} would be written" in evil.json()["message"]
    assert not (tmp_path / "escaped.txt").exists()
    assert loaded.status_code == 200, loaded.text
    assert invoked.status_code == 200 and invoked.json()["generated_text"]
