"""SageMaker's stateful sessions as a client uses them, with boto3's `sagemaker-runtime`
(`SessionId=...`) against a server on the FakeEngine: NEW_SESSION answers an id and its expiry
in `NewSessionId`, the session's turns reach the engine under it, CLOSE answers `ClosedSessionId`
and lets the engine release what it kept; an unknown, closed or expired id is a 400 naming it,
on every protocol; the number of open sessions is bounded."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import boto3
import httpx
import openai
import pytest
from botocore.config import Config
from fakes import FakeEngine, served_app
from server_process import serving

from handlers.server.sessions import Sessions

HEADER = "X-Amzn-SageMaker-Session-Id"


def runtime(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1}))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeEngine, str]]:
    engine = FakeEngine()
    with serving(served_app(engine, max_sessions=3)) as url:
        yield engine, url


def invoke(client, body: dict, session: str | None = None, stream: bool = False) -> dict:
    call = client.invoke_endpoint_with_response_stream if stream else client.invoke_endpoint
    extra = {"SessionId": session} if session is not None else {}
    return call(EndpointName="e", Body=json.dumps(body), ContentType="application/json",
                **extra)


def open_session(client) -> str:
    answer = invoke(client, {"requestType": "NEW_SESSION"}, "NEW_SESSION")
    session, expires = answer["NewSessionId"].split("; Expires=")
    stamp = datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs(stamp.timestamp() - (time.time() + 1200)) < 120  # DJL's default: 20 minutes
    assert re.fullmatch(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*", session)  # SageMaker's id pattern
    assert json.loads(answer["Body"].read()) == {"result": f"Session {session} created"}
    return session


def close_session(client, session: str) -> None:
    answer = invoke(client, {"requestType": "CLOSE"}, session)
    assert answer["ClosedSessionId"] == session


def test_a_sessions_turns_reach_the_engine_under_it_until_closed(server):
    engine, url = server
    client = runtime(url)
    session = open_session(client)
    answer = invoke(client, {"inputs": "a b", "parameters": {"max_new_tokens": 3}}, session)
    assert json.loads(answer["Body"].read())["generated_text"]
    assert engine.requests[-1].session == session
    streamed = invoke(client, {"inputs": "a b c", "stream": True}, session, stream=True)
    assert b"".join(event["PayloadPart"]["Bytes"] for event in streamed["Body"])
    assert engine.requests[-1].session == session
    invoke(client, {"inputs": "a"})
    assert engine.requests[-1].session is None
    close_session(client, session)
    assert engine.released_sessions[-1] == session
    with pytest.raises(client.exceptions.ModelError) as refused:
        invoke(client, {"inputs": "a b"}, session)
    assert refused.value.response["OriginalStatusCode"] == 400
    assert session in refused.value.response["OriginalMessage"]


def test_every_protocol_refuses_an_unknown_session_naming_it(server):
    _, url = server
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no-such-session"):
        chat.chat.completions.create(model="fake-model", messages=[{"role": "user",
                                                                    "content": "a"}],
                                     extra_headers={HEADER: "no-such-session"})
    generate = httpx.post(f"{url}/generate", json={"inputs": "a"},
                          headers={HEADER: "no-such-session"})
    assert generate.status_code == 400 and "no-such-session" in generate.json()["error"]
    lmi = httpx.post(f"{url}/invocations", json={"inputs": "a"}, headers={HEADER: "gone"})
    assert (lmi.status_code, lmi.json()["code"]) == (400, 400)
    assert "'gone'" in lmi.json()["error"]


def test_a_new_session_header_on_a_generation_is_no_session(server):
    """As DJL LMI reads it: NEW_SESSION on a generation request opens nothing."""
    engine, url = server
    answer = httpx.post(f"{url}/invocations", json={"inputs": "a"},
                        headers={HEADER: "NEW_SESSION"})
    assert answer.status_code == 200 and engine.requests[-1].session is None


def test_session_requests_that_cannot_be_served(server):
    _, url = server
    client = runtime(url)
    with pytest.raises(client.exceptions.ModelError, match="needs the session"):
        invoke(client, {"requestType": "CLOSE"})
    with pytest.raises(client.exceptions.ModelError, match="no-such"):
        invoke(client, {"requestType": "CLOSE"}, "no-such")
    bad = httpx.post(f"{url}/invocations", json={"requestType": "RESUME"})
    assert bad.status_code == 400 and "NEW_SESSION or CLOSE" in bad.json()["error"]


def test_open_sessions_are_bounded_and_counted(server):
    _, url = server
    client = runtime(url)
    opened = [open_session(client) for _ in range(3)]
    assert 'lmi_open_sessions{model="fake-model"} 3.0' in httpx.get(f"{url}/metrics").text
    with pytest.raises(client.exceptions.ModelError) as refused:
        invoke(client, {"requestType": "NEW_SESSION"}, "NEW_SESSION")
    assert refused.value.response["OriginalStatusCode"] == 503
    assert "option.max_sessions" in refused.value.response["OriginalMessage"]
    for session in opened:
        close_session(client, session)


def test_one_client_address_holds_at_most_its_share_of_sessions():
    """option.max_sessions_per_client: NEW_SESSION calls from one client address stop at its
    share, and other clients still open theirs. The clients here come through a proxy on the
    loopback, which uvicorn trusts (FORWARDED_ALLOW_IPS), each named by X-Forwarded-For."""
    def new_session(http: httpx.Client, client: str) -> httpx.Response:
        return http.post("/invocations", json={"requestType": "NEW_SESSION"},
                         headers={HEADER: "NEW_SESSION", "X-Forwarded-For": client})

    with serving(served_app(FakeEngine(), max_sessions=10, max_sessions_per_client=2)) as url, \
            httpx.Client(base_url=url) as http:
        hostile = [new_session(http, "203.0.113.7") for _ in range(3)]
        other = new_session(http, "198.51.100.2")
        session = hostile[0].headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        closed = http.post("/invocations", json={"requestType": "CLOSE"},
                           headers={HEADER: session, "X-Forwarded-For": "203.0.113.7"})
        again = new_session(http, "203.0.113.7")
    assert [answer.status_code for answer in hostile] == [200, 200, 503]
    assert hostile[2].json()["error"] == (
        "client 203.0.113.7 holds its limit of 2 open sessions "
        "(option.max_sessions_per_client); close one, or retry once one expired")
    assert other.status_code == 200 and "X-Amzn-SageMaker-New-Session-Id" in other.headers
    assert closed.status_code == 200 and again.status_code == 200  # its place came back


def test_sessions_off_refuse_the_header_and_the_requests():
    with serving(served_app(FakeEngine(), stateful_sessions=False)) as url:
        answer = httpx.post(f"{url}/invocations", json={"inputs": "a"}, headers={HEADER: "s"})
        assert answer.status_code == 400
        assert "option.enable_stateful_sessions" in answer.json()["error"]
        opened = httpx.post(f"{url}/invocations", json={"requestType": "NEW_SESSION"})
        assert opened.status_code == 400
        assert "lmi_open_sessions" not in httpx.get(f"{url}/metrics").text


async def test_an_expired_session_is_gone_and_released():
    now = [1000.0]
    released: list[str] = []

    async def release(session: str) -> None:
        released.append(session)

    sessions = Sessions(expiration=60, max_sessions=10, release=release, clock=lambda: now[0])
    kept, lapsing = await sessions.open(), await sessions.open()
    assert kept.expires == lapsing.expires == 1060.0
    now[0] = 1059.0
    await sessions.get(lapsing.id)
    now[0] = 1060.0
    with pytest.raises(Exception, match=f"session '{lapsing.id}' is unknown, closed or expired"):
        await sessions.get(lapsing.id)
    assert sorted(released) == sorted([kept.id, lapsing.id]) and len(sessions) == 0


def test_a_session_past_its_expiry_is_refused_naming_it():
    engine = FakeEngine()
    now = [1000.0]  # the server's wall clock, stepped by the test
    with serving(served_app(engine, sessions_expiration=60, clock=lambda: now[0])) as url:
        client = runtime(url)
        answer = invoke(client, {"requestType": "NEW_SESSION"}, "NEW_SESSION")
        session = answer["NewSessionId"].split(";")[0]
        now[0] = 1059.0  # a second before its expiry
        invoke(client, {"inputs": "a"}, session)
        assert engine.released_sessions == []
        now[0] = 1060.0
        expired = httpx.post(f"{url}/invocations", json={"inputs": "a"},
                             headers={HEADER: session})
    assert expired.status_code == 400 and session in expired.json()["error"]
    assert engine.released_sessions == [session]
