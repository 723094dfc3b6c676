"""Models of the sizes people deploy on a CPU: our server against llama.cpp driven directly on
the same file. Random-weight Llamas of Llama-3.2-1B's, 3B's and Llama-3.1-8B's shapes with
SmolLM2's tokenizer, as Q4_K_M GGUFs by llama.cpp's own quantizer, and the 1B as bf16 safetensors
(bench/sizes_models.py makes them once into --models-dir).

    python -m bench.sizes [--models 1b:Q4_K_M,3b:Q4_K_M,8b:Q4_K_M,1b:bf16] [--quick]

For each model, each system is started twice, one at a time: a first start (ours: an empty
cache folder) and a warm start (ours: the same folder again). Measured: seconds from the launch
to ready (ours: `/ping` 200; llama.cpp: its `Llama` built, Python's start included), resident
memory then, the peak during start (ours: through its decode graphs' compiling, up to
--graphs-timeout, its compiler subprocess counted) and under load; on the warm start, the
prefill rate of a 512-token prompt (best of two), then generated tokens/s at 1 stream (ours
also at 8 and 16: llama.cpp driven directly serves one request at a time). Memory is the process
tree's resident set (VmRSS summed, sampled every 0.2 s) or the server's own high-water mark
(VmHWM), whichever is higher. Ours runs `lmi-serve --option option.model_id=FILE` with no other
setting but `option.max_model_len` (--context, llama.cpp's n_ctx too), no embedding model and
a stall timeout of 30 minutes (a first request builds kernels; more with --option); each start
answers one short request (timed: `first_answer_s`) before anything else. The machine
(`lscpu`'s model name) and the load average go with every run. Prints a table and issue 50's
targets, met or not; writes `<out>/sizes-<time>.json` and `.png`.

llama.cpp runs in the environment that has llama_cpp (LMI_EXTRAS=llamacpp), --llamacpp-python.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import sizes_models
from bench.launcher import REPO, thread_env
from bench.report import RESULTS, write_json
from bench.sizes_ours import ours
from bench.sizes_report import plot, table, targets

DEFAULT_MODELS = "1b:Q4_K_M,3b:Q4_K_M,8b:Q4_K_M,1b:bf16"
LLAMACPP_PYTHONS = (REPO / ".venv-llamacpp/bin/python",
                    Path.home() / ".cache/lmi-serve/ci/venv-llamacpp/bin/python")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help=f"default {DEFAULT_MODELS} (--quick: small:Q4_K_M,"
                   f"small:bf16); SHAPE:FORMAT, shapes {', '.join(sizes_models.SHAPES)}, formats "
                        f"{', '.join(sizes_models.FORMATS)}")
    p.add_argument("--quick", action="store_true",
                   help="the small shape unless --models, 16 tokens a request, 1 and 4 streams")
    p.add_argument("--systems", default="ours,llamacpp")
    p.add_argument("--models-dir", type=Path,
                   default=Path.home() / ".cache/lmi-serve/bench-sizes")
    p.add_argument("--llamacpp-python", type=Path,
                   default=next((p for p in LLAMACPP_PYTHONS if p.exists()), LLAMACPP_PYTHONS[0]))
    p.add_argument("--python", default=sys.executable, help="the Python that runs lmi-serve")
    p.add_argument("--option", action="append", default=[], help="another KEY=VALUE for ours")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--streams", default="1,8,16")
    p.add_argument("--requests", type=int, default=2, help="requests per stream")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--graphs-timeout", type=float, default=1800,
                   help="seconds ours may take to compile its decode graphs before going on "
                        "(the table then says they were not ready)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.models = args.models or "small:Q4_K_M,small:bf16"
        args.streams, args.max_tokens = "1,4", 16
    args.models = args.models or DEFAULT_MODELS
    args.streams = [int(s) for s in args.streams.split(",")]
    args.systems = args.systems.split(",")
    return args


def machine() -> dict[str, Any]:
    found = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in found.splitlines()
                  if line.startswith("Model name")), "unknown")
    return {"cpu": model, "cores": os.cpu_count()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def llamacpp(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Two launches of llama.cpp on `model`: the first only loads it, the second measures."""
    first = llamacpp_run(model, args, ["--start-only"])
    warm = llamacpp_run(model, args, [])
    return {"first": first, "warm": warm, "version": warm["version"]}


def llamacpp_run(model: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    command = [str(args.llamacpp_python), "-m", "bench.sizes_llamacpp", "measure", str(model),
               "--context", str(args.context), "--threads", str(args.threads),
               "--prompt-tokens", str(args.prompt_tokens), "--requests", str(args.requests),
               "--max-tokens", str(args.max_tokens), *extra]
    launched = time.time()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                          env=thread_env(args.threads))
    if done.returncode:
        raise RuntimeError(f"llama.cpp on {model} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    return {**result, "start_s": result["ready_at"] - launched}


def measure(name: str, args: argparse.Namespace, doc: dict[str, Any], save: Any) -> None:
    shape, form = name.split(":")
    path = sizes_models.make(args.models_dir, shape, form, args.llamacpp_python)
    entry = doc["models"].setdefault(name, {"path": str(path),
                                            "file_gib": sizes_models.size_gib(path)})
    for system in args.systems:
        if system == "llamacpp" and form == "bf16":
            continue  # llama.cpp reads GGUFs only
        print(f"== {name}: {system} (load average {load_average()})", file=sys.stderr,
              flush=True)
        entry[system] = {"load_average_before": load_average()}
        if system == "ours":
            with tempfile.TemporaryDirectory(prefix="lmi-sizes-cache-") as cache:
                entry[system] |= ours(path, Path(cache), args)
        else:
            entry[system] |= llamacpp(path, args)
        entry[system]["load_average_after"] = load_average()
        save()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"sizes-{stamp}.json"
    doc: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
        "command": " ".join(sys.argv), "load_average_at_start": load_average(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "models": {}}
    for name in args.models.split(","):
        measure(name, args, doc, lambda: write_json(doc, path))
    doc["load_average_at_end"] = load_average()
    write_json(doc, path)
    plot(doc, path.with_suffix(".png"))
    print(table(doc))
    print("\n".join(targets(doc)))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
