"""The embedding engine: sentence-transformers models, requests batched into shared passes."""

from handlers.engine.embedding.engine import EmbeddingEngine
from handlers.engine.embedding.model import EmbeddingModel, load_embedding_model

__all__ = ["EmbeddingEngine", "EmbeddingModel", "load_embedding_model"]
