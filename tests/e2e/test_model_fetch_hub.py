"""Models from the Hugging Face Hub (`option.model_id=org/name`), fetched with the real
huggingface_hub from a local stand-in of the Hub's endpoints (hub_standin.py) into a temporary
HF cache: downloaded once, served from the cache when the Hub cannot be reached, and a startup
error naming the id for a missing repo or revision, or when nothing is cached."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_standin import FakeRepo, HubStandIn, point_hub_client_at, serving_hub, use_hub_cache
from huggingface_hub import constants
from server_process import free_port, running_server

from handlers.config import ConfigError, check_effects, load_config, parse_args
from handlers.model_source import ModelSourceError, model_files_in, resolve_model_source

REPO = "org/tiny-llama"


@pytest.fixture(scope="module")
def standin(tiny_dir) -> Iterator[HubStandIn]:
    with serving_hub(FakeRepo(REPO, tiny_dir)) as hub:
        yield hub


@pytest.fixture
def hub(standin, monkeypatch, tmp_path) -> HubStandIn:
    """This process talks to the stand-in, with a fresh HF cache and no downloads seen yet."""
    point_hub_client_at(monkeypatch, standin.url)
    use_hub_cache(monkeypatch, tmp_path / "hf")
    standin.downloads.clear()
    return standin


def unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    point_hub_client_at(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nobody there


def test_a_hub_id_is_downloaded_into_the_hf_cache(hub, tiny_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="handlers.model_fetch"):
        source = resolve_model_source(REPO, tmp_path)
    snapshots = tmp_path / "hf" / "hub" / "models--org--tiny-llama" / "snapshots"
    assert source == snapshots.resolve() / hub.repos[REPO].sha
    assert model_files_in(source) == source
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert sorted(p.name for p in source.iterdir()) == files
    assert sorted(hub.downloads) == [f"{REPO}/{name}" for name in files]
    assert ((source / "model.safetensors").read_bytes()
            == (tiny_dir / "model.safetensors").read_bytes())
    assert f"fetching {REPO}: 1 of {len(files)} files" in caplog.text
    assert f"fetching {REPO}: {len(files)} of {len(files)} files" in caplog.text


def test_the_progress_lines_count_files(hub, tiny_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="handlers.model_fetch"):
        resolve_model_source(REPO, tmp_path)
    totals = set(re.findall(rf"fetching {REPO}: \d+ of (\S+) files", caplog.text))
    assert totals == {str(len(list(tiny_dir.iterdir())))}


def test_a_second_start_downloads_nothing_again(hub, tmp_path):
    first = resolve_model_source(REPO, tmp_path)
    hub.downloads.clear()
    assert resolve_model_source(REPO, tmp_path) == first
    assert hub.downloads == []


def test_a_cached_snapshot_serves_when_the_hub_cannot_be_reached(hub, monkeypatch, tmp_path,
                                                                 caplog):
    first = resolve_model_source(REPO, tmp_path)
    unreachable(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="handlers.model_fetch"):
        assert resolve_model_source(REPO, tmp_path) == first
    assert "serving the cached snapshot" in caplog.text


def test_a_cached_snapshot_serves_offline(hub, monkeypatch, tmp_path):
    first = resolve_model_source(REPO, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, read at import
    hub.downloads.clear()
    assert resolve_model_source(REPO, tmp_path) == first
    assert hub.downloads == []


def test_a_revision_by_commit_sha(hub, tmp_path):
    sha = hub.repos[REPO].sha
    source = resolve_model_source(REPO, tmp_path, revision=sha)
    assert source.name == sha and model_files_in(source) == source


@pytest.mark.parametrize(("model_id", "revision", "where"), [
    (REPO, "v9", f"{REPO}@v9"),
    (REPO, "0" * 40, f"{REPO}@{'0' * 40}"),
    ("org/no-such-model", None, "org/no-such-model"),
])
def test_a_missing_repo_or_revision_is_named(hub, tmp_path, model_id, revision, where):
    with pytest.raises(ModelSourceError, match=f"option.model_id {where}: the Hugging Face Hub "
                       "has no such model or revision"):
        resolve_model_source(model_id, tmp_path, revision=revision)
    assert hub.downloads == []


def test_nothing_cached_and_the_hub_unreachable_is_named(hub, monkeypatch, tmp_path):
    unreachable(monkeypatch)
    with pytest.raises(ModelSourceError, match=f"option.model_id {REPO}: cannot download it "
                       "from the Hugging Face Hub and no copy is cached"):
        resolve_model_source(REPO, tmp_path)


def test_a_file_name_climbing_out_of_the_snapshot_fails_before_any_download(
        hub, tiny_dir, tmp_path, monkeypatch):
    """huggingface_hub refuses a `..` file name only as it downloads that file, the others
    written already: the listing is checked first, so the fetch writes nothing and names it."""
    planted = tmp_path / "planted.json"
    planted.write_text("{}")
    crafted = FakeRepo("org/crafted", tiny_dir, extra={"../../../../escaped.json": planted})
    with serving_hub(crafted) as crafted_hub:
        point_hub_client_at(monkeypatch, crafted_hub.url)
        with pytest.raises(ModelSourceError, match=re.escape(
                "option.model_id org/crafted: the file '../../../../escaped.json' would be "
                "written outside its folder in the cache; nothing was fetched")):
            resolve_model_source("org/crafted", tmp_path)
        assert crafted_hub.downloads == []
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file()]
    assert not list(tmp_path.rglob("escaped.json"))


@pytest.mark.parametrize("model_id", ["a/..", "org/a--b"])
def test_an_id_the_hub_cannot_name_is_refused_unasked(hub, tmp_path, model_id):
    with pytest.raises(ModelSourceError, match=re.escape(
            f"option.model_id {model_id}: not a Hugging Face Hub id")):
        resolve_model_source(model_id, tmp_path)
    assert hub.downloads == []


def check_revision_with(model_id: str, model_dir: Path) -> None:
    args = parse_args(["--model-dir", str(model_dir), "--option", f"option.model_id={model_id}",
                       "--option", "option.revision=main"])
    check_effects(load_config(args, env={}))


def test_option_revision_is_accepted_for_a_hub_id_only(tiny_dir, tmp_path):
    check_revision_with(REPO, tmp_path)
    with pytest.raises(ConfigError, match="option.revision"):
        check_revision_with(str(tiny_dir), tmp_path)


@pytest.mark.e2e
def test_the_server_serves_a_model_from_the_hub(standin, tmp_path):
    env = {"HF_ENDPOINT": standin.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    options = (f"option.model_id={REPO}", "option.embedding_model_id=none")
    with running_server(*options, env=env, log_path=tmp_path / "server.log") as url:
        models = httpx.get(f"{url}/v1/models").json()["models"]
        answer = httpx.post(f"{url}/invocations", timeout=60, json={
            "inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}})
    assert models == ["tiny-llama"]
    assert answer.status_code == 200 and answer.json()["generated_text"]
    assert f"fetching {REPO}" in (tmp_path / "server.log").read_text()


@pytest.mark.e2e
def test_a_missing_hub_id_stops_startup_naming_it(standin, tmp_path):
    env = {"HF_ENDPOINT": standin.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    argv = [sys.executable, "-m", "handlers.cli", "--port", str(free_port()), "--grpc-port", "0",
            "--option", "option.model_id=org/no-such-model",
            "--option", "option.embedding_model_id=none"]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "option.model_id org/no-such-model: the Hugging Face Hub has no such model" in (
        done.stdout)  # logs go to stdout
