"""A GGUF model in llama.cpp (llama-cpp-python's low-level `llama_cpp` API): the weights, loaded
once (memory-mapped) and kept across engine restarts, with what the shared batcher needs besides
(transformers' tokenizer for the same vocabulary, end-of-sequence ids, the context length).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import torch
from transformers import PreTrainedTokenizerBase

from handlers.config import ConfigError
from handlers.engine.gguf.cache import cached_tokenizer
from handlers.engine.llamacpp.kv_types import F16, KVType
from handlers.model_source import derive_model_name

log = logging.getLogger(__name__)
_FLOAT_TYPES = frozenset({"f32", "f16", "bf16"})  # llama.cpp's names of float weights
# llama.cpp's own log lines (one per tensor and setting at load) go to stderr: errors only.
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

# Checked at load: transformers' ids for this text must be llama.cpp's (special tokens included).
_TOKENIZER_PROBE = ("<|im_start|>user\nHello, world! 123 — café, 你好.\n"
                    "  def f(x):\treturn x ** 2<|im_end|>\n")


@dataclass
class LlamaCppModel:
    handle: ctypes.c_void_p  # llama_model *
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    max_model_len: int
    eos_token_ids: set[int]
    dtype: str  # the weights' GGUF type, e.g. "q4_1" (what /info reports)
    vocab_size: int
    kv_bytes_per_token: int  # K and V in `kv_type`, every layer
    kv_type: KVType = F16  # the KV cells' GGML type (option.kv_cache_dtype)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def quantization(self) -> str:
        """The GGUF's type; "none" for float weights."""
        return "none" if self.dtype in _FLOAT_TYPES else self.dtype


def load_model(source: Path, name: str | None = None, max_model_len: int | None = None,
               kv_type: KVType = F16) -> LlamaCppModel:
    started = time.perf_counter()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    handle = llama_cpp.llama_model_load_from_file(str(source).encode(), params)
    if not handle:
        raise ValueError(f"llama.cpp could not load {source}")
    vocab = llama_cpp.llama_model_get_vocab(handle)
    tokenizer = cached_tokenizer(source)
    _check_same_ids(tokenizer, vocab)
    trained = llama_cpp.llama_model_n_ctx_train(handle)
    if max_model_len is not None and max_model_len > trained:
        log.warning("option.max_model_len %d exceeds the model's %d; using that",
                    max_model_len, trained)
    model = LlamaCppModel(
        handle=handle, tokenizer=tokenizer, name=name or derive_model_name(source.name),
        source=str(source), max_model_len=min(max_model_len or trained, trained),
        eos_token_ids=_eos_token_ids(vocab, tokenizer), dtype=_weights_type(handle),
        vocab_size=llama_cpp.llama_vocab_n_tokens(vocab),
        kv_bytes_per_token=_kv_bytes_per_token(handle, kv_type), kv_type=kv_type)
    log.info("Loaded %s from %s into llama.cpp: %s weights, max_model_len=%d eos=%s in %.1f s",
             model.name, source, model.dtype, model.max_model_len, sorted(model.eos_token_ids),
             time.perf_counter() - started)
    return model


def llama_token_ids(vocab: ctypes.c_void_p, text: str) -> list[int]:
    """llama.cpp's tokenization, without BOS, special tokens parsed (as transformers' encode)."""
    data = text.encode()
    out = (llama_cpp.llama_token * (len(data) + 8))()
    count = llama_cpp.llama_tokenize(vocab, data, len(data), out, len(out), False, True)
    return list(out[:count])


def _check_same_ids(tokenizer: PreTrainedTokenizerBase, vocab: ctypes.c_void_p) -> None:
    ours = tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=False)
    theirs = llama_token_ids(vocab, _TOKENIZER_PROBE)
    if ours != theirs:
        raise ValueError("transformers reads another tokenizer from this GGUF than llama.cpp "
                         f"does (ids {ours[:16]}... against {theirs[:16]}...)")


def _eos_token_ids(vocab: ctypes.c_void_p, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = {llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab),
           tokenizer.eos_token_id}
    return {i for i in ids if isinstance(i, int) and i >= 0}


def _weights_type(handle: ctypes.c_void_p) -> str:
    buf = ctypes.create_string_buffer(128)
    llama_cpp.llama_model_desc(handle, buf, len(buf))  # e.g. "llama ?B Q4_1"
    return buf.value.decode().rsplit(" ", 1)[-1].lower()


def _kv_bytes_per_token(handle: ctypes.c_void_p, kv_type: KVType) -> int:
    head_dim = llama_cpp.llama_model_n_embd(handle) // llama_cpp.llama_model_n_head(handle)
    if head_dim % kv_type.block:  # llama.cpp's blocks never span two heads
        raise ConfigError(f"option.kv_cache_dtype: llama.cpp's {kv_type.name} cache packs "
                          f"blocks of {kv_type.block} elements, which heads of {head_dim} do "
                          "not divide into; choose float16 or bfloat16")
    kv_heads = llama_cpp.llama_model_n_head_kv(handle)
    return 2 * llama_cpp.llama_model_n_layer(handle) * kv_type.bytes_for(kv_heads * head_dim)
