"""option.dtype=auto on the CPU: bfloat16 only where this machine multiplies it clearly faster
than float32 (the probe's decision, with the measurements it would see on different CPUs)."""

from __future__ import annotations

import sys

import pytest
import torch

from handlers.engine.torch import dtype_probe
from handlers.engine.torch.loader import resolve_dtype


def machine(monkeypatch, bf16_kernels: bool, gflops: dict[torch.dtype, float]) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_kernels)
    monkeypatch.setattr(dtype_probe, "has_native_bf16", lambda: bf16_kernels)
    monkeypatch.setattr(dtype_probe, "matmul_gflops", lambda dtype: gflops[dtype])


@pytest.mark.parametrize(("kernels", "fp32", "bf16", "chosen"), [
    (True, 210.0, 876.0, torch.bfloat16),  # the AMD EPYC Zen 5 with AVX-512 BF16
    (True, 100.0, 110.0, torch.float32),  # bf16 barely faster: float32 is exact
    (False, 46.0, 0.7, torch.float32),  # no bf16 kernels (AVX2 only)
])
def test_auto_picks_bf16_only_where_it_is_clearly_faster(monkeypatch, kernels, fp32, bf16,
                                                         chosen):
    machine(monkeypatch, kernels, {torch.float32: fp32, torch.bfloat16: bf16})
    dtype, why = dtype_probe.choose_cpu_dtype()
    assert dtype == chosen
    assert ("no bf16 matmul kernels" in why) if not kernels else (f"{bf16:.0f} GFLOP/s" in why)
    assert resolve_dtype("auto", torch.device("cpu"), None) == chosen


def test_auto_serves_float32_where_onednn_would_only_emulate_bf16(monkeypatch):
    """An AVX-512 VNNI Xeon without AVX512-BF16: oneDNN runs bf16 there by widening it, whose
    roundings depend on the batch's shape; auto never picks it, however the probe came out."""
    machine(monkeypatch, True, {torch.float32: 10.0, torch.bfloat16: 100.0})
    monkeypatch.setattr(dtype_probe, "has_native_bf16", lambda: False)
    dtype, why = dtype_probe.choose_cpu_dtype()
    assert dtype == torch.float32 and "no bf16 matmul kernels" in why


def test_an_explicit_dtype_is_never_probed(monkeypatch):
    machine(monkeypatch, True, {})  # a probe would fail: no measurement for any dtype
    assert resolve_dtype("fp32", torch.device("cpu"), None) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu"), None) == torch.bfloat16


def test_the_probe_measures_this_machine():
    dtype, why = dtype_probe.choose_cpu_dtype()
    assert dtype in (torch.float32, torch.bfloat16) and why
    assert dtype_probe.matmul_gflops(torch.float32) > 0


def test_a_slow_stretch_during_one_probe_does_not_decide(monkeypatch):
    """The dtypes are probed in turn, twice, and each keeps its best: a start's other threads
    once slowed a float32 probe to 4 GFLOP/s; on a CPU where bf16 barely wins, that alone would
    have picked bf16."""
    readings = {torch.float32: iter([4.0, 100.0]), torch.bfloat16: iter([110.0, 105.0])}
    order: list[torch.dtype] = []
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtype_probe, "has_native_bf16", lambda: True)
    monkeypatch.setattr(dtype_probe, "matmul_gflops",
                        lambda dtype: order.append(dtype) or next(readings[dtype]))
    dtype, why = dtype_probe.choose_cpu_dtype()
    assert dtype == torch.float32 and "against float32 100" in why
    assert order == [torch.float32, torch.bfloat16] * 2


def test_alternating_best_takes_the_calls_in_turn_and_keeps_each_ones_fastest(monkeypatch):
    """A busy stretch meets the kernel's first samples only: the later rounds' count (a start's
    other threads once slowed every sample of the quantized kernel's probe, and a Zen 4 where it
    runs 5x bf16's speed served bf16)."""
    readings = {"kernel": iter([9.0, 1.0, 1.2]), "float": iter([5.0, 5.1, 4.9])}
    order: list[str] = []
    monkeypatch.setattr(dtype_probe, "best_seconds",
                        lambda call, repeats: next(readings[order.append(call()) or order[-1]]))
    calls = {"kernel": lambda: "kernel", "float": lambda: "float"}
    assert dtype_probe.alternating_best(calls, rounds=3, repeats=5) == {"kernel": 1.0,
                                                                       "float": 4.9}
    assert order == ["kernel", "float"] * 3


def test_a_probe_runs_on_one_thread_and_gives_the_process_its_settings_back():
    """Timed on one thread with the GIL switched often; the thread count and the switch
    interval are the process's again afterwards, also when the call raises."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    seen = []
    seconds = dtype_probe.best_seconds(
        lambda: seen.append((torch.get_num_threads(), sys.getswitchinterval())), repeats=3)
    assert seconds >= 0 and len(seen) == 4
    assert all(count == 1 and switch < interval for count, switch in seen)
    assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, interval)
    with pytest.raises(ZeroDivisionError):
        dtype_probe.best_seconds(lambda: 1 / 0, repeats=3)
    assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, interval)
