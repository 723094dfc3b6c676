"""Serving benchmark: our server's continuous batching against static `generate()` batches.

Workload A is a closed loop at fixed concurrency and fixed output length; workload B replays a
Poisson arrival trace with mixed output lengths. Both run against the server (started here, or
`--url`) and then against Hugging Face generate() in this process, never at the same time.
See bench/README.md. Run: `./dev bench [--quick]` or `python -m bench.serving [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from bench import client
from bench.launcher import ServerProcess, lmi_serve, thread_env
from bench.prompts import prompt
from bench.report import RESULTS, Level, progress, serving_plot, serving_table, write_json
from bench.stats import RequestResult, level, samples
from bench.workloads import Arrival, Progress, poisson_trace

FULL = {"concurrency": "1,8,16,32", "requests_per_client": 2, "max_new_tokens": 128,
        "trace_requests": 40, "trace_rate": 1.0, "trace_min_tokens": 16, "trace_max_tokens": 256}
QUICK = {"concurrency": "1,4", "requests_per_client": 2, "max_new_tokens": 16,
         "trace_requests": 8, "trace_rate": 4.0, "trace_min_tokens": 4, "trace_max_tokens": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="bench this running server instead of starting one")
    p.add_argument("--quick", action="store_true", help="a small smoke-test run")
    p.add_argument("--workloads", default="A,B", help="A, B or A,B")
    p.add_argument("--concurrency", help=f"workload A levels (default {FULL['concurrency']})")
    p.add_argument("--requests-per-client", type=int)
    p.add_argument("--max-new-tokens", type=int, help="workload A output length")
    p.add_argument("--trace-requests", type=int, help="workload B request count")
    p.add_argument("--trace-rate", type=float, help="workload B arrivals per second")
    p.add_argument("--trace-min-tokens", type=int)
    p.add_argument("--trace-max-tokens", type=int)
    p.add_argument("--seed", type=int, default=0, help="workload B trace seed")
    p.add_argument("--max-batch", type=int, default=32,
                   help="server max_rolling_batch_size and the baseline's largest static batch")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads for the server and the baseline")
    p.add_argument("--model", type=Path,
                   help="a Hugging Face model directory for both halves (default: the embedded "
                        "SmolLM2 GGUF)")
    p.add_argument("--device", default="cpu",
                   help="option.device of the server and the baseline's device (cpu, cuda)")
    p.add_argument("--server-option", action="append", default=[], metavar="option.KEY=VALUE",
                   help="another setting for the server (repeatable)")
    p.add_argument("--server-dtype", default="auto",
                   help="the server's option.dtype (auto: bf16 where the CPU runs it, else fp32)")
    p.add_argument("--baseline-dtype", default="fp32",
                   help="dtype of the generate() baseline (fp32: what from_pretrained gives for "
                        "the default GGUF, i.e. generate() as a user runs it)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.workloads = {w.strip().upper() for w in args.workloads.split(",")}
    if bad := args.workloads - {"A", "B"}:
        p.error(f"unknown workload(s): {', '.join(sorted(bad))}")
    if max(args.concurrency) > args.max_batch:
        p.error("a concurrency level exceeds --max-batch")
    return args


def make_trace(args: argparse.Namespace) -> list[Arrival]:
    return poisson_trace(args.trace_requests, args.trace_rate, args.trace_min_tokens,
                         args.trace_max_tokens, args.seed)


def measured(workload: str, system: str, label: str, concurrency: int | None,
             results: list[RequestResult]) -> Level:
    """One row of results: its summary plus every request's own numbers."""
    return {**level(results, workload=workload, system=system, label=label,
                    concurrency=concurrency), "samples": samples(results)}


def trace_label(args: argparse.Namespace) -> str:
    return f"{args.trace_requests} req @ {args.trace_rate:g}/s"


def request_count(args: argparse.Namespace) -> int:
    a = sum(args.concurrency) * args.requests_per_client if "A" in args.workloads else 0
    return a + (args.trace_requests if "B" in args.workloads else 0)


ClosedLoop = Callable[[int, Progress], list[RequestResult]]  # (concurrency, progress)
Trace = Callable[[list[Arrival], Progress], list[RequestResult]]


def run_levels(
    system: str, args: argparse.Namespace, closed: ClosedLoop, trace: Trace
) -> list[Level]:
    """Every level of the chosen workloads, one after the other, for one system."""
    levels = []
    with progress(request_count(args)) as bar:
        for c in args.concurrency if "A" in args.workloads else []:
            bar.set_description(f"{system} A C={c}")
            levels.append(measured("A", system, f"C={c}", c, closed(c, bar.update)))
        if "B" in args.workloads:
            bar.set_description(f"{system} B")
            results = trace(make_trace(args), bar.update)
            levels.append(measured("B", system, trace_label(args), None, results))
    return levels


def server_levels(url: str, args: argparse.Namespace) -> list[Level]:
    asyncio.run(client.warm_up(url, client.LMI))
    turns, length = args.requests_per_client, args.max_new_tokens
    return run_levels(
        "server", args,
        lambda c, done: asyncio.run(client.closed_loop(url, client.LMI, c, turns, length, done)),
        lambda trace, done: asyncio.run(client.arrival_trace(url, client.LMI, trace, done)),
    )


def run_server(args: argparse.Namespace) -> tuple[list[Level], dict[str, Any]]:
    """The server half; returns its levels and how the server was reached."""
    if args.url:
        url = args.url.rstrip("/")
        return server_levels(url, args), {"url": url}
    model = [f"option.model_id={args.model.resolve()}"] if args.model else []
    command = lmi_serve([f"option.max_rolling_batch_size={args.max_batch}",
                         f"option.dtype={args.server_dtype}", f"option.device={args.device}",
                         *model, *args.server_option])
    with ServerProcess(command, args.out / "server.log", thread_env(args.threads)) as server:
        print(f"starting {' '.join(server.command)}", file=sys.stderr)
        server.wait_ready(args.startup_timeout)
        info = {"command": server.command, "log": str(server.log_path)}
        return server_levels(server.url, args), info


def run_baseline(args: argparse.Namespace) -> list[Level]:
    """The generate() half, in this process, after the server half has finished."""
    from bench import baseline  # torch and transformers: loaded only for the baseline

    model = baseline.GenerateBaseline(args.threads, args.baseline_dtype, args.model, args.device)
    model.run_batch([prompt(0)], 8)  # warm-up, not measured
    turns, length = args.requests_per_client, args.max_new_tokens
    return run_levels(
        "generate", args,
        lambda c, done: baseline.closed_loop(model, c, turns, length, done),
        lambda trace, done: baseline.arrival_trace(model, trace, args.max_batch, done),
    )


def meta(args: argparse.Namespace, server: dict[str, Any], load: float) -> dict[str, Any]:
    settings = {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()}
    settings["out"] = str(args.out)
    settings["model"] = str(args.model) if args.model else None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings,
        "server": server,
        "cpu_count": os.cpu_count(),
        "gpu": _gpu_name(args.device),
        "load_avg_at_start": load,
        "python": platform.python_version(),
        "versions": _versions(),
    }


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for package in ("lmi-serve", "torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _gpu_name(device: str) -> str | None:
    if device == "cpu":
        return None
    import torch  # only where a GPU runs the benchmark

    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None


def warn_if_busy() -> float:
    """The 1-minute load average; other work on the machine skews every number measured here."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f} before starting: expect noisy numbers",
              file=sys.stderr)
    return load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = warn_if_busy()
    levels: list[Level] = []
    server: dict[str, Any] = {}
    if not args.skip_server:
        server_part, server = run_server(args)
        levels += server_part
    if not args.skip_baseline:
        levels += run_baseline(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = write_json({"meta": meta(args, server, load), "levels": levels},
                      args.out / f"serving-{stamp}.json", args.out / "latest.json")
    png = path.with_suffix(".png")
    serving_plot(levels, png)
    shutil.copyfile(png, args.out / "latest.png")
    print(serving_table(levels))
    print(f"server option.dtype={args.server_dtype}; generate() dtype={args.baseline_dtype}; "
          f"device {args.device}")
    print(f"\nresults: {path}\nplot:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
