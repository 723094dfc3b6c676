"""The C++ kernels' builds (handlers/engine/native_build.py): prebuilt for the x86-64 levels, as
an image's build step makes them, a server on another CPU loads the best level its CPU runs
instead of compiling; with none prebuilt it compiles for its own CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from handlers.engine import native_build

SOURCE = Path(native_build.__file__).parent / "loop" / "row_reductions.cpp"


def test_a_prebuilt_level_is_loaded_where_no_build_for_this_cpu_is(tmp_path, monkeypatch):
    levels = native_build.runnable_levels()
    if not levels:
        pytest.skip("this CPU runs neither prebuilt level (no AVX2)")
    monkeypatch.setenv("LMI_CACHE_DIR", str(tmp_path))
    subprocess.run([sys.executable, "-m", "handlers.engine.native_build"], check=True,
                   capture_output=True, env=dict(os.environ))
    built = sorted(p.name for p in tmp_path.glob("kernels/*/*.so"))
    sources = sorted(Path(native_build.__file__).parents[1].rglob("*.cpp"))
    assert len(built) == len(sources) * len(native_build.LEVELS)
    library = native_build.build(SOURCE)
    assert library.exists() and len(list(tmp_path.glob("kernels/*/*.so"))) == len(built)
    # The level's build loads on this CPU: in a process of its own, as this one may hold the
    # same ops already (registering them twice aborts).
    subprocess.run([sys.executable, "-c", "import sys, torch; torch.ops.load_library(sys.argv[1])",
                    str(library)], check=True, capture_output=True)


def test_without_a_prebuilt_level_it_compiles_for_this_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("LMI_CACHE_DIR", str(tmp_path))
    library = native_build.build(SOURCE)
    assert library.exists() and [p for p in tmp_path.glob("kernels/*/*.so")] == [library]
    assert native_build.build(SOURCE) == library  # cached


def test_the_levels_a_cpu_runs(monkeypatch):
    avx2 = "sse4_2 avx avx2 bmi1 bmi2 f16c fma movbe xsave"
    for flags, expected in ((avx2, ["x86-64-v3"]),
                            (avx2 + " avx512f avx512bw avx512cd avx512dq avx512vl",
                             ["x86-64-v4", "x86-64-v3"]),
                            (avx2 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni",
                             ["cascadelake", "x86-64-v4", "x86-64-v3"]),
                            ("sse4_2 avx512f avx512bw avx512cd avx512dq avx512vl", []),
                            ("", [])):
        monkeypatch.setattr(native_build, "cpu_flags", lambda flags=flags: flags)
        assert native_build.runnable_levels() == expected
