"""GGUF files dequantized once by transformers and cached as a plain safetensors checkpoint,
keyed by the file's content hash, so later starts load in a second or two instead of ~30 s; and
the tokenizer alone, for an engine that reads the weights itself (reading it takes ~10 s)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from handlers.model_fetch import default_cache_dir

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 20


def gguf_cache_entry(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of `gguf` lives (whether or not it exists yet)."""
    root = cache_dir or default_cache_dir()
    return root / "gguf" / file_sha256(gguf, root / "hashes")


def cached_gguf_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The HF-layout copy of `gguf` in the cache, converting the file first when needed."""
    entry = gguf_cache_entry(gguf, cache_dir)
    if not entry.is_dir():
        convert_gguf(gguf, entry)
    return entry


def cached_tokenizer(gguf: Path, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """transformers' tokenizer of `gguf`: from its converted copy where there is one, else from
    a cached copy of the tokenizer alone (read from the file on first use)."""
    from transformers import AutoTokenizer

    converted = gguf_cache_entry(gguf, cache_dir)
    if converted.is_dir():
        return AutoTokenizer.from_pretrained(converted, local_files_only=True)
    return AutoTokenizer.from_pretrained(tokenizer_dir(gguf, cache_dir), local_files_only=True)


def tokenizer_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The cached copy of `gguf`'s tokenizer alone (transformers' reading of it, saved on first
    use): a directory tokenizer classes load from. A later start imports no transformers here."""
    converted = gguf_cache_entry(gguf, cache_dir)
    entry = converted.parent.parent / "gguf-tokenizer" / converted.name
    if not entry.is_dir():
        from transformers import AutoTokenizer

        logger.info("Reading the tokenizer of %s (first start; later starts use the cache)", gguf)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  local_files_only=True)
        save_atomically(entry, tokenizer)
    return entry


def file_sha256(path: Path, memo_dir: Path) -> str:
    """The file's sha256, remembered by path, size and mtime so a restart need not reread it."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(key.encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    memo_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=memo_dir, delete=False) as tmp:
        tmp.write(digest.hexdigest())
    os.replace(tmp.name, memo)
    return digest.hexdigest()


def convert_gguf(gguf: Path, entry: Path) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """Dequantize `gguf` into a float32 model, save it (with its tokenizer) at `entry`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.perf_counter()
    logger.info("Converting %s (first start: this takes a while; later starts use the cache)", gguf)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    # dequantize=True gives a plain dense model (no quantizer left), which saves as safetensors.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kwargs
    )
    save_atomically(entry, model, tokenizer)
    logger.info("Converted %s into %s in %.1f s", gguf.name, entry, time.perf_counter() - started)
    return model, tokenizer


def save_atomically(entry: Path, *parts: Any) -> None:
    """Save each part (a model, a tokenizer: `save_pretrained`) into a temporary sibling and
    rename it, so `entry` is complete or absent."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for part in parts:
            part.save_pretrained(tmp)  # a model's also writes generation_config.json
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # not a lost race with another process: a real failure
            raise
        logger.info("Another process cached %s first; using its copy", entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
