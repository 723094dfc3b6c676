"""GET /metrics as an operator reads it: requests by protocol, route and status; latency
histograms and token counters once per engine request (under LMI's names and vLLM's);
overload refusals; engine restarts; on the real torch engine, token counters equal the usage
the responses report. Every check counts events, never wall-clock time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from fakes import FakeEngine, served_app
from prometheus_client.parser import text_string_to_metric_families
from server_process import free_port, serving
from tritonclient.utils import InferenceServerException

from handlers.config import load_config, parse_args
from handlers.engine import registry
from handlers.server.app import create_app
from handlers.server.context import Served, ServerContext, ServerSettings

MODEL = "fake-model"
Samples = list[tuple[str, dict[str, str], float]]


def parse(text: str) -> Samples:
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    matching = [v for n, have, v in samples
                if n == name and labels.items() <= have.items()]
    assert matching, f"{name}{labels or ''} is not in /metrics"
    return sum(matching)


def requests_counted(samples: Samples) -> dict[tuple[str, str, str], float]:
    return {(labels["protocol"], labels["route"], labels["status"]): v
            for name, labels, v in samples if name == "lmi_requests_total"}


@pytest.fixture
def engine() -> FakeEngine:
    """A fresh one per test, as its server: every counter starts at zero."""
    return FakeEngine()


@pytest.fixture
def url(engine: FakeEngine) -> Iterator[str]:
    with serving(served_app(engine, model_name=MODEL)) as base:
        yield base


def prompts(*texts: str) -> triton.InferInput:
    tensor = triton.InferInput("text_input", [len(texts)], "BYTES")
    return tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))


def scrape(url: str, **kwargs) -> Samples:
    response = httpx.get(f"{url}/metrics", timeout=10, **kwargs)
    assert response.status_code == 200
    return parse(response.text)


def test_requests_are_counted_by_protocol_route_template_and_status(url):
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for _ in range(3):
        assert httpx.post(f"{url}/invocations", json={"inputs": "a b"}).status_code == 200
    refused = httpx.post(f"{url}/invocations", json={"inputs": "[[invalid]] a"})
    assert refused.status_code == 424
    chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                 max_tokens=2)
    list(chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                      max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(model="other", messages=[{"role": "user", "content": "a"}])
    infer = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                         "data": ["a"]}]}
    assert httpx.post(f"{url}/v2/models/{MODEL}/infer", json=infer).status_code == 200
    assert httpx.post(f"{url}/v2/models/nope/infer", json=infer).status_code == 404
    assert httpx.get(f"{url}/no/such/page").status_code == 404
    assert httpx.get(f"{url}/ping").status_code == 200

    assert requests_counted(scrape(url)) == {
        ("lmi", "/invocations", "200"): 3,
        ("lmi", "/invocations", "424"): 1,
        ("openai", "/v1/chat/completions", "200"): 2,
        ("openai", "/v1/chat/completions", "404"): 1,
        ("kserve_v2", "/v2/models/{model}/infer", "200"): 1,
        ("kserve_v2", "/v2/models/{model}/infer", "404"): 1,
        ("http", "unmatched", "404"): 1,
        ("health", "/ping", "200"): 1,
    }
    # The scrape itself is counted once it has been answered.
    assert requests_counted(scrape(url))[("metrics", "/metrics", "200")] == 1


def test_a_request_answered_before_routing_is_counted_under_its_route(engine):
    """The API key check answers 401 before the router runs: still counted by route."""
    with serving(served_app(engine, model_name=MODEL, api_key="secret")) as url:
        assert httpx.post(f"{url}/invocations", json={"inputs": "a"}).status_code == 401
        assert httpx.post(f"{url}/v2/models/{MODEL}/infer", json={}).status_code == 401
        counted = requests_counted(scrape(url, headers={"x-api-key": "secret"}))
    assert counted == {("lmi", "/invocations", "401"): 1,
                       ("kserve_v2", "/v2/models/{model}/infer", "401"): 1}


def test_latency_histograms_and_token_counters_count_each_engine_request(url):
    """Two chats of 4 tokens, one LMI request of 3 and one that stops at EOS after 2 tokens
    (the EOS token is generated, so 3): four engine requests, 14 tokens, 10 inter-token
    intervals; the same under LMI's names and vLLM's."""
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    usage = [chat.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "one two"}], max_tokens=4).usage
        for _ in range(2)]
    lmi = [httpx.post(f"{url}/invocations", json={"inputs": words, "parameters": {
        "max_new_tokens": 3, "details": True}}).json()
        for words in ("x y z", "x [[eos:2]]")]
    prompt_tokens = sum(u.prompt_tokens for u in usage) + 3 + 2  # a marker is a word too
    samples = scrape(url)

    assert [u.completion_tokens for u in usage] == [4, 4]
    assert [r["details"]["generated_tokens"] for r in lmi] == [3, 3]
    vllm = {"model_name": MODEL, "engine": "0"}
    for lmi_name, vllm_names in (
        ("lmi_time_to_first_token_seconds", ["vllm:time_to_first_token_seconds"]),
        ("lmi_e2e_request_latency_seconds", ["vllm:e2e_request_latency_seconds"]),
        ("lmi_request_queue_time_seconds", ["vllm:request_queue_time_seconds"]),
    ):
        assert value(samples, lmi_name + "_count", model=MODEL) == 4
        for name in vllm_names:
            assert value(samples, name + "_count", **vllm) == 4
    assert value(samples, "lmi_inter_token_latency_seconds_count", model=MODEL) == 10
    assert value(samples, "vllm:inter_token_latency_seconds_count", **vllm) == 10
    assert value(samples, "vllm:time_per_output_token_seconds_count", **vllm) == 10
    assert value(samples, "vllm:generation_tokens_total", **vllm) == 14
    assert value(samples, "vllm:prompt_tokens_total", **vllm) == prompt_tokens
    assert value(samples, "vllm:request_generation_tokens_sum", **vllm) == 14
    assert value(samples, "vllm:request_prompt_tokens_sum", **vllm) == prompt_tokens
    assert value(samples, "lmi_request_generation_tokens_count", model=MODEL) == 4
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 3
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 0
    # The engine's own gauges, also under vLLM's names: nothing runs now.
    assert value(samples, "lmi_running_requests", model=MODEL) == 0
    assert value(samples, "vllm:num_requests_running", **vllm) == 0
    assert value(samples, "vllm:num_requests_waiting", **vllm) == 0
    assert value(samples, "lmi_finished_requests_total", model=MODEL) == 4


def test_a_request_refused_for_overload_is_counted_and_an_aborted_one_too():
    gate = asyncio.Event()

    class Held(FakeEngine):
        async def _run(self, request):  # holds every request until the gate opens
            await gate.wait()
            async for output in super()._run(request):
                yield output

    engine = Held()

    async def run() -> tuple[Samples, list[int]]:
        app = served_app(engine, model_name=MODEL, job_queue_size=1)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            held = asyncio.create_task(http.post("/invocations", json={"inputs": "a"}))
            while not engine.requests:
                await asyncio.sleep(0)
            refused = [(await http.post(path, json=body)).status_code for path, body in (
                ("/invocations", {"inputs": "b"}),
                ("/generate", {"inputs": "b"}),
                ("/v1/completions", {"model": MODEL, "prompt": "b"}))]
            held.cancel()  # the client goes away: its request is aborted
            await asyncio.gather(held, return_exceptions=True)
            return parse((await http.get("/metrics")).text), refused

    samples, refused = asyncio.run(run())
    assert refused == [503, 429, 503]  # TGI says overloaded with 429
    assert value(samples, "lmi_rejected_requests_total", model=MODEL) == 3
    counted = requests_counted(samples)
    assert counted[("lmi", "/invocations", "503")] == 1
    assert counted[("tgi", "/generate", "429")] == 1
    assert counted[("openai", "/v1/completions", "503")] == 1
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(samples, "lmi_e2e_request_latency_seconds_count") == 0  # none finished


def test_engine_restarts_are_counted_from_zero():
    ctx = ServerContext(ServerSettings(MODEL), Served(MODEL, FakeEngine()))
    samples = parse(ctx_metrics(ctx))
    assert value(samples, "lmi_engine_restarts_total", model=MODEL) == 0
    ctx.telemetry.engine_restarted()
    ctx.telemetry.engine_restarted()
    assert value(parse(ctx_metrics(ctx)), "lmi_engine_restarts_total", model=MODEL) == 2


def ctx_metrics(ctx: ServerContext) -> str:
    async def get() -> str:
        transport = httpx.ASGITransport(app=create_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.get("/metrics")).text
    return asyncio.run(get())


def test_two_apps_in_one_process_keep_their_own_counts(engine):
    """Each server context has its own registry: the default global one would refuse the
    second app's metrics, or mix their counts."""
    first = ServerContext(ServerSettings(MODEL), Served(MODEL, engine))
    second = ServerContext(ServerSettings(MODEL), Served(MODEL, engine))
    first.telemetry.rejected()
    assert value(parse(ctx_metrics(first)), "lmi_rejected_requests_total") == 1
    assert value(parse(ctx_metrics(second)), "lmi_rejected_requests_total") == 0


def test_grpc_calls_are_counted_by_method_and_status_code(engine):
    port = free_port()
    app = served_app(engine, model_name=MODEL, grpc_host="127.0.0.1", grpc_port=port)
    with serving(app) as url:
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live()
        client.infer(MODEL, [prompts("a b")])
        client.infer(MODEL, [prompts("c")])
        with pytest.raises(InferenceServerException):
            client.infer("nope", [prompts("a")])
        client.close()
        counted = requests_counted(scrape(url))
    service = "/inference.GRPCInferenceService/"
    assert {key: n for key, n in counted.items() if key[0] == "kserve_v2_grpc"} == {
        ("kserve_v2_grpc", service + "ServerLive", "OK"): 1,
        ("kserve_v2_grpc", service + "ModelInfer", "OK"): 2,
        ("kserve_v2_grpc", service + "ModelInfer", "NOT_FOUND"): 1,
    }


# --- the real torch engine -------------------------------------------------------------------


async def test_token_counters_equal_the_usage_the_responses_report_on_the_torch_engine(
        tiny_dir):
    argv = ["--model-dir", str(tiny_dir), "--option", "option.embedding_model_id=none",
            "--option", "option.max_rolling_batch_size=4", "--option", "option.enforce_eager=true"]
    engine = registry.build(load_config(parse_args(argv), env={})).engine
    ctx = ServerContext(ServerSettings(engine.model_name), Served(engine.model_name, engine))
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            questions = ("Hello there", "What is two plus two?")
            chats = [await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 6,
                "temperature": 0}) for text in questions]
            completion = await http.post("/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "n": 2})
            samples = parse((await http.get("/metrics")).text)
    finally:
        await engine.shutdown()
    usages = [r.json()["usage"] for r in (*chats, completion)]
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    model, vllm = {"model": engine.model_name}, {"model_name": engine.model_name}
    assert generated > 0
    assert value(samples, "lmi_prompt_tokens_total", **model) == prompt
    assert value(samples, "vllm:prompt_tokens_total", **vllm) == prompt
    assert value(samples, "lmi_generated_tokens_total", **model) == generated
    assert value(samples, "vllm:generation_tokens_total", **vllm) == generated
    assert value(samples, "vllm:request_generation_tokens_sum", **vllm) == generated
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **vllm) == 3
    # Every prompt was looked up in the prefix cache; the second chat found all that its
    # chat-template opening shares with the first.
    assert value(samples, "lmi_prefix_cache_queries_total", **model) == prompt
    assert value(samples, "vllm:prefix_cache_queries_total", **vllm) == prompt
    first, second = (engine.tokenizer.encode(engine.tokenizer.render_chat(
        engine.tokenizer.chat_template(), [{"role": "user", "content": text}], tools=None,
        add_generation_prompt=True, continue_final_message=False)) for text in questions)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    hits = value(samples, "lmi_prefix_cache_hits_total", **model)
    assert hits == shared >= 16
    assert value(samples, "vllm:prefix_cache_hits_total", **vllm) == hits
    # Every slot is free again, out of the batch size's.
    assert value(samples, "lmi_kv_cache_slots", **model) == 4
    assert value(samples, "lmi_kv_cache_slots_in_use", **model) == 0
    assert value(samples, "vllm:kv_cache_usage_perc", **vllm) == 0
