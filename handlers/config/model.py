"""What the configuration serves: the model directory, the model files in it, the task (text
generation or embeddings) and the served model's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from handlers.config import values
from handlers.config.keys import TEXT_EMBEDDING, ConfigError
from handlers.config.sources import CLI, DEFAULT
from handlers.model_source import (
    DEFAULT_EMBEDDING_NAME,
    DEFAULT_MODEL_FILE,
    ModelSourceError,
    derive_model_name,
    has_sentence_transformers_layout,
    is_default_embedding_id,
    is_embedding_source,
    model_files_in,
)

REPO_DIR = Path(__file__).resolve().parent.parent.parent
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")

ModelFiles = Literal["hf", "gguf"]


def resolve_model_dir(
    model_dir: str | None,
    sagemaker_dir: Path = SAGEMAKER_MODEL_DIR,
    repo_dir: Path = REPO_DIR,
) -> tuple[Path, str]:
    """The model directory and why: `--model-dir`, else /opt/ml/model, else the repository."""
    if model_dir:
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"--model-dir={model_dir!r} ({CLI}) is not a directory")
        return path.resolve(), CLI
    if sagemaker_dir.is_dir():
        return sagemaker_dir, f"{DEFAULT} ({sagemaker_dir} exists)"
    return repo_dir, f"{DEFAULT} (the repository's top-level directory)"


def find_model_files(model_dir: Path) -> tuple[ModelFiles | None, Path | None]:
    """What the directory holds: a Hugging Face model (config.json + safetensors), one GGUF."""
    try:
        found = model_files_in(model_dir)
    except ModelSourceError as exc:
        raise ConfigError(str(exc)) from None
    if found is None:
        return None, None
    return ("gguf", found) if found.suffix.lower() == ".gguf" else ("hf", None)


def model_values(model_dir: Path, settings: dict[str, Any], sources: dict[str, str]
                 ) -> dict[str, Any]:
    """What the model directory holds (when no model id is set), the task and the served model's
    name."""
    files, gguf = find_model_files(model_dir) if settings["model_id"] is None else (None, None)
    sources["model_files"] = sources["gguf_file"] = f"found in {model_dir}" if files else DEFAULT
    task = _task(settings, model_dir, sources)
    name = settings["model_name"]
    if name is None:
        name, sources["model_name"] = (
            _embedding_name(settings["model_id"], model_dir) if task == TEXT_EMBEDDING
            else _derived_name(settings["model_id"], files, gguf, model_dir))
        try:
            values.model_name(name)
        except ValueError as exc:
            message = f"model name {name!r} ({sources['model_name']}) is unusable: {exc}"
            raise ConfigError(message + "; set option.model_name") from None
    return {"model_files": files, "gguf_file": gguf, "model_name": name, "task": task}


def _names_embedding_model(model_id: str | None, model_dir: Path) -> bool:
    if model_id is None:
        return has_sentence_transformers_layout(model_dir)
    return is_embedding_source(model_id, model_dir)


def _task(settings: dict[str, Any], model_dir: Path, sources: dict[str, str]) -> str:
    """option.task, else text-embedding when the model to serve is an embedding model."""
    model_id, task = settings["model_id"], settings["task"]
    embedding = _names_embedding_model(model_id, model_dir)
    where = "option.model_id" if model_id is not None else "the model directory"
    if task is None:
        sources["task"] = f"derived from {where}" if embedding else DEFAULT
        return TEXT_EMBEDDING if embedding else "text-generation"
    if task != TEXT_EMBEDDING and embedding:
        raise ConfigError(f"option.task={task!r} ({sources['task']}), but {where} holds an "
                          "embedding model; set option.task=text-embedding or choose an LLM")
    return task


def _embedding_name(model_id: str | None, model_dir: Path) -> tuple[str, str]:
    if model_id is None and has_sentence_transformers_layout(model_dir):
        return model_dir.name.lower(), "derived from the model directory's name"
    if model_id is None or is_default_embedding_id(model_id):
        return DEFAULT_EMBEDDING_NAME, f"{DEFAULT} (the embedded embedding model)"
    return derive_model_name(model_id), "derived from option.model_id"


def _derived_name(
    model_id: str | None, files: ModelFiles | None, gguf: Path | None, model_dir: Path
) -> tuple[str, str]:
    if model_id is not None:
        return derive_model_name(model_id), "derived from option.model_id"
    if gguf is not None:
        return derive_model_name(gguf.name), f"derived from {gguf.name}"
    if files == "hf":
        return model_dir.name.lower(), "derived from the model directory's name"
    return derive_model_name(DEFAULT_MODEL_FILE), f"{DEFAULT} (the embedded model)"
