"""Cold start: `lmi-serve` from launch to `/ping` 200, with the phases its log shows, and to its
first embeddings answer (the embedding model loads once the LLM serves).

    .venv/bin/python -m bench.cold_start [--runs 5] [--option KEY=VALUE ...]

One server at a time, each a fresh process with the caches warm (a first, uncounted run fills
them: the GGUF conversion, the page cache); every run is stopped once it has answered. Phases
are read from the log's timestamps: the configuration logged (Python, the server's imports,
the engine's choice), the model loaded (torch, the tokenizer, the weights), ready (fusing,
packing), then `/ping` and `/v1/embeddings` as a client sees them. Prints a table (median, min,
max seconds); writes `<out>/cold-start-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime
from pathlib import Path

from bench.launcher import ServerProcess, lmi_serve
from bench.report import RESULTS, figure, progress, write_json

# Log lines that end a phase (the first line containing the text), in the order they come.
PHASES = {
    "configured": "lmi_serve: config ",
    "model loaded": "handlers.engine.torch.loader: Loaded ",
    "ready": " is ready on http",
}
POLL_S = 0.02  # how often a start is asked whether it answers yet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed starts (after a warm-up)")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for lmi-serve")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def one_start(options: list[str], log_path: Path, timeout: float) -> dict[str, float]:
    """Seconds from launch to each phase, `/ping` 200 and the first embeddings answer."""
    with ServerProcess(lmi_serve(options), log_path) as server:
        times = {"/ping 200": server.wait_ready(timeout, poll=POLL_S)}
        server.wait_embeddings(timeout, poll=POLL_S)
        times["/v1/embeddings"] = time.time() - server.launched
    return {**_phases(log_path.read_text(errors="replace"), server.launched), **times}


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
    with figure(path, 1, (8, 1 + 0.5 * len(runs)), dpi=120) as ax:
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / f"cold-start-{stamp}-logs"
    logs.mkdir()
    runs = []
    with progress(args.runs + 1, "starts", unit="start") as bar:
        for index in range(args.runs + 1):
            timed = one_start(args.option, logs / f"run-{index}.log", args.timeout)
            if index:  # the first fills the caches
                runs.append(timed)
            bar.update()
    stats = summary(runs)
    print(format_table(stats))
    doc = {"options": args.option, "runs": runs, "summary": stats}
    write_json(doc, args.out / f"cold-start-{stamp}.json")
    plot(runs, args.out / f"cold-start-{stamp}.png")
    print(f"wrote {args.out / f'cold-start-{stamp}'}.json and .png")


if __name__ == "__main__":
    main()
