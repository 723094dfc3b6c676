"""The benchmarks' outputs: a progress bar while they run, then a table, JSON and a PNG plot.

The serving benchmark pairs each level of our server with generate()'s at the same level. The
peer benchmark gives each peer's throughput as a ratio of its reference peer's at the same level
(vLLM's server for our torch and vllm engines, llama.cpp driven directly for our llama.cpp
engine, whose one-at-a-time rate holds at every level); a run of several rounds (the peers
measured in turn, again and again) reports each level's median over its rounds: these 2-core
machines drift by +-5% from one minute to the next, more than a ratio of 0.97 is meant to
resolve.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"  # the default output folder

Level = dict[str, Any]  # a `stats.level` dict plus what names it (workload, label, system …)


def progress(total: int, desc: str | None = None, unit: str = "req") -> tqdm:
    """A progress bar on stderr; its `update` is a workload's `Progress`."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False,
                 ) -> str:
    """Plain text (right-aligned under a dashed line) or a Markdown table."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    if markdown:
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
                 for row in table]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    else:
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: Path, *copies: Path) -> Path:
    """`doc` to `path` and to each copy (the same content)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1)
    for target in (path, *copies):
        target.write_text(text)
    return path


@contextmanager
def figure(path: Path, columns: int, size: tuple[float, float], dpi: int = 110) -> Iterator[Any]:
    """A row of `columns` plots (one Axes, or an array of them) to draw on, saved to `path`."""
    import matplotlib  # here, so the tables and JSON need no matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=size)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _cells(level: Level, ratio: str) -> tuple[str, ...]:
    """A level's throughput, its ratio and its TTFT and TPOT p50/p99 (ms)."""
    return (f"{level['tok_s']:.1f}", ratio, ms(level["ttft_p50_s"]), ms(level["ttft_p99_s"]),
            ms(level["tpot_p50_s"]), ms(level["tpot_p99_s"]))


def _throughput(ax: Any, series: dict[str, list[Level]], x_key: str) -> None:
    """One line of tokens/s per series, against each level's `x_key`."""
    for name, levels in series.items():
        if levels:
            ax.plot([int(lv[x_key]) for lv in levels], [lv["tok_s"] for lv in levels],
                    marker="o", label=name)


# -- serving: our server against generate() -----------------------------------------------

SYSTEMS = ("server", "generate")
SERVING_HEADER = ("workload", "level", "system", "tok/s", "srv/gen", "TTFT p50", "TTFT p99",
                  "TPOT p50", "TPOT p99", "errors")


@dataclass
class Pair:
    """The server's and generate()'s results for the same workload level (either may be absent)."""

    workload: str
    label: str
    server: Level | None = None
    generate: Level | None = None

    @property
    def ratio(self) -> float | None:
        """Server throughput over generate() throughput; None when either side is missing."""
        if not self.server or not self.generate or not self.generate["tok_s"]:
            return None
        return self.server["tok_s"] / self.generate["tok_s"]


def paired(levels: Sequence[Level]) -> list[Pair]:
    """The levels matched by (workload, label), in first-seen order."""
    pairs: dict[tuple[str, str], Pair] = {}
    for level in levels:
        key = (level["workload"], level["label"])
        pair = pairs.setdefault(key, Pair(*key))
        setattr(pair, level["system"], level)
    return list(pairs.values())


def serving_table(levels: Sequence[Level]) -> str:
    """One row per level and system, the server's with its throughput over generate()'s."""
    rows = []
    for pair in paired(levels):
        for system in SYSTEMS:
            level = getattr(pair, system)
            if level is None:
                continue
            ratio = pair.ratio if system == "server" else None
            rows.append((pair.workload, pair.label, system,
                         *_cells(level, "" if ratio is None else f"{ratio:.2f}x"),
                         f"{level['errors']}"
                         + (f" ({level['short']} short)" if level["short"] else "")))
    return format_table(SERVING_HEADER, rows) + "\n(TTFT and TPOT in ms)"


def serving_plot(levels: Sequence[Level], path: Path) -> None:
    """Throughput vs concurrency (workload A) and TTFT p99 bars (every level), side by side."""
    with figure(path, 2, (12, 4.5)) as (left, right):
        workload_a = [lv for lv in levels if lv["workload"] == "A"]
        _throughput(left, {s: [lv for lv in workload_a if lv["system"] == s] for s in SYSTEMS},
                    "concurrency")
        left.set_xticks(sorted({lv["concurrency"] for lv in workload_a}))
        left.set(xlabel="concurrency (server) = static batch size (generate)",
                 ylabel="generated tokens/s", title="Workload A throughput")
        left.legend()
        _ttft_bars(right, paired(levels))


def _ttft_bars(ax: Any, pairs: list[Pair]) -> None:
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    width = 0.4
    for offset, system in enumerate(SYSTEMS):
        heights = [(getattr(p, system) or {}).get("ttft_p99_s") or 0.0 for p in pairs]
        ax.bar([i + (offset - 0.5) * width for i in range(len(pairs))], heights, width,
               label=system)
    ax.set_xticks(range(len(pairs)), [f"{p.workload} {p.label}" for p in pairs], rotation=30)
    ax.set(ylabel="seconds (log scale)", yscale="log", title="TTFT p99")
    # Ticks at 1, 2, 5 x 10^k labelled as plain numbers, not as powers of ten.
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend()


# -- peers: each of our engines against its reference ------------------------------------

PEER_HEADER = ("peer", "workload", "level", "rounds", "tok/s", "ratio", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "errors")
_MEDIAN = ("tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
REFERENCES = {"torch": "vllm-server", "vllm": "vllm-server", "llamacpp": "llamacpp-direct"}


def medians(levels: list[Level]) -> list[Level]:
    """One level per (peer, workload, level): the median of its rounds' figures, errors summed,
    in the order the levels were first measured."""
    groups: dict[tuple[str, str, str], list[Level]] = {}
    for lv in levels:
        groups.setdefault((lv["peer"], lv["workload"], lv["label"]), []).append(lv)
    out = []
    for rounds in groups.values():
        merged = {**rounds[0], "rounds": len(rounds), "errors": sum(r["errors"] for r in rounds)}
        for key in _MEDIAN:
            values = [r[key] for r in rounds if r.get(key) is not None]
            merged[key] = statistics.median(values) if values else None
        out.append(merged)
    return out


def reference_rate(levels: list[Level], peer: str, level: Level) -> float | None:
    ref = REFERENCES.get(peer)
    found = [lv for lv in levels if lv["peer"] == ref and lv["workload"] ==
             level["workload"] and lv["label"] == level["label"]]
    if not found and ref == "llamacpp-direct":  # it serves one request at a time
        found = [lv for lv in levels if lv["peer"] == ref and lv["label"] == "1"]
    return found[0]["tok_s"] if found else None


def peer_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    levels = medians(doc["levels"])
    out = []
    for lv in levels:
        ref = reference_rate(levels, lv["peer"], lv)
        out.append((lv["peer"], lv["workload"], lv["label"], str(lv["rounds"]),
                    *_cells(lv, f"{lv['tok_s'] / ref:.2f}x" if ref else "-"), str(lv["errors"])))
    return out


def peer_table(doc: dict[str, Any]) -> str:
    """The levels' medians, the machine and its bounds, and the peers skipped."""
    lines = [format_table(PEER_HEADER, peer_rows(doc), markdown=True)]
    bounds = doc["machine"]["bounds"]
    lines.append(f"\nmachine: {doc['machine']['cpu']} {doc['machine']['flags']}, "
                 f"{doc['machine']['threads']} threads; read {bounds['read_gb_s']:.1f} GB/s, "
                 f"fp32 {bounds['fp32_gflop_s']:.0f} / bf16 {bounds['bf16_gflop_s']:.0f} GFLOP/s"
                 f", int8 {bounds.get('int8_gop_s', 0):.0f} GOP/s (at 32 rows of the model's "
                 f"layers {bounds.get('int8_32_rows_gop_s', 0):.0f}); bounds: 1 stream "
                 f"{bounds['one_stream_fp32_tok_s']:.0f} (fp32) / "
                 f"{bounds['one_stream_bf16_tok_s']:.0f} (bf16) / "
                 f"{bounds.get('one_stream_quantized_tok_s', 0):.0f} (GGUF) tok/s, batches "
                 f"{bounds['batch_fp32_tok_s']:.0f} / {bounds['batch_bf16_tok_s']:.0f} / "
                 f"{bounds.get('batch_int8_tok_s', 0):.0f} (int8) / "
                 f"{bounds.get('batch_int8_32_rows_tok_s', 0):.0f} (int8 at 32 rows) tok/s")
    lines += [f"skipped {peer}: {why}" for peer, why in doc["skipped"].items()]
    return "\n".join(lines)


def peer_plot(doc: dict[str, Any], path: Path) -> None:
    """Throughput against concurrent streams, one line per peer; TTFT p99 of every level."""
    levels = medians(doc["levels"])
    peers = list(dict.fromkeys(lv["peer"] for lv in levels))
    with figure(path, 2, (13, 4.5)) as (left, right):
        _throughput(left, {doc["peers"][peer]: [lv for lv in levels if lv["peer"] == peer
                                                and lv["workload"] == "streams"]
                           for peer in peers}, "label")
        for peer in peers:
            every = [lv for lv in levels if lv["peer"] == peer]
            right.plot([lv["label"] for lv in every],
                       [(lv["ttft_p99_s"] or 0) * 1000 for lv in every], marker="s", label=peer)
        left.set(xlabel="concurrent streams", ylabel="generated tokens/s", title="Throughput")
        right.set(xlabel="level", ylabel="ms", title="TTFT p99")
        left.legend(fontsize=7)
        right.legend(fontsize=7)
