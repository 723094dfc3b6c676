"""A real `lmi-serve` on the tiny model with a KV budget of 200 positions
(option.kv_cache_memory_bytes): the log states the budget in tokens and bytes and where it came
from; concurrent requests beyond it wait and all finish as each does alone, the positions
reserved never passing the budget (/metrics); a prompt that can never fit is refused with the
protocol's error naming the budget and the setting (the openai client, /invocations, and every
other protocol's route)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server

pytestmark = pytest.mark.e2e

BYTES = 200 * 256  # 200 positions of the tiny model's 16-bit cache
TOPICS = ["the sea", "a mountain", "the city at night", "an old library", "the desert",
          "a winter forest"]

LONG = "one two three four five six seven eight nine ten " * 25  # > 200 tokens, < the context
CHAT = [{"role": "user", "content": LONG}]
# route -> (body, status, the error's text), each in its protocol's shape (as a prompt past the
# context is refused: tests/protocols/test_prompt_bounds.py)
ROUTES = {
    "/v1/chat/completions": ({"messages": CHAT, "max_tokens": 1}, 400,
                             lambda body: body["error"]["message"]),
    "/v1/responses": ({"input": LONG, "max_output_tokens": 16}, 400,
                      lambda body: body["error"]["message"]),
    "/generate": ({"inputs": LONG, "parameters": {"max_new_tokens": 1}}, 422,
                  lambda body: body["error"]),
    "/v2/models/tiny-llama/generate": ({"text_input": LONG, "parameters": {"max_tokens": 1}},
                                       400, lambda body: body["error"]),
    "/v1/messages": ({"messages": CHAT, "max_tokens": 1, "model": "tiny-llama"}, 400,
                     lambda body: body["error"]["message"]),
}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("budget") / "server.log"
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        f"option.kv_cache_memory_bytes={BYTES}",
                        "option.enable_prefix_caching=false", log_path=log) as url:
        yield url, log


def engine_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("lmi_")}


def complete(client: openai.OpenAI, model: str, topic: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=f"Write a short story about {topic}.",
                                     max_tokens=70, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_the_log_states_the_budget_in_tokens_and_bytes_and_its_source(server):
    _, log = server
    text = log.read_text()
    per_token = int(re.search(r"KV cache: \S+ \(.*\), (\d+) bytes per token", text)[1])
    stated = re.search(r"KV cache budget: (\d+) tokens \((\d+) bytes at (\d+) bytes a token; "
                       r".*\), from (.*)", text)
    assert stated is not None, text[-3000:]
    assert (int(stated[1]), int(stated[2]), int(stated[3])) == (BYTES // per_token, BYTES,
                                                                 per_token)
    assert stated[4] == f"option.kv_cache_memory_bytes={BYTES}, command line"


def test_requests_beyond_the_budget_wait_and_all_finish_as_they_do_alone(server, tiny_dir):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    budget = engine_metrics(url)["lmi_kv_cache_budget_tokens"]
    assert budget == 200
    with ThreadPoolExecutor(len(TOPICS)) as pool:  # 2 fit at once, not 3
        together = list(pool.map(lambda topic: complete(client, tiny_dir.name, topic), TOPICS))
    alone = [complete(client, tiny_dir.name, topic) for topic in TOPICS]
    for answer, reference in zip(together, alone, strict=True):
        assert 67 <= answer.usage.total_tokens <= 100  # 3 x 67 > 200
        assert answer.usage.completion_tokens == 70
        assert answer.choices[0].text == reference.choices[0].text
    seen = engine_metrics(url)
    assert seen["lmi_kv_cache_reserved_tokens_peak"] <= budget  # never more than fits
    assert seen["lmi_kv_cache_reserved_tokens"] == 0
    assert seen["lmi_running_requests"] == 0


def test_a_prompt_that_can_never_fit_is_refused_naming_the_setting(server, tiny_dir):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=tiny_dir.name, prompt=LONG, max_tokens=1)
    assert "budget holds 200 tokens" in refused.value.message
    assert f"option.kv_cache_memory_bytes={BYTES}" in refused.value.message
    answer = httpx.post(f"{url}/invocations", json={"inputs": LONG,
                                                    "parameters": {"max_new_tokens": 1}})
    assert answer.status_code == 424  # LMI's status for a refused input, as past the context
    assert f"option.kv_cache_memory_bytes={BYTES}" in answer.json()["error"]
    fits = client.completions.create(model=tiny_dir.name, prompt=LONG[:300], max_tokens=1)
    assert fits.usage.completion_tokens == 1


@pytest.mark.parametrize("route", ROUTES)
def test_every_protocol_refuses_it_in_its_own_shape(server, route):
    url, _ = server
    body, status, message = ROUTES[route]
    answer = httpx.post(f"{url}{route}", json=body, timeout=60)
    assert answer.status_code == status, answer.text[:500]
    assert f"option.kv_cache_memory_bytes={BYTES}" in message(answer.json())
