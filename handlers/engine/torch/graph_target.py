"""Which CPU a compiled decode graph targets: an x86-64 level (native_build.LEVELS, as the
kernels are built for), or this CPU's own instruction sets ("native").

A float32 graph compiles for the best level this CPU runs, so that a package built ahead (an
image's, on another machine) is found by every CPU of that level, and one compiled here serves
any CPU of the same level sharing the cache. Inductor would otherwise pick its vector ISA and
`-march` from the compiling machine (AMX, AVX512-BF16 where it has them): pinned to the level,
a graph carries no instruction a CPU of that level lacks. bfloat16 graphs stay native: they hold
oneDNN's weights packed for the compiling CPU's ISA (decode_step.py), which no level names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from handlers.engine import native_build
from handlers.engine.machine import cpu_flags

NATIVE = "native"
# Inductor's names for the vector ISAs each level runs (cpu_vec_isa.x86_isa_checker's), best
# last; AMX and AVX512-BF16 belong to none of them.
VEC_ISAS = {
    "cascadelake": ["avx2", "avx512", "avx512_vnni"],
    "x86-64-v4": ["avx2", "avx512"],
    "x86-64-v3": ["avx2"],
}


def for_compile(dtype: str) -> str:
    """The target a graph of `dtype` ("fp32" or "bf16") compiled on this CPU gets."""
    if dtype != "fp32":
        return NATIVE
    levels = runnable()
    return levels[0] if levels else NATIVE


def runnable() -> list[str]:
    """The levels this CPU runs, best first."""
    return [level for level in native_build.runnable_levels() if level in VEC_ISAS]


def key_part(target: str) -> str:
    """What a package's key holds of its target: the level, or this CPU's flags."""
    return cpu_flags() if target == NATIVE else f"level:{target}"


@contextlib.contextmanager
def pinned(target: str) -> Iterator[dict[str, Any]]:
    """Inductor limited to `target`'s instruction sets while the block compiles; yields the
    inductor settings a compile passes on (`-march`)."""
    if target == NATIVE:
        yield {}
        return
    from torch._inductor import cpu_vec_isa

    # Private, version-bound hooks (torch 2.13): the ISAs inductor sees the CPU run, and the
    # AVX512-BF16 probe that widens its AVX-512 flags.
    saved = cpu_vec_isa.x86_isa_checker, torch.cpu._is_avx512_bf16_supported
    cpu_vec_isa.x86_isa_checker = lambda: list(VEC_ISAS[target])
    torch.cpu._is_avx512_bf16_supported = lambda: False
    _forget(cpu_vec_isa)
    try:
        picked = cpu_vec_isa.pick_vec_isa()
        if str(picked).split()[-1] != VEC_ISAS[target][-1] or "bf16" in picked.build_arch_flags():
            raise RuntimeError(f"inductor picked {picked} ({picked.build_arch_flags()}) for "
                               f"{target}: this torch's ISA choice is not pinned")
        yield {"cpp.march": target}
    finally:
        cpu_vec_isa.x86_isa_checker, torch.cpu._is_avx512_bf16_supported = saved
        _forget(cpu_vec_isa)


def _forget(cpu_vec_isa: Any) -> None:
    """Drop what inductor cached of this CPU's ISAs (each ISA's probe result, AVX-512's bf16)."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        clear = getattr(type(isa).__bool__, "cache_clear", None)
        if clear is not None:
            clear()
        isa.__dict__.pop("_is_avx512_bf16_supported", None)
