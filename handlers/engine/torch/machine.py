"""What this machine's CPU can run, for the keys of code compiled for it."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), '' where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return text.split("flags", 1)[-1].split("\n", 1)[0]


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere oneDNN still
    runs bf16 by widening it to float32, slowly, and with roundings that depend on the batch's
    shape: a row's bf16 logits then change with how many rows run beside it."""
    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags
