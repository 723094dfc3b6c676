"""A stateful session on the real server, driven with boto3 as a SageMaker client drives it: the
first turn's conversation (its prompt and its answer) stays pinned in the prefix cache, so the
second turn, which repeats it, prefills only what is new; CLOSE lets it go."""

from __future__ import annotations

import json
import re

import boto3
import httpx
from botocore.config import Config

PROMPT = ("A short story about a lighthouse keeper who finds a message in a bottle one stormy "
          "night, and what the message says:")


def metric(url: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", httpx.get(f"{url}/metrics").text,
                      re.MULTILINE)
    return float(found.group(1)) if found else None


def test_a_sessions_second_turn_finds_the_first_in_the_cache(served):
    client = boto3.client("sagemaker-runtime", endpoint_url=served.url, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          config=Config(retries={"max_attempts": 1}))

    def invoke(body: dict, session: str) -> dict:
        return client.invoke_endpoint(EndpointName="e", Body=json.dumps(body),
                                      ContentType="application/json", SessionId=session)

    session = invoke({"requestType": "NEW_SESSION"}, "NEW_SESSION")["NewSessionId"].split(";")[0]
    first = json.loads(invoke({"inputs": PROMPT, "parameters": {
        "max_new_tokens": 24, "details": True}}, session)["Body"].read())
    conversation = PROMPT + first["generated_text"]
    pinned = metric(served.url, "lmi_prefix_cache_pinned_tokens")  # None: vLLM pins nothing
    if pinned is not None:
        assert pinned >= first["details"]["generated_tokens"] + 16  # the answer and the prompt
    hits = metric(served.url, "vllm:prefix_cache_hits_total")
    invoke({"inputs": conversation + " The end.", "parameters": {"max_new_tokens": 2}}, session)
    found = metric(served.url, "vllm:prefix_cache_hits_total") - hits
    if pinned is not None:
        assert found >= pinned - 2  # all of it, but where the answer's text re-tokenizes apart
    assert found > len(PROMPT) // 8  # at least the first turn's prompt
    closed = invoke({"requestType": "CLOSE"}, session)
    assert closed["ClosedSessionId"] == session
    if pinned is not None:
        assert metric(served.url, "lmi_prefix_cache_pinned_tokens") == 0
