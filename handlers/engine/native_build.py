"""C++ built against this torch's headers on first use and cached: g++ in seconds, in
$LMI_CACHE_DIR/kernels keyed by the source, the compiler, torch and the CPU (-march=native).

An image builds them ahead for the x86-64 levels instead (`python -m
handlers.engine.native_build`, -march=x86-64-v3, x86-64-v4 and cascadelake: v4 with VNNI), as
its build machine's CPU is not the one it will run on: a server that finds no build for its own
CPU loads the best prebuilt level its CPU runs, so a container starts without compiling (about
15 s on 2 cores).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from handlers.engine.machine import cpu_flags
from handlers.model_fetch import default_cache_dir

log = logging.getLogger(__name__)

# The x86-64 levels prebuilt, best first, with the CPU flags each needs (beyond the lower ones').
# cascadelake is x86-64-v4 with AVX-512 VNNI (the quantized linears' int8 dot products), which
# every CPU since Cascade Lake and Zen 4 runs.
LEVELS = {
    "cascadelake": {"avx512_vnni"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"},
}


def flags(march: str = "native") -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O3", f"-march={march}", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
            "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]


def build(source: Path) -> Path:
    """The shared library of `source`: built for this CPU, else a prebuilt level it runs,
    else compiled now (raises OSError or CalledProcessError where it cannot be)."""
    compiler, version = _compiler()
    native = _library(source, compiler, version, "native")
    if native.exists():
        return native
    for level in runnable_levels():
        prebuilt = _library(source, compiler, version, level)
        if prebuilt.exists():
            return prebuilt
    return _compile(source, compiler, native, "native")


def _compiler() -> tuple[str, str]:
    """The C++ compiler ($CXX, else g++) and its version text (part of a build's key)."""
    compiler = os.environ.get("CXX", "g++")
    return compiler, subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                    check=True).stdout


def _library(source: Path, compiler: str, version: str, march: str) -> Path:
    """Where the build of `source` for `march` lives (whether or not it exists yet)."""
    machine = cpu_flags() if march == "native" else march
    digest = hashlib.sha256("\0".join([source.read_text(), compiler, version, torch.__version__,
                                       *flags(march), machine]).encode())
    return default_cache_dir() / "kernels" / digest.hexdigest()[:16] / f"lib{source.stem}.so"


def _compile(source: Path, compiler: str, library: Path, march: str) -> Path:
    directory = library.parent
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server building the same: wait for it
        if not library.exists():
            partial = directory / f"partial-{os.getpid()}.so"
            subprocess.run([compiler, str(source), "-o", str(partial), *flags(march)],
                           capture_output=True, text=True, check=True)
            os.replace(partial, library)  # whole, or not there
    log.info("built %s", library)
    return library


def runnable_levels() -> list[str]:
    """The prebuilt levels this CPU runs, best first."""
    have = set(cpu_flags().split())
    needed: set[str] = set()
    runnable = []
    for level, level_flags in reversed(LEVELS.items()):  # lowest first: each needs those below
        needed |= level_flags
        if needed <= have:
            runnable.append(level)
    return runnable[::-1]


def load(source: Path, without: str, fakes: Mapping[str, Callable] | None = None) -> bool:
    """Build `source` and load it into torch's registry, with `fakes` (op name: what
    torch.export traces that op as) registered; False, with a warning naming the library and
    `without` (what runs instead), where it cannot be."""
    try:
        torch.ops.load_library(str(build(source)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("%s could not be built (%s); %s", source.name, str(detail).strip()[-500:],
                    without)
        return False
    for op, fake in (fakes or {}).items():
        torch.library.register_fake(op)(fake)
    return True


def build_level(source: Path, march: str) -> Path:
    """The build of `source` for `march` (a level, or any -march value), compiled once and
    cached beside the others."""
    compiler, version = _compiler()
    return _compile(source, compiler, _library(source, compiler, version, march), march)


def prebuild(levels: Iterable[str] = tuple(LEVELS)) -> list[Path]:
    """Every kernel of the package built for each of `levels` (an image's build step: all)."""
    sources = sorted(Path(__file__).resolve().parents[1].rglob("*.cpp"))
    return [build_level(source, level) for source in sources for level in levels]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    prebuild()
