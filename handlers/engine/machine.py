"""What this machine can run: its CPU's instruction sets (the keys of code compiled for it) and
the device a model loads on. Shared by the engines that run on torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_flags() -> str:
    """The CPU's instruction-set flags (/proc/cpuinfo), '' where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return text.split("flags", 1)[-1].split("\n", 1)[0]


def resolve_device(device: str = "auto") -> torch.device:
    """option.device as a torch device: `auto` is CUDA where present, else the CPU."""
    import torch  # bench/peers.py reads cpu_flags without paying for torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available.")
    return target
