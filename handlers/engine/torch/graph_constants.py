"""The compiled decode graphs' constants, stored beside their packages and mapped, not copied.

AOTInductor puts a graph's constants (the weights, and the copies its GEMMs read, prepacked) in
its shared library and copies them into memory when loading: each of the two graphs held twice
the weights, 2.2 GB of anonymous memory for SmolLM2's 0.54 GB, most of it originals the packed
kernels never read. Here they are compiled out of the library (`pickle_weights`), then moved
into one file per graph, each distinct tensor stored once per directory (the graphs share most
packed weights), and the server maps those files read-only and hands the tensors to the graph
(`user_managed`): only the pages a graph reads become resident, as page cache that servers on
the same machine share. A constant the server holds itself, unchanged (the quantized blocks
that the kernel's op reads as they are), is the server's own tensor instead: the graphs then
cost no memory for them at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.export.pt2_archive._package import AOTICompiledModel

    from handlers.engine.torch.graph_runner import Package

SUFFIX = ".constants.pt"


def split(package: Path, name: str, directory: Path) -> None:
    """Move the constants AOTInductor pickled into `package` to `directory/<name>.constants.pt`,
    leaving out the tensors the file of another graph there, compiled whole, has."""
    known = {key for path in _stores(directory) if path.name != f"{name}{SUFFIX}"
             for key in _load(path)["tensors"]}
    tensors: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for fqn, tensor in _pickled(package):
        names[fqn] = key = _content_key(tensor)
        if key not in known:
            tensors[key] = tensor
    partial = directory / f"{name}{SUFFIX}.partial"
    torch.save({"tensors": tensors, "names": names}, partial)
    os.replace(partial, directory / f"{name}{SUFFIX}")
    _strip(package)


class ConstantStore:
    """The constant files of one directory, mapped once and kept alive while graphs use them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[Path, dict] = {}

    def attach(self, graph: Package | AOTICompiledModel, name: str,
               own: dict[str, torch.Tensor] | None = None) -> int:
        """Give `graph` (the package `name`) its constants: the server's own tensor where `own`
        (the step's tensors by name: the model's, prefixed `model.`) has one of that name and
        layout, which the graphs' key guarantees holds the same values (decode_graphs.py's
        weights_digest), so that weights the graph reads as they are (the quantized kernel's
        blocks) are not held a second time; the rest mapped from the files. Returns how many
        came from `own`."""
        for path in _stores(self.directory):
            if path not in self._files:
                self._files[path] = _load(path)
        tensors = {k: t for saved in self._files.values() for k, t in saved["tensors"].items()}
        names = self._files[self.directory / f"{name}{SUFFIX}"]["names"]
        constants = {fqn: _same_layout((own or {}).get(fqn), tensors[key])
                     for fqn, key in names.items()}
        graph.load_constants(constants, check_full_update=True, user_managed=True)
        return sum(constants[fqn] is not tensors[key] for fqn, key in names.items())


def _same_layout(own: torch.Tensor | None, stored: torch.Tensor) -> torch.Tensor:
    """`own` where it has `stored`'s shape, strides and dtype (a packed copy of another layout
    does not), else `stored`."""
    if own is not None and own.dtype == stored.dtype and own.shape == stored.shape \
            and own.stride() == stored.stride() and own.device == stored.device:
        return own
    return stored


def _stores(directory: Path) -> list[Path]:
    """The constant files of the graphs whose package is there (a compile cut short between
    writing the one and the other leaves a file no graph uses yet)."""
    return [path for path in sorted(directory.glob(f"*{SUFFIX}"))
            if path.with_name(path.name.removesuffix(SUFFIX) + ".pt2").exists()]


def _load(path: Path) -> dict:
    return torch.load(path, mmap=True, weights_only=True)


def _pickled(package: Path):
    """(name, tensor) for each constant in the package, one pickled file in memory at a time."""
    with zipfile.ZipFile(package) as archive:
        config = next(n for n in archive.namelist() if n.endswith("/weights_config.json"))
        root = config.split("/", 1)[0]
        by_file: dict[str, list] = defaultdict(list)
        for fqn, (file, shape, stride, offset) in json.loads(archive.read(config)).items():
            by_file[file].append((fqn, shape, stride, offset))
        for file, entries in by_file.items():
            data = archive.read(f"{root}/data/weights/{file}")
            whole = torch.load(io.BytesIO(data), weights_only=True)
            for fqn, shape, stride, offset in entries:  # its own storage, in the same layout
                view = whole.as_strided(shape, stride, offset)
                yield fqn, torch.empty_strided(shape, stride, dtype=view.dtype).copy_(view)


def _content_key(tensor: torch.Tensor) -> str:
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}{tensor.stride()}".encode())
    digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def _strip(package: Path) -> None:
    """Rewrite `package` without its pickled constants: the code and its metadata stay."""
    stripped = package.with_name(package.name + ".stripped")
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(stripped, "w") as target:
        for info in source.infolist():
            if "/data/weights/" not in info.filename:
                target.writestr(info, source.read(info))
    os.replace(stripped, package)
