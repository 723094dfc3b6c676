"""Every protocol over the llama.cpp engine (`option.rolling_batch=llamacpp`, the embedded GGUF),
driven by the clients users have: LMI /invocations (json with details, jsonlines), the openai
client (chat and completions: n, logprobs, stop, seed, json_schema), TGI's client, KServe V2
over HTTP and gRPC with tritonclient. Skipped where llama-cpp-python is not installed.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
import requests
from optional_deps import need

need("llama_cpp", "llama-cpp-python is not installed (the `llamacpp` extra: "
     "LMI_VENV=.venv-llamacpp LMI_EXTRAS=llamacpp ./dev test)")

import openai  # noqa: E402
import text_generation  # noqa: E402
import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
from server_process import free_port, running_server  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    grpc_port = free_port()
    with running_server("option.rolling_batch=llamacpp", "option.max_model_len=512",
                        log_path=log, grpc_port=grpc_port) as url:
        yield url, f"127.0.0.1:{grpc_port}", log


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none")


def invoke(url: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(f"{url}/invocations", data=orjson.dumps(body), timeout=120, **kwargs)


def test_the_llama_cpp_engine_serves(url, server):
    info = requests.get(f"{url}/info", timeout=5).json()
    assert info["model_dtype"] == "q4_1" and info["model_device_type"] == "cpu"
    assert "llama.cpp engine" in server[2].read_text()


def test_lmi_json_with_details_and_jsonlines_stream(url):
    body = {"inputs": chat("What is deep learning?"),
            "parameters": {"max_new_tokens": 16, "details": True}}
    plain = invoke(url, body).json()
    details = plain["details"]
    assert details["generated_tokens"] == len(details["tokens"]) <= 16
    assert "".join(t["text"] for t in details["tokens"]) == plain["generated_text"]
    assert "learning" in plain["generated_text"].lower()
    response = invoke(url, {**body, "stream": True}, stream=True)
    lines = [orjson.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["token"]["text"] for line in lines) == plain["generated_text"]
    assert lines[-1]["generated_text"] == plain["generated_text"]


def test_concurrent_streams_all_complete_whole(url):
    """Unlike the torch engine's, llama.cpp's numerics depend on the batch (the KV cells' order,
    passes of 64 tokens or more): concurrent greedy texts may differ from those alone."""
    questions = ["Name three colors.", "Why is the sky blue?", "What is 2 + 2?",
                 "Write one sentence about cats.", "Say hello in Chinese."]
    bodies = [{"inputs": chat(q), "parameters": {"max_new_tokens": 20, "ignore_eos_token": True},
               "stream": True} for q in questions]

    def stream(body: dict) -> list[dict]:
        response = invoke(url, body, stream=True)
        return [orjson.loads(line) for line in response.iter_lines() if line]

    with ThreadPoolExecutor(len(bodies)) as pool:
        for lines in pool.map(stream, bodies):
            assert len(lines) == 20
            assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]


def test_openai_chat_n_logprobs_seed(client):
    messages = [{"role": "user", "content": "Name a color."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           n=2, logprobs=True, top_logprobs=2, seed=7,
                                           temperature=1.0)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.logprobs.content and all(len(t.top_logprobs) == 2
                                               for t in choice.logprobs.content)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           n=2, seed=7, temperature=1.0)
    assert [c.message.content for c in again.choices] == \
        [c.message.content for c in reply.choices]


def test_openai_completion_stop_and_stream(client):
    prompt = chat("Count from one to ten in words.")
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    stop = free.choices[0].text.split()[2]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == free.choices[0].text


def test_openai_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "bright": {"type": "boolean"}},
              "required": ["color", "bright"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=60,
        messages=[{"role": "user", "content": "Pick a color; answer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "pick", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["bright"], bool)


def test_tgi_client(url):
    tgi = text_generation.Client(url)
    response = tgi.generate(chat("What is 2 + 2?"), max_new_tokens=8, decoder_input_details=True)
    assert response.details.generated_tokens == len(response.details.tokens) <= 8
    streamed = "".join(r.token.text for r in tgi.generate_stream(chat("What is 2 + 2?"),
                                                                  max_new_tokens=8))
    assert streamed == response.generated_text


def test_kserve_v2_over_http_and_grpc(server):
    url, grpc, _ = server
    prompt = chat("What is the capital of France?")
    http = triton_http.InferenceServerClient(url.removeprefix("http://"))
    data = triton_http.InferInput("text_input", [1], "BYTES")
    data.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    over_http = http.infer(MODEL, [data], parameters={"max_new_tokens": 12, "temperature": 0})
    text = over_http.as_numpy("text_output")[0].decode()
    assert "paris" in text.lower()
    rpc = triton_grpc.InferenceServerClient(grpc)
    data = triton_grpc.InferInput("text_input", [1], "BYTES")
    data.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    over_grpc = rpc.infer(MODEL, [data], parameters={"max_new_tokens": 12, "temperature": 0})
    assert over_grpc.as_numpy("text_output")[0].decode() == text


def test_triton_generate(url):
    body = {"id": "1", "text_input": chat("What is the capital of France?"),
            "parameters": {"max_new_tokens": 12}}
    answer = requests.post(f"{url}/v2/models/{MODEL}/generate", json=body, timeout=60).json()
    assert "paris" in answer["text_output"].lower()
    stream = requests.post(f"{url}/v2/models/{MODEL}/generate_stream", json=body, timeout=60)
    events = [orjson.loads(line.split(b":", 1)[1]) for line in stream.iter_lines()
              if line.startswith(b"data:")]
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
