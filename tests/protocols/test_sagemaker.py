"""The SageMaker runtime emulation: the event-stream encoder against botocore's decoder, and boto3's
`sagemaker-runtime` client against a real server on the FakeEngine (tests/fakes.py)."""

from __future__ import annotations

import logging

import boto3
import httpx
import orjson
import pytest
from botocore.config import Config
from botocore.eventstream import EventStreamBuffer
from botocore.exceptions import ClientError, EventStreamError
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.protocols.sagemaker_eventstream import encode_frame, model_stream_error, payload_part

STREAM_BODY = {"inputs": "a b c", "parameters": {"max_new_tokens": 5}, "stream": True}


def decode(raw: bytes, split_at: int | None = None) -> list:
    buffer = EventStreamBuffer()
    pieces = [raw] if split_at is None else [raw[:split_at], raw[split_at:]]
    messages = []
    for piece in pieces:
        buffer.add_data(piece)
        messages.extend(buffer)
    return messages


# --- the encoder ----------------------------------------------------------------------------


def test_payload_part_decodes_in_botocore():
    raw = payload_part(b'{"token": 1}\n') + payload_part(b"")
    first, empty = decode(raw, split_at=7)
    assert first.headers == {
        ":event-type": "PayloadPart",
        ":message-type": "event",
        ":content-type": "application/octet-stream",
    }
    assert first.payload == b'{"token": 1}\n'
    assert empty.payload == b""


def test_model_stream_error_decodes_in_botocore():
    (message,) = decode(model_stream_error("boom"))
    assert message.headers[":message-type"] == "exception"
    assert message.headers[":exception-type"] == "ModelStreamError"
    assert orjson.loads(message.payload) == {"ErrorCode": "StreamBroken", "Message": "boom"}


def test_non_ascii_headers_and_large_payload_round_trip():
    payload = bytes(range(256)) * 1000
    (message,) = decode(encode_frame({"x-név": "érték"}, payload))
    assert (message.headers, message.payload) == ({"x-név": "érték"}, payload)


# --- boto3 against the server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(url: str):
    return boto3.client(
        "sagemaker-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}),
    )


def invocations(url: str, body: dict) -> bytes:
    response = httpx.post(f"{url}/invocations", content=orjson.dumps(body))
    assert response.status_code == 200
    return response.content


def stream(runtime, body: dict, **kwargs) -> tuple[dict, list[bytes]]:
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName="any-name", Body=orjson.dumps(body), ContentType="application/json", **kwargs
    )
    return response, [event["PayloadPart"]["Bytes"] for event in response["Body"]]


def test_invoke_endpoint_returns_the_lmi_json(url, runtime):
    body = {"inputs": "Deep learning is", "parameters": {"max_new_tokens": 4}}
    response = runtime.invoke_endpoint(
        EndpointName="my-endpoint",
        Body=orjson.dumps(body),
        ContentType="application/json",
        CustomAttributes="trace=1",
    )
    assert response["Body"].read() == invocations(url, body)
    assert orjson.loads(invocations(url, body)) == {"generated_text": " Deep learning is Deep"}
    assert response["ContentType"] == "application/json"
    assert response["CustomAttributes"] == "trace=1"


def test_response_stream_reassembles_into_the_invocations_stream(url, runtime):
    response, parts = stream(runtime, STREAM_BODY, CustomAttributes="a=b", Accept="*/*")
    assert len(parts) > 1
    assert b"".join(parts) == invocations(url, STREAM_BODY)
    assert response["ContentType"].startswith("application/jsonlines")
    assert response["CustomAttributes"] == "a=b"


def test_non_streaming_body_on_the_stream_route_is_one_part(url, runtime):
    body = {"inputs": "x y", "parameters": {"max_new_tokens": 2}}
    response, parts = stream(runtime, body)
    assert parts == [invocations(url, body)]
    assert response["ContentType"] == "application/json"


def test_failure_mid_stream_is_a_model_stream_error(runtime):
    body = {**STREAM_BODY, "inputs": "a b [[raise:2]]"}
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName="e", Body=orjson.dumps(body), ContentType="application/json"
    )
    parts = []
    with pytest.raises(EventStreamError) as caught:
        for event in response["Body"]:
            parts.append(event["PayloadPart"]["Bytes"])
    assert caught.value.response["Error"]["Code"] == "ModelStreamError"
    tokens = [orjson.loads(line)["token"]["text"] for line in b"".join(parts).splitlines()]
    assert tokens == [" a", " b"]


@pytest.mark.parametrize("operation", ["invoke_endpoint", "invoke_endpoint_with_response_stream"])
def test_container_errors_are_model_errors(runtime, operation):
    bad = {"inputs": "a", "parameters": {"max_new_tokens": -1}}
    with pytest.raises(ClientError) as caught:
        getattr(runtime, operation)(EndpointName="e", Body=orjson.dumps(bad))
    error = caught.value.response
    assert error["Error"]["Code"] == "ModelError"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 424  # LMI answers failed validation with 424
    assert "max_new_tokens" in error["OriginalMessage"]


def test_inference_id_is_the_request_id_in_logs(runtime, caplog):
    body = orjson.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 1}})
    with caplog.at_level(logging.INFO, logger="handlers"):
        runtime.invoke_endpoint(EndpointName="e", Body=body, InferenceId="inference-42")
    assert any("[RequestId=inference-42]" in r.getMessage() for r in caplog.records)


def test_dynamic_batch_stream_failure_is_a_model_stream_error():
    app = served_app(FakeEngine(), dynamic=(2, 10, True))  # batch_size, delay ms, streaming
    with serving(app) as url:
        client = boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id="x", aws_secret_access_key="x")
        body = {"inputs": ["a b [[raise:2]]"], "parameters": {"max_new_tokens": 4}}
        response = client.invoke_endpoint_with_response_stream(
            EndpointName="e", Body=orjson.dumps(body))
        parts = []
        with pytest.raises(EventStreamError) as caught:
            for event in response["Body"]:
                parts.append(event["PayloadPart"]["Bytes"])
        assert caught.value.response["Error"]["Code"] == "ModelStreamError"
        lines = [orjson.loads(line) for line in b"".join(parts).splitlines()]
        assert lines == [{"outputs": [" a"]}, {"outputs": [" b"]}]
