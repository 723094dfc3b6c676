"""llama.cpp's side of `bench.sizes`, run in the environment that has llama_cpp
(LMI_EXTRAS=llamacpp):

    python -m bench.sizes_llamacpp quantize IN-F16.gguf OUT.gguf [--ftype Q4_K_M]
    python -m bench.sizes_llamacpp measure MODEL.gguf [--context 2048] [--max-tokens 128]

`quantize` is llama.cpp's own quantizer (`llama_model_quantize`), as `llama-quantize` runs it.
`measure` loads the file into a `Llama` (no server) and prints one JSON object: when it was
ready (time.time(), for the caller to subtract its launch time from), this process's resident
memory then and its peak (VmRSS, VmHWM); unless --start-only, then the prefill rate of
`--prompt-tokens` tokens (best of two prompts), the one-stream requests' timelines (the peer
bench's `run_one`) and the memory again.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import llama_cpp
from llama_cpp import Llama

from bench.llamacpp_direct import run_one
from bench.prompts import prompt, words
from bench.start_memory import memory_kib


def quantize(source: str, target: str, ftype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = os.cpu_count() or 1
    failed = llama_cpp.llama_model_quantize(source.encode(), target.encode(),
                                            ctypes.byref(params))
    if failed:
        raise SystemExit(f"llama_model_quantize {source} -> {target} failed ({failed})")


def memory_gib() -> dict[str, float]:
    found = memory_kib(os.getpid())
    return {"rss_gib": found["VmRSS"] / 2**20, "peak_gib": found["VmHWM"] / 2**20}


def prefill_rate(llm: Llama, tokens: int, offset: int) -> dict[str, float]:
    """`tokens` prompt tokens (no earlier ones kept) and one more generated, timed."""
    ids = llm.tokenize(words(tokens + 16, offset).encode(), add_bos=False)[:tokens]
    llm.reset()
    began = time.perf_counter()
    llm.create_completion(ids, max_tokens=1, temperature=0.0)
    seconds = time.perf_counter() - began
    return {"tokens": len(ids), "seconds": seconds, "tok_s": len(ids) / seconds}


def measure(args: argparse.Namespace) -> dict:
    llm = Llama(args.model, n_ctx=args.context, n_threads=args.threads, verbose=False)
    ready_at = time.time()
    ready = memory_gib()
    base = {"ready_at": ready_at, "ready": ready, "version": llama_cpp.__version__,
            "context": args.context, "threads": args.threads}
    if args.start_only:
        return base
    run_one(llm, prompt(0), 8, time.perf_counter())  # warm up, not measured
    prefill = max((prefill_rate(llm, args.prompt_tokens, i) for i in range(2)),
                  key=lambda r: r["tok_s"])
    start = time.perf_counter()
    requests = [run_one(llm, prompt(i), args.max_tokens, start) for i in range(args.requests)]
    return {**base, "prefill": prefill, "requests": requests, "after_load": memory_gib()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("quantize")
    make.add_argument("source")
    make.add_argument("target")
    make.add_argument("--ftype", default="Q4_K_M")
    run = commands.add_parser("measure")
    run.add_argument("model")
    run.add_argument("--context", type=int, default=2048)
    run.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    run.add_argument("--prompt-tokens", type=int, default=512)
    run.add_argument("--requests", type=int, default=2)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--start-only", action="store_true", help="load, then stop")
    args = parser.parse_args(argv)
    if args.command == "quantize":
        quantize(args.source, args.target, args.ftype)
    else:
        print(json.dumps(measure(args)), flush=True)


if __name__ == "__main__":
    main()
