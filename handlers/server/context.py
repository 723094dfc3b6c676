"""What every router serves from: the settings, the served models and their engines (each
attached once loaded), the admission limit they share, and the workers that do what would
hold the event loop (`offload`: tokenizing, chat templates, grammar compilation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, ParamSpec, TypeVar

import anyio
import anyio.to_thread

from handlers.engine.base import Embedder, Engine
from handlers.engine.types import AdapterActivity, GenerationRequest
from handlers.protocols.adapter_management import AdapterRecord
from handlers.protocols.chat.answer import ChatFormat
from handlers.protocols.checks import Checks, Refuse
from handlers.protocols.errors import ErrorKind, ProtocolError
from handlers.protocols.openai_responses import ResponseStore
from handlers.server.driver import validated
from handlers.server.failures import FailureStreak
from handlers.server.generation import Admission, Generation
from handlers.server.request_ids import current as current_request_id
from handlers.server.request_ids import new_id
from handlers.server.telemetry import Telemetry
from handlers.server.tracing import NO_USAGE, RequestTrace, Tracing

E = TypeVar("E", Engine, Embedder)
P = ParamSpec("P")
T = TypeVar("T")

# Threads that tokenize, render chat templates and compile grammars for requests: the
# tokenizers and xgrammar release the GIL, so the event loop keeps scheduling meanwhile.
WORKERS = 8

OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the generation model's; an embeddings-only server's embedding model's
    output_formatter: str | None = None  # json | jsonlines | sse; None: by `stream`, as DJL
    tgi_compat: bool = False
    max_request_size: int = 6 * 1024 * 1024  # bytes; SageMaker's real-time payload limit
    full_text_enabled: bool = False  # MindIE's streamed chat with the whole text in each chunk
    reasoning_parser: str | None = None  # how chat answers split thinking from the answer
    tool_call_parser: str | None = None  # how chat answers read a model family's tool calls
    auto_tool_choice: bool = True  # option.enable_auto_tool_choice (false: `auto` refused)
    dynamic_batching: bool = False  # option.rolling_batch=disable: LMI's dynamic-batch schema
    dynamic_streaming: bool = False  # option.enable_streaming: dynamic batches answer streams
    predict_timeout: float | None = None  # seconds a request may take; None: no deadline
    server_version: str = "0"  # what the server's metadata reports
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 0  # KServe V2 over gRPC; 0: off
    job_queue_size: int = 1000  # client requests held at once
    api_key: str | None = field(default=None, repr=False)  # required on every route but health
    otlp_traces_endpoint: str | None = None  # where request traces go; None: traces off
    model_dir: Path = Path(".")  # where relative adapter sources are read from
    adapter_roots: tuple[Path, ...] = ()  # the only places the adapter API reads from

    def chat_format(self, engine: Engine) -> ChatFormat:
        """How `engine`'s chat answers are read: by its own parsers where it has them."""
        return ChatFormat(self.full_text_enabled, self.reasoning_parser, self.tool_call_parser,
                          self.auto_tool_choice, engine.answer_parsing)

    def __post_init__(self) -> None:
        if self.output_formatter not in (None, *OUTPUT_FORMATTERS):
            raise ValueError(
                f"option.output_formatter must be one of {', '.join(OUTPUT_FORMATTERS)}; "
                f"got {self.output_formatter!r}"
            )


class Served(Generic[E]):
    """A model the server serves: its name (known before loading, or from the loaded model)
    and, once loaded, its engine. One `loads_later` loads while the server already answers
    (/ping does not wait for it; its requests wait in `loaded`)."""

    def __init__(self, name: str | None = None, engine: E | None = None,
                 max_failures: int = 0, loads_later: bool = False) -> None:
        self.name = name
        self.engine = engine
        self.failures = FailureStreak(max_failures)
        self.loads_later = loads_later
        self.load_error: str | None = None  # why loading failed

    def attach(self, engine: E) -> None:
        self.name = self.name or engine.model_name
        self.engine = engine

    @property
    def ready(self) -> bool:
        return (self.engine is not None and self.engine.health()
                and not self.failures.tripped)

    @property
    def loading_later(self) -> bool:
        """Still loading behind a server that answers already."""
        return self.loads_later and self.engine is None and self.load_error is None

    async def loaded(self) -> None:
        """Return once a model that loads later has loaded or failed to."""
        while self.loading_later:
            await asyncio.sleep(0.05)

    def unavailable(self) -> str:
        """Why it cannot answer (while not `ready`)."""
        if self.load_error is not None:
            return f"not loaded ({self.load_error})"
        if self.engine is None:
            return "still loading"
        return "failing every request" if self.failures.tripped else "not running"

    def ready_engine(self, refuse: Callable[[str, ErrorKind], ProtocolError]) -> E:
        """The engine, or the protocol's refusal saying why it cannot answer."""
        if not self.ready:
            raise refuse(f"the model is {self.unavailable()}", ErrorKind.UNAVAILABLE)
        return self.engine


class ServerContext:
    """The generation model (None on an embeddings-only server) and the embedding model (None
    when none is served)."""

    def __init__(self, settings: ServerSettings, generator: Served[Engine] | None,
                 embedder: Served[Embedder] | None = None) -> None:
        self.settings = settings
        self.generator = generator
        self.embedder = embedder
        self.telemetry = Telemetry(settings.model_name, self._engine_stats,  # GET /metrics
                                   self._adapter_activity)
        self.admission = Admission(settings.job_queue_size, self.telemetry.rejected)
        self.created = int(time.time())
        self.responses = ResponseStore()  # OpenAI Responses kept for retrieval: bounded LRU
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self.workers = anyio.CapacityLimiter(WORKERS)
        self._drains: list[Callable[[], Awaitable[None]]] = []
        self.adapter_records: dict[str, AdapterRecord] = {}  # what the adapter API reports
        endpoint = settings.otlp_traces_endpoint
        self.tracing = Tracing(endpoint) if endpoint is not None else None

    def text_engine(self, refuse: Refuse, not_served: Callable[[str], ProtocolError]
                    ) -> Engine:
        """The generation engine, or the protocol's answer why none can answer: `not_served`
        (given the model's name) on a server without one, else the refusal of one not ready."""
        if self.generator is None:
            raise not_served(self.settings.model_name)
        return self.generator.ready_engine(refuse)

    async def offload(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)` in a worker thread: what takes time in proportion to what
        a client sent never runs on the event loop, where it would hold every other request."""
        return await anyio.to_thread.run_sync(lambda: work(*args, **kwargs),
                                              limiter=self.workers)

    async def generation(self, engine: Engine, requests: list[GenerationRequest],
                         checks: Checks, timeout: float | None = None) -> Generation:
        """Validate (in a worker: tokenizing, grammars), admit and submit a client request's
        engine requests, under the server's deadline (option.predict_timeout) or the request's
        own `timeout`, whichever is sooner."""
        trace = self._trace(requests)
        try:
            requests = await self.offload(validated, engine, requests, checks)
            server = self.settings.predict_timeout
            own = timeout is not None and (server is None or timeout < server)
            outcome = self.generator.failures.record if self.generator is not None else None
            generation = Generation(engine, requests, self.admission,
                                    timeout if own else server, outcome,
                                    observer=self.telemetry.observer(requests, trace),
                                    timeout_source="the request's timeout" if own else
                                    "option.predict_timeout")
        except Exception as exc:
            if trace is not None:
                trace.ended(NO_USAGE, getattr(exc, "message", None) or str(exc))
            raise
        if trace is not None:
            trace.admitted(requests)
        return generation

    def _trace(self, requests: list[GenerationRequest]) -> RequestTrace | None:
        """The request's trace, when traces are on; its log lines carry the trace id."""
        if self.tracing is None:
            return None
        request_id = current_request_id() or new_id()
        trace = self.tracing.begin(request_id.trace_headers, self.settings.model_name,
                                   request_id.value,
                                   min(request.arrival_time for request in requests))
        request_id.trace_id = trace.trace_id
        return trace

    def _adapter_activity(self) -> AdapterActivity | None:
        served = self.generator
        return served.engine.adapter_activity() if served is not None and served.ready else None

    def _engine_stats(self) -> dict[str, int]:
        # Read while not ready too: counters that dropped to 0 would read as a reset.
        served = self.generator
        return served.engine.stats() if served is not None and served.engine is not None else {}

    def model_names(self) -> list[str]:
        """The names of the models served (an embedding model once it is loaded)."""
        served = (self.generator, self.embedder)
        return [model.name for model in served if model is not None and model.name is not None]

    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the generation model serves, once it is loaded."""
        served = self.generator
        return served.engine.adapters if served is not None and served.engine is not None else ()

    def ready(self) -> bool:
        """Whether every served model can answer (what /ping reports): one that loads later
        holds it back only once it failed to."""
        return all(model.ready or model.loading_later
                   for model in (self.generator, self.embedder) if model is not None)

    def embedding_model(self) -> str | None:
        """The served embedding model's name, once loaded."""
        return self.embedder.name if self.embedder is not None else None

    def on_drain(self, drain: Callable[[], Awaitable[None]]) -> None:
        """Register how a wire stops taking requests and finishes those it has."""
        self._drains.append(drain)

    def drain(self) -> None:
        """Begin draining every registered wire (HTTP drains itself); safe from any thread and
        from signal handlers."""
        if self.loop is not None:
            for drain in self._drains:
                asyncio.run_coroutine_threadsafe(drain(), self.loop)

    async def drained(self) -> None:
        """Drain every registered wire and wait until it has."""
        for drain in self._drains:
            await drain()

    async def shutdown(self) -> None:
        """Stop the engines (the HTTP server has drained its requests) and export the last
        traces."""
        if self.tracing is not None:
            await self.offload(self.tracing.shutdown)
        if self.generator is not None and self.generator.engine is not None:
            await self.generator.engine.shutdown()
        if self.embedder is not None and self.embedder.engine is not None:
            self.embedder.engine.stop()
