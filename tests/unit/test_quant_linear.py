"""The quantized linear kernel and the blocks it reads: llama.cpp's arithmetic (int8 input groups,
exact int32 sums, float32 scales), a row's output the same bits whatever else is in its batch or
whichever unit (AVX-512 VNNI, AVX2, plain C++) computed it, and GGUF's blocks repacked exactly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf.quants import dequantize

from handlers.engine import native_build
from handlers.engine.torch import quant_linear
from handlers.engine.torch.gguf_blocks import to_blocks
from handlers.engine.torch.quant_blocks import GROUP, from_float, joined
from handlers.engine.torch.quant_linear import QuantLinear, available, pack, unpack

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler here")


def llama_cpp_product(x: torch.Tensor, weight) -> torch.Tensor:
    """What the kernel computes, in float64: each input group of 32 rounded to int8 by its own
    max, times the blocks' weights."""
    groups = x.view(x.shape[0], -1, GROUP).double()
    amax = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (q * amax / 127).view_as(x) @ weight.dequantize().double().T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 37])
def test_it_computes_llama_cpps_product(bits, rows):
    torch.manual_seed(bits * 10 + rows)
    weight = from_float(torch.randn(48, 96), bits)
    x = torch.randn(rows, 96) * 3
    got = QuantLinear(weight)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    torch.testing.assert_close(got.double(), llama_cpp_product(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_output_does_not_depend_on_its_batch_or_the_threads(bits):
    torch.manual_seed(bits)
    layer = QuantLinear(from_float(torch.randn(64, 128), bits))
    batch = torch.randn(37, 128)
    together = layer(batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [layer(batch[i : i + 1])[0] for i in range(len(batch))]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(row, together[i]) for i, row in enumerate(alone))


def test_quantizing_at_load_keeps_each_weight_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(32, 256)
    weight[0, :GROUP] = weight[0, :GROUP].abs()  # a group all on one side of 0
    for bits, levels in ((8, 255), (4, 15)):
        blocks = from_float(weight, bits)
        groups = weight.view(32, -1, GROUP)
        step = (groups.amax(-1) - groups.amin(-1)) / levels
        error = (blocks.dequantize() - weight).view(32, -1, GROUP).abs().amax(-1)
        assert (error <= step * 0.51 + 1e-3 * step).all()


def test_packing_round_trips_and_fused_layers_concatenate_outputs():
    torch.manual_seed(1)
    parts = [from_float(torch.randn(n, 64), 4) for n in (32, 16, 16)]
    for part in parts:
        back = unpack(*pack(part), part.bits)
        assert torch.equal(back.values, part.values) and torch.equal(back.scales, part.scales)
    fused = QuantLinear.fused([QuantLinear(p) for p in parts])
    x = torch.randn(5, 64)
    expected = torch.cat([QuantLinear(p)(x) for p in parts], dim=-1)
    assert torch.equal(fused(x), expected)
    assert torch.equal(fused.unpacked().values, joined(parts).values)  # joined as packed
    mixed = joined([parts[0], from_float(torch.randn(16, 64), 8)])
    assert mixed.bits == 8 and torch.equal(unpack(*pack(mixed), 8).values, mixed.values)
    eight = QuantLinear(from_float(torch.randn(16, 64), 8))
    both = QuantLinear.fused([QuantLinear(parts[0]), eight])
    assert both.bits == 8 and torch.equal(both(x), torch.cat([QuantLinear(parts[0])(x),
                                                              eight(x)], dim=-1))


def test_shapes_the_kernel_cannot_take_are_refused():
    assert quant_linear.fits(48, 64) and not quant_linear.fits(40, 64)
    assert not quant_linear.fits(48, 72)
    with pytest.raises(ValueError, match="whole tiles"):
        pack(from_float(torch.randn(40, 64), 8))


def _random_blocks(kind: Kind, rows: int, size: int, scale_at: tuple[int, ...]) -> np.ndarray:
    """Random raw blocks with sane float16 scales at byte offsets `scale_at` of each block."""
    rng = np.random.default_rng(int(kind))
    raw = rng.integers(0, 256, (rows, 8, size), dtype=np.uint8)
    for offset in scale_at:
        halves = rng.uniform(0.001, 0.01, (rows, 8)).astype(np.float16)
        raw[..., offset : offset + 2] = halves[..., None].view(np.uint8).reshape(rows, 8, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize(("kind", "size", "scales"), [
    (Kind.Q4_0, 18, (0,)), (Kind.Q4_1, 20, (0, 2)), (Kind.Q8_0, 34, (0,))])
def test_gguf_q4_and_q8_blocks_repack_exactly(kind, size, scales):
    raw = _random_blocks(kind, 16, size, scales)
    blocks = to_blocks(raw, kind)
    assert blocks.bits == (8 if kind == Kind.Q8_0 else 4)
    assert np.array_equal(blocks.dequantize().numpy(), dequantize(raw, kind))


def test_gguf_q4_k_repacks_with_its_scales_rounded_to_float16():
    raw = _random_blocks(Kind.Q4_K, 16, 144, (0, 2))
    blocks = to_blocks(raw, Kind.Q4_K)
    expected = dequantize(raw, Kind.Q4_K)
    assert blocks.bits == 4
    # d * sc and dmin * m rounded to float16: each off by at most 2^-11 of itself, times q <= 15
    error = np.abs(blocks.dequantize().numpy() - expected)
    assert (error <= np.abs(expected).max(-1, keepdims=True) * 2**-10).all()


def test_gguf_q6_k_runs_at_8_bits_quantized_again_from_its_values():
    raw = _random_blocks(Kind.Q6_K, 16, 210, (208,))
    blocks = to_blocks(raw, Kind.Q6_K)
    expected = dequantize(raw, Kind.Q6_K)
    step = np.abs(expected).reshape(16, -1, GROUP).max(-1, keepdims=True) / 127
    assert blocks.bits == 8
    error = np.abs(blocks.dequantize().numpy() - expected).reshape(16, -1, GROUP)
    assert (error <= step * 0.51).all()


@pytest.mark.parametrize(("kind", "size", "scales"), [
    (Kind.Q4_0, 18, (0,)), (Kind.Q4_1, 20, (0, 2)), (Kind.Q8_0, 34, (0,))])
def test_the_embedding_over_packed_blocks_gives_the_dequantized_rows_exactly(kind, size, scales):
    raw = _random_blocks(kind, 48, size, scales)
    embedding = quant_linear.QuantEmbedding(*pack(to_blocks(raw, kind)),
                                            8 if kind == Kind.Q8_0 else 4)
    ids = torch.tensor([[0, 47, 16], [15, 17, 31]])
    table = torch.from_numpy(dequantize(raw, kind))
    rows = embedding(ids)
    assert rows.dtype == torch.float32 and rows.shape == (2, 3, 256)
    assert torch.equal(rows, table[ids])


def awkward_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` with the groups whose quantization each build could get wrong: exact halves (ties go
    to even), all zeros, a negative zero, a NaN (0, and not counted in the max)."""
    x = x.clone()
    x[0, :GROUP] = torch.arange(GROUP) - 15.5
    x[0, 0] = 127.0  # the scale 1: the other elements half-way between two integers
    x[1, GROUP : 2 * GROUP] = 0.0
    x[1, 2 * GROUP] = -0.0
    x[2, 7] = float("nan")
    return x


def test_halves_round_to_even_and_a_nan_input_counts_as_zero():
    torch.manual_seed(5)
    weight = from_float(torch.randn(48, 96), 8)
    x = awkward_rows(torch.randn(4, 96))
    got = QuantLinear(weight)(x)
    torch.testing.assert_close(got.double(), llama_cpp_product(x.nan_to_num(0.0), weight),
                               rtol=1e-5, atol=1e-4)


_OTHER_BUILD = textwrap.dedent("""
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    ops = torch.ops.lmi_quant
    x, weights, scales, mins, bits, norm, y, y_norm = torch.load(sys.argv[2])
    torch.save([ops.quant_linear(x, weights, scales, mins, bits),
                ops.quant_linear(x, weights, scales, mins, bits, norm, 1e-5),
                ops.rms_norm(y, y_norm, 1e-5)], sys.argv[3])
""")


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.lmi_quant.rms_norm(x, weight, 1e-5)


@pytest.mark.parametrize("march", ["cascadelake", "x86-64-v3", "x86-64"])
def test_vnni_avx2_and_plain_cpp_builds_give_the_same_bits(march, tmp_path):
    """The image's prebuilt VNNI (cascadelake) and AVX2 (x86-64-v3) builds and plain C++
    (x86-64) against this CPU's own (AMX's tiles for 32 of the rows where it has AMX-INT8):
    the inputs quantized alike (awkward_rows), integer sums exact, the float steps and the
    norms' sums in one order, so the bits are the same."""
    if march != "x86-64" and march not in native_build.runnable_levels():
        pytest.skip(f"this CPU does not run {march}")
    library = native_build.build_level(quant_linear.SOURCE, march)
    torch.manual_seed(3)
    for bits in (4, 8):
        layer = QuantLinear(from_float(torch.randn(64, 160), bits))
        x = awkward_rows(torch.randn(37, 160) * 2)
        norm, y, y_norm = torch.rand(160) + 0.5, torch.randn(5, 100), torch.rand(100) + 0.5
        torch.save((x, layer.weights, layer.scales, layer.mins, bits, norm, y, y_norm),
                   tmp_path / "in.pt")
        subprocess.run([sys.executable, "-c", _OTHER_BUILD, str(library), str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], check=True)
        plain, normed, alone = torch.load(tmp_path / "out.pt")
        assert torch.equal(plain, layer(x))
        assert torch.equal(normed, layer(rms_norm(x, norm)))
        assert torch.equal(alone, rms_norm(y, y_norm))


@pytest.mark.parametrize("width", [576, 100])
def test_the_norm_is_rmsnorm_and_a_rows_norm_is_its_own(width):
    """torch's RMSNorm within float32's rounding (its sums run in another order), each row's
    the same bits alone as in a batch; a layer given the norm computes it the same way."""
    torch.manual_seed(width)
    x, weight = torch.randn(33, width) * 3, torch.rand(width) + 0.5
    together = rms_norm(x, weight)
    torch.testing.assert_close(together, torch.nn.functional.rms_norm(x, (width,), weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    assert all(torch.equal(rms_norm(x[i : i + 1], weight)[0], together[i]) for i in range(33))
    if width % GROUP == 0:
        layer = QuantLinear(from_float(torch.randn(32, width), 4))
        norm = torch.nn.RMSNorm(width, eps=1e-5)
        norm.weight.data, norm.variance_epsilon = weight, 1e-5
        assert torch.equal(layer(x, norm), layer(together))
