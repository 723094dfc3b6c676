"""Where the decode graphs compile for (graph_target.py): float32 for the best x86-64 level this
CPU runs, keyed by that level and not the CPU's flags; bfloat16 for this CPU. Pinned to a level,
inductor's vector ISA and -march are the level's, whatever this CPU has beyond it, and what
inductor picks afterwards is this CPU's again."""

from __future__ import annotations

import platform

import pytest
from torch._inductor import cpu_vec_isa

from handlers.engine import native_build
from handlers.engine.machine import cpu_flags
from handlers.engine.torch import graph_target

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")
# The ISA inductor names each level's best vectors by, and the flags no CPU of the level has.
WANTED = {"x86-64-v3": ("avx2", "-mavx512"), "x86-64-v4": ("avx512", "vnni"),
          "cascadelake": ("avx512 avx512_vnni", "bf16")}


@pytest.mark.parametrize("level", list(graph_target.VEC_ISAS))
def test_a_level_pins_inductors_isa_and_march(level):
    before = str(cpu_vec_isa.pick_vec_isa())
    if level not in graph_target.runnable():
        pytest.skip(f"this CPU lacks {level}: inductor checks an ISA by loading code built for it")
    with graph_target.pinned(level) as settings:
        picked = cpu_vec_isa.pick_vec_isa()
        assert settings == {"cpp.march": level}
        isa, absent = WANTED[level]
        assert str(picked) == isa
        assert absent not in picked.build_arch_flags() and "amx" not in picked.build_arch_flags()
    assert str(cpu_vec_isa.pick_vec_isa()) == before


def test_native_pins_nothing():
    before = str(cpu_vec_isa.pick_vec_isa())
    with graph_target.pinned(graph_target.NATIVE) as settings:
        assert settings == {}
        assert str(cpu_vec_isa.pick_vec_isa()) == before


def test_float32_targets_the_best_level_this_cpu_runs_and_bfloat16_this_cpu(monkeypatch):
    runnable = native_build.runnable_levels()
    assert graph_target.for_compile("fp32") == (runnable[0] if runnable else graph_target.NATIVE)
    assert graph_target.for_compile("bf16") == graph_target.NATIVE
    monkeypatch.setattr(native_build, "cpu_flags", lambda: "fpu sse sse2")  # no level
    assert graph_target.for_compile("fp32") == graph_target.NATIVE


def test_a_level_keys_by_its_name_and_native_by_the_cpus_flags():
    assert graph_target.key_part("x86-64-v3") == "level:x86-64-v3"
    assert graph_target.key_part(graph_target.NATIVE) == cpu_flags()
