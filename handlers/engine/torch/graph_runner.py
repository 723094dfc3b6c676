"""AOTInductor packages called without holding the GIL.

torch's loader (`torch._inductor.aoti_load_package`) holds the GIL for the whole of a call. The
engine's decode step is such a call, so the server's HTTP thread waited out every step: a Python
thread ran 46 times during 40 steps of 32 rows instead of ~3,000, and the tokens of a step were
streamed only between steps, the next step waiting for them. graph_runner.cpp wraps the same C++
loader as a TorchScript class, whose methods torch runs with the GIL released. Where it cannot
be built, `load` falls back to torch's loader, logged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from handlers.engine import native_build

SOURCE = Path(__file__).with_name("graph_runner.cpp")


class Package:
    """A loaded package, called as torch's `AOTICompiledModel` is (positional arguments)."""

    def __init__(self, path: Path) -> None:
        self._graph = torch.classes.lmi_graphs.Graph(str(path))
        self._outputs = pytree.treespec_loads(self._graph.call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        flat = [x for x in pytree.tree_leaves((args, {})) if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self._graph.run(flat), self._outputs)

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool = False) -> None:
        self._graph.load_constants(constants, check_full_update, user_managed)


def load(path: Path) -> Any:
    """The package at `path`, called without the GIL where the runner builds."""
    if available():
        return Package(path)
    return torch._inductor.aoti_load_package(str(path))


@functools.cache
def available() -> bool:
    """Whether the runner class is loaded (built on first use, once per process)."""
    return native_build.load(SOURCE, "the compiled decode step holds the GIL while it runs")
