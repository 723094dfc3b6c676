"""The image itself, run as SageMaker and `docker run` users run it (LMI_TEST_IMAGE names it;
.ci/run builds it with `./dev image cpu` where podman or docker runs, and skips this otherwise).

Each container runs `serve` with SAGEMAKER_BIND_TO_PORT, on a read-only root file system with a
writable /tmp (as SageMaker may run it), on the host's network, and is driven by the real clients:
requests for /invocations (json, jsonlines and, asked by a mounted serving.properties, SSE),
boto3's event stream, the openai client, tritonclient's gRPC. /opt/ml/model mounted with a
serving.properties alone serves the embedded default; a model folder, or option.model_id=s3://…
on a moto server, serves that model. `stop` during a stream lets it finish and exits 0; a killed
container serves again when started. The image holds the embedded default's compiled decode
graphs for its x86-64 levels, and a start loads them, compiling nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import numpy as np
import openai
import orjson
import pytest
import requests
import tritonclient.grpc as triton_grpc
from botocore.config import Config
from moto.server import ThreadedMotoServer
from otlp_receiver import grpc_receiver
from prometheus_client.parser import text_string_to_metric_families
from server_process import InvocationStream, free_port

IMAGE = os.environ.get("LMI_TEST_IMAGE", "")
MODEL = "smollm2-135m-instruct"


def _engine() -> list[str]:
    """podman (with the flags a run needs on these hosts), or docker where its daemon answers."""
    chosen = os.environ.get("LMI_CONTAINER_ENGINE")
    if chosen == "docker" or (chosen is None and shutil.which("docker") and subprocess.run(
            ["docker", "info"], capture_output=True).returncode == 0):
        return ["docker"]
    return ["podman"]


ENGINE = _engine() if IMAGE else []
RUN_FLAGS = (["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit",
              "nproc=1024:1024"] if ENGINE == ["podman"] else []) + ["--network", "host"]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not IMAGE, reason="no image to run: LMI_TEST_IMAGE unset (.ci/run builds "
                                         "one with ./dev image cpu where podman or docker runs)"),
]


@dataclass
class Running:
    name: str
    url: str
    grpc: str  # host:port of KServe V2 over gRPC

    def engine(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """`podman ARGS… NAME` (stop, start, kill, rm, inspect)."""
        return subprocess.run([*ENGINE, *args, self.name], capture_output=True, text=True,
                              check=check, timeout=120)

    def exec(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*ENGINE, "exec", self.name, *argv], capture_output=True,
                              text=True, timeout=120)

    def logs(self) -> str:
        result = subprocess.run([*ENGINE, "logs", self.name], capture_output=True, text=True)
        return result.stdout + result.stderr


def start(name: str, *args: str, env: dict[str, str] | None = None) -> Running:
    """A container of the image, `serve` on free ports; returned once /ping says 200."""
    port, grpc = free_port(), free_port()
    subprocess.run([*ENGINE, "rm", "-f", name], capture_output=True)
    settings = [f"--env={key}={value}" for key, value in {
        "SAGEMAKER_BIND_TO_PORT": str(port), "OPTION_ENFORCE_EAGER": "true", **(env or {})
    }.items()]
    subprocess.run([*ENGINE, "run", "-d", "--name", name, *RUN_FLAGS, "--read-only",
                    "--tmpfs", "/tmp", *settings, *args, IMAGE, "serve", "--grpc-port",
                    str(grpc)], check=True, capture_output=True, timeout=120)
    running = Running(name, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc}")
    wait_ready(running)
    return running


def wait_ready(running: Running, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{running.url}/ping", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        state = running.engine("inspect", "--format", "{{.State.Status}}", check=False)
        if state.stdout.strip() in ("exited", "stopped"):
            raise RuntimeError(f"{running.name} exited while starting:\n{running.logs()[-3000:]}")
        time.sleep(0.25)
    raise TimeoutError(f"{running.name} was not ready within {timeout} s")


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    running = start("lmi-test-default")
    yield running
    running.engine("rm", "-f")


def generate(url: str, body: dict) -> requests.Response:
    response = requests.post(f"{url}/invocations", data=orjson.dumps(body), timeout=120,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    return response


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_invocations_in_json_and_jsonlines(served):
    assert requests.get(f"{served.url}/ping", timeout=5).status_code == 200
    body = {"inputs": chat("Name a color."), "parameters": {"max_new_tokens": 6}}
    assert generate(served.url, body).json()["generated_text"].strip()
    lines = generate(served.url, {**body, "stream": True}).content.splitlines()
    tokens = [orjson.loads(line) for line in lines]
    assert len(tokens) == 6 and "generated_text" in tokens[-1]


def test_boto3s_event_stream_reassembles_into_the_generated_text(served):
    runtime = boto3.client("sagemaker-runtime", endpoint_url=served.url, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x",
                           config=Config(retries={"max_attempts": 1}))
    body = {"inputs": chat("Why is the sky blue?"), "stream": True,
            "parameters": {"max_new_tokens": 12, "do_sample": False}}
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName="lmi", Body=orjson.dumps(body), ContentType="application/json")
    parts = [event["PayloadPart"]["Bytes"] for event in response["Body"]]
    lines = [orjson.loads(line) for line in b"".join(parts).splitlines()]
    assert len(parts) > 1
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"]
    whole = generate(served.url, {**body, "stream": False}).json()["generated_text"]
    assert lines[-1]["generated_text"] == whole


def test_the_openai_client_and_tritons_grpc_client(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert answer.choices[0].message.content and answer.usage.completion_tokens <= 8
    triton = triton_grpc.InferenceServerClient(served.grpc)
    assert triton.is_server_ready() and triton.is_model_ready(MODEL)
    tensor = triton_grpc.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([chat("Hello").encode()], dtype=np.object_))
    result = triton.infer(MODEL, [tensor], parameters={"max_new_tokens": 4})
    assert result.as_numpy("text_output")[0].decode()


def test_it_runs_as_a_user_on_a_read_only_root_and_logs_to_stdout(served):
    assert served.exec("id", "-u").stdout.strip() not in ("", "0")
    probe = served.exec("touch", "/opt/lmi/probe")
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr
    assert served.exec("touch", "/tmp/probe").returncode == 0
    assert f"model {MODEL} is ready" in served.logs()


def test_the_image_keeps_its_healthcheck(served):
    """podman's default OCI format would drop the Dockerfile's HEALTHCHECK (build-image asks for
    the Docker format): podman runs it, docker shows it."""
    if ENGINE == ["podman"]:
        checked = subprocess.run(["podman", "healthcheck", "run", served.name],
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    else:
        shown = served.engine("inspect", "--format", "{{json .Config.Healthcheck}}").stdout
        assert "/ping" in shown


def readable(folder) -> None:
    """A folder the container's user reads, as a model folder SageMaker mounts is (its
    folders entered, its files read, at any depth)."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        if path.is_dir():
            readable(path)
        else:
            os.chmod(path, 0o644)


def test_a_mounted_serving_properties_alone_serves_the_embedded_default(tmp_path):
    """…with what it sets taken: SSE streams here."""
    (tmp_path / "serving.properties").write_text("option.output_formatter=sse\n")
    readable(tmp_path)
    running = start("lmi-test-sse", "--volume", f"{tmp_path}:/opt/ml/model:ro")
    try:
        body = {"inputs": chat("Hi"), "stream": True, "parameters": {"max_new_tokens": 4}}
        response = generate(running.url, body)
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert len(events) == 4
        assert requests.get(f"{running.url}/v1/models", timeout=10).json()["data"][0]["id"] \
            == MODEL
    finally:
        running.engine("rm", "-f")


def test_a_mounted_model_folder_is_served(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    readable(model)
    running = start("lmi-test-folder", "--volume", f"{model}:/opt/ml/model:ro")
    try:
        answer = generate(running.url, {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert answer.json()["generated_text"]
        models = requests.get(f"{running.url}/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] != MODEL
    finally:
        running.engine("rm", "-f")


def test_a_model_loaded_at_runtime_answers_and_is_traced(tiny_dir, tmp_path):
    """SageMaker's multi-model layout mounted at /opt/ml/models: POST /models loads a model,
    /models/{name}/invoke answers from it, and a local OTLP receiver (the standard
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) gets its span in the caller's trace, under its name."""
    models = tmp_path / "models"
    shutil.copytree(tiny_dir, models / "alpha" / "model")
    readable(models)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with grpc_receiver() as receiver:
        running = start("lmi-test-fleet", "--volume", f"{models}:/opt/ml/models:ro", env={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50"})
        try:
            loaded = requests.post(f"{running.url}/models", timeout=300, json={
                "model_name": "alpha", "url": "/opt/ml/models/alpha/model"})
            assert loaded.status_code == 200, loaded.text
            answer = requests.post(f"{running.url}/models/alpha/invoke", timeout=120, json={
                "inputs": "Hello", "parameters": {"max_new_tokens": 3, "details": True}},
                headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
            assert answer.status_code == 200, answer.text
            root = receiver.trace(trace_id, 4)["llm_request"]
        finally:
            running.engine("rm", "-f")
    assert root.attributes["gen_ai.response.model"] == "alpha"
    assert root.attributes["gen_ai.usage.completion_tokens"] == \
        answer.json()["details"]["generated_tokens"]


def test_an_s3_model_id_is_fetched_at_startup(tiny_dir):
    port = free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    s3.start()
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        client = boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"],
                              region_name="us-east-1", aws_access_key_id="x",
                              aws_secret_access_key="x")
        client.create_bucket(Bucket="models")
        for path in sorted(tiny_dir.iterdir()):
            client.upload_file(str(path), "models", f"tiny/{path.name}")
        running = start("lmi-test-s3", env={**aws, "OPTION_MODEL_ID": "s3://models/tiny"})
        try:
            answer = generate(running.url, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            assert answer.json()["generated_text"]
            assert "fetching s3://models/tiny" in running.logs()
        finally:
            running.engine("rm", "-f")
    finally:
        s3.stop()


def test_stop_lets_a_stream_in_flight_finish_and_a_killed_container_serves_again():
    running = start("lmi-test-stop")
    try:
        tokens = 48
        stream = InvocationStream(running.url, {"inputs": chat("Tell a story."), "stream": True,
                                      "parameters": {"max_new_tokens": tokens,
                                                     "ignore_eos": True}})
        thread = threading.Thread(target=stream.run)
        thread.start()
        assert stream.started.wait(120) and stream.error is None
        assert "generated_text" not in stream.lines[-1], "not in flight"
        running.engine("stop", "--time", "60")
        thread.join(timeout=120)
        assert stream.error is None and len(stream.lines) == tokens
        assert stream.lines[-1]["generated_text"]
        exit_code = running.engine("inspect", "--format", "{{.State.ExitCode}}").stdout.strip()
        assert exit_code == "0"

        running.engine("start")
        wait_ready(running)
        running.engine("kill")
        running.engine("start")
        wait_ready(running)
        assert generate(running.url, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    finally:
        running.engine("rm", "-f")


# What the image holds of its compiled decode graphs, and the levels the container's CPU runs.
_GRAPHS_SCRIPT = """
import json, pathlib
from handlers.engine.torch import graph_target
jobs = [json.loads(p.read_text()) for p in pathlib.Path('/opt/lmi/graphs').rglob('job.json')]
print(json.dumps({"runnable": graph_target.runnable(), "jobs": jobs, "complete": [
    all((pathlib.Path(j["directory"]) / f"{g}.pt2").exists() for g in j["graphs"])
    for j in jobs]}))
"""
# The decode-graph compile processes running in a container (decode_graphs.py starts them),
# this one (whose command line names them too) left out.
_COMPILES_SCRIPT = """
import os, pathlib
print(sum(b"handlers.engine.torch.decode_step" in p.read_bytes()
          for p in pathlib.Path('/proc').glob('[0-9]*/cmdline')
          if p.exists() and p.parent.name != str(os.getpid())))
"""


def test_the_image_holds_compiled_decode_graphs_and_a_start_compiles_none():
    """The embedded default's decode graphs are compiled at image build (those of its own
    quantized blocks, by default for each x86-64 level the build machine runs; .ci/run builds
    this CPU's best level only): on a CPU of a level built (this host, where the image was
    built), a start serving those blocks with compiled graphs on loads them from the image and
    starts no compile process."""
    shown = subprocess.run([*ENGINE, "run", "--rm", *RUN_FLAGS, "--read-only", "--tmpfs",
                            "/tmp", "--entrypoint", "python3", IMAGE, "-c", _GRAPHS_SCRIPT],
                           capture_output=True, text=True, timeout=300, check=True)
    held = orjson.loads(shown.stdout)
    if not held["runnable"]:
        pytest.skip("this CPU runs no x86-64 level graphs are built for")
    assert all(held["complete"]) and held["jobs"]
    built = {(job["target"], job["quantize"]) for job in held["jobs"]}
    assert (held["runnable"][0], "gguf") in built
    running = start("lmi-test-graphs", env={"OPTION_ENFORCE_EAGER": "false",
                                            "OPTION_QUANTIZE": "gguf"})
    try:
        deadline = time.monotonic() + 120  # loading them: seconds; compiling: minutes
        while not (counts := _graph_counts(running.url))[1] or counts[0] != counts[1]:
            assert time.monotonic() < deadline, f"graphs not loaded: {counts}"
            time.sleep(0.5)
        logs = running.logs()
        assert (f"decode graphs compiled ahead for {held['runnable'][0]} found in "
                "/opt/lmi/graphs/") in logs
        assert "compiling decode graphs" not in logs
        assert running.exec("python3", "-c", _COMPILES_SCRIPT).stdout.strip() == "0"
        assert running.exec("test", "-e", "/tmp/lmi-serve-cache/decode-graphs").returncode != 0
        assert generate(running.url, {"inputs": chat("Hi"), "parameters": {"max_new_tokens": 4}})
    finally:
        running.engine("rm", "-f")


def _graph_counts(url: str) -> tuple[float | None, float | None]:
    """(lmi_decode_graphs_ready, lmi_decode_graphs_total) from /metrics."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return samples.get("lmi_decode_graphs_ready"), samples.get("lmi_decode_graphs_total")
