"""`bench.sizes`'s outputs: one row per model and system, the issue's targets met or not, and a
plot of memory and throughput."""

from __future__ import annotations

from typing import Any

from bench.report import figure, format_table
from bench.stats import RequestResult, level

HEADER = ("model", "system", "file GiB", "first start s", "warm start s", "graphs s",
          "RSS ready GiB (first/warm)", "peak start GiB", "peak load GiB", "prefill tok/s")
NAMES = {"ours": "lmi-serve", "llamacpp": "llama.cpp direct"}


def summary(found: dict[str, Any]) -> dict[str, Any]:
    """One system's figures on one model: starts, memory, rates (tok/s by stream count)."""
    first, warm = found["first"], found["warm"]
    peaks = [first["ready"]["peak_gib"], first.get("graphs_ready", {}).get("peak_gib", 0.0)]
    if "levels" in warm:
        rates = {k: lv["tok_s"] for k, lv in warm["levels"].items()}
    else:  # llama.cpp's requests, one at a time
        results = [RequestResult(start=r["start"], first_token=r["first"], last_token=r["last"],
                                 done=r["done"], tokens=r["tokens"], expected_tokens=r["tokens"])
                   for r in warm["requests"]]
        rates = {"1": level(results)["tok_s"]}
    return {"first_s": first["start_s"], "warm_s": warm["start_s"],
            "graphs_s": first.get("graphs_s"), "rss_first": first["ready"]["rss_gib"],
            "rss_warm": warm["ready"]["rss_gib"], "peak_start": max(peaks),
            "peak_load": warm["after_load"]["peak_gib"], "prefill": warm["prefill"]["tok_s"],
            "rates": rates}


def rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    streams = [str(n) for n in doc["settings"]["streams"]]
    out = []
    for name, entry in doc["models"].items():
        for system in NAMES:
            if system not in entry or "warm" not in entry[system]:
                continue
            s = summary(entry[system])
            graphs = ("-" if system != "ours" else f"{s['graphs_s']:.0f}"
                      if s["graphs_s"] is not None else "not ready")
            out.append((name, NAMES[system], f"{entry['file_gib']:.2f}", f"{s['first_s']:.1f}",
                        f"{s['warm_s']:.1f}", graphs,
                        f"{s['rss_first']:.2f} / {s['rss_warm']:.2f}", f"{s['peak_start']:.2f}",
                        f"{s['peak_load']:.2f}", f"{s['prefill']:.0f}",
                        *(f"{s['rates'][k]:.1f}" if k in s["rates"] else "-"
                          for k in streams)))
    return out


def table(doc: dict[str, Any]) -> str:
    header = (*HEADER, *(f"tok/s {n} streams" for n in doc["settings"]["streams"]))
    return (format_table(header, rows(doc), markdown=True)
            + f"\n\n{doc['machine']['cpu']}, {doc['machine']['cores']} cores; load average "
              f"{doc['load_average_at_start']} at the start, {doc.get('load_average_at_end')} "
              "at the end")


def targets(doc: dict[str, Any]) -> list[str]:
    """Issue 50's targets, each with its figure and whether it was met."""
    lines = []
    for name, entry in doc["models"].items():
        if "warm" not in entry.get("ours", {}):
            continue
        ours = summary(entry["ours"])
        if name.endswith(":bf16"):
            lines.append(check(name, "peak during start <= 1.1x the files",
                               ours["peak_start"] / entry["file_gib"], 1.1, "x"))
            continue
        if "1" in ours["rates"] and "8" in ours["rates"]:
            lines.append(check(name, "8 streams >= 3x our one stream",
                               ours["rates"]["8"] / ours["rates"]["1"], 3.0, "x", at_least=True))
        if "warm" not in entry.get("llamacpp", {}):
            continue
        peer = summary(entry["llamacpp"])
        load = peer["warm_s"]
        lines += [
            check(name, "resident ready <= 1.15x llama.cpp's",
                  max(ours["rss_first"], ours["rss_warm"]) / peer["rss_warm"], 1.15, "x"),
            check(name, "peak during start <= 1.25x llama.cpp's",
                  ours["peak_start"] / peer["peak_start"], 1.25, "x"),
            check(name, "first start <= llama.cpp's load + 20 s", ours["first_s"] - load, 20,
                  " s over"),
            check(name, "warm start <= llama.cpp's load + 3 s", ours["warm_s"] - load, 3,
                  " s over"),
            check(name, "decode at 1 stream >= 1.0x llama.cpp",
                  ours["rates"]["1"] / peer["rates"]["1"], 1.0, "x", at_least=True),
            check(name, "prefill >= 1.0x llama.cpp", ours["prefill"] / peer["prefill"], 1.0,
                  "x", at_least=True)]
    return lines


def check(model: str, target: str, value: float, bound: float, unit: str,
          at_least: bool = False) -> str:
    met = value >= bound if at_least else value <= bound
    return f"{model}: {target}: {value:.2f}{unit} -> {'met' if met else 'NOT met'}"


def plot(doc: dict[str, Any], path: Any) -> None:
    """Memory (resident when ready, peaks) and generated tokens/s by stream count."""
    found = [(f"{name}\n{NAMES[system]}", summary(entry[system]))
             for name, entry in doc["models"].items() for system in NAMES
             if "warm" in entry.get(system, {})]
    if not found:
        return
    with figure(path, 2, (13, 4.5)) as (left, right):
        width = 0.27
        for offset, (key, label) in enumerate((("rss_warm", "resident ready (warm)"),
                                               ("peak_start", "peak during start"),
                                               ("peak_load", "peak under load"))):
            left.bar([i + (offset - 1) * width for i in range(len(found))],
                     [s[key] for _, s in found], width, label=label)
        left.set_xticks(range(len(found)), [label for label, _ in found], fontsize=7)
        left.set(ylabel="GiB", title="Memory")
        left.legend(fontsize=7)
        for label, s in found:
            streams = sorted(s["rates"], key=int)
            right.plot([int(k) for k in streams], [s["rates"][k] for k in streams], marker="o",
                       label=label.replace("\n", " "))
        right.set(xlabel="concurrent streams", ylabel="generated tokens/s", title="Decode")
        right.legend(fontsize=7)
