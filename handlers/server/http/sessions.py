"""Stateful sessions on /invocations, as DJL LMI answers them (handlers/server/sessions.py keeps
them): `{"requestType": "NEW_SESSION"}` opens one and answers its id and expiry in
`X-Amzn-SageMaker-New-Session-Id: <id>; Expires=<UTC time>`; `{"requestType": "CLOSE"}` closes
the one `X-Amzn-SageMaker-Session-Id` names and answers `X-Amzn-SageMaker-Closed-Session-Id`.
boto3's `invoke_endpoint(SessionId=...)` sends that header and reads both answers' headers
(`NewSessionId`, `ClosedSessionId`). Refusals are LMI's `{"error", "code": 400}`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from handlers.protocols.errors import ErrorKind
from handlers.protocols.lmi import LmiError
from handlers.protocols.schemas.lmi import LmiErrorBody
from handlers.protocols.schemas.sagemaker import SessionAnswer, SessionRequest
from handlers.server.context import ServerContext
from handlers.server.framing import Answer, Reply
from handlers.server.http.descriptor import JSON, Body, Doc, Protocol, error_bodies
from handlers.server.http.guard import guarded
from handlers.server.http.lmi import LMI
from handlers.server.sessions import NEW_SESSION, SESSION_HEADER

NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
CLOSE = "CLOSE"


async def session_body(ctx: ServerContext, request: Request, body: Any) -> Answer:
    async def answer() -> Answer:
        kind = body["requestType"]
        if ctx.sessions is None:
            raise LmiError(f"stateful sessions are off (option.enable_stateful_sessions=false): "
                           f"requestType {kind!r} is refused", ErrorKind.SESSION)
        if kind == NEW_SESSION:
            session = await ctx.sessions.open(request.client.host if request.client else None)
            return Reply(200, {"result": f"Session {session.id} created"},
                         {NEW_SESSION_HEADER: session.header})
        if kind == CLOSE:
            named = request.headers.get(SESSION_HEADER)
            if not named or named == NEW_SESSION:
                raise LmiError(f"requestType CLOSE needs the session to close in {SESSION_HEADER}",
                               ErrorKind.SESSION)
            await ctx.sessions.close(named)
            return Reply(200, {"result": f"Session {named} closed"},
                         {CLOSED_SESSION_HEADER: named})
        raise LmiError(f"requestType must be {NEW_SESSION} or {CLOSE}, not {kind!r}",
                       ErrorKind.SESSION)

    return await guarded(LMI, answer)


SESSIONS = Doc("Stateful sessions (DJL LMI's): open or close one", SessionRequest,
               {JSON: SessionAnswer}, error_bodies(LmiErrorBody, 400, 503))
PROTOCOL = Protocol(bodies=(Body(0, lambda _ctx, body, _headers: "requestType" in body,
                                 session_body, SESSIONS),))
