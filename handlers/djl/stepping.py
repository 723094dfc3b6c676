"""Driving the torch engine's `ContinuousBatcher` synchronously, from DJL's calling thread.

DJL's sync Python engine calls `handle()` from one thread and waits for it, so the batcher is
stepped right there, as the server's engine loop steps it, without a background thread.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from handlers.engine.torch.batcher import ContinuousBatcher
from handlers.engine.types import GenerationRequest, RequestOutput

Pair = tuple[int, RequestOutput]  # (position of the request in the list given, its output)


def step(batcher: ContinuousBatcher) -> list[RequestOutput]:
    """One engine step: admit, prefill a chunk, decode one token for every running sequence."""
    with torch.inference_mode():
        return batcher.step()


def run_steps(
    batcher: ContinuousBatcher, requests: list[GenerationRequest]
) -> Iterator[list[Pair]]:
    """Queue validated requests and yield each step's outputs until all of them finished.

    Closing the iterator early (or an error in a step) aborts the requests still running.
    """
    position = {request.request_id: i for i, request in enumerate(requests)}
    running = set(position)
    for request in requests:
        batcher.add(request)
    try:
        while running and batcher.has_work:
            pairs = [(position[out.request_id], out) for out in step(batcher)]
            running -= {out.request_id for _, out in pairs if out.finished}
            yield pairs
    finally:
        for request_id in running:
            batcher.abort(request_id)
