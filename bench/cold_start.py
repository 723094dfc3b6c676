"""Cold start: `lmi-serve` from launch to `/ping` 200, with the phases its log shows, and to its
first embeddings answer (the embedding model loads once the LLM serves).

    .venv/bin/python bench/cold_start.py [--runs 5] [--option KEY=VALUE ...]

One server at a time, each a fresh process with the caches warm (a first, uncounted run fills
them: the GGUF conversion, the page cache); every run is stopped once it has answered. Phases
are read from the log's timestamps: the configuration logged (Python, the server's imports,
the engine's choice), the model loaded (torch, the tokenizer, the weights), ready (fusing,
packing), then `/ping` and `/v1/embeddings` as a client sees them. Prints a table (median, min,
max seconds); writes `<out>/cold-start-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.launcher import REPO, free_port  # noqa: E402

# Log lines that end a phase (the first line containing the text), in the order they come.
PHASES = {
    "configured": "lmi_serve: config ",
    "model loaded": "handlers.engine.torch.loader: Loaded ",
    "ready": " is ready on http",
}
EMBEDDER = "all-minilm-l6-v2"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed starts (after a warm-up)")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for lmi-serve")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def one_start(options: list[str], log_path: Path, timeout: float) -> dict[str, float]:
    """Seconds from launch to each phase, `/ping` 200 and the first embeddings answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "handlers.cli", "--host", "127.0.0.1", "--port", str(port),
               "--grpc-port", "0", *(f"--option={o}" for o in options)]
    launched = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        times = {"/ping 200": _until_ok(lambda: httpx.get(f"{url}/ping", timeout=5), proc,
                                        timeout) - launched}
        embedding = {"model": EMBEDDER, "input": "warm start"}
        times["/v1/embeddings"] = _until_ok(lambda: httpx.post(
            f"{url}/v1/embeddings", json=embedding, timeout=timeout), proc, timeout) - launched
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {**_phases(log_path.read_text(errors="replace"), launched), **times}


def _until_ok(ask, proc: subprocess.Popen, timeout: float) -> float:
    """The time the first 200 came back; polls every 20 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if ask().status_code == 200:
                return time.time()
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.02)
    raise TimeoutError(f"no answer in {timeout:.0f} s")


def _phases(log: str, launched: float) -> dict[str, float]:
    found = {}
    for phase, marker in PHASES.items():
        line = next((line for line in log.splitlines() if marker in line), None)
        if line is not None:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[phase] = stamp - launched
    return found


def summary(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    columns = [*PHASES, "/ping 200", "/v1/embeddings"]
    return {c: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for c in columns if (v := [run[c] for run in runs if c in run])}


def format_table(stats: dict[str, dict[str, float]]) -> str:
    rows = ["| seconds from launch | median | min | max |", "| --- | --- | --- | --- |"]
    rows += [f"| {name} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} |"
             for name, s in stats.items()]
    return "\n".join(rows)


def plot(runs: list[dict[str, float]], path: Path) -> None:
    import matplotlib  # here, so the table and JSON need no matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1 + 0.5 * len(runs)))
    for row, run in enumerate(runs):
        start = 0.0
        for name in (*PHASES, "/ping 200"):
            if name in run:
                ax.barh(row, run[name] - start, left=start, label=name if row == 0 else None)
                start = run[name]
        ax.plot(run["/v1/embeddings"], row, "k|", markersize=14,
                label="/v1/embeddings" if row == 0 else None)
    ax.set_xlabel("seconds from launch")
    ax.set_yticks(range(len(runs)), [f"run {i + 1}" for i in range(len(runs))])
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / f"cold-start-{stamp}-logs"
    logs.mkdir()
    runs = []
    for index in tqdm(range(args.runs + 1), desc="starts", unit="start"):
        timed = one_start(args.option, logs / f"run-{index}.log", args.timeout)
        if index:  # the first fills the caches
            runs.append(timed)
    stats = summary(runs)
    print(format_table(stats))
    doc = {"options": args.option, "runs": runs, "summary": stats}
    (args.out / f"cold-start-{stamp}.json").write_text(json.dumps(doc, indent=2))
    plot(runs, args.out / f"cold-start-{stamp}.png")
    print(f"wrote {args.out / f'cold-start-{stamp}'}.json and .png")


if __name__ == "__main__":
    main()
