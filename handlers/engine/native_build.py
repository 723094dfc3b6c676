"""C++ built against this torch's headers on first use and cached: g++ in seconds, in
$LMI_CACHE_DIR/kernels keyed by the source, the compiler, torch and the CPU (-march=native)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from handlers.engine.machine import cpu_flags
from handlers.model_fetch import default_cache_dir

log = logging.getLogger(__name__)


def flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
            "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]


def build(source: Path) -> Path:
    """The shared library of `source`, compiled unless cached (raises OSError or
    CalledProcessError where it cannot be)."""
    compiler = os.environ.get("CXX", "g++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    options = flags()
    digest = hashlib.sha256("\0".join([source.read_text(), compiler, version, torch.__version__,
                                       *options, cpu_flags()]).encode())
    directory = default_cache_dir() / "kernels" / digest.hexdigest()[:16]
    library = directory / f"lib{source.stem}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server building the same: wait for it
        if not library.exists():
            partial = directory / f"partial-{os.getpid()}.so"
            subprocess.run([compiler, str(source), "-o", str(partial), *options],
                           capture_output=True, text=True, check=True)
            os.replace(partial, library)  # whole, or not there
    log.info("built %s", library)
    return library


def load(source: Path, without: str) -> bool:
    """Build `source` and load it into torch's registry; False, with a warning naming the
    library and `without` (what runs instead), where it cannot be."""
    try:
        torch.ops.load_library(str(build(source)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("%s could not be built (%s); %s", source.name, str(detail).strip()[-500:],
                    without)
        return False
    return True
