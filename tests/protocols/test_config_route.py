"""`GET /config`: the served model and every effective setting with where it came from, as
startup reads and logs them (real configuration lines here, over the FakeEngine), behind the
API key and never showing the key."""

from __future__ import annotations

import httpx
import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.config import config_lines, load_config, parse_args

KEY = "config-s3cret"


def config_of(tmp_path, *argv: str):
    (tmp_path / "serving.properties").write_text("option.max_rolling_batch_size=8\n")
    return load_config(parse_args(["--model-dir", str(tmp_path), *argv]), env={})


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    config = config_of(tmp_path_factory.mktemp("model"), "--option", "option.max_model_len=64")
    return served_app(FakeEngine(), configuration=tuple(config_lines(config)))


def test_config_reports_the_model_and_each_value_with_its_source(url):
    described = httpx.get(f"{url}/config").json()
    assert (described["model"], described["dtype"], described["device"]) == (
        "fake-model", "float32", "cpu")
    assert described["quantization"] == "none" and described["ready"] is True
    settings = {s["key"]: s for s in described["settings"]}
    assert (settings["option.max_rolling_batch_size"]["value"],
            settings["option.max_rolling_batch_size"]["source"]) == ("8", "serving.properties")
    assert settings["option.max_model_len"]["source"] == "command line"
    assert settings["option.dtype"]["source"] == "default"


def test_config_with_an_api_key(tmp_path):
    config = config_of(tmp_path, "--api-key", KEY)
    app = served_app(FakeEngine(), api_key=KEY, configuration=tuple(config_lines(config)))
    with serving(app) as url:
        refused = httpx.get(f"{url}/config")
        assert refused.status_code == 401 and "API key" in refused.json()["error"]
        described = httpx.get(f"{url}/config", headers={"Authorization": f"Bearer {KEY}"})
        assert described.status_code == 200 and KEY not in described.text
        shown = {s["key"]: s for s in described.json()["settings"]}["option.api_key"]
        assert (shown["value"], shown["source"]) == ("<set>", "command line --api-key")
