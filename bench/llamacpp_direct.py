"""llama.cpp driven directly (llama-cpp-python's `Llama`, no server): the peer benchmark's
reference for a GGUF file. Run in the environment that has llama_cpp (LMI_EXTRAS=llamacpp):

    python -m bench.llamacpp_direct MODEL.gguf --streams 1,16 --requests 2 --max-tokens 128

One `Llama` serves one request at a time (so does llama-cpp-python's own server): a level of N
streams is its N x requests requests, in turn, all queued at the level's start. Prints one JSON
object: per level, each request's start / first / last token times and token count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from llama_cpp import Llama

from bench.prompts import prompt


def run_one(llm: Llama, text: str, max_tokens: int, start: float) -> dict[str, float | int]:
    first = last = None
    tokens = 0
    # EOS banned: every request generates exactly max_tokens, as `ignore_eos` does elsewhere.
    for chunk in llm.create_completion(text, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, logit_bias={llm.token_eos(): -1e9}):
        if chunk["choices"][0]["finish_reason"] is not None:
            break  # the closing chunk: no token of its own (counting it made 129 of 128)
        now = time.perf_counter()
        first = first or now
        last = now
        tokens += 1
    return {"start": start, "first": first, "last": last, "done": time.perf_counter(),
            "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--streams", default="1,16,32")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    llm = Llama(args.model, n_ctx=2048, n_threads=args.threads, verbose=False)
    run_one(llm, prompt(0), 8, time.perf_counter())  # warm up
    levels = {}
    for streams in (int(s) for s in args.streams.split(",")):
        start = time.perf_counter()
        levels[streams] = [run_one(llm, prompt(i), args.max_tokens, start)
                           for i in range(streams * args.requests)]
        print(f"llama.cpp direct: {streams} streams done", file=sys.stderr, flush=True)
    print(json.dumps(levels))


if __name__ == "__main__":
    main()
