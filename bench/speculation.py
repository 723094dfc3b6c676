"""Speculative decoding (n-gram proposals) on the torch engine: one stream's decode speed with
and without, on an input-grounded workload (answers that copy the prompt's text) and a free-text
one, on the embedded SmolLM2-135M-Instruct.

    .venv/bin/python -m bench.speculation [--option KEY=VALUE ...] [--tokens 96] [--turns 3]

Two `lmi-serve`s, one without speculation and one with `--spec` (vLLM's speculative_config
JSON), each serving `--turns` greedy chat requests per prompt, one request at a time, the two
alternating request by request so that a shared machine's drifting load falls on both alike
(max_tokens `--tokens`).
Speed is completion tokens over the requests' wall time; the texts must be identical with and
without. Prints a table with the acceptance the server counted (vllm:spec_decode_* in /metrics)
and writes `<out>/speculation-<time>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
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


def ask(url: str, prompt: str, tokens: int) -> tuple[str, int, float]:
    """One greedy chat answer: its text, completion tokens and seconds."""
    began = time.perf_counter()
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": tokens,
        "messages": [{"role": "user", "content": prompt}]}).json()
    return (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"],
            time.perf_counter() - began)


def run(urls: dict[str, str], prompts: list[str], args: argparse.Namespace
        ) -> dict[str, dict[str, Any]]:
    """Per mode (off, on): the prompts' answers, tokens and seconds, `turns` times each, one
    request at a time, the modes alternating request by request (the machine's load drifts)."""
    before = counters(urls["on"])
    done = {mode: {"texts": [], "tokens": 0, "seconds": 0.0} for mode in urls}
    for _ in range(args.turns):
        for prompt in prompts:
            for mode, url in urls.items():
                text, tokens, seconds = ask(url, prompt, args.tokens)
                done[mode]["texts"].append(text)
                done[mode]["tokens"] += tokens
                done[mode]["seconds"] += seconds
    after = counters(urls["on"])
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    for result in done.values():
        result["tok_s"] = result["tokens"] / result["seconds"]
    done["on"]["acceptance"] = spent["num_accepted_tokens"] / spent["num_draft_tokens"] \
        if spent.get("num_draft_tokens") else None
    return done


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for mode, extra in (("off", []), ("on", [f"option.speculative_config={args.spec}"])):
            options = ["option.embedding_model_id=none", *args.option, *extra]
            server = stack.enter_context(ServerProcess(
                lmi_serve(options), args.out / f"speculation-{stamp}-{mode}.log"))
            server.wait_ready(600)
            urls[mode] = server.url
        for name, prompts in (("grounded", GROUNDED), ("free", FREE)):
            for mode, result in run(urls, prompts, args).items():
                results[f"{name}/{mode}"] = result
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
