"""`python -m handlers.engine.torch.graphs_ahead [--into DIR] [--levels L...] [lmi-serve's
arguments]`: the CPU decode graphs a server started with those arguments would load, compiled
ahead for each x86-64 level into DIR (default: $LMI_PREBUILT_GRAPHS), where servers find them
(decode_graphs.py). The image's build step, for its embedded default model: a container then
starts compiling nothing on any CPU of a level built.

Compiling autotunes each GEMM by running it, so only the levels this machine runs are built
(all of them by default; a level it lacks is refused). option.quantize=auto (the default)
chooses at startup, by a probe on the serving CPU, between a GGUF's quantized blocks and float
weights: both are built. Constant files identical across levels are hard-linked, stored once.
Graphs are built ahead in float32 only: option.dtype=auto serves that
wherever the CPU lacks fast bfloat16, and bfloat16 graphs are the compiling CPU's own
(graph_target.py), so such a CPU compiles its own at startup, as without an image.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from handlers.config import Config, load_config, parse_args
from handlers.engine.torch import decode_step, graph_constants, graph_target, quant_linear
from handlers.engine.torch.decode_graphs import (
    job_for,
    prebuilt_directory,
    prebuilt_root,
    weights_digest,
)
from handlers.engine.torch.decode_step import graph_specs
from handlers.engine.torch.loader import load_model
from handlers.model_source import resolve_model_source

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m handlers.engine.torch.graphs_ahead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--into", type=Path, default=prebuilt_root(),
                        help="the folder (default: $LMI_PREBUILT_GRAPHS)")
    parser.add_argument("--levels", nargs="+", choices=list(graph_target.VEC_ISAS),
                        help="default: every level this machine runs")
    ahead, server_args = parser.parse_known_args(argv)
    if ahead.into is None:
        parser.error("name the folder: --into DIR, or $LMI_PREBUILT_GRAPHS")
    runnable = graph_target.runnable()
    levels = ahead.levels or runnable
    lacking = [level for level in levels if level not in runnable]
    if lacking or not levels:
        parser.error(f"this machine runs levels {runnable or 'none'}: it cannot autotune "
                     f"graphs for {lacking or 'any level'}")
    skipped = [level for level in graph_target.VEC_ISAS if level not in levels]
    if skipped:
        log.warning("not built (this machine lacks them, or not asked for): %s", skipped)
    config = load_config(parse_args(server_args))
    if config.dtype.lower() not in ("auto", "fp32", "float32"):
        parser.error(f"option.dtype={config.dtype}: graphs are built ahead in float32 only")
    source = resolve_model_source(config.model_id, config.model_dir, config.revision)
    for quantize in _quantize_modes(config, source):
        build(config, source, quantize, levels, ahead.into)
    saved = link_identical(ahead.into)
    log.info("constants identical across levels linked: %.0f MB saved", saved / 1e6)
    return 0


def build(config: Config, source: Path, quantize: str, levels: list[str],
          into: Path) -> list[Path]:
    """The folders the graphs of `config`'s model (at `source`) with `quantize` went into, one
    a level."""
    loaded = load_model(source, dtype="fp32", device="cpu", max_model_len=config.max_model_len,
                        trust_remote_code=config.trust_remote_code, quantize=quantize)
    job = job_for(loaded, config.max_rolling_batch_size, loaded.max_model_len,
                  config.kv_cache_dtype)
    weights = weights_digest(loaded.model, job)
    specs = graph_specs(job["num_slots"], job["dtype"], job["quantize"])
    folders = []
    for level in levels:
        directory = prebuilt_directory(into, weights, level)
        directory.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        graphs = [spec.name for spec in specs]
        full = {**job, "target": level, "directory": str(directory), "graphs": graphs}
        # A process a level: inductor's ISA choice is pinned once per process.
        subprocess.run([sys.executable, "-m", decode_step.__name__, json.dumps(full)],
                       check=True)
        (directory / "job.json").write_text(json.dumps(full, indent=1) + "\n")
        log.info("decode graphs %s (quantize=%s) for %s in %s, in %.0f s", ", ".join(graphs),
                 job["quantize"], level, directory, time.perf_counter() - began)
        folders.append(directory)
    return folders


def link_identical(into: Path) -> int:
    """Hard-link the constant files under `into` that hold the same bytes (the levels' graphs
    often pack the weights alike: SmolLM2's quantized graph held the same 216 MB at every
    level); the bytes saved."""
    first: dict[tuple[int, str], Path] = {}
    saved = 0
    for path in sorted(into.rglob(f"*{graph_constants.SUFFIX}")):
        with path.open("rb") as file:
            key = (path.stat().st_size, hashlib.file_digest(file, "sha256").hexdigest())
        original = first.setdefault(key, path)
        if original != path and not original.samefile(path):
            partial = path.with_name(path.name + ".link")
            os.link(original, partial)
            os.replace(partial, path)  # the file stays whole for a reader meanwhile
            saved += key[0]
    return saved


def _quantize_modes(config: Config, source: Path) -> list[str]:
    """option.quantize, or where it is auto, what it may choose at startup: a GGUF's blocks
    (where the kernel builds) or float weights."""
    mode = (config.quantize or "auto").lower()
    if mode != "auto":
        return [mode]
    return ["gguf", "none"] if source.suffix.lower() == ".gguf" and quant_linear.available() \
        else ["none"]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
