"""The peer benchmark's table and plot: each peer's levels, with its throughput as a ratio of
its reference peer's at the same level (vLLM's server for our torch and vllm engines, llama.cpp
driven directly for our llama.cpp engine, whose one-at-a-time rate holds at every level).

A run of several rounds (the peers measured in turn, again and again) reports each level's
median over its rounds: these 2-core machines drift by +-5% from one minute to the next, more
than the differences a ratio of 0.97 is meant to resolve."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

HEADER = ("peer", "workload", "level", "rounds", "tok/s", "ratio", "TTFT p50", "TTFT p99",
          "TPOT p50", "TPOT p99", "errors")
_MEDIAN = ("tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
REFERENCES = {"torch": "vllm-server", "vllm": "vllm-server", "llamacpp": "llamacpp-direct"}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def medians(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One level per (peer, workload, level): the median of its rounds' figures, errors summed,
    in the order the levels were first measured."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
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


def reference_rate(levels: list[dict[str, Any]], peer: str, level: dict[str, Any]
                   ) -> float | None:
    ref = REFERENCES.get(peer)
    found = [lv for lv in levels if lv["peer"] == ref and lv["workload"] ==
             level["workload"] and lv["label"] == level["label"]]
    if not found and ref == "llamacpp-direct":  # it serves one request at a time
        found = [lv for lv in levels if lv["peer"] == ref and lv["label"] == "1"]
    return found[0]["tok_s"] if found else None


def rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    levels = medians(doc["levels"])
    out = []
    for lv in levels:
        ref = reference_rate(levels, lv["peer"], lv)
        ratio = f"{lv['tok_s'] / ref:.2f}x" if ref else "-"
        out.append((lv["peer"], lv["workload"], lv["label"], str(lv["rounds"]),
                    f"{lv['tok_s']:.1f}", ratio, _ms(lv["ttft_p50_s"]), _ms(lv["ttft_p99_s"]),
                    _ms(lv["tpot_p50_s"]), _ms(lv["tpot_p99_s"]), str(lv["errors"])))
    return out


def format_table(doc: dict[str, Any]) -> str:
    table = [HEADER, *rows(doc)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |"
             for row in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    bounds = doc["machine"]["bounds"]
    lines.append(f"\nmachine: {doc['machine']['cpu']} {doc['machine']['flags']}, "
                 f"{doc['machine']['threads']} threads; read {bounds['read_gb_s']:.1f} GB/s, "
                 f"fp32 {bounds['fp32_gflop_s']:.0f} / bf16 {bounds['bf16_gflop_s']:.0f} GFLOP/s"
                 f"; bounds: 1 stream {bounds['one_stream_fp32_tok_s']:.0f} (fp32) / "
                 f"{bounds['one_stream_bf16_tok_s']:.0f} (bf16) tok/s, batches "
                 f"{bounds['batch_fp32_tok_s']:.0f} / {bounds['batch_bf16_tok_s']:.0f} tok/s")
    lines += [f"skipped {peer}: {why}" for peer, why in doc["skipped"].items()]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Throughput against concurrent streams, one line per peer; TTFT p99 of every level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    levels = medians(doc["levels"])
    for peer in dict.fromkeys(lv["peer"] for lv in levels):
        mine = [lv for lv in levels if lv["peer"] == peer and lv["workload"] == "streams"]
        left.plot([int(lv["label"]) for lv in mine], [lv["tok_s"] for lv in mine], marker="o",
                  label=doc["peers"][peer])
        every = [lv for lv in levels if lv["peer"] == peer]
        right.plot([f"{lv['label']}" for lv in every],
                   [(lv["ttft_p99_s"] or 0) * 1000 for lv in every], marker="s", label=peer)
    left.set(xlabel="concurrent streams", ylabel="generated tokens/s", title="Throughput")
    right.set(xlabel="level", ylabel="ms", title="TTFT p99")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
