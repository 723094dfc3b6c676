"""`lmi-serve`: load the configuration, start the HTTP server at once (/ping answers 503), load
the model (and the embedding model beside it), then run the engine loop in the main thread until
SIGTERM or SIGINT. With option.task=text-embedding no LLM is loaded: the embedding model alone is
served and generation requests are refused.

The HTTP server (uvicorn) runs in a background thread and the engine in the main thread: torch
ops measured ~1.4x faster in the process's main thread than in another one.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from handlers.config import Config, ConfigError, load_config, log_config, parse_args
from handlers.engine.base import Engine
from handlers.engine.deferred import DeferredEngine, NoGeneration
from handlers.engine.factory import build_engine
from handlers.server.app import ServerSettings, create_app
from handlers.server.dynamic_handler import DynamicBatching
from handlers.server.embedding_routes import EmbeddingSlot

log = logging.getLogger("lmi_serve")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=(args.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(args)
    except ConfigError as exc:
        sys.exit(f"lmi-serve: configuration error: {exc}")
    log_config(config, log)
    sys.exit(serve(config))


def serve(config: Config) -> int:
    engine = DeferredEngine(config.model_name)
    embeddings = EmbeddingSlot() if config.embedding_source is not None else None
    app = create_app(engine, _server_settings(config), embeddings)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        timeout_graceful_shutdown=30,
    ))
    http = threading.Thread(target=server.run, name="http")  # no signal handlers off main
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: finishing in-flight requests, then exiting",
                 signal.Signals(signum).name)
        stopping.set()
        server.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    http.start()
    real = _load(config, embeddings)
    if real is None or stopping.is_set():
        server.should_exit = True
        http.join()
        _stop_embeddings(embeddings)
        return 1 if real is None else 0
    engine.attach(real)  # /ping answers 200 from here on: everything is loaded
    # The engine stops once the HTTP server has drained its in-flight requests.
    threading.Thread(target=lambda: (http.join(), real.stop()), name="drain", daemon=True).start()
    log.info("model %s is ready on http://%s:%d", config.model_name, config.host, config.port)
    real.run_forever()
    http.join()
    _stop_embeddings(embeddings)
    return 0


def _server_settings(config: Config) -> ServerSettings:
    return ServerSettings(
        model_name=config.model_name,
        output_formatter=config.output_formatter,
        tgi_compat=config.tgi_compat,
        max_request_size=config.max_request_size,
        full_text_enabled=config.full_text_enabled,
        embeddings_only=config.embeddings_only,
        dynamic_batching=DynamicBatching(
            config.batch_size, config.max_batch_delay, config.enable_streaming
        ) if config.rolling_batch == "disable" else None,
    )


def _load(config: Config, embeddings: EmbeddingSlot | None) -> Engine | None:
    """Load the LLM here (the main thread) and the embedding model beside it, in a worker thread:
    its imports alone take seconds. None when either failed (logged)."""
    with ThreadPoolExecutor(1, thread_name_prefix="embedding-load") as pool:
        pending = pool.submit(_attach_embeddings, config, embeddings) if embeddings else None
        try:
            real = (NoGeneration(config.model_name) if config.embeddings_only
                    else build_engine(config))
        except Exception:
            log.exception("loading the model failed")
            real = None
        embedded = pending is None or pending.result()
    return real if embedded else None


def _attach_embeddings(config: Config, slot: EmbeddingSlot) -> bool:
    """Load the embedding model and start its worker; False if that failed."""
    from handlers.engine.embeddings import EmbeddingEngine, load_embedding_model

    source = config.embedding_source
    try:
        loaded = load_embedding_model(source, base_dir=config.model_dir)
    except Exception:
        log.exception("loading the embedding model %r failed", source)
        return False
    if config.embeddings_only:
        loaded.name = config.model_name  # option.model_name applies to the one model served
    engine = EmbeddingEngine(loaded)
    engine.start()
    slot.attach(engine)
    log.info("embedding model %s is ready", engine.model_name)
    return True


def _stop_embeddings(slot: EmbeddingSlot | None) -> None:
    if slot is not None and slot.engine is not None:
        slot.engine.stop()


if __name__ == "__main__":
    main()
