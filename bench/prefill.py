"""Long prompts against short ones: prefill throughput at 2k, 4k and 7k tokens, and the time to
first token of a short request sent while two ~7,000-token prompts prefill.

    .venv/bin/python -m bench.prefill [--option KEY=VALUE ...] [--lengths 2000 4000 7000]

One `lmi-serve` (the embedded SmolLM2-135M-Instruct unless options say otherwise; no
embedding model). Prompts of an exact token count are made with the server's own /tokenize and
/detokenize. Throughput: one prompt at a time, `max_new_tokens` 1, its length over its time to
first token. Fairness: two long prompts at once (`max_new_tokens` 4), then, once the server
holds both, a 4-token request: when each answered, and whether the short one came first. The
server's resident memory is read once ready and after the long prompts, with its peak. Prints a
table; writes `<out>/prefill-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.launcher import ServerProcess, lmi_serve
from bench.prompts import words
from bench.report import RESULTS, figure, format_table, progress, write_json

LONG = 7000
SHORT = {"inputs": "Say hi", "parameters": {"max_new_tokens": 4}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for lmi-serve")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 7000])
    parser.add_argument("--timeout", type=float, default=900, help="seconds a request may take")
    parser.add_argument("--label", default="", help="what this run measures (before, after...)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def prompt_of(url: str, tokens: int) -> str:
    """A text of exactly `tokens` tokens, as the server counts them."""
    text = words(tokens + 16)
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                     timeout=60).json()["tokens"][:tokens]
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def lmi(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}


async def timed(http: httpx.AsyncClient, body: dict[str, Any], began: float) -> dict[str, float]:
    """When the answer's first line and its end arrived, seconds after `began`."""
    first = None
    async with http.stream("POST", "/invocations", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            first = first or time.perf_counter() - began
    return {"first_s": first or float("nan"), "done_s": time.perf_counter() - began}


async def throughput(url: str, lengths: list[int], timeout: float, bar: Any) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        for length in lengths:
            prompt = prompt_of(url, length)
            got = await timed(http, lmi(prompt, 1), time.perf_counter())
            rows.append({"tokens": length, "ttft_s": got["first_s"],
                         "tok_s": length / got["first_s"]})
            bar.update()
    return rows


async def fairness(server: ServerProcess, timeout: float) -> dict[str, Any]:
    """Two long prompts, then a short request once the engine holds both."""
    prompts = [prompt_of(server.url, LONG - i) for i in range(2)]  # no shared prefix reuse
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout) as http:
        began = time.perf_counter()
        longs = [asyncio.create_task(timed(http, lmi(p, 4), began)) for p in prompts]
        while running(server.url) < 2:
            await asyncio.sleep(0.05)
        sent = time.perf_counter() - began
        short = await timed(http, SHORT, began)
        done = await asyncio.gather(*longs)
    return {"short_sent_s": sent, "short": short, "long": done,
            "short_ttft_s": short["first_s"] - sent,
            "short_first": short["done_s"] < min(d["done_s"] for d in done)}


def running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("lmi_running_requests"))


def rss_gib(server: ServerProcess) -> float:
    return psutil.Process(server.proc.pid).memory_info().rss / 2**30


def peak_rss_gib(server: ServerProcess) -> float:
    """The most memory the server has held at once (Linux's VmHWM)."""
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    kib = next(int(line.split()[1]) for line in status.splitlines()
               if line.startswith("VmHWM:"))
    return kib / 2**20


def plot(doc: dict[str, Any], path: Path) -> None:
    with figure(path, 2, (11, 4)) as (left, right):
        rows = doc["throughput"]
        left.plot([r["tokens"] for r in rows], [r["tok_s"] for r in rows], marker="o")
        left.set_xlabel("prompt tokens")
        left.set_ylabel("prefill tokens/s")
        fair = doc["fairness"]
        bars = {"long 1": fair["long"][0]["done_s"], "long 2": fair["long"][1]["done_s"],
                "short (sent)": fair["short_sent_s"], "short (answered)": fair["short"]["done_s"]}
        right.barh(list(bars), list(bars.values()))
        right.set_xlabel("seconds from the first long prompt")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    options = ["option.embedding_model_id=none", *args.option]
    with ServerProcess(lmi_serve(options), args.out / f"prefill-{stamp}.log") as server, \
            progress(len(args.lengths) + 1, "prefill runs", unit="run") as bar:
        server.wait_ready(600)
        rss = {"ready": rss_gib(server)}
        rows = asyncio.run(throughput(server.url, args.lengths, args.timeout, bar))
        fair = asyncio.run(fairness(server, args.timeout))
        bar.update()
        rss["after long prompts"] = rss_gib(server)
        rss["peak"] = peak_rss_gib(server)
    print(format_table(("prompt tokens", "TTFT s", "prefill tok/s"),
                       [(str(r["tokens"]), f"{r['ttft_s']:.2f}", f"{r['tok_s']:.0f}")
                        for r in rows]))
    print(f"short request behind two {LONG}-token prompts: TTFT {fair['short_ttft_s']:.2f} s, "
          f"answered {'before' if fair['short_first'] else 'after'} them (long ones done at "
          f"{', '.join(format(d['done_s'], '.1f') for d in fair['long'])} s); RSS GiB {rss}")
    doc = {"label": args.label, "options": options, "throughput": rows, "fairness": fair,
           "rss_gib": rss}
    write_json(doc, args.out / f"prefill-{stamp}.json")
    plot(doc, args.out / f"prefill-{stamp}.png")
    print(f"wrote {args.out / f'prefill-{stamp}'}.json and .png")


if __name__ == "__main__":
    main()
