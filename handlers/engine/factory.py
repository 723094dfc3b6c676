"""Choose and build the engine that `option.rolling_batch` asks for."""

from __future__ import annotations

from handlers.config import Config, ConfigError
from handlers.engine.base import Engine
from handlers.engine.loader import load_model, resolve_model_source


def build_engine(config: Config) -> Engine:
    """Load the model and return the (not yet started) engine. Slow: run it off the event loop."""
    # "disable" (dynamic batching) runs on the torch engine too: the HTTP server batches.
    if config.rolling_batch not in ("auto", "torch", "disable"):
        raise ConfigError(
            f"option.rolling_batch={config.rolling_batch!r} is not available in this build "
            "(available: auto, torch, disable)"
        )
    from handlers.engine.torch.engine import TorchEngine

    source = resolve_model_source(config.model_id, config.model_dir)
    loaded = load_model(
        source,
        dtype=config.dtype,
        device=config.device,
        max_model_len=config.max_model_len,
        trust_remote_code=config.trust_remote_code,
    )
    loaded.name = config.model_name
    return TorchEngine(
        loaded,
        max_batch_size=config.max_rolling_batch_size,
        max_prefill_tokens=config.max_rolling_batch_prefill_tokens,
    )
