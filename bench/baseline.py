"""The static-batching baseline: the same requests through Hugging Face `generate()`.

Time to first token of a static batch is its first decoding step (prefill plus one token),
timed in the same run by a streamer that stamps every step; TPOT is the mean step time after it.
This module imports torch and transformers: import it only when the baseline runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from bench.stats import RequestResult
from bench.workloads import Arrival, BatchTiming, Progress, closed_loop_prompts, run_static_trace
from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.engine.machine import resolve_device
from handlers.engine.torch.loader import resolve_dtype
from handlers.model_source import default_model_path


class GenerateBaseline:
    """One model in this process, run one static batch at a time (greedy, fixed length):
    `model` (a Hugging Face model directory), else the embedded default, on `device`."""

    def __init__(self, threads: int, dtype: str, model: Path | None = None,
                 device: str = "cpu") -> None:
        torch.set_num_threads(threads)
        # Transformers' own classes (the server's loader gives its own Llama, which has no
        # generate()); the embedded default from the GGUF's cached conversion, which the server
        # reads too.
        directory = model or cached_gguf_dir(default_model_path())
        target = resolve_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=resolve_dtype(dtype, target, None),
            local_files_only=True).to(target).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.tokenizer.padding_side = "left"
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id

    def run_batch(self, prompts: list[str], max_new_tokens: int) -> BatchTiming:
        """Generate exactly `max_new_tokens` for every prompt, as one left-padded batch."""
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.model.device)
        steps = _StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=steps,
            )
        return BatchTiming(start=start, token_times=steps.times, end=time.perf_counter())


class _StepClock(BaseStreamer):
    """Stamps each decoding step; generate()'s first `put` is the prompt, not a step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def closed_loop(
    baseline: GenerateBaseline, concurrency: int, turns: int, max_new_tokens: int,
    progress: Progress,
) -> list[RequestResult]:
    """Workload A: turn j of all `concurrency` clients as one static batch, turn after turn."""
    plan = closed_loop_prompts(concurrency, turns)
    results: list[RequestResult] = []
    for turn in range(turns):
        timing = baseline.run_batch([plan[c][turn] for c in range(concurrency)], max_new_tokens)
        for _ in range(concurrency):
            results.append(_result(timing, max_new_tokens))
        progress(concurrency)
    return results


def _result(timing: BatchTiming, expected: int) -> RequestResult:
    return RequestResult(
        start=timing.start,
        first_token=timing.token_times[0] if timing.token_times else None,
        last_token=timing.token_times[-1] if timing.token_times else None,
        done=timing.end,
        tokens=len(timing.token_times),
        expected_tokens=expected,
    )


def arrival_trace(
    baseline: GenerateBaseline, trace: list[Arrival], max_batch: int, progress: Progress
) -> list[RequestResult]:
    """Workload B: replay the arrivals in real time through a static batcher."""

    def run_batch(batch: list[Arrival]) -> BatchTiming:
        longest = max(a.max_new_tokens for a in batch)
        timing = baseline.run_batch([a.prompt for a in batch], longest)
        progress(len(batch))
        return timing

    return run_static_trace(trace, run_batch, time.perf_counter, time.sleep, max_batch)
