"""What this machine's CPU can run, for the keys of code compiled for it."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), '' where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return text.split("flags", 1)[-1].split("\n", 1)[0]
