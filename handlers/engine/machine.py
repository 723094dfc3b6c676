"""What this machine can run: its CPU's instruction sets (the keys of code compiled for it) and
the device a model loads on, and how fast a call runs on it. Shared by the engines that run on
torch and the benchmarks' probes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), '' where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return text.split("flags", 1)[-1].split("\n", 1)[0]


def fastest(runs: int, work: Callable[[], object]) -> float:
    """The fastest of `runs` timings of `work()`, in seconds."""
    best = float("inf")
    for _ in range(runs):
        began = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - began)
    return best


def resolve_device(device: str = "auto") -> torch.device:
    """option.device as a torch device: `auto` is CUDA where present, else the CPU."""
    import torch  # bench/peers.py reads cpu_flags without paying for torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available.")
    return target


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Elsewhere oneDNN still
    runs bf16 by widening it to float32, slowly, and with roundings that depend on the batch's
    shape: a row's bf16 logits then change with how many rows run beside it."""
    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def settle_vector_math() -> None:
    """Let MKL's vector math (torch's CPU cos, sin, log, tanh...) pick its code path for this
    CPU in one thread, before any op splits its work across torch's threads.

    It picks on first use, and two threads making that first call at once (an op's halves) have
    computed one half with a far less accurate path: cos off by up to 1.5e-4 in 4 of 24 fresh
    processes on a 2-core AMX Xeon, where 1e-7 is its error. A server's first prefill then
    rotated half its rows' queries and keys differently from every later pass, and over
    quantized weights a first burst of greedy requests answered differently from the next.
    One small call, which no op splits, settles it for the process."""
    import torch

    torch.cos(torch.zeros(1))
