"""`lmi-serve`: load the configuration, start the HTTP server at once (/ping answers 503), load
the model in the background, then serve."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

from handlers.config import Config, ConfigError, load_config, log_config, parse_args
from handlers.engine.deferred import DeferredEngine
from handlers.engine.factory import build_engine
from handlers.server.app import ServerSettings, create_app

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
    sys.exit(asyncio.run(serve(config)))


async def serve(config: Config) -> int:
    engine = DeferredEngine(config.model_name)
    app = create_app(engine, ServerSettings(
        model_name=config.model_name,
        output_formatter=config.output_formatter,
        tgi_compat=config.tgi_compat,
        max_request_size=config.max_request_size,
    ))
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        timeout_graceful_shutdown=30,
    ))
    loading = asyncio.create_task(_load(config, engine, server))
    await server.serve()
    await engine.shutdown()
    return 0 if not loading.done() or loading.result() else 1


async def _load(config: Config, engine: DeferredEngine, server: uvicorn.Server) -> bool:
    try:
        real = await asyncio.to_thread(build_engine, config)
        engine.attach(real)
        await engine.start()
    except Exception as exc:
        log.exception("loading the model failed: %s", exc)
        server.should_exit = True
        return False
    log.info("model %s is ready on http://%s:%d", config.model_name, config.host, config.port)
    return True


if __name__ == "__main__":
    main()
