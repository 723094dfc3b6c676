"""Speculative decoding (n-gram proposals) on the torch engine: one stream's decode speed with
and without, on an input-grounded workload (answers that copy the prompt's text) and a free-text
one, on the embedded SmolLM2-135M-Instruct.

    .venv/bin/python -m bench.speculation [--option KEY=VALUE ...] [--tokens 96] [--turns 3]

One `lmi-serve` without speculation, then one with `--spec` (vLLM's speculative_config JSON),
each serving `--turns` greedy chat requests per prompt, one at a time (max_tokens `--tokens`).
Speed is completion tokens over the requests' wall time; the texts must be identical with and
without. Prints a table with the acceptance the server counted (vllm:spec_decode_* in /metrics)
and writes `<out>/speculation-<time>.json`.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx

from bench.launcher import ServerProcess, lmi_serve
from bench.report import RESULTS, format_table, write_json

GROUNDED = [
    "Fix the typo in this code and print the whole function again:\n"
    "def total_price(items, tax_rate):\n    subtotal = sum(item.price * item.quantity for item "
    "in items)\n    tax = subtotal * tax_rte\n    return round(subtotal + tax, 2)\n",
    "Extract the fields name, city and email as JSON from: 'Contact Maria Gonzalez, who lives "
    "in Barcelona, at maria.gonzalez@example.com for the shipment details.'",
    "Repeat this paragraph exactly: The quarterly report shows revenue of 4.2 million dollars, "
    "up 12 percent from last year, driven by strong sales in the northern region and lower "
    "shipping costs across every warehouse.",
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten year old.",
    "Give three tips for staying focused while studying.",
]
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", default=[], help="option.KEY=VALUE")
    parser.add_argument("--spec", default=SPEC, help="option.speculative_config's JSON")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r"^vllm:spec_decode_(num_\w+)_total{[^}]*} (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def run(url: str, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The prompts' answers, tokens and seconds, `turns` times each, one request at a time."""
    texts, tokens, seconds = [], 0, 0.0
    before = counters(url)
    for _ in range(args.turns):
        for prompt in prompts:
            began = time.perf_counter()
            answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": args.tokens,
                "messages": [{"role": "user", "content": prompt}]}).json()
            seconds += time.perf_counter() - began
            tokens += answer["usage"]["completion_tokens"]
            texts.append(answer["choices"][0]["message"]["content"])
    after = counters(url)
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"texts": texts, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "acceptance": spent["num_accepted_tokens"] / spent["num_draft_tokens"]
            if spent.get("num_draft_tokens") else None}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, Any]] = {}
    for mode, extra in (("off", []), ("on", [f"option.speculative_config={args.spec}"])):
        options = ["option.embedding_model_id=none", *args.option, *extra]
        with ServerProcess(lmi_serve(options), args.out / f"speculation-{stamp}-{mode}.log") \
                as server:
            server.wait_ready(600)
            for name, prompts in (("grounded", GROUNDED), ("free", FREE)):
                results[f"{name}/{mode}"] = run(server.url, prompts, args)
    rows = []
    for name in ("grounded", "free"):
        off, on = results[f"{name}/off"], results[f"{name}/on"]
        acceptance = on["acceptance"]
        rows.append((name, f"{off['tok_s']:.1f}", f"{on['tok_s']:.1f}",
                     f"{on['tok_s'] / off['tok_s']:.2f}",
                     "-" if acceptance is None else f"{acceptance:.2f}",
                     str(on["texts"] == off["texts"])))
    print(format_table(("workload", "off tok/s", "on tok/s", "speed-up", "acceptance",
                        "same text"), rows))
    doc = {"options": args.option, "spec": json.loads(args.spec), "tokens": args.tokens,
           "turns": args.turns, "results": results}
    write_json(doc, args.out / f"speculation-{stamp}.json")
    print(f"wrote {args.out / f'speculation-{stamp}.json'}")


if __name__ == "__main__":
    main()
