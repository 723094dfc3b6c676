"""What a start costs in memory: `lmi-serve` launched on a model, the seconds until `/ping` says
200, its resident memory then (VmRSS) and its peak so far (VmHWM, the kernel's high-water mark
of the process's resident set), and both again after one greedy answer.

    python -m bench.start_memory MODEL [--cache-dir DIR] [--option KEY=VALUE ...] [--runs 2]

Each run is a fresh server; with an empty `--cache-dir` the first run is a first start and the
later ones warm starts. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import httpx

from bench.launcher import ServerProcess, lmi_serve


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of process `pid`, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def one_start(model: str, cache_dir: Path, options: list[str], log: Path) -> dict:
    env = {**os.environ, "LMI_CACHE_DIR": str(cache_dir)}
    command = lmi_serve([f"option.model_id={model}", *options])
    with ServerProcess(command, log, env=env) as server:
        seconds = server.wait_ready(timeout=1800, poll=0.1)
        ready = memory_kib(server.proc.pid)
        answer = httpx.post(f"{server.url}/invocations", timeout=600, json={
            "inputs": "The capital of France is", "parameters": {"max_new_tokens": 16}})
        answer.raise_for_status()
        served = memory_kib(server.proc.pid)
    return {"start_s": round(seconds, 1), "rss_ready_gib": round(ready["VmRSS"] / 2**20, 3),
            "peak_ready_gib": round(ready["VmHWM"] / 2**20, 3),
            "rss_after_answer_gib": round(served["VmRSS"] / 2**20, 3),
            "peak_after_answer_gib": round(served["VmHWM"] / 2**20, 3),
            "file_gib": round(_size(Path(model)) / 2**30, 3)}


def _size(model: Path) -> int:
    """The model's bytes: a file's, or a checkpoint directory's files'."""
    if model.is_file():
        return model.stat().st_size
    return sum(file.stat().st_size for file in model.rglob("*") if file.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a new empty one")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for lmi-serve")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="lmi-start-memory-"))
    for run in range(args.runs):
        result = one_start(args.model, cache_dir, args.option, cache_dir / f"server-{run}.log")
        print(json.dumps({"run": run, **result}), flush=True)


if __name__ == "__main__":
    main()
