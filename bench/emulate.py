"""Run a command as on a CPU with fewer instruction sets than this one, for another CPU kind's
numbers where only this machine is at hand:

    .venv/bin/python -m bench.emulate avx2 -- .venv/bin/python -m bench.peers ...

`avx512-vnni` is a Xeon with AVX-512 VNNI but neither BF16 nor AMX (Cascade Lake, Ice Lake);
`avx2` a CPU with AVX2 and FMA only (Zen 3, Haswell to Comet Lake). Limited in the command and
every process it starts: oneDNN (ONEDNN_MAX_CPU_ISA), ATen's kernels and the code inductor
generates (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS); this package's C++ kernels, loaded
from a cache that holds only the level an image prebuilds for that CPU; and AMX, whose tile
state Linux grants a process only when it asks (arch_prctl), which a preloaded library refuses.
Not emulated: this CPU's caches, memory bandwidth and clocks, and code compiled for this CPU
outside this package (vLLM's own kernels, llama.cpp built here), which keeps its instruction
sets: a peer's numbers are then an upper bound for the emulated CPU, a ratio against it a lower
one.
"""

from __future__ import annotations

import argparse
import os
import subprocess

from handlers.engine import native_build
from handlers.model_fetch import default_cache_dir

# kind: the prebuilt level of this package's kernels, and the limits of torch's libraries
KINDS = {
    "avx512-vnni": ("cascadelake", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                                    "ATEN_CPU_CAPABILITY": "avx512",
                                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "avx2": ("x86-64-v3", {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                           "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
}

# Refuses ARCH_REQ_XCOMP_PERM (0x1023), the request for AMX's tile state; passes the rest on.
REFUSE_AMX = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
long syscall(long number, ...) {
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_arch_prctl && a[0] == 0x1023) { errno = EPERM; return -1; }
    static long (*next)(long, ...);
    if (!next) next = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return next(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
"""


def prepare(kind: str) -> dict[str, str]:
    """The environment that emulates `kind`: its kernels built, the AMX refusal compiled."""
    level, limits = KINDS[kind]
    shared = default_cache_dir()
    cache = shared / "emulate" / kind
    (cache / "kernels").mkdir(parents=True, exist_ok=True)
    gguf = cache / "gguf"  # a GGUF's converted blocks are the same at every level
    if not gguf.exists():
        (shared / "gguf").mkdir(parents=True, exist_ok=True)
        gguf.symlink_to(shared / "gguf")
    os.environ["LMI_CACHE_DIR"] = str(cache)
    native_build.prebuild([level])
    env = {**os.environ, **limits}
    source, shim = cache / "refuse_amx.c", cache / "refuse_amx.so"
    built = shim.exists() and source.exists() and source.read_text() == REFUSE_AMX
    if not built:  # or built from an older text
        source.write_text(REFUSE_AMX)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", str(source), "-o",
                        str(shim), "-ldl"], check=True)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD")]))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    env = prepare(args.kind)
    print(f"emulating {args.kind}: kernels at {KINDS[args.kind][0]}, "
          + ", ".join(f"{k}={v}" for k, v in KINDS[args.kind][1].items()), flush=True)
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
