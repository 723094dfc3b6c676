"""The CPU decode step as AOTInductor compiles it, and the subprocess that compiles it.

What `decode_graphs.py` loads: ModelRunner.decode's forward pass (the Llama stack, its KV writes
into the cache's own buffers, the LM head) exported with `torch.export` for a range of rows, any
read length and cache capacity, then packaged by AOTInductor over frozen weights, the constants
in a file of their own. The packages' cache key hashes this file, so what changes the compiled
code changes the key.

Run as `python -m handlers.engine.torch.decode_step JOB` (JSON): loads the model as the server
did, compiles the graphs the job names into its directory, one at a time, each appearing whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from handlers.engine.machine import settle_vector_math
from handlers.engine.torch import graph_constants
from handlers.engine.torch.attention import cpu_cache_dtype
from handlers.engine.torch.fused_projections import fuse_projections
from handlers.engine.torch.llama_stack import LlamaStack
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.onednn_linear import use_onednn_linears

# Inductor's settings live in the thread that compiles (set elsewhere they do not reach it).
# float32: frozen weights prepacked for the C++ GEMM template, each GEMM's kernel chosen by timing
# (it reads a one-row step's weights faster than oneDNN's GEMV). bfloat16: the linears oneDNN
# runs in the eager step, packed by the server's own code (onednn_linear.py), whose result for a
# row does not depend on the row count; one graph for every row count then keeps a row's text
# independent of its batch (the C++ template converts bf16 to float32 and is slower in batches).
INDUCTOR = {
    "fp32": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
    "bf16": {"freezing": True},
}
# float32 constants are pickled beside the code, not in it: graph_constants.py moves them to a file
# the server maps. oneDNN's packed bf16 weights (an opaque layout) cannot be pickled and stay in
# the library.
PACKAGING = {"aot_inductor.package_constants_in_so": False,
             "aot_inductor.package_constants_on_disk_format": "pickle_weights"}


@dataclass(frozen=True)
class GraphSpec:
    name: str
    min_rows: int
    max_rows: int
    example_rows: int  # the row count autotuning times the GEMMs at


def graph_specs(num_slots: int, dtype: str, quantize: str = "none") -> list[GraphSpec]:
    """float32: one row, and 2..num_slots rows (each autotuned for its shape); bfloat16, and
    quantized linears: one graph for every row count. The two float32 graphs round differently
    (~1e-6 apart); quantized linears round each input to int8, where such a difference can move
    a value by a whole step and, some tokens later, the text: one graph keeps a row's text
    independent of its batch."""
    if dtype == "bf16" or quantize != "none":
        return [GraphSpec(f"rows-1-{num_slots}", 1, num_slots, min(16, num_slots))]
    specs = [GraphSpec("rows-1", 1, 1, 1)]
    if num_slots >= 2:
        specs.append(GraphSpec(f"rows-2-{num_slots}", 2, num_slots, min(16, num_slots)))
    return specs


class _CacheViews:
    """The slot cache as the compiled step sees it: buffer lists it writes into (rows in slots
    0..B-1, at `positions`) and reads the first `read_len` positions of."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 positions: torch.Tensor, read_len: int) -> None:
        self.keys, self.values, self.positions, self.read_len = keys, values, positions, read_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int):
        rows = key.shape[0]
        index = torch.arange(rows, device=key.device)[:, None]
        k_buf, v_buf = self.keys[layer], self.values[layer]
        k_buf[index, :, self.positions] = key.transpose(1, 2)
        v_buf[index, :, self.positions] = value.transpose(1, 2)
        return k_buf[:rows, :, : self.read_len], v_buf[:rows, :, : self.read_len]


class DecodeStep(nn.Module):
    """ModelRunner.decode's forward pass over slots 0..B-1: float32 logits [B, V]."""

    def __init__(self, model: nn.Module, positions: int) -> None:
        super().__init__()
        self.model = model  # registers the weights the stack reads
        self.stack = LlamaStack.of(model, positions)
        if self.stack is None:
            raise ValueError("not a Llama with fused projections")

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        cache = _CacheViews(keys, values, positions, mask.shape[-1])
        hidden = self.stack.forward(ids, positions, mask, cache)
        return self.model.get_output_embeddings()(hidden[:, -1]).float()


def export_step(step: DecodeStep, spec: GraphSpec, num_slots: int, max_len: int,
                layers: tuple[int, int, int]) -> torch.export.ExportedProgram:
    """`step` exported for `spec`'s rows, any cache capacity and read length up to max_len;
    `layers`: (count, KV heads, head size)."""
    from torch.export import Dim

    count, heads, head_dim = layers
    rows, seen = spec.example_rows, 64
    capacity = max(seen, min(256, max_len))
    cache = cpu_cache_dtype(step.model.dtype)
    buffers = [torch.zeros(num_slots, heads, capacity, head_dim, dtype=cache)
               for _ in range(2 * count)]
    example = (torch.zeros(rows, 1, dtype=torch.long), torch.full((rows, 1), seen - 1),
               torch.zeros(rows, 1, 1, seen), buffers[:count], buffers[count:])
    row_dim = Dim("rows", min=spec.min_rows, max=spec.max_rows) if spec.max_rows > 1 \
        else Dim.STATIC
    length = Dim("length", min=2, max=max_len)
    cache = [{2: Dim("capacity", min=2, max=max_len)}] * count
    shapes = ({0: row_dim}, {0: row_dim}, {0: row_dim, 3: length}, cache, cache)
    with torch.no_grad():
        return torch.export.export(step, example, dynamic_shapes=shapes, strict=False)


def compile_graphs(job: dict) -> None:
    directory = Path(job["directory"])
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server compiling the same: wait for it
        wanted = [s for s in graph_specs(job["num_slots"], job["dtype"], job["quantize"])
                  if s.name in job["graphs"]
                  and not (directory / f"{s.name}.pt2").exists()]
        if not wanted:
            return
        settle_vector_math()  # before the rotary table's cos (machine.py says why)
        loaded = load_model(Path(job["source"]), dtype=job["dtype"], device="cpu",
                            max_model_len=job["max_model_len"], quantize=job["quantize"])
        fuse_projections(loaded.model)
        if job["dtype"] == "bf16":
            use_onednn_linears(loaded.model, loaded.dtype)
        step = DecodeStep(loaded.model, job["max_len"]).eval()
        config = loaded.model.config
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        layers = (config.num_hidden_layers, heads, step.stack.head_dim)
        for spec in wanted:
            _package(step, spec, job, layers, directory)


def _package(step: DecodeStep, spec: GraphSpec, job: dict, layers: tuple[int, int, int],
             directory: Path) -> None:
    began = time.perf_counter()
    program = export_step(step, spec, job["num_slots"], job["max_len"], layers)
    partial = directory / f"{spec.name}.partial.pt2"
    inductor = INDUCTOR[job["dtype"]]
    packaging = PACKAGING if job["dtype"] == "fp32" else {}
    with torch._inductor.config.patch(inductor):
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                 inductor_configs={**inductor, **packaging})
    if packaging:
        graph_constants.split(partial, spec.name, directory)
    os.replace(partial, directory / f"{spec.name}.pt2")  # whole, or not there
    print(f"{spec.name}: compiled in {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        compile_graphs(json.loads(sys.argv[1]))
