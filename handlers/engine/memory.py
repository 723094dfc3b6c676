"""How much memory this process may use: the machine's, bounded by the container's cgroup limit
where there is one (cgroup v2's memory.max, v1's memory.limit_in_bytes), for the engines' KV
budget (kv_budget.py) and the fleet's loader (server/fleet.py).

Memory granted to an engine's KV budget is the engine's from then on, though it becomes memory
only as sequences fill the cache: `grant` records it, and what is available leaves it out, so a
model loaded beside (server/fleet.py) or its budget cannot take it too (counted twice once
written: erring on the side of room).

A cgroup's usage counts the page cache its processes read; the inactive part of it is reclaimed
before the kernel's OOM killer acts, so it does not count as used here (what `docker stats`
subtracts too).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import psutil

CGROUP = Path("/sys/fs/cgroup")
# (limit, usage, the memory.stat key of the reclaimable page cache): cgroup v2's, then v1's
_FILES = (("memory.max", "memory.current", "inactive_file"),
          ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
           "total_inactive_file"))
_granted: dict[int, int] = {}  # grant -> bytes
_grants = itertools.count()


@dataclass(frozen=True)
class Memory:
    total: int  # bytes the process may use in all: the machine's, or its cgroup's limit
    available: int  # bytes free now: the machine's available memory, or what the limit leaves


def memory(cgroup: Path = CGROUP) -> Memory:
    """The memory of this machine, bounded by the cgroup mounted at `cgroup` where it sets a
    limit."""
    machine = psutil.virtual_memory()
    total, available = machine.total, machine.available
    limit = cgroup_limit(cgroup)
    if limit is not None:
        cap, used = limit
        total, available = min(total, cap), min(available, cap - used)
    return Memory(total, max(available - sum(_granted.values()), 0))


def available_memory(cgroup: Path = CGROUP) -> int:
    """Bytes free to load into (the fleet's question)."""
    return memory(cgroup).available


def grant(size: int) -> int:
    """Set `size` bytes aside (a KV budget); the grant's key, for `revoke`."""
    key = next(_grants)
    _granted[key] = size
    return key


def revoke(key: int | None) -> None:
    """The grant's engine is gone: its memory is available again."""
    _granted.pop(key, None)


def cgroup_limit(cgroup: Path = CGROUP) -> tuple[int, int] | None:
    """(limit, usage less reclaimable page cache) of the cgroup at `cgroup`; None where it
    sets no limit or cannot be read."""
    for limit_file, usage_file, inactive_key in _FILES:
        try:
            text = (cgroup / limit_file).read_text().strip()
            if text == "max":
                return None
            cap, used = int(text), int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        stat = cgroup / Path(limit_file).parent / "memory.stat"
        return cap, max(used - _stat(stat, inactive_key), 0)
    return None


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
