"""The decode step on CUDA, captured as CUDA graphs: one per bucket of row counts, replayed.

Eager, a step is bound by Python, not the GPU: transformers' modules cost ~1.5 ms of host time a
layer, so SmolLM2-135M's 30 layers took 35-75 ms a step on an H200 whatever the batch; replayed,
3-10 ms from 1 to 64 rows: a replay launches the captured kernels at once. A graph holds
fixed shapes and addresses, so:

- rows are padded up to the bucket; padding rows write their keys and values into a scratch
  slot past the engine's own (the cache has one more slot), and their logits are dropped;
- attention reads the cache's whole capacity, masked to each row's length, and the graphs are
  captured again (lazily, per bucket) when the cache grows or shrinks;
- the inputs (token, position and written slot of each row) are copied into fixed buffers.

Rows decoding with LoRA adapters, or from a slot other than 0, run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from handlers.engine.torch.kv_cache import SlotKVCache

log = logging.getLogger(__name__)

# (ids [B, 1], positions [B, 1], the keys each row sees [B, capacity]) -> logits [B, vocab]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def buckets(max_rows: int) -> list[int]:
    """Row counts a graph is captured for, as vLLM's: 1, 2, 4, then every 8 up to max_rows."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return [*sizes, max_rows]


@dataclass
class _Graph:
    replay: Callable[[], object]
    inputs: torch.Tensor  # [3, B, 1]: token ids, positions, written slots
    logits: torch.Tensor  # [B, vocab], written by each replay


class CudaDecodeGraphs:
    def __init__(self, step: Step, cache: SlotKVCache, max_rows: int) -> None:
        self._step = step
        self._cache = cache
        self._scratch = max_rows  # the cache's extra slot: padding rows write there
        self._buckets = buckets(max_rows)
        self._graphs: dict[int, _Graph] = {}
        self._resizes = -1  # the cache's count when the graphs were captured
        self._pool: tuple[int, int] | None = None  # the memory the graphs of a capacity share

    def counts(self) -> dict[str, int]:
        return {"decode_graphs_ready": len(self._graphs),
                "decode_graphs_total": len(self._buckets)}

    def decode(self, token_ids: list[int], lengths: list[int]) -> torch.Tensor:
        """One token's logits (float32 [rows, vocab]) for the rows in slots 0..rows-1, whose
        `lengths` tokens are cached already."""
        rows = len(token_ids)
        bucket = next(b for b in self._buckets if b >= rows)
        self._cache.reserve(max(lengths) + 1)
        if self._cache.resizes != self._resizes:  # the buffers moved: every graph is stale
            self._graphs.clear()
            self._pool = None
            self._resizes = self._cache.resizes
        pad = bucket - rows
        host = torch.tensor([token_ids + [0] * pad, lengths + [0] * pad,
                             list(range(rows)) + [self._scratch] * pad])[:, :, None]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(host)
        else:
            graph.inputs.copy_(host)
        graph.replay()
        self._cache.note_written(range(rows), [length + 1 for length in lengths])
        return graph.logits[:rows].to(torch.float32, copy=True)

    def _capture(self, host: torch.Tensor) -> _Graph:
        """The step for host's rows, captured (host: its first inputs, which the warm-up run
        computes and writes, so the cache holds what a replay writes)."""
        inputs = host.to(self._cache.keys[0].device)
        ids, positions, slots = inputs
        keys = torch.arange(self._cache.capacity, device=inputs.device)

        def step() -> torch.Tensor:
            self._cache.bind_graph(slots, positions, len(ids))  # read at capture only
            return self._step(ids, positions, keys[None, :] <= positions)  # keys 0..length

        replay, logits = self._record(step)
        log.info("decode step captured for %d rows (cache capacity %d)", len(ids),
                 self._cache.capacity)
        return _Graph(replay, inputs, logits)

    def _record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], object],
                                                                  torch.Tensor]:
        """`step` as a CUDA graph: its replay, and the logits each replay writes."""
        device = self._cache.keys[0].device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # allocations and lazy inits happen before the capture
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = step()
        return graph.replay, logits
