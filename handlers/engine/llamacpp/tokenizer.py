"""transformers' tokenizer for a GGUF file, for the batcher's detokenization, chat templates and
grammars: its ids are llama.cpp's (both read the GGUF's vocabulary). Reading it from the GGUF
takes ~10 s, so it is cached by the file's content hash; the torch engine's converted copy of the
same file carries it too, and is used when present.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from handlers.engine.torch.loader import gguf_cache_entry

log = logging.getLogger(__name__)


def load_tokenizer(gguf: Path, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    converted = gguf_cache_entry(gguf, cache_dir)
    if converted.is_dir():
        return AutoTokenizer.from_pretrained(converted, local_files_only=True)
    entry = converted.parent.parent / "gguf-tokenizer" / converted.name
    if not entry.is_dir():
        log.info("Reading the tokenizer of %s (first start; later starts use the cache)", gguf)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  local_files_only=True)
        _save_atomically(tokenizer, entry)
        return tokenizer
    return AutoTokenizer.from_pretrained(entry, local_files_only=True)


def _save_atomically(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    """Into a temporary sibling, then renamed: `entry` is complete or absent."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, entry)
    except OSError:
        if not entry.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
