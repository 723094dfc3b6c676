"""The machine's own bounds, measured where the benchmark runs: memory read bandwidth and
float32 / bfloat16 matmul throughput, with the torch threads the servers get.

A decode step reads every weight once, so one stream cannot beat bandwidth / weight bytes
tokens per second; a batch costs ~2 FLOPs per parameter per token, so no level can beat
matmul FLOP/s / (2 x parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_of(runs: int, work: Callable[[], object]) -> float:
    """The fastest of `runs` timings of `work()`, in seconds."""
    best = float("inf")
    for _ in range(runs):
        began = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - began)
    return best


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second summing a `gib`-GiB float32 tensor (larger than any cache)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    seconds = best_of(5, data.sum)
    return data.numel() * 4 / seconds


def matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.matmul(a, b)  # warm the kernels
    return 2 * n**3 / best_of(5, lambda: torch.matmul(a, b))


def highest(*probed: dict[str, float]) -> dict[str, float]:
    """Each bound at its highest over several probes: a machine whose speed varies (a shared
    host) is judged against what it showed it can do."""
    return {key: max(run[key] for run in probed) for key in probed[0]}


def bounds(parameters: int, threads: int) -> dict[str, float]:
    """The probes, and the token rates they bound for a model of `parameters`."""
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    flops = {"float32": matmul_flops(torch.float32), "bfloat16": matmul_flops(torch.bfloat16)}
    return {
        "read_gb_s": bandwidth / 1e9,
        "fp32_gflop_s": flops["float32"] / 1e9,
        "bf16_gflop_s": flops["bfloat16"] / 1e9,
        "one_stream_fp32_tok_s": bandwidth / (4 * parameters),
        "one_stream_bf16_tok_s": bandwidth / (2 * parameters),
        "batch_fp32_tok_s": flops["float32"] / (2 * parameters),
        "batch_bf16_tok_s": flops["bfloat16"] / (2 * parameters),
    }
