"""SageMaker's stateful sessions, as DJL LMI serves them: a client opens a session (a body
`{"requestType": "NEW_SESSION"}`), sends its turns with `X-Amzn-SageMaker-Session-Id`, and
closes it (`{"requestType": "CLOSE"}`); an idle session expires `option.sessions_expiration`
seconds after it was opened, as DJL's session manager has it.

The server keeps no files for a session: what a session holds is its conversation's keys and
values, pinned in the engine's prefix cache (engines that cache prefixes pin each finished
turn's tokens under the session), so its next turn prefills only what is new. Closing or
expiring a session lets them go. At most `option.max_sessions` are open at once, and, where
`option.max_sessions_per_client` is set, at most that many for one client: the address the
connection came from (uvicorn's, which takes a trusted proxy's X-Forwarded-For), the only
identity the server can vouch for. The API key is one key that every client shares, and
SageMaker passes on no caller identity (its callers all arrive from its front end).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from handlers.protocols.errors import ErrorKind, GenerationError

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"  # the session a request belongs to
NEW_SESSION = "NEW_SESSION"  # the session header's value that asks for a new session
Release = Callable[[str], Awaitable[None]]  # the engine letting a session's cache go


@dataclass(frozen=True)
class Session:
    id: str
    expires: float  # time.time() past which it is gone
    client: str | None = None  # the address it was opened from

    @property
    def header(self) -> str:
        """`X-Amzn-SageMaker-New-Session-Id`'s value: the id and its expiry."""
        stamp = datetime.fromtimestamp(self.expires, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"{self.id}; Expires={stamp}"


class Sessions:
    """The open sessions; `release` tells the engine a session's pinned cache may go."""

    def __init__(self, expiration: int, max_sessions: int, release: Release,
                 clock: Callable[[], float] = time.time,
                 per_client: int | None = None) -> None:
        self.expiration = expiration
        self.max_sessions = max_sessions
        self.per_client = per_client  # sessions one client address may hold; None: no bound
        self._release = release
        self._clock = clock
        self._open: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._open)

    async def open(self, client: str | None = None) -> Session:
        """A new session for `client` (an address; None: unknown); OVERLOADED while
        max_sessions are open, or while `client` holds its `per_client` of them."""
        await self._expire()
        if len(self._open) >= self.max_sessions:
            raise GenerationError(f"the server holds its limit of {self.max_sessions} open "
                                  "sessions (option.max_sessions); close one, or retry once "
                                  "one expired", ErrorKind.OVERLOADED)
        if client is not None and self.per_client is not None and self.per_client <= sum(
                session.client == client for session in self._open.values()):
            raise GenerationError(f"client {client} holds its limit of {self.per_client} open "
                                  "sessions (option.max_sessions_per_client); close one, or "
                                  "retry once one expired", ErrorKind.OVERLOADED)
        session = Session(str(uuid.uuid4()), self._clock() + self.expiration, client)
        self._open[session.id] = session
        return session

    async def get(self, session_id: str) -> Session:
        """An open session; the SESSION error naming an id that is unknown, closed or expired."""
        await self._expire()
        session = self._open.get(session_id)
        if session is None:
            raise GenerationError(f"session {session_id!r} is unknown, closed or expired "
                                  f"(sessions expire {self.expiration} s after they open); "
                                  "open a new one with NEW_SESSION", ErrorKind.SESSION)
        return session

    async def close(self, session_id: str) -> None:
        """Close an open session (the SESSION error for one that is not)."""
        await self.get(session_id)
        del self._open[session_id]
        await self._release(session_id)

    async def expire_every(self, seconds: float) -> None:
        """Let expired sessions go every `seconds` (each call also does), so that an idle
        server's pinned caches do not outlive them; runs until cancelled."""
        while True:
            await asyncio.sleep(seconds)
            await self._expire()

    async def _expire(self) -> None:
        now = self._clock()
        for session in [s for s in self._open.values() if s.expires <= now]:
            del self._open[session.id]
            await self._release(session.id)
