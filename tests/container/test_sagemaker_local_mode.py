"""The SageMaker Python SDK's local mode deploying the image (examples/sagemaker_local_mode.py):
`Model(image_uri, model_data="file://…", role).deploy(instance_type="local")`, then
`Predictor.predict` and a streamed invoke, as a SageMaker user first tries a container.

The SDK runs the image with docker-compose through the Docker API; podman's (`podman system
service`, with runc and explicit limits, which these hosts need) stands in for Docker. Needs
the image (LMI_TEST_IMAGE), a Python with the SDK v2 (LMI_SAGEMAKER_PYTHON: the SDK pins what
the test environment's packages outgrew, so it has an environment of its own) and
docker-compose; .ci/run's image lane provides all three.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

IMAGE = os.environ.get("LMI_TEST_IMAGE", "")
PYTHON = os.environ.get("LMI_SAGEMAKER_PYTHON", "")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def documented_podman_conf() -> str:
    """The containers.conf the example's docstring tells podman users to write: the test runs
    podman with it, so the steps stay the ones that work."""
    source = (EXAMPLES / "sagemaker_local_mode.py").read_text()
    doc = ast.get_docstring(ast.parse(source))
    heredoc = doc.split("<<'EOF'\n", 1)[1].split("\n    EOF\n", 1)[0]
    return textwrap.dedent(heredoc) + "\n"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (IMAGE and PYTHON and shutil.which("docker-compose")
                            and shutil.which("podman")),
                       reason="needs LMI_TEST_IMAGE, LMI_SAGEMAKER_PYTHON (the SDK v2), "
                              "docker-compose and podman (.ci/run's image lane sets them up)"),
]


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory) -> Iterator[str]:
    """podman's Docker-compatible API on a socket of its own."""
    folder = tmp_path_factory.mktemp("podman")
    (folder / "containers.conf").write_text(documented_podman_conf())
    socket = folder / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{socket}"],
        env={**os.environ, "CONTAINERS_CONF": str(folder / "containers.conf")},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if socket.exists():
                break
            time.sleep(0.05)
        yield f"unix://{socket}"
    finally:
        service.terminate()
        service.wait(timeout=30)


def test_local_mode_deploys_predicts_and_streams(docker_host, tmp_path):
    assert _port_free(8080), "local mode serves on port 8080, which something else holds"
    env = {**os.environ, "DOCKER_HOST": docker_host, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "SAGEMAKER_SUPPRESS_V2_WARNING": "1", "PYTHONPATH": str(EXAMPLES)}
    run = subprocess.run([PYTHON, str(EXAMPLES / "sagemaker_local_mode.py"), "--image-uri",
                          IMAGE, "--max-new-tokens", "12"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The SDK prints its deploy progress ("--!") without a newline and copies the container's log
    # from a thread, so a marker may sit mid-line.
    lines = run.stdout.splitlines()
    predicted = next(line for line in lines if "predict: " in line)
    streamed = next(line for line in lines if "stream: " in line)
    assert '"generated_text"' in predicted and '"generated_text"' in streamed
    assert "(12 lines)" in streamed
    assert _port_free(8080)  # delete_endpoint took the container down


def _port_free(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/ping", timeout=2)
    except requests.ConnectionError:
        return True
    return False
