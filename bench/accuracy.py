"""What the torch engine's quantized linears and narrower KV caches cost in accuracy, on the
embedded SmolLM2: perplexity on a fixed text (`bench/accuracy_text.md`, written for this) and
greedy agreement with float32 on the benchmark's 32 prompts, 64 tokens each.

    .venv/bin/python -m bench.accuracy [--tokens 64] [--window 512] [--out DIR]
                                       [--variants float32,kv-float16,...]

Ways to serve the same weights, each through the engine's own model runner (its fused and
quantized linears, its attention kernel), computing in float32:

- `float32`: the GGUF's blocks dequantized to float (the float checkpoint it was made from is not
  on this machine: this is the float model the others are held against), float32 KV cache;
- `int8`, `int4`: that float checkpoint quantized at load (`option.quantize=int8` / `int4`);
- `gguf`: the GGUF's own Q4_1 / Q8_0 blocks, what `option.quantize=auto` serves;
- `kv-float16`, `kv-bfloat16`, `kv-fp8`, `kv-fp8_e5m2`: the float model over a KV cache of that
  `option.kv_cache_dtype` (`kv-float16` is what `auto` stores under a float32 model).

The quantized paths quantize each input row to int8 in groups of 32 too (quant_linear.py).
Prints a table; writes `<out>/accuracy-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from bench.prompts import QUESTIONS, chat_prompt
from bench.report import RESULTS, figure, format_table, progress, write_json
from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.machine import settle_vector_math
from handlers.engine.torch.kv_dtype import DTYPES
from handlers.engine.torch.loader import LoadedModel, load_model
from handlers.engine.torch.model_runner import ModelRunner
from handlers.model_source import default_model_path

TEXT = Path(__file__).with_name("accuracy_text.md")
# name -> (served from the GGUF itself, option.quantize, option.kv_cache_dtype)
VARIANTS = {"float32": (False, "none", "float32"), "int8": (False, "int8", "float32"),
            "int4": (False, "int4", "float32"), "gguf": (True, "auto", "float32"),
            "kv-float16": (False, "none", "float16"), "kv-bfloat16": (False, "none", "bfloat16"),
            "kv-fp8": (False, "none", "fp8"), "kv-fp8_e5m2": (False, "none", "fp8_e5m2")}


def load(variant: str) -> LoadedModel:
    from_gguf, quantize, _ = VARIANTS[variant]
    gguf = default_model_path()
    source = gguf if from_gguf else cached_gguf_dir(gguf)
    return load_model(source, dtype="fp32", device="cpu", quantize=quantize)


def perplexity(runner: ModelRunner, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of `ids`, read in windows of `window` tokens, each
    predicting its tokens from the window's earlier ones."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        [logits] = runner.prefill([PrefillChunk(slot=0, token_ids=chunk[:-1], start=0,
                                                all_logits=True)])
        targets = torch.tensor(chunk[1:])
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
        runner.release(0)
    return math.exp(total / count)


def greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """`tokens` greedy tokens for each prompt, all decoding together (slot i: prompt i)."""
    chunks = [PrefillChunk(slot=i, token_ids=p, start=0) for i, p in enumerate(prompts)]
    last = torch.cat([logits[-1:] for logits in runner.prefill(chunks)])
    lengths = [len(p) for p in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    for _ in range(tokens):
        picked = last.argmax(-1).tolist()
        for answer, token in zip(answers, picked, strict=True):
            answer.append(token)
        last = runner.decode(picked, lengths)
        lengths = [n + 1 for n in lengths]
    for slot in range(len(prompts)):
        runner.release(slot)
    return answers


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Whole answers equal, and the tokens before an answer's first difference, as fractions."""
    same = sum(a == r for a, r in zip(answers, reference, strict=True))
    prefix = 0
    for a, r in zip(answers, reference, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, r, strict=True)) if x != y), len(r))
    return {"identical": same / len(reference),
            "common_prefix": prefix / sum(len(r) for r in reference)}


def measure(tokens: int, window: int, variants: list[str] | None = None) -> dict[str, dict]:
    """Each variant's numbers (`variants`: VARIANTS' names, float32 first; all by default)."""
    settle_vector_math()  # as a server does first: else the rotary table's cos varies by start
    variants = ["float32", *(v for v in variants or VARIANTS if v != "float32")]
    results: dict[str, dict] = {}
    reference: list[list[int]] | None = None
    with progress(len(variants), unit="variant") as bar:
        for variant in variants:
            loaded = load(variant)
            tokenizer = loaded.tokenizer
            prompts = [tokenizer.encode(chat_prompt(q)) for q in QUESTIONS]
            kv = VARIANTS[variant][2]
            runner = ModelRunner(loaded.model, len(prompts), 1024, kv_dtype=DTYPES[kv])
            ids = tokenizer.encode(TEXT.read_text())
            answers = greedy(runner, prompts, tokens)
            reference = reference or answers
            results[variant] = {"perplexity": perplexity(runner, ids, window),
                                "linears": loaded.quantize, "kv_cache": kv,
                                "text_tokens": len(ids), **agreement(answers, reference)}
            bar.update()
    return results


def table(results: dict[str, dict]) -> str:
    base = results["float32"]["perplexity"]
    rows = [(name, r["linears"], r["kv_cache"], f"{r['perplexity']:.3f}",
             f"{r['perplexity'] / base - 1:+.2%}", f"{r['identical']:.0%}",
             f"{r['common_prefix']:.0%}") for name, r in results.items()]
    return format_table(("path", "linears", "KV cache", "perplexity", "vs float32",
                         "answers identical", "tokens before a difference"), rows, markdown=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    results = measure(args.tokens, args.window, variants)
    print(table(results))
    stem = args.out / f"accuracy-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = {"tokens": args.tokens, "window": args.window, "prompts": len(QUESTIONS),
            "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}
    write_json({"meta": meta, "results": results}, stem.with_suffix(".json"))
    with figure(stem.with_suffix(".png"), 1, (6, 3.5), dpi=100) as ax:
        names = list(results)
        ax.bar(names, [results[n]["perplexity"] for n in names], color="tab:blue")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title("Embedded SmolLM2: perplexity by linear-layer path and KV cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
