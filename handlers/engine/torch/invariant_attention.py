"""Attention over the slot KV cache on the CPU whose result for a query is the same whatever else
is in its pass.

torch's CPU attention (SDPA's flash kernel, or the GEMMs of attention written out in torch) blocks
its work by the pass's shapes: the padded key length (the batch's longest sequence), the number of
queries in a chunk and a query's place in it. Sums then round differently, ~1e-7 apart in
float32. A bf16 model rounds each attention output to bf16, where such differences flip
roundings and, some tokens later, the text: 4 of 32 greedy SmolLM2 answers changed with their
batch (AMD EPYC Zen 4). invariant_attention.cpp computes each (row, query, head) by itself, over
exactly the keys it sees, in one fixed order; at decode it is also faster than SDPA (32 rows of
300 keys: 0.49 vs 0.71 ms).

The C++ is compiled here on first use (g++, under a second; cached in $LMI_CACHE_DIR/kernels by
source, compiler and CPU) and called through ctypes, which releases the GIL. `slot_attention` is
a torch op over it, so the compiled decode step (torch.export, AOTInductor) calls it too.
Where it cannot be built, `kernel()` is None, logged, and attention stays on SDPA.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from handlers.engine.torch.machine import cpu_flags
from handlers.model_fetch import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("invariant_attention.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_FUNCTIONS = {torch.float32: "attend_f32", torch.bfloat16: "attend_bf16"}


class Kernel:
    """The compiled library: `__call__` is attention of query [B, H, T, D] over key/value
    [B, H_kv, S, D], each query seeing the first `counts` [B, T] keys; float32 [B, T, H, D]."""

    def __init__(self, library: Path) -> None:
        loaded = ctypes.CDLL(str(library))
        i64, pointer = ctypes.c_int64, ctypes.c_void_p
        self._functions = {}
        for dtype, name in _FUNCTIONS.items():
            function = getattr(loaded, name)
            function.argtypes = [pointer, pointer, pointer, i64, i64, pointer, pointer, i64, i64,
                                 i64, i64, i64, ctypes.c_float, ctypes.c_int]
            function.restype = None
            self._functions[dtype] = function

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 counts: torch.Tensor, scale: float) -> torch.Tensor:
        batch, heads, width, size = query.shape
        q = query.transpose(1, 2).to(torch.float32).contiguous()
        out = torch.empty_like(q)
        counts = counts.to(torch.int64).contiguous()
        if key.dtype not in _FUNCTIONS or not _positions_packed(key, value):
            key, value = key.float().contiguous(), value.float().contiguous()
        self._functions[key.dtype](
            q.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
            counts.data_ptr(), out.data_ptr(), batch, width, heads, key.shape[1], size, scale,
            torch.get_num_threads())
        return out


def _positions_packed(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Each head's positions one after another (what the kernel reads), in both."""
    return key.stride() == value.stride() and key.stride(3) == 1 \
        and key.stride(2) == key.shape[3] and value.dtype == key.dtype


@functools.cache
def kernel() -> Kernel | None:
    """The kernel, built on first use (once per process), or None where it cannot be."""
    try:
        return Kernel(_build())
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("the invariant attention kernel could not be built (%s); CPU attention runs "
                    "on SDPA, whose results for a row depend slightly on the rest of its batch",
                    str(detail).strip()[-500:])
        return None


def _build() -> Path:
    compiler = os.environ.get("CXX", "g++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *FLAGS,
                                       cpu_flags()]).encode())
    directory = default_cache_dir() / "kernels" / digest.hexdigest()[:16]
    library = directory / "libinvariant_attention.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server building the same: wait for it
        if not library.exists():
            partial = directory / f"partial-{os.getpid()}.so"
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)],
                           capture_output=True, text=True, check=True)
            os.replace(partial, library)  # whole, or not there
    log.info("built the invariant attention kernel: %s", library)
    return library


# A torch op over the kernel, what torch.export records and the compiled decode step calls (the
# library API: torch.library.custom_op would import torch._dynamo, 1.5 s of a start).
_LIBRARY = torch.library.Library("lmi", "DEF")
_LIBRARY.define("slot_attention(Tensor query, Tensor key, Tensor value, Tensor counts, "
                "float scale) -> Tensor")


def _slot_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    counts: torch.Tensor, scale: float) -> torch.Tensor:
    return kernel()(query, key, value, counts, scale)


@torch.library.register_fake("lmi::slot_attention", lib=_LIBRARY)
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, counts: torch.Tensor,
      scale: float) -> torch.Tensor:
    batch, heads, width, size = query.shape
    return query.new_empty((batch, width, heads, size), dtype=torch.float32)


_LIBRARY.impl("slot_attention", _slot_attention, "CPU")
slot_attention = torch.ops.lmi.slot_attention
