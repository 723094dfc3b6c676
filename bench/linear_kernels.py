"""The linear layers of one decode step, through torch's default CPU kernel (MKL, what
`nn.Linear` and `generate()` use) and through oneDNN with prepacked weights (what the torch
engine uses, `handlers/engine/torch/onednn_linear.py`), at several row counts; and through AMD's
zentorch (ZenDNN, the kernels of vLLM's `zen` extra) where it is installed: it is built for one
torch minor version (2.14 for zentorch 2.14), so it runs in an environment of its own.

    .venv/bin/python bench/linear_kernels.py [--rows 1,8,32,64,256] [--repeats 5] [--threads N]

The weights are the embedded model's own (every linear layer and the LM head), so they stream
from memory as in a real step. Prints a table; writes `<out>/linear-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from handlers.engine.torch.loader import load_model
from handlers.engine.torch.onednn_linear import OneDnnLinear
from handlers.model_source import default_model_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256", help="row counts (batch x tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per measurement")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def step_time(run: Callable[[], object], repeats: int) -> float:
    """Seconds per pass over every layer, the best of `repeats` after one warm-up pass."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(rows: int, linears: list[torch.nn.Linear], packed: list[OneDnnLinear],
            repeats: int) -> dict[str, float]:
    inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in linears}}
    mkl = step_time(lambda: [F.linear(inputs[m.in_features], m.weight) for m in linears],
                    repeats)
    onednn = step_time(lambda: [p(inputs[p.in_features]) for p in packed], repeats)
    result = {"rows": rows, "mkl_ms": mkl * 1e3, "onednn_ms": onednn * 1e3,
              "speedup": mkl / onednn}
    if zentorch_available():
        zen = torch.ops.zentorch.zentorch_linear_unary
        result["zentorch_ms"] = 1e3 * step_time(
            lambda: [zen(inputs[m.in_features], m.weight) for m in linears], repeats)
    return result


def zentorch_available() -> bool:
    try:
        import zentorch  # noqa: F401 (registers torch.ops.zentorch)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(default_model_path(), dtype="fp32").model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [OneDnnLinear(m) for m in linears]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode(), tqdm(total=len(rows_list), file=sys.stderr) as bar:
        for rows in rows_list:
            results.append(measure(rows, linears, packed, args.repeats))
            bar.update()
    zen = "zentorch_ms" in results[0]
    print(f"{'rows':>6} {'MKL ms':>9} {'oneDNN ms':>10} {'speedup':>8}"
          + (f" {'zentorch ms':>12}" if zen else ""))
    for r in results:
        print(f"{r['rows']:>6} {r['mkl_ms']:>9.1f} {r['onednn_ms']:>10.1f} {r['speedup']:>7.2f}x"
              + (f" {r['zentorch_ms']:>12.1f}" if zen else ""))
    save(args, results, len(linears))
    return 0


def save(args: argparse.Namespace, results: list[dict], layers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"linear-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = {"threads": args.threads, "repeats": args.repeats, "layers": layers,
            "torch": torch.__version__, "cpu_count": os.cpu_count()}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results},
                                                    indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r["rows"] for r in results]
    ax.plot(rows, [r["mkl_ms"] for r in results], "o-", label="MKL (nn.Linear)")
    ax.plot(rows, [r["onednn_ms"] for r in results], "o-", label="oneDNN, prepacked")
    if "zentorch_ms" in results[0]:
        ax.plot(rows, [r["zentorch_ms"] for r in results], "o-", label="zentorch (ZenDNN)")
    ax.set(xscale="log", xlabel="rows", ylabel="ms per step (all linears)",
           title=f"{layers} linear layers, {args.threads} threads")
    ax.legend()
    fig.savefig(stem.with_suffix(".png"), dpi=100, bbox_inches="tight")
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    raise SystemExit(main())
