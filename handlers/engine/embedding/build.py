"""Build the embedding engine for a configuration (the registry's entry point for `embedding`):
the model option.embedding_model_id names beside a generation model, or option.model_id on an
embeddings-only server (option.task=text-embedding)."""

from __future__ import annotations

from pathlib import Path

from handlers.config import Config
from handlers.engine.embedding.engine import EmbeddingEngine
from handlers.engine.embedding.model import load_embedding_model


def build(config: Config, files: Path | None = None) -> EmbeddingEngine:
    """The embedding model (from `files`, where located already), loaded and started."""
    revision = config.revision if config.embeddings_only else None  # option.model_id's
    loaded = load_embedding_model(config.embedding_source, base_dir=config.model_dir,
                                  device=config.device, revision=revision, files=files)
    if config.embeddings_only:
        loaded.name = config.model_name  # option.model_name applies to the one model served
    engine = EmbeddingEngine(loaded)
    engine.start()
    return engine
