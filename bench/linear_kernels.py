"""The linear layers of one decode step, through torch's default CPU kernel (MKL, what
`nn.Linear` and `generate()` use) and through oneDNN with prepacked weights (what the torch
engine uses, `handlers/engine/torch/onednn_linear.py`), at several row counts; and through AMD's
zentorch (ZenDNN, the kernels of vLLM's `zen` extra) where it is installed: it is built for one
torch minor version (2.14 for zentorch 2.14), so it runs in an environment of its own. With
`--inductor`, also through inductor's C++ GEMM template over frozen weights (`torch.compile`
with freezing and max-autotune: a minute or more of compiling per row count).

    .venv/bin/python -m bench.linear_kernels [--rows 1,8,32,64,256] [--repeats 5] [--threads N]
        [--inductor]

The weights are the embedded model's own (every linear layer and the LM head), so they stream
from memory as in a real step; each kernel's GB/s is the weights' bytes over its time, to hold
against the machine's read bandwidth (`bench/probes.py`). Prints a table; writes
`<out>/linear-<time>.json` and `.png`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.report import RESULTS, figure, progress, write_json
from handlers.engine.machine import fastest
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.onednn_linear import OneDnnLinear
from handlers.model_source import default_model_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256", help="row counts (batch x tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per measurement")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--inductor", action="store_true",
                        help="also inductor's C++ GEMM over frozen weights (slow to compile)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def step_time(run: Callable[[], object], repeats: int) -> float:
    """Seconds per pass over every layer, the best of `repeats` after one warm-up pass."""
    run()
    return fastest(repeats, run)


class Linears(torch.nn.Module):
    """Every linear layer applied to the input of its width: one graph for inductor."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [m(inputs[m.in_features]) for m in self.linears]


def inductor_step(linears: Linears, inputs: dict[int, torch.Tensor]) -> Callable[[], object]:
    """The layers compiled for these inputs' shapes, weights frozen into the graph (packed for
    the C++ GEMM template), each GEMM autotuned between that template and aten's."""
    compiled = torch.compile(linears, dynamic=False)
    with torch._inductor.config.patch(freezing=True, max_autotune=True,
                                      max_autotune_gemm_backends="CPP,ATEN",
                                      autotune_num_choices_displayed=0,
                                      max_autotune_report_choices_stats=False):
        compiled(inputs)  # compiles here, under these settings
    return lambda: compiled(inputs)


def measure(rows: int, linears: list[torch.nn.Linear], packed: list[OneDnnLinear],
            repeats: int, inductor: Linears | None) -> dict[str, float]:
    inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in linears}}
    mkl = step_time(lambda: [F.linear(inputs[m.in_features], m.weight) for m in linears],
                    repeats)
    onednn = step_time(lambda: [p(inputs[p.in_features]) for p in packed], repeats)
    result = {"rows": rows, "mkl_ms": mkl * 1e3, "onednn_ms": onednn * 1e3,
              "speedup": mkl / onednn}
    if inductor is not None:
        result["inductor_ms"] = 1e3 * step_time(inductor_step(inductor, inputs), repeats)
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
    inductor = Linears(linears).eval() if args.inductor else None
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode(), progress(len(rows_list), unit="row count") as bar:
        for rows in rows_list:
            results.append(measure(rows, linears, packed, args.repeats, inductor))
            bar.update()
    gigabytes = sum(m.weight.numel() * m.weight.element_size() for m in linears) / 1e9
    print_table(results, gigabytes)
    save(args, results, len(linears), gigabytes)
    return 0


KERNELS = {"mkl_ms": "MKL (nn.Linear)", "onednn_ms": "oneDNN, prepacked",
           "zentorch_ms": "zentorch (ZenDNN)", "inductor_ms": "inductor C++ GEMM, frozen"}


def print_table(results: list[dict], gigabytes: float) -> None:
    """Per row count: each kernel's ms per step and the GB/s of weights it read."""
    kernels = [k for k in KERNELS if k in results[0]]
    print(f"{'rows':>6} " + " ".join(f"{KERNELS[k]:>27}" for k in kernels)
          + f" {'oneDNN vs MKL':>14}")
    for r in results:
        cells = [f"{r[k]:8.1f} ms {gigabytes / r[k] * 1e3:6.1f} GB/s" for k in kernels]
        print(f"{r['rows']:>6} " + " ".join(f"{c:>27}" for c in cells)
              + f" {r['speedup']:>13.2f}x")


def save(args: argparse.Namespace, results: list[dict], layers: int, gigabytes: float) -> None:
    stem = args.out / f"linear-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = {"threads": args.threads, "repeats": args.repeats, "layers": layers,
            "weights_gb": gigabytes, "torch": torch.__version__, "cpu_count": os.cpu_count()}
    write_json({"meta": meta, "results": results}, stem.with_suffix(".json"))
    with figure(stem.with_suffix(".png"), 1, (6, 4), dpi=100) as ax:
        rows = [r["rows"] for r in results]
        for key, label in KERNELS.items():
            if key in results[0]:
                ax.plot(rows, [r[key] for r in results], "o-", label=label)
        ax.set(xscale="log", xlabel="rows", ylabel="ms per step (all linears)",
               title=f"{layers} linear layers, {args.threads} threads")
        ax.legend()
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    raise SystemExit(main())
