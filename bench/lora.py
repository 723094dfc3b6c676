"""LoRA adapters on the torch engine: decode throughput at 1, 16 and 32 streams for the base
model alone, one adapter, and four adapters mixed in one batch.

    .venv/bin/python -m bench.lora [--option KEY=VALUE ...] [--streams 1 16 32] [--rank 16]

Four adapters are made with PEFT on the embedded SmolLM2-135M-Instruct (random, non-zero B, on
q/k/v/o_proj: the common attention adapter) into a model directory's `adapters/`, which one
`lmi-serve` serves (no embedding model). Each level runs `streams` closed-loop clients, each
sending `--turns` streaming LMI requests of `--tokens` tokens (EOS ignored): all of them with
the base model, all with adapter a1, or client i with adapter a(i mod 4 + 1). Throughput is the
tokens generated over the level's wall time; the ratio is against the base model at the same
streams. Levels start once the compiled decode step is in use (the base model's: batches with
adapter rows run eagerly); `option.enforce_eager=true` compares one forward path throughout.
Prints a table; writes `<out>/lora-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.client import LMI, Route, lmi_body, session, stream_request, warm_up
from bench.launcher import ServerProcess, lmi_serve
from bench.report import RESULTS, figure, format_table, progress, write_json
from bench.stats import level
from bench.workloads import closed_loop_prompts

ADAPTERS = ("a1", "a2", "a3", "a4")
SCENARIOS = {"base": lambda i: None, "one adapter": lambda i: "a1",
             "four adapters mixed": lambda i: ADAPTERS[i % len(ADAPTERS)]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for lmi-serve")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--turns", type=int, default=2, help="requests per client")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank")
    parser.add_argument("--label", default="", help="what this run measures")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def make_adapters(model_dir: Path, rank: int) -> None:
    """Four PEFT adapters of the embedded model in `model_dir/adapters/`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from handlers.engine.gguf.cache import cached_gguf_dir
    from handlers.model_source import default_model_path

    base = cached_gguf_dir(default_model_path())
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(
            r=rank, lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        for parameter_name, parameter in peft.named_parameters():
            if "lora_B" in parameter_name:
                torch.nn.init.normal_(parameter, std=0.02)
        peft.save_pretrained(model_dir / "adapters" / name)


def route_for(adapter: str | None) -> Route:
    if adapter is None:
        return LMI
    return Route(LMI.path, lambda text, tokens: {**lmi_body(text, tokens), "adapters": adapter},
                 LMI.timer)


async def run_level(url: str, streams: int, turns: int, tokens: int, pick, bar) -> list:
    """`streams` clients, client i sending its `turns` requests with adapter pick(i)."""
    async def client(http, index: int, prompts: list[str]) -> list:
        results = []
        for text in prompts:
            results.append(await stream_request(http, url, route_for(pick(index)), text,
                                                tokens))
            bar.update()
        return results

    async with session() as http:
        done = await asyncio.gather(*(client(http, i, p) for i, p in
                                      enumerate(closed_loop_prompts(streams, turns))))
    return [result for results in done for result in results]


def measure(url: str, args: argparse.Namespace, bar) -> list[dict[str, Any]]:
    rows = []
    for streams in args.streams:
        base_rate = None
        for scenario, pick in SCENARIOS.items():
            results = asyncio.run(run_level(url, streams, args.turns, args.tokens, pick, bar))
            row = level(results, streams=streams, scenario=scenario)
            base_rate = base_rate or row["tok_s"]
            row["vs_base"] = row["tok_s"] / base_rate if base_rate else None
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    with figure(path, 1, (7, 4)) as axis:
        for scenario in SCENARIOS:
            points = [(r["streams"], r["tok_s"]) for r in rows if r["scenario"] == scenario]
            axis.plot(*zip(*points, strict=True), marker="o", label=scenario)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel("generated tokens/s")
        axis.legend()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        make_adapters(model_dir, args.rank)
        options = ["option.embedding_model_id=none", *args.option]
        command = lmi_serve(options)
        total = sum(streams * args.turns for streams in args.streams) * len(SCENARIOS)
        with ServerProcess(lambda port: [*command(port), "--model-dir", str(model_dir)],
                           args.out / f"lora-{stamp}.log") as server, \
                progress(total, "LoRA levels") as bar:
            server.wait_ready(600)
            server.wait_decode_graphs(1800)  # the base model's compiled step, where it compiles
            asyncio.run(warm_up(server.url, LMI))
            rows = measure(server.url, args, bar)
    print(format_table(("streams", "scenario", "tok/s", "vs base", "TPOT p50 ms", "errors"),
                       [(str(r["streams"]), r["scenario"], f"{r['tok_s']:.1f}",
                         f"{r['vs_base']:.2f}", f"{1000 * (r['tpot_p50_s'] or 0):.1f}",
                         str(r["errors"])) for r in rows]))
    doc = {"label": args.label, "options": options, "rank": args.rank, "tokens": args.tokens,
           "turns": args.turns, "levels": rows}
    write_json(doc, args.out / f"lora-{stamp}.json")
    plot(rows, args.out / f"lora-{stamp}.png")
    print(f"wrote {args.out / f'lora-{stamp}'}.json and .png")


if __name__ == "__main__":
    main()
