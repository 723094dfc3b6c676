"""The machine's own bounds, measured where the benchmark runs: memory read bandwidth and
float32 / bfloat16 / int8 matmul throughput, with the torch threads the servers get.

A decode step reads every weight once, so one stream cannot beat bandwidth / weight bytes
tokens per second; a batch costs ~2 operations per parameter per token, so no level can beat
matmul operations/s / (2 x parameters). The int8 bound is oneDNN's int8 GEMM (`torch._int_mm`:
VNNI, or AMX where the CPU has it), the rate the quantized linears' int8 dot products could
reach; the one-stream bound of quantized weights is bandwidth / the GGUF's bytes.

Those square 1024 x 1024 products are the peaks. A 32-stream decode step multiplies 32 rows by
each layer's weights, too few rows for a GEMM to reach them (on an AMX Xeon oneDNN's int8 GEMM
ran the model's own layers at 32 rows at 14% of its square rate), so the same GEMM is also timed
on the model's layers at 32 rows: the rate a step of plain int8 products, with no scales at all,
could reach there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from handlers.engine.machine import fastest


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second summing a `gib`-GiB float32 tensor (larger than any cache)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    seconds = fastest(5, data.sum)
    return data.numel() * 4 / seconds


def matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.matmul(a, b)  # warm the kernels
    return 2 * n**3 / fastest(5, lambda: torch.matmul(a, b))


def int8_ops_on(layers: Sequence[tuple[int, int]], rows: int) -> float:
    """Integer operations/s of oneDNN's int8 GEMM over `layers` (in, out features each), one
    after another as a step runs them, `rows` rows each."""
    pairs = [(torch.randint(-127, 128, (rows, k), dtype=torch.int8),
              torch.randint(-127, 128, (k, n), dtype=torch.int8)) for k, n in layers]

    def step() -> None:
        for a, b in pairs:
            torch._int_mm(a, b)

    step()
    return sum(2 * rows * k * n for k, n in layers) / fastest(5, step)


def highest(*probed: dict[str, float]) -> dict[str, float]:
    """Each bound at its highest over several probes: a machine whose speed varies (a shared
    host) is judged against what it showed it can do."""
    return {key: max(run[key] for run in probed) for key in probed[0]}


def bounds(parameters: int, threads: int, quantized_bytes: int,
           layers: Sequence[tuple[int, int]]) -> dict[str, float]:
    """The probes, and the token rates they bound for a model of `parameters` whose quantized
    weights take `quantized_bytes` and whose step multiplies by `layers` (in, out features)."""
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    flops = {"float32": matmul_flops(torch.float32), "bfloat16": matmul_flops(torch.bfloat16)}
    int8 = int8_ops_on([(1024, 1024)], 1024)
    int8_32 = int8_ops_on(layers, 32)
    return {
        "int8_32_rows_gop_s": int8_32 / 1e9,
        "batch_int8_32_rows_tok_s": int8_32 / (2 * sum(k * n for k, n in layers)),
        "int8_gop_s": int8 / 1e9,
        "one_stream_quantized_tok_s": bandwidth / quantized_bytes,
        "batch_int8_tok_s": int8 / (2 * parameters),
        "read_gb_s": bandwidth / 1e9,
        "fp32_gflop_s": flops["float32"] / 1e9,
        "bf16_gflop_s": flops["bfloat16"] / 1e9,
        "one_stream_fp32_tok_s": bandwidth / (4 * parameters),
        "one_stream_bf16_tok_s": bandwidth / (2 * parameters),
        "batch_fp32_tok_s": flops["float32"] / (2 * parameters),
        "batch_bf16_tok_s": flops["bfloat16"] / (2 * parameters),
    }
