"""The embedding engine: concurrent `embed` calls share forward passes in one worker thread.

Callers await on their own event loop (any loop, any thread); the worker gathers what is queued
(up to `max_batch_size` inputs, waiting at most `max_batch_delay` seconds for company), cuts
each input to the part the model reads (never tokenizing a long one whole), counts and checks
each request's tokens on its own, then embeds the batch. A request that fails its
checks, or whose inputs break the forward pass, fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from handlers.engine.embedding.model import EmbeddingModel
from handlers.engine.types import EmbeddingResult, RequestValidationError

T = TypeVar("T")
# An input's first read, in characters per token the model reads: more than words take, so one
# read is enough for text (all-MiniLM-L6-v2 reads 256 tokens: 8,192 characters).
_CHARS_PER_TOKEN = 32
_LAST_SPACE = re.compile(r"\s\S*\Z")  # the last whitespace before the end (endpos)


@dataclass
class _Job:
    texts: list[str]
    prompt: str  # prepended to every text: the instruction, else the model's default prompt
    truncate: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[EmbeddingResult]
    prompt_tokens: int = 0


class EmbeddingEngine:
    """Embeds texts with a loaded model. `start()` and `stop()` may be called from any thread."""

    def __init__(
        self, loaded: EmbeddingModel, *, max_batch_size: int = 32, max_batch_delay: float = 0.005
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model_name = loaded.name
        self.dimension = loaded.dimension
        self.max_seq_length = loaded.max_seq_length
        self.forward_passes = 0  # model calls so far: each embeds up to max_batch_size inputs
        self._loaded = loaded
        self._max_batch_size = max_batch_size
        self._max_batch_delay = max_batch_delay
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._carry: _Job | None = None  # taken from the queue, left for the next batch
        self._lock = threading.Lock()  # orders submissions before the stop sentinel
        self._running = False
        self._thread: threading.Thread | None = None

    def health(self) -> bool:
        return self._running

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("The embedding engine was already started")
            self._thread = threading.Thread(target=self._work, name="embeddings", daemon=True)
            self._thread.start()
            self._running = True

    def stop(self) -> None:
        """Refuse new requests; those already queued are still answered, then the worker ends."""
        with self._lock:
            if not self._running:
                return
            self._running = False
            self._queue.put(None)

    async def embed(
        self, texts: list[str], instruction: str | None = None, truncate: bool = True
    ) -> EmbeddingResult:
        """Embed `texts`. Inputs over the model's max sequence length are truncated, or refused
        with a RequestValidationError when `truncate` is False. `instruction` is prepended
        verbatim to every input as sentence-transformers prepends a prompt (so a model whose
        pooling excludes its prompt, as INSTRUCTOR-style ones declare, pools only the text); it
        replaces the model's default prompt, which applies without one."""
        _check_request(texts, instruction)
        loop = asyncio.get_running_loop()
        job = _Job(
            texts=texts,
            prompt=instruction or self._loaded.default_prompt,
            truncate=truncate,
            loop=loop,
            future=loop.create_future(),
        )
        with self._lock:
            if not self._running:
                raise RuntimeError("The embedding engine is not running")
            self._queue.put(job)
        return await job.future

    # --- the worker thread ---------------------------------------------------------------------

    def _work(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._gather()
            ready = [job for job in batch if self._admit(job)]
            by_prompt: dict[str, list[_Job]] = {}
            for job in ready:
                by_prompt.setdefault(job.prompt, []).append(job)
            for prompt, jobs in by_prompt.items():
                self._embed_jobs(prompt, jobs)

    def _gather(self) -> tuple[list[_Job], bool]:
        """The next batch, and whether the stop sentinel came after it."""
        first = self._carry or self._queue.get()
        self._carry = None
        if first is None:
            return [], True
        batch, size = [first], len(first.texts)
        deadline = time.monotonic() + self._max_batch_delay
        while size < self._max_batch_size:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                return _live(batch), True
            if size + len(job.texts) > self._max_batch_size:
                self._carry = job
                break
            batch.append(job)
            size += len(job.texts)
        return _live(batch), False

    def _admit(self, job: _Job) -> bool:
        """Cut the job's inputs to what the model reads and count their tokens; fail it (alone)
        when an input is too long to embed whole and truncation is off. Returns whether the job
        goes on to the forward pass."""
        limit = self.max_seq_length
        try:
            read = [self._read(job.prompt, text) for text in job.texts]
            for index, (text, length) in enumerate(read):
                if length > limit and not job.truncate:
                    size = length if text is job.texts[index] else f"more than {limit}"
                    raise RequestValidationError(
                        "input",
                        f"input[{index}] is {size} tokens long, over the embedding model's "
                        f"limit of {limit} tokens; shorten it or allow truncation",
                    )
        except Exception as error:  # this job's own failure: reported to it alone
            _settle(job, error=error)
            return False
        job.texts = [text for text, _ in read]
        job.prompt_tokens = sum(min(length, limit) for _, length in read)
        return True

    def _read(self, prompt: str, text: str) -> tuple[str, int]:
        """The part of `text` the model reads after `prompt`, and its tokens with `prompt`.

        The model reads an input's first max_seq_length tokens; tokenizing a 5 MB input whole
        to find them took seconds and ~1 GB, twice (here and in the forward pass). So the input
        is cut first, in a window of _CHARS_PER_TOKEN characters per token the model reads,
        doubled until the part holds more tokens than the model reads or is the whole input.
        The cut falls before the last whitespace in the window's back half: tokenizers that
        split words at whitespace (BERT's WordPiece, SentencePiece, byte-level BPE) give the
        words before it the tokens they have in the whole input, so the model reads the same
        tokens. Without whitespace there, it falls at the window's end, in a word longer than
        half the window (WordPiece reads one [UNK] for any word over 100 characters)."""
        limit, window = self.max_seq_length, self.max_seq_length * _CHARS_PER_TOKEN
        tokenizer = self._loaded.model.tokenizer
        while True:
            part = _cut(text, window)
            [ids] = tokenizer([prompt + part], verbose=False)["input_ids"]
            if part is text or len(ids) > limit:
                return part, len(ids)
            window *= 2

    def _embed_jobs(self, prompt: str, jobs: list[_Job]) -> None:
        """Embed the jobs' inputs together; if that fails, embed each job alone so the failure
        reaches only the job that causes it."""
        try:
            vectors = self._encode([text for job in jobs for text in job.texts], prompt)
        except Exception as error:
            if len(jobs) == 1:
                _settle(jobs[0], error=error)
            else:
                for job in jobs:
                    self._embed_jobs(prompt, [job])
            return
        start = 0
        for job in jobs:
            end = start + len(job.texts)
            _settle(job, EmbeddingResult(vectors[start:end], job.prompt_tokens))
            start = end

    def _encode(self, texts: list[str], prompt: str) -> list[list[float]]:
        vectors: list[list[float]] = []
        for start in range(0, len(texts), self._max_batch_size):
            chunk = texts[start : start + self._max_batch_size]
            array = _in_passing_thread(lambda c=chunk: self._loaded.model.encode(
                c, prompt=prompt, batch_size=len(c), show_progress_bar=False))
            self.forward_passes += 1
            vectors.extend(array.tolist())
        return vectors


def _in_passing_thread(work: Callable[[], T]) -> T:
    """`work()` in a thread that ends with it. libgomp keeps an OpenMP team for every thread
    that started one, for as long as that thread lives; once it manages more threads than there
    are CPUs, every barrier spins ~100 times instead of ~300,000 before it sleeps, and the
    generation engine's decode step (hundreds of parallel regions) then waits on futexes: 2.5x
    slower after a single embeddings request while this worker thread kept its team. A thread
    that ends frees its team."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeddings-forward") as once:
        return once.submit(work).result()


def _cut(text: str, window: int) -> str:
    """`text` if it fits in `window` characters, else its start: up to the last whitespace in
    the window's back half, or the whole window where there is none."""
    if len(text) <= window:
        return text
    space = _LAST_SPACE.search(text, window // 2, window)
    return text[: space.start() if space else window]


def _check_request(texts: object, instruction: object) -> None:
    if not isinstance(texts, list) or not texts:
        raise RequestValidationError("input", "input must be a non-empty list of strings")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestValidationError("input", f"input[{index}] must be a string")
        if not text:
            raise RequestValidationError("input", f"input[{index}] must not be empty")
    if instruction is not None and not isinstance(instruction, str):
        raise RequestValidationError("instruction", "instruction must be a string")


def _live(batch: list[_Job]) -> list[_Job]:
    """The jobs whose callers still wait (one that was cancelled needs no work)."""
    return [job for job in batch if not job.future.cancelled()]


def _settle(
    job: _Job, result: EmbeddingResult | None = None, error: BaseException | None = None
) -> None:
    """Complete the job's future on its own loop (from the worker thread)."""

    def settle() -> None:
        if job.future.done():  # the caller went away
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
        job.loop.call_soon_threadsafe(settle)
