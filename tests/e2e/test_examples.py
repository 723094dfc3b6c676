"""The examples as their users run them: boto3_invoke.py as a script against a real lmi-serve, and
sagemaker_deploy.py against a mocked SageMaker control plane (moto), its invocations going to that
same server through the SageMaker runtime routes."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import boto3
import botocore.handlers
import httpx
import pytest
from moto import mock_aws
from server_process import running_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # the examples import each other as sibling scripts do
from boto3_invoke import LineIterator, json_lines  # noqa: E402

REGION = "us-east-1"
ROLE = "arn:aws:iam::123456789012:role/SageMakerExecutionRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/lmi-serve:cpu"
PROMPT = "What is Deep Learning?"
MAX_NEW_TOKENS = 5


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server() as url:  # the embedded default model
        yield url


@pytest.fixture(scope="module")
def expected_text(server: str) -> str:
    """What the server itself answers on /invocations (greedy, so every route must match it)."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
    text = httpx.post(f"{server}/invocations", json=body, timeout=60).json()["generated_text"]
    assert text
    return text


def split_output(stdout: str, first: str, second: str) -> tuple[str, str]:
    """The two answers the scripts print: `<first>: text` then `<second>: text`."""
    head, sep, streamed = stdout.partition(f"\n{second}: ")
    assert sep and head.startswith(f"{first}: ") and streamed.endswith("\n"), stdout
    return head[len(first) + 2 :], streamed[:-1]


# --- the line iterator ----------------------------------------------------------------------

STREAM = '{"token": {"text": "café"}}\n{"token": {"text": " au lait"}, "generated_text": "x"}\n'


def parts(raw: bytes, *cuts: int) -> list[dict]:
    pieces = [raw[start:end] for start, end in zip((0, *cuts), (*cuts, len(raw)), strict=True)]
    return [{"PayloadPart": {"Bytes": piece}} for piece in pieces]


def test_line_iterator_rejoins_lines_cut_anywhere():
    raw = STREAM.encode()  # "é" is two bytes: some cuts fall inside it
    for cut in range(1, len(raw)):
        lines = list(LineIterator(parts(raw, cut, min(cut + 7, len(raw)))))
        assert lines == raw.splitlines(), cut
    assert lines[0].decode() == '{"token": {"text": "café"}}'


def test_line_iterator_keeps_a_last_line_without_newline():
    assert list(LineIterator(parts(b'{"a": 1}\n{"b"', 12))) == [b'{"a": 1}', b'{"b"']


def test_json_lines_reads_jsonlines_and_sse():
    lines = [b'{"a": 1}', b"", b'data: {"b": 2}', b"", b'data:{"c": 3}']
    assert list(json_lines(lines)) == [{"a": 1}, {"b": 2}, {"c": 3}]


# --- boto3_invoke.py, as a script -----------------------------------------------------------


def run_boto3_invoke(url: str) -> tuple[str, str]:
    """The script's two answers (invoke_endpoint, then the stream's tokens) from the server at
    `url`, on a machine with no AWS credentials (it sends unsigned requests to a local server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}
    argv = [sys.executable, str(EXAMPLES / "boto3_invoke.py"), "--endpoint-url", url,
            "--endpoint-name", "any-name", "--region", REGION, "--prompt", PROMPT,
            "--max-new-tokens", str(MAX_NEW_TOKENS)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return split_output(done.stdout, "invoke_endpoint", "invoke_endpoint_with_response_stream")


def test_boto3_invoke_script_against_the_server(server, expected_text):
    plain, streamed = run_boto3_invoke(server)
    assert plain == streamed == expected_text


# --- sagemaker_deploy.py, against moto ------------------------------------------------------


def drop_empty_members(parsed: dict, **_: object) -> None:
    """moto answers Describe* with `VpcConfig: {}` / `DataCaptureConfig: {}` where SageMaker
    leaves them out, and the SDK's pydantic shapes refuse the empty ones."""
    for key in [key for key, value in parsed.items() if value == {}]:
        del parsed[key]


@pytest.fixture
def sagemaker_deploy(monkeypatch) -> Iterator[ModuleType]:
    """The script's module (imported here: sagemaker-core takes seconds), inside mock_aws."""
    # Every new boto3 session registers these, the ones sagemaker-core makes included.
    handlers = [*botocore.handlers.BUILTIN_HANDLERS, ("after-call.sagemaker", drop_empty_members)]
    monkeypatch.setattr(botocore.handlers, "BUILTIN_HANDLERS", handlers)
    with mock.patch.dict(os.environ), mock_aws():  # main() sets the runtime endpoint variable
        yield importlib.import_module("sagemaker_deploy")


def deploy_argv(server: str, *extra: str) -> list[str]:
    return ["--role-arn", ROLE, "--image-uri", IMAGE, "--region", REGION,
            "--endpoint-name", "lmi-test", "--instance-type", "ml.c5.xlarge",
            "--instance-count", "2", "--model-id", "/opt/ml/model/model.gguf",
            "--model-data", "s3://models/smollm2.tar.gz", "--option", "max_rolling_batch_size=8",
            "--runtime-endpoint-url", server, "--prompt", PROMPT,
            "--max-new-tokens", str(MAX_NEW_TOKENS), *extra]


def test_sagemaker_deploy_creates_the_endpoint_and_invokes_it(
    sagemaker_deploy, server, expected_text, capsys
):
    sagemaker_deploy.main(deploy_argv(server))

    sm = boto3.client("sagemaker", region_name=REGION)
    model = sm.describe_model(ModelName="lmi-test")
    assert model["ExecutionRoleArn"] == ROLE
    assert model["PrimaryContainer"] == {
        "Image": IMAGE,
        "ModelDataUrl": "s3://models/smollm2.tar.gz",
        "Environment": {
            "HF_MODEL_ID": "/opt/ml/model/model.gguf",
            "OPTION_ROLLING_BATCH": "auto",
            "OPTION_MAX_ROLLING_BATCH_SIZE": "8",
        },
    }
    endpoint = sm.describe_endpoint(EndpointName="lmi-test")
    assert endpoint["EndpointStatus"] == "InService"
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    (variant,) = config["ProductionVariants"]
    assert (variant["ModelName"], variant["InstanceType"], variant["InitialInstanceCount"]) == (
        "lmi-test", "ml.c5.xlarge", 2)

    stdout = capsys.readouterr().out
    plain, streamed = split_output(
        stdout, "Endpoint.invoke", "invoke_endpoint_with_response_stream"
    )
    assert plain == streamed == expected_text


def test_sagemaker_deploy_delete_removes_what_it_created(sagemaker_deploy, server, capsys):
    sagemaker_deploy.main(deploy_argv(server, "--delete", "--max-new-tokens", "2"))

    sm = boto3.client("sagemaker", region_name=REGION)
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    assert sm.list_models()["Models"] == []
    assert "invoke_endpoint_with_response_stream: " in capsys.readouterr().out


def test_lmi_environment_maps_options_and_model_id(sagemaker_deploy):
    environment = sagemaker_deploy.lmi_environment(
        "/opt/ml/model", {"option.output_formatter": "sse", "rolling_batch": "disable"}
    )
    assert environment == {
        "HF_MODEL_ID": "/opt/ml/model",
        "OPTION_OUTPUT_FORMATTER": "sse",
        "OPTION_ROLLING_BATCH": "disable",
    }


@pytest.mark.parametrize("formatter", ["sse", "jsonlines"])
def test_boto3_invoke_script_where_the_formatter_streams_every_answer(tiny_dir, formatter):
    """option.output_formatter answers every LMI request in its format, as DJL LMI does (Accept
    does not choose): the script's invoke_endpoint reads the text from the last event."""
    with running_server(f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
                        f"option.output_formatter={formatter}") as url:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
        answer = httpx.post(f"{url}/invocations", json=body, timeout=60,
                            headers={"Accept": "application/json"})
        media_type = {"sse": "text/event-stream", "jsonlines": "application/jsonlines"}
        assert answer.headers["content-type"].split(";")[0] == media_type[formatter]
        expected = list(json_lines(answer.content.splitlines()))[-1]["generated_text"]
        plain, streamed = run_boto3_invoke(url)
    assert plain == streamed == expected
