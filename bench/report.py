"""The benchmark's outputs: the comparison table, the JSON file and the plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("server", "generate")

Level = dict[str, Any]  # a `stats.summarize` dict plus workload, system, concurrency, label


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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


HEADER = (
    "workload", "level", "system", "tok/s", "srv/gen", "TTFT p50", "TTFT p99", "TPOT p50",
    "TPOT p99", "errors",
)


def table_rows(levels: Sequence[Level]) -> list[tuple[str, ...]]:
    rows = []
    for pair in paired(levels):
        for system in SYSTEMS:
            level = getattr(pair, system)
            if level is None:
                continue
            ratio = pair.ratio if system == "server" else None
            rows.append((
                pair.workload, pair.label, system, f"{level['tok_s']:.1f}",
                "" if ratio is None else f"{ratio:.2f}x",
                _ms(level["ttft_p50_s"]), _ms(level["ttft_p99_s"]),
                _ms(level["tpot_p50_s"]), _ms(level["tpot_p99_s"]),
                f"{level['errors']}" + (f" ({level['short']} short)" if level["short"] else ""),
            ))
    return rows


def format_table(levels: Sequence[Level]) -> str:
    """A plain-text table, times in milliseconds."""
    rows = [HEADER, *table_rows(levels)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(TTFT and TPOT in ms)"


def save_json(doc: dict[str, Any], out_dir: Path, stamp: str) -> Path:
    """Write serving-<stamp>.json and latest.json (the same content) under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1)
    path = out_dir / f"serving-{stamp}.json"
    path.write_text(text)
    (out_dir / "latest.json").write_text(text)
    return path


def plot(levels: Sequence[Level], path: Path) -> None:
    """Throughput vs concurrency (workload A) and TTFT p99 bars (every level), side by side."""
    import matplotlib  # here, so the table and JSON code need no matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _throughput(left, levels)
    _ttft_bars(right, levels)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput(ax: Any, levels: Sequence[Level]) -> None:
    workload_a = [lv for lv in levels if lv["workload"] == "A"]
    for system in SYSTEMS:
        points = [lv for lv in workload_a if lv["system"] == system]
        if points:
            ax.plot([lv["concurrency"] for lv in points], [lv["tok_s"] for lv in points],
                    marker="o", label=system)
    ax.set_xticks(sorted({lv["concurrency"] for lv in workload_a}))
    ax.set(xlabel="concurrency (server) = static batch size (generate)",
           ylabel="generated tokens/s", title="Workload A throughput")
    ax.legend()


def _ttft_bars(ax: Any, levels: Sequence[Level]) -> None:
    pairs = paired(levels)
    width = 0.4
    for offset, system in enumerate(SYSTEMS):
        heights = [(getattr(p, system) or {}).get("ttft_p99_s") or 0.0 for p in pairs]
        ax.bar([i + (offset - 0.5) * width for i in range(len(pairs))], heights, width,
               label=system)
    ax.set_xticks(range(len(pairs)), [f"{p.workload} {p.label}" for p in pairs], rotation=30)
    ax.set(ylabel="seconds (log scale)", yscale="log", title="TTFT p99")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    # Ticks at 1, 2, 5 x 10^k labelled as plain numbers, not as powers of ten.
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend()
