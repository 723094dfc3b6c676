"""The protocol tests' server on the FakeEngine (tests/fakes.py), one per module.

A module overrides `engine` or `app` for a server set up its own way (adapters, an API key, a
size limit, gRPC); a module whose tests script the engine or count what it served overrides both
at function scope, for a fresh one per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fakes import FakeEngine, served_app
from server_process import serving, serving_here


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def app(engine: FakeEngine) -> Any:
    return served_app(engine)


@pytest.fixture(scope="module")
def url(app: Any) -> Iterator[str]:
    """The app served over HTTP on a free loopback port."""
    with serving(app) as base:
        yield base


@pytest.fixture
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """httpx on the app in this process (no socket, no lifespan)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as session:
        yield session


@pytest.fixture
async def live_fake() -> AsyncIterator[tuple[FakeEngine, str]]:
    """A FakeEngine of 10 ms a token served on this test's event loop, so the test can watch the
    engine while a client hangs up mid-stream."""
    engine = FakeEngine(token_delay=0.01)
    async with serving_here(served_app(engine)) as base:
        yield engine, base
