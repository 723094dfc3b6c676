"""option.kv_cache_dtype on llama.cpp: the GGML type of its K and V cells (the context's
`type_k`/`type_v`). llama.cpp stores float32, float16 and bfloat16 cells, and no float8: `fp8`
(an 8-bit cache) is its q8_0, 8-bit integers with a float16 scale per 32 elements of one token's
head; the named float8 formats are refused by the registry (LLAMACPP_KV)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVType:
    name: str  # GGML's
    ggml: int  # its `enum ggml_type` value (stable across llama.cpp releases)
    block: int  # elements per block
    block_bytes: int
    why: str  # for the startup log

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def bytes_for(self, elements: int) -> int:
        return elements // self.block * self.block_bytes


F16 = KVType("f16", 1, 1, 2, "llama.cpp's default")
_TYPES = {
    "auto": F16,
    "float16": KVType("f16", 1, 1, 2, "as asked"),
    "bfloat16": KVType("bf16", 30, 1, 2, "as asked"),
    "float32": KVType("f32", 0, 1, 4, "as asked"),
    "fp8": KVType("q8_0", 8, 32, 34, "llama.cpp has no float8 cache; q8_0 is its 8-bit one"),
}


def kv_type(kv_cache_dtype: str) -> KVType:
    """The cells' type for an option.kv_cache_dtype the registry let through."""
    return _TYPES[kv_cache_dtype]
