"""`lmi-serve`, the composition root: configuration -> engine registry -> app.

It checks that every setting takes effect, starts the HTTP server at once (/ping answers 503),
loads the model (within option.model_loading_timeout), loads the embedding model while the model
serves, and runs until SIGTERM or SIGINT. An engine whose loop runs fastest in the main thread
(the torch engine: ~1.4x) runs it there; the HTTP server (uvicorn) runs in a background thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import uvicorn

from handlers.config import (
    TEXT_EMBEDDING,
    Config,
    ConfigError,
    check_effects,
    config_lines,
    load_config,
    log_config,
    parse_args,
)
from handlers.djl.custom_entry import CustomEntry
from handlers.djl.model_code import ModelCodeError, ModelCodes
from handlers.djl.model_code import find as find_model_code
from handlers.engine import registry
from handlers.engine.base import (
    Embedder,
    Engine,
    EngineBuild,
    RevivableEngine,
    SupervisedLoop,
)
from handlers.model_fetch import default_cache_dir
from handlers.model_source import (
    DEFAULT_EMBEDDING_NAME,
    ModelSourceError,
    has_sentence_transformers_layout,
    is_default_embedding_id,
    resolve_embedding_source,
)
from handlers.protocols.adapter_management import AdapterRecord
from handlers.server.app import create_app
from handlers.server.context import CUT_GRACE, Served, ServerContext, ServerSettings
from handlers.server.fleet import Build, Fleet
from handlers.server.http.connections import bounded_protocol
from handlers.server.http.request_id import uvicorn_log_config
from handlers.startup_gc import StartupCollection
from handlers.stop_signals import on_first_stop_signal
from handlers.supervision import Supervisor, watch_revivable

log = logging.getLogger("lmi_serve")
SAGEMAKER_MODELS = Path("/opt/ml/models")  # where SageMaker's multi-model endpoints put models
T = TypeVar("T")


@dataclass(frozen=True)
class Loaded:
    build: EngineBuild | None  # None on an embeddings-only server
    embedder: Embedder | None = None  # loaded with the engine (an embeddings-only server's)
    embedding_files: Path | None = None  # located, to load once the engine serves
    code: ModelCodes | None = None  # the model.py files found, imported


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=(args.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,  # one stream for every log line, uvicorn's too (uvicorn_log_config)
    )
    try:
        config = load_config(args)
        check_effects(config)
        if not config.embeddings_only:
            registry.check(config)
    except ConfigError as exc:
        sys.exit(f"lmi-serve: configuration error: {exc}")
    log_config(config, log)
    follow = None if config.embeddings_only else registry.follower(config)
    sys.exit(follow(config) if follow else serve(config))


def _version() -> str:
    """The installed package's version; a checkout run without installing it (PYTHONPATH) has
    no package metadata, and serves all the same."""
    try:
        return importlib.metadata.version("lmi-serve")
    except importlib.metadata.PackageNotFoundError:
        return "0+checkout"


def server_settings(config: Config, engine: str | None = None) -> ServerSettings:
    """What the server serves by (`engine`: the registry's choice, None for embeddings only)."""
    return ServerSettings(
        model_name=config.model_name,
        output_formatter=config.output_formatter,
        tgi_compat=config.tgi_compat,
        max_request_size=config.max_request_size,
        client_body_timeout=config.client_body_timeout,
        full_text_enabled=config.full_text_enabled,
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        auto_tool_choice=config.enable_auto_tool_choice is not False,
        dynamic_batching=config.dynamic_batching,
        dynamic_streaming=config.enable_streaming,
        predict_timeout=config.predict_timeout,
        job_queue_size=config.job_queue_size,
        timeout_graceful_shutdown=config.timeout_graceful_shutdown,
        max_client_batch_size=min(config.max_client_batch_size, config.job_queue_size),
        api_key=config.api_key,
        otlp_traces_endpoint=config.otlp_traces_endpoint,
        stateful_sessions=config.enable_stateful_sessions and not config.embeddings_only,
        sessions_expiration=config.sessions_expiration,
        max_sessions=config.max_sessions,
        max_sessions_per_client=config.max_sessions_per_client,
        server_version=_version(),
        grpc_host=config.host,
        grpc_port=config.grpc_port,
        model_dir=config.model_dir,
        adapter_roots=adapter_roots(config),
        model_roots=model_roots(config),
        runtime_fetch=config.allow_runtime_fetch,
        enable_ui=config.enable_ui,
        engine=engine,
        configuration=tuple(config_lines(config)),
    )


def adapter_roots(config: Config) -> tuple[Path, ...]:
    """Where the adapter management API may read adapters: the model directory, the model
    cache, and the folders holding the adapters configured at startup."""
    return tuple(dict.fromkeys((config.model_dir, default_cache_dir(),
                                *(adapter.path.parent for adapter in config.adapters))))


def model_roots(config: Config) -> tuple[Path, ...]:
    """Where POST /models may read models: SageMaker's multi-model folder, the model
    directory, the model cache."""
    return tuple(dict.fromkeys((SAGEMAKER_MODELS, config.model_dir, default_cache_dir())))


def fleet_build(config: Config) -> Build:
    """How a model loaded at runtime is built: as the server's own model is, from its own
    files, under its own name, without the server's LoRA adapters; a sentence-transformers
    model (modules.json) as an embeddings-only server's is (option.task=text-embedding)."""
    def build(name: str, path: Path) -> Engine | Embedder:
        own = dataclasses.replace(config, model_id=str(path), model_name=name, adapters=(),
                                  lora=None, sources={**config.sources,
                                                      "model_id": "POST /models"})
        if has_sentence_transformers_layout(path):
            return registry.build_embedder(dataclasses.replace(own, task=TEXT_EMBEDDING))
        built = registry.build(own)
        return built.engine

    return build


def serve(config: Config) -> int:
    generator = None if config.embeddings_only else \
        Served(config.model_name, max_failures=config.max_consecutive_failures)
    embedder = None
    if config.embedding_source is not None:
        embedder = Served(config.model_name if config.embeddings_only else
                          _embedding_name(config.embedding_source),
                          loads_later=not config.embeddings_only)
    engine = None if config.embeddings_only else registry.chosen(config).name
    ctx = ServerContext(server_settings(config, engine), generator, embedder)
    if not config.embeddings_only:
        ctx.load_models_with(Fleet(fleet_build(config), config.max_models))
    ctx.adapter_records.update({adapter.name: AdapterRecord(adapter.name, str(adapter.path))
                                for adapter in config.adapters})
    server = uvicorn.Server(uvicorn.Config(
        create_app(ctx), host=config.host, port=config.port,
        http=bounded_protocol(config.client_header_timeout,
                              config.max_connections or 2 * config.job_queue_size),
        log_level=config.log_level.lower(),
        timeout_graceful_shutdown=config.timeout_graceful_shutdown + CUT_GRACE,
        log_config=uvicorn_log_config(),
    ))
    http = threading.Thread(target=server.run, name="http")  # no signal handlers off main
    stopping = threading.Event()

    def on_signal(signum: signal.Signals) -> None:
        log.info("received %s: finishing in-flight requests, then exiting", signum.name)
        stopping.set()
        stop_server()

    def stop_server() -> None:
        server.should_exit = True
        ctx.drain()  # gRPC stops taking requests as HTTP does

    on_first_stop_signal(on_signal)
    with StartupCollection() as startup:
        http.start()
        try:
            loaded = _load(config)
            if loaded is None or stopping.is_set():
                server.should_exit = True
                http.join()
                return 1 if loaded is None else 0
            return _run(config, ctx, loaded, http, stop_server, startup.loaded)
        except Exception:  # whatever it was, the process must not outlive it serving 503s
            log.exception("the server failed; stopping")
            stop_server()
            http.join()
            return 1


def _run(config: Config, ctx: ServerContext, loaded: Loaded, http: threading.Thread,
         stop_server: Callable[[], None], all_loaded: Callable[[], None]) -> int:
    """Attach what loaded (/ping answers 200 from here on) and run until the server stops;
    `all_loaded` runs once every model has (the embedding model may load later)."""
    built = loaded.build
    if loaded.code is not None:
        ctx.entry_code = CustomEntry(loaded.code)
    if loaded.embedder is not None:
        ctx.embedder.attach(loaded.embedder)
    if loaded.embedder is None and loaded.embedding_files is not None:
        _load_embedder_later(config, loaded.embedding_files, ctx.embedder, stop_server,
                             all_loaded)
    else:
        all_loaded()
    done = threading.Event()
    if built is not None:
        if built.main_loop is None:  # an engine that lives on the server's event loop
            while ctx.loop is None and http.is_alive():  # the server is still starting
                time.sleep(0.05)
            if ctx.loop is not None and not _started(built.engine, ctx.loop):
                stop_server()
                http.join()
                return 1
        ctx.generator.attach(built.engine)
    log.info("model %s is ready on http://%s:%d", config.model_name, config.host, config.port)
    # Stopping: the app's shutdown stops the engines once the requests drained; should the
    # HTTP server end otherwise, its end stops them here.
    stop = built.main_loop.stop if built is not None and built.main_loop else done.set
    threading.Thread(target=lambda: (http.join(), stop(), done.set()), name="drain",
                     daemon=True).start()
    status = 0
    if built is not None and isinstance(built.main_loop, SupervisedLoop):
        status = Supervisor(built.main_loop, ctx.generator.failures, config.engine_restart,
                            stop_server, http, ctx.telemetry.engine_restarted,
                            drain_limit=config.timeout_graceful_shutdown + CUT_GRACE).run()
    elif built is not None and built.main_loop is not None:
        built.main_loop.run_forever()
    elif built is not None and isinstance(built.engine, RevivableEngine) and ctx.loop:
        status = watch_revivable(built.engine, ctx.loop, config.engine_restart, stop_server,
                                 done, ctx.telemetry.engine_restarted)
    done.wait()
    http.join()
    return 1 if ctx.embedder is not None and ctx.embedder.load_error else status


def _started(engine: Engine, loop: asyncio.AbstractEventLoop) -> bool:
    """Start the engine on the server's loop; False (logged) when it fails to (vLLM loads its
    LoRA adapters there): startup stops rather than serve without it."""
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), loop).result()
    except Exception:
        log.exception("starting the engine failed; stopping")
        return False
    return True


def _load(config: Config) -> Loaded | None:
    """The engine, or on an embeddings-only server the embedding model; None when loading
    failed or took longer than option.model_loading_timeout (logged). Beside a generation
    model the embedding model's files are located (fetched) meanwhile, so a bad
    option.embedding_model_id fails the start; the model loads later (`_load_embedder_later`)."""
    if config.embeddings_only:
        loading = _in_thread(lambda: Loaded(None, _load_embedder(config),
                                            code=find_model_code(config)), "embedding-load")
    else:
        try:
            load = registry.loader(config)  # imports the engine: anything may raise there
        except Exception as error:  # noqa: BLE001 (logged: the server stops)
            log.error("importing the engine failed (option.rolling_batch=%s)",
                      config.rolling_batch, exc_info=error)
            return None
        source = config.embedding_source
        located = _in_thread(lambda: source and resolve_embedding_source(source,
                                                                         config.model_dir),
                             "embedding-fetch")
        # model.py first: its import, and its init handler, fail before the model loads
        loading = _in_thread(lambda: _loaded(find_model_code(config), load, located), "load")
    try:
        return loading.result(timeout=config.model_loading_timeout)
    except ModelCodeError as error:
        log.error("%s; stopping", error, exc_info=error.__cause__)
    except (ModelSourceError, ConfigError) as error:  # its message names what and why
        log.error("%s; stopping", error)
    except TimeoutError:
        log.error("loading the model took longer than option.model_loading_timeout=%d s "
                  "(%s); stopping", config.model_loading_timeout,
                  config.sources["model_loading_timeout"])
    except Exception as error:  # noqa: BLE001 (logged: the server stops)
        log.error("loading failed", exc_info=error)
    return None


def _loaded(code: ModelCodes | None, load: Callable[[], EngineBuild],
            located: Future[Path | None]) -> Loaded:
    return Loaded(load(), None, located.result(), code)


def _load_embedder(config: Config, files: Path | None = None) -> Embedder | None:
    """The embedding model (from `files`, where located already), loaded and started (None when
    none is served)."""
    if config.embedding_source is None:
        return None
    engine = registry.build_embedder(config, files)
    log.info("embedding model %s is ready", engine.model_name)
    return engine


def _load_embedder_later(config: Config, files: Path, served: Served[Embedder],
                         stop_server: Callable[[], None], loaded: Callable[[], None]) -> None:
    """Load the embedding model while the generation model serves: its import of
    sentence-transformers (and through it scikit-learn) takes longer than the rest of a start,
    and under the GIL it would as good as double the start. Its requests wait meanwhile. Failing
    (or outlasting option.model_loading_timeout) stops the server, as a failed start does."""
    future = _in_thread(lambda: _load_embedder(config, files), "embedding-load")

    def watch() -> None:
        try:
            served.attach(future.result(timeout=config.model_loading_timeout))
            loaded()
        except BaseException as error:  # noqa: BLE001 (a timeout or the load's own error)
            served.load_error = str(error) or type(error).__name__
            log.error("loading the embedding model failed; stopping", exc_info=error)
            stop_server()

    threading.Thread(target=watch, name="embedding-watch", daemon=True).start()


def _embedding_name(source: str) -> str | None:
    """The embedded default's served name, known before it loads (others' come from their
    files)."""
    return DEFAULT_EMBEDDING_NAME if is_default_embedding_id(source) else None


def _in_thread(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` in a daemon thread: a load that outlives its timeout must not keep the
    process from exiting."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to the waiting thread, which logs it
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


if __name__ == "__main__":
    main()
