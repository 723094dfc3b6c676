"""Offline loading of sentence-embedding models: the embedded default or a local directory.

sentence-transformers reads the directory's own pipeline (modules.json: the encoder, its pooling
config, a Normalize or Dense step, the max sequence length, prompts), so whatever a model
declares is what it computes. It is imported only here, when an embedding model is loaded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.engine.machine import resolve_device
from handlers.model_source import (
    DEFAULT_EMBEDDING_NAME,
    ModelSourceError,
    is_default_embedding_id,
    resolve_embedding_source,
)

logger = logging.getLogger(__name__)


@dataclass
class EmbeddingModel:
    model: Any  # a sentence_transformers.SentenceTransformer in eval mode
    name: str  # e.g. "all-minilm-l6-v2"
    source: Path  # the directory it was loaded from
    dimension: int  # length of every vector
    max_seq_length: int  # longer inputs are truncated (or refused) at this many tokens
    default_prompt: str  # the model's own default prompt ("" when it declares none)


def load_embedding_model(
    source: str | Path | None = None, *, device: str = "auto", base_dir: Path | None = None,
    revision: str | None = None, files: Path | None = None,
) -> EmbeddingModel:
    """Load the embedding model `source` names (see `resolve_embedding_source`) on `device`;
    `files`: where it was located already."""
    started = time.perf_counter()
    path = files or resolve_embedding_source(source, base_dir, revision)
    is_default = source is None or is_default_embedding_id(str(source))
    target = resolve_device(device)
    from sentence_transformers import SentenceTransformer  # heavy (scikit-learn): load on use

    model = SentenceTransformer(str(path), device=str(target), local_files_only=True)
    model.eval()
    max_len = model.get_max_seq_length()
    if not max_len:
        raise ModelSourceError(f"embedding model {path} declares no maximum sequence length.")
    default_prompt = model.prompts.get(model.default_prompt_name or "", "") or ""
    loaded = EmbeddingModel(
        model=model,
        name=DEFAULT_EMBEDDING_NAME if is_default else path.name.lower(),
        source=path,
        dimension=model.get_embedding_dimension(),
        max_seq_length=max_len,
        default_prompt=default_prompt,
    )
    logger.info(
        "Loaded embedding model %s from %s: dimension=%d max_seq_length=%d device=%s in %.1f s",
        loaded.name, path, loaded.dimension, max_len, target, time.perf_counter() - started,
    )  # fmt: skip
    return loaded
