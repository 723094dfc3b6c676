"""A safetensors checkpoint's tensors read one at a time into memory of this process's own, in the
dtype (or quantized blocks) they are served in.

Why not safetensors' `load_file`: it maps the files, and every page a conversion or a copy
touches then counts in the process's resident set until the whole file is unmapped, beside the
converted copy. A bf16 checkpoint served in float32 peaked at 4.2x its files (8.5 GiB for a
2.0 GiB 1B model) and one quantized to int8 at load at 3.3x. Read with `pread` instead, the file's
pages stay in the page cache (the kernel's, reclaimable, not this process's), a tensor in its
file's dtype is read straight into its final buffer, and a converted or quantized one passes
through a float copy of at most `CHUNK_BYTES` at a time.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header size, a JSON
header naming each tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from handlers.engine.torch import quant_linear
from handlers.engine.torch.quant_blocks import from_float
from handlers.engine.torch.quant_linear import TILE

CHUNK_BYTES = 4 << 20  # float32 bytes converted or quantized at a time
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}


@dataclass(frozen=True)
class Entry:
    fd: int
    offset: int  # of the first byte, in the file
    dtype: torch.dtype
    shape: tuple[int, ...]


class Checkpoint:
    """The tensors of safetensors `files`, by name; a context manager (the files stay open)."""

    def __init__(self, files: list[Path]) -> None:
        self._stack = ExitStack()
        self.entries: dict[str, Entry] = {}
        for file in files:
            handle = self._stack.enter_context(file.open("rb", buffering=0))
            self.entries |= _header(handle.fileno(), file)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, names: list[str], dtype: torch.dtype) -> torch.Tensor:
        """Tensors `names` in `dtype`, joined along their first dimension (one name: that
        tensor): read into the buffer where the file has that dtype, else converted a chunk of
        rows at a time."""
        entries = [self.entries[name] for name in names]
        out = torch.empty((sum(e.shape[0] for e in entries), *entries[0].shape[1:]),
                          dtype=dtype) if entries[0].shape else torch.empty((), dtype=dtype)
        start = 0
        for entry in entries:
            rows = entry.shape[0] if entry.shape else 1
            if entry.dtype == dtype:  # no conversion: straight into place
                _read_into(entry.fd, out[start:start + rows] if entry.shape else out,
                           entry.offset)
            else:
                for first, chunk in _row_chunks(entry, 1):
                    out[start + first:start + first + chunk.shape[0]] = chunk
            start += rows
        return out

    def quantized(self, names: list[str], bits: int) -> tuple[torch.Tensor, ...]:
        """2-D tensors `names` quantized in groups (quant_blocks.from_float) and packed for the
        kernel (quant_linear.pack), their outputs joined one after another (a fused
        projection's): weights, scales, mins; a chunk of rows at a time, into buffers allocated
        once (joining parts after would copy them)."""
        entries = [self.entries[name] for name in names]
        tiles = sum(entry.shape[0] for entry in entries) // TILE
        packed: list[torch.Tensor] = []
        start = 0
        for entry in entries:
            for first, rows in _row_chunks(entry, TILE):
                chunk = quant_linear.pack(from_float(rows, bits))
                if not packed:
                    packed = [part.new_empty((tiles, *part.shape[1:])) for part in chunk]
                at = (start + first) // TILE
                for whole, part in zip(packed, chunk, strict=True):
                    whole[at:at + part.shape[0]] = part
            start += entry.shape[0]
        return tuple(packed)


def _header(fd: int, file: Path) -> dict[str, Entry]:
    (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header = json.loads(os.pread(fd, size, 8))
    entries = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} is {spec['dtype']}, not a float type the "
                             "torch engine reads")
        entries[name] = Entry(fd, 8 + size + spec["data_offsets"][0], _DTYPES[spec["dtype"]],
                              tuple(spec["shape"]))
    return entries


def _row_chunks(entry: Entry, multiple: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of `entry`, read in its file's dtype, about CHUNK_BYTES of float32 at
    a time, each chunk a whole number of `multiple` rows (a 1-D tensor: one chunk)."""
    if len(entry.shape) < 2:
        buffer = torch.empty(entry.shape, dtype=entry.dtype)
        _read_into(entry.fd, buffer, entry.offset)
        yield 0, buffer
        return
    per_row = math.prod(entry.shape[1:])
    count = max(multiple, CHUNK_BYTES // (4 * per_row) // multiple * multiple)
    row_bytes = per_row * torch.empty((), dtype=entry.dtype).element_size()
    for first in range(0, entry.shape[0], count):
        buffer = torch.empty((min(count, entry.shape[0] - first), *entry.shape[1:]),
                             dtype=entry.dtype)
        _read_into(entry.fd, buffer, entry.offset + first * row_bytes)
        yield first, buffer


def _read_into(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Fill contiguous `tensor` with the file's bytes from `offset`."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        read = os.preadv(fd, [view[done:]], offset + done)
        if read == 0:
            raise EOFError(f"the checkpoint ends {len(view) - done} bytes short of a tensor")
        done += read
