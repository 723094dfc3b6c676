"""The page's routes over HTTP (tests/e2e/test_page.py drives it in a browser): `GET /ui`, and
`GET /` when a browser asks for HTML, while every other request to `/` is TGI's as before; its
files open with an API key set; `option.enable_ui=false` turning it off from each source."""

from __future__ import annotations

import httpx
import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from handlers import cli
from handlers.config import ConfigError, load_config, parse_args
from handlers.djl.settings import check_djl_effects

KEY = "page-s3cret"
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # Chromium's


def config_of(tmp_path, *argv: str, env: dict[str, str] | None = None):
    return load_config(parse_args(["--model-dir", str(tmp_path), *argv]), env=env or {})


def is_tgi_health(response: httpx.Response) -> bool:
    return response.status_code == 200 and response.content == b""


def test_a_browser_gets_the_page_at_the_root_and_at_ui(url):
    for path in ("/", "/ui"):
        page = httpx.get(url + path, headers={"Accept": BROWSER})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="ui/app.js"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{url}/ui").text == page.text  # /ui needs no Accept


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "text/html;q=0",
                                    "text/plain, text/*"])
def test_other_clients_get_tgis_health_at_the_root(url, accept):
    headers = {"Accept": accept} if accept else {}
    assert is_tgi_health(httpx.get(f"{url}/", headers=headers))


def test_tgis_post_root_is_unchanged_whatever_it_accepts(url):
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 2}}
    answer = httpx.post(f"{url}/", json=body, headers={"Accept": BROWSER})
    assert answer.status_code == 200 and answer.json() == [{"generated_text": "a b a b"}]
    assert answer.json() == httpx.post(f"{url}/", json=body).json()


def test_an_unhealthy_server_still_says_so_at_the_root_and_still_serves_the_page():
    with serving(served_app(FakeEngine(), loaded=False)) as url:
        assert httpx.get(f"{url}/").status_code == 503
        assert httpx.get(f"{url}/", headers={"Accept": BROWSER}).status_code == 200


def test_the_pages_files_are_served_and_nothing_else_under_ui(url):
    script = httpx.get(f"{url}/ui/app.js")
    assert script.status_code == 200 and "text/javascript" in script.headers["content-type"]
    assert httpx.get(f"{url}/ui/style.css").headers["content-type"].startswith("text/css")
    for name in ("page.py", "__init__.py", "..%2Fpage.py", "index.html.bak"):
        missing = httpx.get(f"{url}/ui/{name}")
        assert missing.status_code == 404, name
        assert "handlers" not in missing.text  # never where the server keeps its files


def test_the_pages_files_are_open_with_an_api_key_and_the_rest_is_not():
    """They hold nothing of the server's: a browser loads them, then the page asks for the key
    (a navigation cannot send one)."""
    with serving(served_app(FakeEngine(), api_key=KEY)) as url:
        for path in ("/ui", "/ui/app.js", "/ui/style.css"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.get(url + "/", headers={"Accept": BROWSER}).status_code == 200
        assert httpx.get(f"{url}/config").status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401


@pytest.mark.parametrize(("argv", "env", "source"), [
    (["--option", "option.enable_ui=false"], {}, "command line"),
    ([], {"OPTION_ENABLE_UI": "false"}, "env OPTION_ENABLE_UI"),
])
def test_enable_ui_false_turns_the_page_off(tmp_path, argv, env, source):
    config = config_of(tmp_path, *argv, env=env)
    assert (config.enable_ui, config.sources["enable_ui"]) == (False, source)
    settings = cli.server_settings(config)
    with serving(served_app(FakeEngine(), enable_ui=settings.enable_ui)) as url:
        assert httpx.get(f"{url}/ui").status_code == 404
        assert httpx.get(f"{url}/ui/app.js").status_code == 404
        assert is_tgi_health(httpx.get(f"{url}/", headers={"Accept": BROWSER}))
        assert httpx.get(f"{url}/config").status_code == 200  # an API route, not the page's


def test_enable_ui_is_on_by_default_and_refused_where_the_djl_entry_serves(tmp_path):
    assert config_of(tmp_path).enable_ui is True
    with pytest.raises(ConfigError, match="option.enable_ui=False would have no effect"):
        check_djl_effects(config_of(tmp_path, "--option", "option.enable_ui=false"))
