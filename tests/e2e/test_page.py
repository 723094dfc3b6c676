"""The page (GET /ui, GET / from a browser) driven in Debian's headless Chromium through
Playwright (no browser download: `executable_path`), as a person uses it: the status shows the
served model and where each value came from, refreshed from the server; a chat streams its
answer token by token, its thinking apart and its tool calls as calls; LMI's /invocations tab
shows the exact bodies, and its boto3 code runs; an API key is asked for and a wrong one shows
the server's 401 message. Most run on the FakeEngine's server (deterministic streams: a
`[[stall:K]]` marker holds one in flight); one on the real server, on its own port.

Verdicts come from the DOM's states as the page reaches them and from the engine's own record
of its requests, never from the clock; Playwright's waits time out only against a hang. Each
state is also a screenshot under the test's tmp dir. Skipped, saying why, where Chromium is not
installed (`apt-get install chromium`; .ci/run installs it)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from fakes import FakeEngine, ScriptedEngine, served_app
from optional_deps import need, need_program
from server_process import serving

from handlers.config import config_lines, load_config, parse_args

CHROMIUM = need_program("chromium", "the page's tests drive Debian's headless Chromium: "
                                    "apt-get install chromium")
sync_api = need("playwright.sync_api", "the page's tests drive Chromium through Playwright "
                                       "(the test extra)")
KEY = "page-test-key"
MODEL = "fake-model"
HANG_GUARD_S = 60  # how long a wait on the page or the engine may take before the test fails
expect = sync_api.expect
expect.set_options(timeout=HANG_GUARD_S * 1000)


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


class Visit:
    """One tab on the page: every request it made, every script error it hit, screenshots."""

    def __init__(self, browser: sync_api.Browser, shots: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 900})
        self.context.set_default_timeout(HANG_GUARD_S * 1000)
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.shots = shots

    def shot(self, name: str) -> None:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=path, full_page=True)
        assert path.read_bytes().startswith(b"\x89PNG")

    def fact(self, name: str) -> sync_api.Locator:
        return self.page.locator(f"dd[data-fact='{name}']")

    def setting(self, key: str) -> sync_api.Locator:
        return self.page.locator(f"#config tr[data-key='{key}']")

    def tab(self, name: str) -> None:
        self.page.click(f"[data-tab={name}]")

    def only_reached(self, url: str) -> None:
        """Nothing but the server: no CDN, no other host or port (data: URLs aside)."""
        origin = urlsplit(url)[:2]
        assert [r for r in self.requests if not r.startswith("data:")
                and urlsplit(r)[:2] != origin] == []


@pytest.fixture
def visit(browser, tmp_path) -> Iterator[Visit]:
    opened = Visit(browser, tmp_path)
    yield opened
    opened.context.close()
    assert opened.errors == []  # the page's script never failed


def until(check: Callable[[], bool]) -> None:
    """Return once `check()` holds (the engine's record, read from another thread)."""
    deadline = time.monotonic() + HANG_GUARD_S  # against a hang only
    while not check():
        assert time.monotonic() < deadline, "the awaited event never came"
        time.sleep(0.01)


def configured(tmp_path: Path, *argv: str) -> tuple:
    """Real configuration lines, read as startup reads them."""
    (tmp_path / "serving.properties").write_text("option.max_rolling_batch_size=8\n")
    config = load_config(parse_args(["--model-dir", str(tmp_path), *argv]), env={})
    return tuple(config_lines(config))


# -- status -------------------------------------------------------------------------------------


def test_status_shows_the_served_model_and_where_each_value_came_from(visit, tmp_path):
    engine = FakeEngine()
    app = served_app(engine, configuration=configured(tmp_path, "--option",
                                                      "option.max_model_len=64"))
    with serving(app) as url:
        served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        settings = {s["key"]: s for s in httpx.get(f"{url}/config").json()["settings"]}
        visit.page.goto(f"{url}/")  # a browser's navigation asks for HTML: the page
        expect(visit.page.locator("#model-name")).to_have_text(served)
        expect(visit.fact("dtype")).to_have_text(engine.dtype)
        expect(visit.fact("quantization")).to_have_text(engine.quantization)
        expect(visit.page.locator("#served-models li")).to_have_text([f"{served} (model)"])
        for key in ("option.max_rolling_batch_size", "option.max_model_len", "option.dtype"):
            row = visit.setting(key)
            expect(row.locator("td.value")).to_have_text(settings[key]["value"])
            expect(row.locator("td.source")).to_have_text(settings[key]["source"])
        expect(visit.setting("option.max_rolling_batch_size").locator("td.source")).to_have_text(
            "serving.properties")
        expect(visit.page.locator("#health")).to_have_text("healthy")
        expect(visit.fact("running requests")).to_have_text("0")
        visit.shot("status")
        visit.page.fill("#config-filter", "serving.properties")
        expect(visit.page.locator("#config tbody tr")).to_have_count(1)
        # Refreshed from the server: a chat held in flight is running, then health turns.
        visit.tab("chat")
        visit.page.fill("#max-tokens", "8")
        chat(visit, "a b [[stall:1]]")
        visit.tab("status")
        expect(visit.fact("running requests")).to_have_text("1")
        engine.ready = False
        expect(visit.page.locator("#health")).to_have_text("unhealthy (503)")
        visit.shot("status-unhealthy")
        visit.tab("chat")
        visit.page.click("#stop-button")
        expect(visit.fact("running requests")).to_have_text("0")
        visit.only_reached(url)


# -- chat ---------------------------------------------------------------------------------------


def record_answer_states(page: sync_api.Page) -> None:
    """Keep the last answer's text each time the transcript changes (a MutationObserver)."""
    page.evaluate("""() => {
        window.answerStates = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .content');
            if (answers.length) window.answerStates.push(answers[answers.length - 1].textContent);
        }).observe(document.querySelector('#transcript'),
                   {childList: true, subtree: true, characterData: true});
    }""")


def chat(visit: Visit, text: str) -> sync_api.Locator:
    """Send `text` from the chat tab; the locator of its answer."""
    visit.page.fill("#chat-input", text)
    visit.page.press("#chat-input", "Enter")
    return visit.page.locator(".message.assistant").last


def test_a_chat_streams_its_answer_token_by_token(visit):
    engine = FakeEngine()
    with serving(served_app(engine)) as url:
        visit.page.goto(f"{url}/ui")
        visit.tab("chat")
        visit.page.fill("#max-tokens", "16")
        record_answer_states(visit.page)
        answer = chat(visit, "alpha beta gamma [[stall:3]]")  # 3 tokens, then held in flight
        content = answer.locator(".content")
        expect(content).to_have_text(" <|user|> alpha beta")
        # The DOM holds part of the answer while the engine still generates it.
        (request,) = engine.requests
        assert request.request_id not in engine.finished + engine.aborted
        assert answer.get_attribute("data-state") == "streaming"
        seen = visit.page.evaluate("window.answerStates")
        states = [text for i, text in enumerate(seen) if text and text not in seen[:i]]
        assert states == [" <|user|>", " <|user|> alpha", " <|user|> alpha beta"]  # one by one
        visit.shot("chat-streaming")
        visit.page.click("#stop-button")  # the client goes away: the engine aborts the request
        expect(answer).to_have_attribute("data-state", "stopped")
        until(lambda: request.request_id in engine.aborted)
        visit.shot("chat-stopped")

        visit.page.fill("#system", "be brief")
        answer = chat(visit, "one two [[eos:3]]")
        expect(answer).to_have_attribute("data-state", "done")
        prompt = engine.requests[-1].prompt
        assert "be brief" in prompt and "alpha" not in prompt  # a stopped turn is not resent
        same = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        expected = same.chat.completions.create(model=MODEL, max_tokens=16, messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "one two [[eos:3]]"}])
        expect(answer.locator(".content")).to_have_text(expected.choices[0].message.content)
        stats = visit.page.locator("#chat-stats")
        expect(stats).to_contain_text("time to first token")
        expect(stats).to_contain_text(f"· {expected.usage.completion_tokens} tokens ·")
        expect(stats).to_contain_text("tokens/s")
        visit.shot("chat-done")
        visit.only_reached(url)


def test_a_bad_chat_request_shows_the_servers_message(visit):
    with serving(served_app(FakeEngine())) as url:
        visit.page.goto(f"{url}/ui")
        visit.tab("chat")  # max tokens 256 by default: more than the FakeEngine's context
        answer = chat(visit, "a b")
        expect(answer).to_have_attribute("data-state", "error")
        refused = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a b"}], "max_tokens": 256,
            "temperature": 0.7, "stream": True})
        expect(answer.locator(".error")).to_have_text(refused.json()["error"]["message"])
        visit.shot("chat-refused")


THINKING = ("<think>", "The", " user", " wants", " weather", "</think>", "\n\n")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_reasoning_is_shown_apart_and_tool_calls_as_calls(visit):
    script = (*THINKING, *(CALL[i:i + 6] for i in range(0, len(CALL), 6)))
    engine = ScriptedEngine(script=script, max_model_len=4096)
    with serving(served_app(engine, reasoning_parser="qwen3")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        message = client.chat.completions.create(
            model=MODEL, tools=TOOLS, messages=[{"role": "user", "content": "Paris?"}]
        ).choices[0].message
        visit.page.goto(f"{url}/ui")
        visit.tab("chat")
        visit.page.fill("#tools", json.dumps(TOOLS))
        answer = chat(visit, "Paris?")
        expect(answer).to_have_attribute("data-state", "done")
        expect(answer.locator(".reasoning div")).to_have_text(message.reasoning_content)
        (called,) = message.tool_calls
        expect(answer.locator(".tool-call .tool-name")).to_have_text(called.function.name)
        shown = answer.locator(".tool-call .tool-arguments").text_content()
        assert json.loads(shown) == json.loads(called.function.arguments) == {"city": "Paris"}
        assert "tool_call" not in answer.locator(".content").text_content()
        visit.shot("chat-reasoning-and-tool-call")


# -- /invocations -------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"inputs": "a b c", "parameters": {"max_new_tokens": 4}},
    {"inputs": "x y", "parameters": {"max_new_tokens": 3}, "stream": True},
], ids=["whole", "stream"])
def test_invocations_shows_the_exact_bodies_and_boto3_code_that_runs(visit, body):
    with serving(served_app(FakeEngine())) as url:
        visit.page.goto(f"{url}/ui")
        visit.tab("invocations")
        sent = json.dumps(body, indent=1)
        visit.page.fill("#invoke-body", sent)
        visit.page.click("#invoke-send")
        answered = httpx.post(f"{url}/invocations", content=sent,
                              headers={"Content-Type": "application/json"})
        expect(visit.page.locator("#invoke-status")).to_contain_text(str(answered.status_code))
        expect(visit.page.locator("#invoke-request")).to_have_text(sent)
        expect(visit.page.locator("#invoke-response")).to_have_text(answered.text)
        visit.shot("invocations")
        code = visit.page.locator("#invoke-boto3").text_content()
        assert run_boto3(code, url).rstrip("\n") == answered.text.rstrip("\n")


def run_boto3(code: str, url: str) -> str:
    """What the page's boto3 code prints, run against this server as the SageMaker runtime."""
    client = ('boto3.client("sagemaker-runtime", endpoint_url=URL, region_name="us-east-1", '
              'aws_access_key_id="test", aws_secret_access_key="test")')
    assert 'boto3.client("sagemaker-runtime")' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace('boto3.client("sagemaker-runtime")', client), {"URL": url})
    return printed.getvalue()


# -- the API key --------------------------------------------------------------------------------


def test_the_page_asks_for_the_api_key_and_shows_the_401s_message(visit, tmp_path):
    app = served_app(FakeEngine(), api_key=KEY,
                     configuration=configured(tmp_path, "--api-key", KEY))
    with serving(app) as url:
        visit.page.goto(f"{url}/")
        form = visit.page.locator("#key-form")
        expect(form).to_be_visible()
        expect(visit.page.locator("#model-name")).to_have_text("")  # nothing shown without it
        visit.shot("key-asked")
        visit.page.fill("#key-input", "not-the-key")
        visit.page.click("#key-form button")
        refused = httpx.get(f"{url}/config", headers={"Authorization": "Bearer not-the-key"})
        assert refused.status_code == 401
        expect(visit.page.locator("#key-error")).to_have_text(refused.json()["error"])
        expect(form).to_be_visible()
        visit.shot("key-refused")
        visit.page.fill("#key-input", KEY)
        visit.page.click("#key-form button")
        expect(visit.page.locator("#model-name")).to_have_text(MODEL)
        expect(form).to_be_hidden()
        expect(visit.setting("option.api_key").locator("td.value")).to_have_text("<set>")
        visit.shot("key-accepted")
        visit.page.reload()  # kept for this tab only: no prompt again
        expect(visit.page.locator("#model-name")).to_have_text(MODEL)
        expect(form).to_be_hidden()
        assert KEY not in visit.page.url and not any(KEY in r for r in visit.requests)
        assert KEY not in visit.page.content()
        assert KEY not in visit.page.evaluate("JSON.stringify(localStorage)")


# -- the real server ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_page_on_the_real_server_on_its_own_port(visit, served):
    """`served` (tests/conftest.py) is lmi-serve on a free port with the embedded model."""
    assert urlsplit(served.url).port not in (None, 80, 8080)
    described = httpx.get(f"{served.url}/config").json()
    visit.page.goto(f"{served.url}/")
    expect(visit.page.locator("#model-name")).to_have_text(described["model"])
    expect(visit.fact("engine")).to_have_text(described["engine"])
    value = visit.setting("option.max_model_len")
    expect(value.locator("td.value")).to_have_text(str(served.context))
    expect(value.locator("td.source")).to_have_text("command line")
    logged = f"config option.max_model_len = {served.context} [command line]"
    assert logged in served.log.read_text()  # the page says what startup logged
    visit.shot("real-status")
    visit.tab("chat")
    visit.page.fill("#max-tokens", "8")
    visit.page.fill("#temperature", "0")
    answer = chat(visit, "What is the capital of France?")
    expect(answer).to_have_attribute("data-state", "done")
    assert answer.locator(".content").text_content().strip()
    expect(visit.page.locator("#chat-stats")).to_contain_text("tokens/s")
    visit.shot("real-chat")
    visit.only_reached(served.url)
