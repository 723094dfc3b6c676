"""What every router serves from: the settings, the served models and their engines (each
attached once loaded), the admission limit they share, and the workers that do what would
hold the event loop (`offload`: tokenizing, chat templates, grammar compilation)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar

import anyio
import anyio.to_thread

from handlers.config import Line
from handlers.engine.base import Embedder, Engine
from handlers.engine.types import AdapterActivity, GenerationRequest
from handlers.protocols.adapter_management import AdapterRecord
from handlers.protocols.chat.answer import ChatFormat
from handlers.protocols.checks import Checks, Refuse
from handlers.protocols.errors import ErrorKind, GenerationError, ProtocolError
from handlers.protocols.openai_responses import ResponseStore
from handlers.server.driver import bounded, validated, with_media
from handlers.server.failures import FailureStreak
from handlers.server.generation import Admission, Generation
from handlers.server.request_ids import current as current_request_id
from handlers.server.request_ids import new_id
from handlers.server.sessions import NEW_SESSION, SESSION_HEADER, Sessions
from handlers.server.telemetry import Telemetry
from handlers.server.tracing import NO_USAGE, RequestTrace, Tracing

if TYPE_CHECKING:
    from handlers.server.fleet import Fleet
    from handlers.server.http.invocations import EntryCode

E = TypeVar("E", Engine, Embedder)
P = ParamSpec("P")
T = TypeVar("T")

# Threads that tokenize, render chat templates and compile grammars for requests: the
# tokenizers and xgrammar release the GIL, so the event loop keeps scheduling meanwhile.
WORKERS = 8
# Threads that read requests' media (fetching URLs, at most engine/media's MAX_FETCHES at once,
# and decoding): apart from WORKERS, so slow media hold up only other media.
MEDIA_WORKERS = 16

OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")

# Seconds a generation cut at the drain limit gets to send its error event before the HTTP and
# gRPC servers end what is left.
CUT_GRACE = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the generation model's; an embeddings-only server's embedding model's
    output_formatter: str | None = None  # json | jsonlines | sse; None: by `stream`, as DJL
    tgi_compat: bool = False
    max_request_size: int = 6 * 1024 * 1024  # bytes; SageMaker's real-time payload limit
    client_body_timeout: float = 60  # seconds a request body may pause (then 408)
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
    job_queue_size: int = 1000  # sequences held at once, queued or running
    # Seconds requests get to finish once the server stops; then the generations still running
    # end with their protocol's error (SageMaker's SIGKILL comes 30 s after its SIGTERM).
    timeout_graceful_shutdown: float = 25
    max_client_batch_size: int = 256  # sequences one client request may ask for
    api_key: str | None = field(default=None, repr=False)  # required on every route but health
    otlp_traces_endpoint: str | None = None  # where request traces go; None: traces off
    stateful_sessions: bool = True  # option.enable_stateful_sessions (DJL LMI's default)
    sessions_expiration: int = 1200  # seconds a session lives after it opened
    max_sessions: int = 1000  # sessions open at once
    max_sessions_per_client: int | None = None  # of them opened from one address; None: any
    model_dir: Path = Path(".")  # where relative adapter sources are read from
    adapter_roots: tuple[Path, ...] = ()  # the only places the adapter API reads from
    model_roots: tuple[Path, ...] = ()  # the only places POST /models reads from
    runtime_fetch: bool = False  # option.allow_runtime_fetch: those may fetch s3:// or Hub ids
    enable_ui: bool = True  # option.enable_ui: the page (GET /ui, GET / asked for HTML)
    engine: str | None = None  # the engine the registry chose (torch, llamacpp, vllm)
    configuration: tuple[Line, ...] = ()  # the effective settings and their sources (GET /config)

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
                 max_failures: int = 0, loads_later: bool = False, embeds: bool = False) -> None:
        self.name = name
        self.engine = engine
        self.embeds = embeds  # an embedding model's (an Embedder), not a generation engine
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
                 embedder: Served[Embedder] | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: the wall clock sessions expire by (tests step their own)."""
        self.settings = settings
        self.generator = generator
        self.embedder = embedder
        if embedder is not None:
            embedder.embeds = True
        self.telemetry = Telemetry(settings.model_name, self._engine_stats,  # GET /metrics
                                   self._adapter_activity)
        self.admission = Admission(settings.job_queue_size, self.telemetry.rejected)
        self.created = int(time.time())
        self.responses = ResponseStore()  # OpenAI Responses kept for retrieval: bounded LRU
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self.workers = anyio.CapacityLimiter(WORKERS)
        self.media_workers = anyio.CapacityLimiter(MEDIA_WORKERS)
        self._drains: list[Callable[[], Awaitable[None]]] = []
        self._draining: set[asyncio.Task] = set()
        self._cut_timer: asyncio.TimerHandle | None = None  # set once draining began
        self._generations: weakref.WeakSet[Generation] = weakref.WeakSet()  # what a drain cuts
        self.adapter_records: dict[str, AdapterRecord] = {}  # what the adapter API reports
        self.fleet: Fleet | None = None  # models loaded at runtime (POST /models), when served
        self.entry_code: EntryCode | None = None  # a model.py's, at LMI's entry, once imported
        endpoint = settings.otlp_traces_endpoint
        self.tracing = Tracing(endpoint) if endpoint is not None else None
        self.sessions = Sessions(settings.sessions_expiration, settings.max_sessions,
                                 self._release_session, clock,
                                 per_client=settings.max_sessions_per_client
                                 ) if settings.stateful_sessions else None
        if self.sessions is not None:
            self.telemetry.open_sessions(self.sessions.__len__)

    def text_engine(self, refuse: Refuse, not_served: Callable[[str], ProtocolError],
                    named: object = None) -> Engine:
        """The generation engine a request is for, or the protocol's answer why none can
        answer: the model its caller targets (SageMaker's `X-Amzn-SageMaker-Target-Model`,
        `/models/{name}/invoke`: 404 when none such is loaded), else the loaded model the body
        `named`, else the server's own; `not_served` (given the model's name) on a server
        without one, else the refusal of one not ready."""
        target = self.targeted()
        served = self.served(target) if target is not None else None
        if target is not None and served is None:
            raise refuse(f"model {target!r} is not loaded", ErrorKind.NOT_FOUND)
        if served is not None and served.embeds:
            raise refuse(f"model {target!r} is an embedding model: it generates no text; send "
                         '{"input": [...]} for its embeddings', ErrorKind.VALIDATION)
        if served is None:
            served = self.generation_model(named) if isinstance(named, str) else self.generator
        if served is None:
            raise not_served(self.settings.model_name)
        return served.ready_engine(refuse)

    def embedding_model_for(self, refuse: Refuse, named: object = None
                            ) -> Served[Embedder] | None:
        """The embedding model a request is for: the model its caller targets (the protocol's
        refusal when that one generates text), else a model loaded at runtime the body `named`,
        else the server's own (None without one)."""
        target = self.targeted()
        if target is not None:
            served = self.served(target)
            if served is None or not served.embeds:
                raise refuse(f"model {target!r} is not an embedding model loaded here",
                             ErrorKind.NOT_FOUND)
            return served
        model = self.fleet.get(named) if self.fleet is not None and isinstance(named, str) \
            else None
        return model.served if model is not None and model.served.embeds else self.embedder

    def targeted(self) -> str | None:
        """The model the request's caller targets (`X-Amzn-SageMaker-Target-Model`,
        `/models/{name}/invoke`), if any."""
        bound = current_request_id()
        return bound.target if bound is not None else None

    def load_models_with(self, fleet: Fleet) -> None:
        """Serve models loaded at runtime through `fleet`, each generation model under its own
        series in /metrics."""
        self.fleet = fleet
        fleet.on_loaded = lambda name, engine: None if isinstance(engine, Embedder) else \
            self.telemetry.add_engine(name, engine.stats, engine.adapter_activity)
        fleet.on_unloaded = lambda name, _engine: self.telemetry.remove_engine(name)

    def served(self, name: str) -> Served | None:
        """The model served under `name`: the server's own, its embedding model, or one loaded
        at runtime."""
        for served in (self.generator, self.embedder):
            if served is not None and served.name == name:
                return served
        model = self.fleet.get(name) if self.fleet is not None else None
        return model.served if model is not None else None

    def name_of(self, engine: Engine) -> str:
        """The name `engine` serves under (a model loaded at runtime's, else the server's)."""
        return self._served_by(engine).name or self.settings.model_name

    def _served_by(self, engine: Engine) -> Served[Engine]:
        if self.fleet is not None:
            for model in self.fleet.models.values():
                if model.served.engine is engine:
                    return model.served
        return self.generator or Served(self.settings.model_name, engine)

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
        served = self._served_by(engine)
        trace = self._trace(requests, served.name or self.settings.model_name)
        try:
            bounded(requests, self.settings.max_client_batch_size, checks)
            requests = await self._in_session(requests)
            requests = await self._with_media(requests, checks)
            requests = await self.offload(validated, engine, requests, checks)
            server = self.settings.predict_timeout
            own = timeout is not None and (server is None or timeout < server)
            generation = Generation(engine, requests, self.admission,
                                    timeout if own else server, served.failures.record,
                                    observer=self.telemetry.observer(requests, trace,
                                                                     served.name),
                                    timeout_source="the request's timeout" if own else
                                    "option.predict_timeout")
        except Exception as exc:
            if trace is not None:
                trace.ended(NO_USAGE, getattr(exc, "message", None) or str(exc))
            raise
        if trace is not None:
            trace.admitted(requests)
        self._generations.add(generation)
        return generation

    async def _with_media(self, requests: list[GenerationRequest], checks: Checks
                          ) -> list[GenerationRequest]:
        """Each request's media read (fetched, checked, decoded) in threads of their own, so a
        slow URL holds none of the workers other requests are validated in; a part that cannot
        be used is the protocol's refusal naming it."""
        read = []
        for index, request in enumerate(requests):
            if request.pending_media is not None:
                request = await anyio.to_thread.run_sync(with_media, request, checks, index,
                                                         limiter=self.media_workers)
            read.append(request)
        return read

    async def _in_session(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        """The requests, in the stateful session the caller named (if any, and open)."""
        request_id = current_request_id()
        named = request_id.session if request_id is not None else None
        if not named or named == NEW_SESSION:  # DJL LMI: NEW_SESSION on a generation: none
            return requests
        if self.sessions is None:
            raise GenerationError(f"stateful sessions are off (option.enable_stateful_sessions="
                                  f"false): {SESSION_HEADER} is refused", ErrorKind.SESSION)
        await self.sessions.get(named)
        return [replace(request, session=named) for request in requests]

    async def _release_session(self, session: str) -> None:
        for engine in self._engines():
            await engine.release_session(session)

    def _engines(self) -> list[Engine]:
        """Every generation engine loaded: the server's own and those loaded at runtime."""
        served = [self.generator] if self.generator is not None else []
        if self.fleet is not None:
            served += [model.served for model in self.fleet.models.values()]
        return [s.engine for s in served if s.engine is not None]

    def _trace(self, requests: list[GenerationRequest], model: str) -> RequestTrace | None:
        """The request's trace, when traces are on; its log lines carry the trace id."""
        if self.tracing is None:
            return None
        request_id = current_request_id() or new_id()
        trace = self.tracing.begin(request_id.trace_headers, model, request_id.value,
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
        """The names of the models served (an embedding model once it is loaded, the models
        loaded at runtime)."""
        served = (self.generator, self.embedder)
        loaded = list(self.fleet.models) if self.fleet is not None else []
        return [model.name for model in served if model is not None and model.name is not None
                ] + loaded

    def adapters(self, served: Served[Engine] | None = None) -> tuple[str, ...]:
        """The LoRA adapters a generation model (the server's own unless `served` names
        another) serves, once it is loaded."""
        served = served or self.generator
        return served.engine.adapters if served is not None and served.engine is not None else ()

    def generation_model(self, name: str) -> Served[Engine] | None:
        """The generation model a protocol's model name is for: one loaded at runtime by that
        name, else the server's own (which the protocol checks the name against)."""
        model = self.fleet.get(name) if self.fleet is not None else None
        return model.served if model is not None and not model.served.embeds else self.generator

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
        """Begin draining every registered wire (HTTP drains itself), and past
        settings.timeout_graceful_shutdown cut the generations still running; safe from any
        thread and from signal handlers (a loop that closed has nothing left to drain)."""
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._begin_draining)

    def _begin_draining(self) -> None:
        if self._cut_timer is not None:
            return
        self._cut_timer = asyncio.get_running_loop().call_later(
            self.settings.timeout_graceful_shutdown, self._cut_generations)
        for drain in self._drains:
            task = asyncio.create_task(drain())
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    def _cut_generations(self) -> None:
        limit = self.settings.timeout_graceful_shutdown
        running = [generation for generation in self._generations if not generation.closed]
        if running:
            log.warning("%d request(s) still running past the drain limit "
                        "(timeout_graceful_shutdown=%g s): ending them", len(running), limit)
        for generation in running:
            generation.cut(f"the server is shutting down: the answer ran past its drain limit "
                           f"of {limit:g} s")

    async def drained(self) -> None:
        """Drain every registered wire and wait until it has."""
        for drain in self._drains:
            await drain()
        if self._cut_timer is not None:
            self._cut_timer.cancel()

    async def shutdown(self) -> None:
        """Stop the engines (the HTTP server has drained its requests) and export the last
        traces."""
        if self.tracing is not None:
            await self.offload(self.tracing.shutdown)
        if self.fleet is not None:
            for name in list(self.fleet.models):
                await self.fleet.unload(name)
        if self.generator is not None and self.generator.engine is not None:
            await self.generator.engine.shutdown()
        if self.embedder is not None and self.embedder.engine is not None:
            self.embedder.engine.stop()
