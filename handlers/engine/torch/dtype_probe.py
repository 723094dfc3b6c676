"""`option.dtype=auto` on the CPU: bfloat16 where this machine has bf16 kernels (AVX512-BF16 or
AMX) and multiplies it faster than float32, else float32, decided by a probe at startup (a few
milliseconds), since the machines differ: one without bf16 kernels ran bf16 matmul at ~1 GFLOP/s
against ~50 for float32, another (AVX-512 BF16) at 876 against 210. Without native bf16, oneDNN's
widened bf16 also rounds by the batch's shape, so `auto` serves bf16 only where a row's answer
does not depend on the rows beside it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

from handlers.engine.machine import fastest, has_native_bf16

BF16_SPEEDUP_NEEDED = 1.3  # below this, float32's exactness is worth more than the speed
_ROWS, _SIZE, _REPEATS = 32, 1024, 3  # a decode batch through one projection-sized matmul
_ROUNDS = 2

K = TypeVar("K")
# The thread count and switch interval are the process's: probes of models loading side by side
# take turns, so that each restores what it found.
_PROBING = threading.Lock()


def choose_cpu_dtype() -> tuple[torch.dtype, str]:
    """The dtype to serve in on this CPU, and why (for the log)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not (torch.ops.mkldnn._is_mkldnn_bf16_supported() and has_native_bf16()):
        return torch.float32, (f"this CPU ({capability}) has no bf16 matmul kernels "
                               "(AVX512-BF16 or AMX)")
    # once a start's other threads slowed a float32 probe to 4 GFLOP/s: the rounds' best counts
    best = in_turns({dtype: lambda dtype=dtype: matmul_gflops(dtype)
                     for dtype in (torch.float32, torch.bfloat16)}, _ROUNDS, max)
    fp32, bf16 = best[torch.float32], best[torch.bfloat16]
    measured = (f"bf16 matmul {bf16:.0f} GFLOP/s against float32 {fp32:.0f} on one thread here "
                f"({capability})")
    if bf16 >= BF16_SPEEDUP_NEEDED * fp32:
        return torch.bfloat16, measured
    return torch.float32, measured


def matmul_gflops(dtype: torch.dtype) -> float:
    """The best of a few timed (rows x size) @ (size x size) products, after one warm-up."""
    a = torch.randn(_ROWS, _SIZE, dtype=dtype)
    b = torch.randn(_SIZE, _SIZE, dtype=dtype)
    return 2 * _ROWS * _SIZE * _SIZE / best_seconds(lambda: torch.mm(a, b), _REPEATS) / 1e9


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed, on one thread and with the
    GIL handed back within ~10 us: at a start the server's other threads hold the GIL and the
    cores, and a sample then timed a wait for the GIL (up to 5 ms, against a ~20 us call) or
    for a descheduled worker thread. Under two busy Python threads on a 2-core Zen 4 the
    default settings measured bf16 at 2-10 GFLOP/s (300 alone) in 9 of 12 probes, choosing
    float32 in 4; these measured its ~2x float32 every time. A model serving beside a loading
    one runs single-threaded for the probe's ~0.1 s."""
    with _PROBING:
        interval, threads = sys.getswitchinterval(), torch.get_num_threads()
        sys.setswitchinterval(1e-5)
        torch.set_num_threads(1)
        try:
            call()
            return fastest(repeats, call)
        finally:
            sys.setswitchinterval(interval)
            torch.set_num_threads(threads)


def alternating_best(calls: Mapping[K, Callable[[], object]], rounds: int,
                     repeats: int) -> dict[K, float]:
    """Each call's fastest time (best_seconds) over `rounds` rounds that take the calls in
    turn (in_turns)."""
    return in_turns({key: lambda call=call: best_seconds(call, repeats)
                     for key, call in calls.items()}, rounds, min)


def in_turns(measures: Mapping[K, Callable[[], float]], rounds: int,
             keep: Callable[[float, float], float]) -> dict[K, float]:
    """Each measure's best reading (by `keep`: min or max) over `rounds` rounds that take the
    measures in turn: a busy stretch of the machine (a start's other threads) spoils the
    readings it meets, not every reading of one measure."""
    best: dict[K, float] = {}
    for _ in range(rounds):
        for key, measure in measures.items():
            reading = measure()
            best[key] = keep(best[key], reading) if key in best else reading
    return best
