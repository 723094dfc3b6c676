"""LoRA adapters on the torch engine, for real: adapters made here with PEFT on the embedded
SmolLM2 (random, non-zero B, so the text changes), served from the model directory's
`adapters/` folder. Greedy text with an adapter is the PEFT-merged transformers model's; a batch
mixing the base model and two adapters gives each request its answer alone; every way a client
names an adapter reaches it, with the real clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import boto3
import httpx
import openai
import orjson
import pytest
import torch
from botocore.config import Config
from huggingface_hub import InferenceClient
from peft_adapters import ATTENTION, EVERY_PROJECTION, make_adapter
from server_process import running_server

from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.model_source import default_model_path

PROMPT = "The best thing about the ocean is"
TOKENS = 12
ADAPTERS = {"a1": (ATTENTION, 1), "a2": (EVERY_PROJECTION, 2)}  # name: (targets, seed)


def base_dir() -> Path:
    return cached_gguf_dir(default_model_path())


def greedy(model, tokenizer) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, top_p=None,
                             top_k=None, temperature=None)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory) -> tuple[Path, dict[str | None, str]]:
    """A model directory with adapters/a1 and adapters/a2, and what transformers generates:
    the base model's text (None) and each merged adapter's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("lora-model")
    tokenizer = AutoTokenizer.from_pretrained(base_dir())
    texts: dict[str | None, str] = {None: greedy(
        AutoModelForCausalLM.from_pretrained(base_dir(), dtype=torch.float32).eval(), tokenizer)}
    for name, (targets, seed) in ADAPTERS.items():
        merged = make_adapter(base_dir(), folder / "adapters" / name, targets, seed)
        texts[name] = greedy(merged, tokenizer)
    assert len(set(texts.values())) == 3, texts  # each adapter changes the text
    return folder, texts


@pytest.fixture(scope="module")
def expected(lora_model) -> dict[str | None, str]:
    return lora_model[1]


@pytest.fixture(scope="module")
def url(lora_model):
    folder = lora_model[0]
    # float32 linears: the adapters are checked against PEFT's merge of the float checkpoint
    with running_server("option.dtype=fp32", "option.quantize=none",
                        "option.embedding_model_id=none", "option.max_model_len=256",
                        model_dir=folder,
                        log_path=folder / "server.log") as base:
        yield base


def lmi(url: str, params: dict | None = None, headers: dict | None = None, **body) -> str:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": TOKENS, "do_sample": False},
            **body}
    response = httpx.post(f"{url}/invocations", params=params, headers=headers, json=body,
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def test_greedy_text_with_an_adapter_is_the_merged_models(url, expected):
    assert lmi(url) == expected[None]
    for name in ADAPTERS:
        assert lmi(url, adapters=name) == expected[name], name
    assert lmi(url, adapters=["a2"]) == expected["a2"]  # the list form, one per input
    assert lmi(url, adapters="") == expected[None]  # "": the base model


def test_one_batch_mixes_the_base_model_and_two_adapters(url, expected):
    names = [None, "a1", "a2"] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda name: lmi(url, adapters=name), names))
    assert texts == [expected[name] for name in names]


def test_every_way_of_naming_an_adapter_reaches_it(url, expected):
    want = expected["a1"]
    assert lmi(url, params={"adapter": "a1"}) == want
    assert lmi(url, headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=1; adapter=a1"}) \
        == want
    assert lmi(url, headers={"X-Amzn-SageMaker-Adapter-Identifier": "a1"}) == want
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    completion = client.completions.create(model="a1", prompt=PROMPT, max_tokens=TOKENS,
                                           temperature=0)
    assert (completion.choices[0].text, completion.model) == (want, "a1")
    hub = InferenceClient(model=url)
    assert hub.text_generation(PROMPT, max_new_tokens=TOKENS, adapter_id="a1",
                               return_full_text=False) == want


def test_boto3_names_the_adapter_in_custom_attributes(url, expected):
    runtime = boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x",
                           config=Config(retries={"max_attempts": 1}))
    body = orjson.dumps({"inputs": PROMPT,
                         "parameters": {"max_new_tokens": TOKENS, "do_sample": False}})
    answer = runtime.invoke_endpoint(EndpointName="e", Body=body, ContentType="application/json",
                                     CustomAttributes="adapter=a2")
    assert orjson.loads(answer["Body"].read())["generated_text"] == expected["a2"]
    streamed = runtime.invoke_endpoint_with_response_stream(
        EndpointName="e", ContentType="application/json", CustomAttributes="adapter=a2",
        Body=orjson.dumps({**orjson.loads(body), "stream": True}))
    lines = b"".join(e["PayloadPart"]["Bytes"] for e in streamed["Body"]).splitlines()
    assert "".join(orjson.loads(line)["token"]["text"] for line in lines) == expected["a2"]


def test_chat_protocols_name_the_adapter_by_model(url):
    """OpenAI chat, Anthropic Messages and Responses render the same chat: with `model` an
    adapter, each answers the adapter's text, which is not the base model's."""
    messages = [{"role": "user", "content": PROMPT}]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")

    def chat(model: str) -> str:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                                temperature=0)
        return answer.choices[0].message.content

    adapted = chat("a2")
    assert adapted != chat("smollm2-135m-instruct")
    message = anthropic.Anthropic(base_url=url, api_key="x").messages.create(
        model="a2", max_tokens=24, messages=messages,
        extra_body={"temperature": 0})  # this SDK dropped the argument; the API keeps it
    assert (message.model, message.content[0].text) == ("a2", adapted)
    response = client.responses.create(model="a2", input=PROMPT, max_output_tokens=24,
                                       temperature=0)
    assert (response.model, response.output_text) == ("a2", adapted)


def test_an_unknown_adapter_is_a_404_naming_it(url):
    response = httpx.post(f"{url}/invocations", params={"adapter": "nope"},
                          json={"inputs": PROMPT})
    assert response.status_code == 404 and "'nope'" in response.text
    with pytest.raises(openai.NotFoundError, match="nope"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="x").completions.create(
            model="nope", prompt=PROMPT, max_tokens=2)


def test_adapters_are_registered_used_and_deleted_at_runtime(url, lora_model, expected):
    """DJL's management API on the torch engine: an adapter registered at runtime (a1's
    files under a new name) serves a1's text; once deleted it is a 404 naming it."""
    folder, _ = lora_model
    src = str(folder / "adapters" / "a1")
    registered = httpx.post(f"{url}/models/smollm2-135m-instruct/adapters",
                            params={"name": "fresh", "src": src})
    assert registered.json() == {"status": "Adapter fresh registered"}
    assert lmi(url, adapters="fresh") == expected["a1"]
    listed = httpx.get(f"{url}/adapters").json()["adapters"]
    assert [a["name"] for a in listed] == ["a1", "a2", "fresh"]
    assert httpx.get(f"{url}/adapters/fresh").json() == [
        {"name": "fresh", "src": src, "pin": False}]
    assert httpx.delete(f"{url}/adapters/fresh").json() == {
        "status": "Adapter fresh unregistered"}
    gone = httpx.post(f"{url}/invocations", json={"inputs": PROMPT, "adapters": "fresh"})
    assert gone.status_code == 404 and "'fresh'" in gone.text
    refused = httpx.post(f"{url}/adapters", params={"name": "etc", "src": "/etc"})
    assert refused.status_code == 400 and "outside the directories" in refused.text


def test_metrics_name_the_adapters_running_and_served(url):
    """vLLM's `vllm:lora_requests_info` names the adapters of running requests while they
    run (what llm-d's scheduler reads), and each adapter's requests are counted."""
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(lambda: httpx.post(f"{url}/invocations", timeout=300, json={
            "inputs": PROMPT, "adapters": "a2",
            "parameters": {"max_new_tokens": 200, "ignore_eos": True}}))
        running = None
        while running is None and not long.done():
            running = next((line for line in httpx.get(f"{url}/metrics").text.splitlines()
                            if line.startswith("vllm:lora_requests_info")
                            and 'running_lora_adapters="a2"' in line), None)
        assert long.result().status_code == 200
    assert running is not None and 'max_lora="4"' in running
    assert 'waiting_lora_adapters=""' in running
    metrics = httpx.get(f"{url}/metrics").text
    assert 'lmi_adapter_requests_total{adapter="a2",model="smollm2-135m-instruct"}' in metrics
    assert 'running_lora_adapters=""' in metrics  # none runs now
