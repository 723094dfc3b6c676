"""The HTTP connections uvicorn serves, bounded against slow and idle clients.

uvicorn (h11) starts its keep-alive timer only once an answer was sent, and every byte that
arrives stops it: a connection that never completes its request's line and headers (slowloris),
or never sends any, is held for ever (uvicorn issue #157). Here a request's head must arrive
within `header_timeout` of the connection opening or the previous answer ending, as nginx's
client_header_timeout; and the server holds at most `max_connections` connections, one more is
answered 503 and closed before it can send anything. Bodies are bounded by the app
(handlers/server/http/body.py), which can answer in the request's protocol.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from handlers.server.status import RETRY_AFTER_SECONDS

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: %d\r\nconnection: close\r\n"
                 b"content-length: 0\r\n\r\n" % RETRY_AFTER_SECONDS)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head and a connection cap
    (set by `bounded_protocol`)."""

    header_timeout: float = 60
    max_connections: int = 2000
    _head_timer: asyncio.TimerHandle | None = None
    _head_started = False  # some of the awaited request head arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: the server holds max_connections=%d",
                        self.max_connections)
            self.transport.write(OVER_CAPACITY)
            self.transport.close()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's head arrived whole
            self._head_arrived()
        elif self._head_timer is not None:
            self._head_started = True

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if not self.transport.is_closing():
            self._await_head()
        super().on_response_complete()  # may start a pipelined request at once
        if self.cycle is not cycle:
            self._head_arrived()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_arrived()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_started = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_started:  # an idle connection is closed as keep-alive closes it
            log.info("closed a connection whose request head did not arrive within %g s "
                     "(client_header_timeout)", self.header_timeout)
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def bounded_protocol(header_timeout: float, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class uvicorn.Config takes as `http`, with these bounds."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
