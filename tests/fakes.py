"""A deterministic `Engine` for protocol and server tests: no model, scripted by the prompt.

Every whitespace-separated word is a token. Sequence `s` echoes the prompt's words from word `s`
on, cycling, each as " word" with log-probability -1 / 2**s (so with n > 1 the last sequence is
the most likely). Markers in the prompt script the rest (they are not echoed):

- `[[invalid]]`: `validate` raises RequestValidationError("inputs", ...);
- `[[eos:K]]`: after K tokens, an EOS special token (text "") ends the sequence (eos_token);
- `[[error:K]]`: after K tokens, the sequence finishes with FinishReason.ERROR;
- `[[raise:K]]`: after K tokens, the output iterator raises RuntimeError;
- `[[stall:K]]`: after K tokens, the request stalls: no further step until it is aborted.

Tests wait on the engine's events, not on the clock: `until(check)` returns once `check()` holds,
re-checked whenever a request arrives, yields, finishes or is aborted; `generated` counts each
request's tokens. `on_fake_clock` runs a coroutine on an event loop whose clock only moves when
every task waits on a timer, so code that reads time through its loop can be tested exactly.
"""

from __future__ import annotations

import asyncio
import re
import selectors
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2

from handlers.engine.types import (
    AdapterActivity,
    AdapterError,
    EmbeddingResult,
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    RequestValidationError,
    SamplingParams,
    SequenceOutput,
    Token,
    TopToken,
)

EOS_ID = 2
ALT_ID = 1000  # top-token alternatives are ids ALT_ID + 1, ALT_ID + 2, ...
MARKER = re.compile(r"\[\[(\w+)(?::(\d+))?\]\]")
HANG_GUARD_S = 60.0  # how long a test waits on an event before failing, against hanging forever

T = TypeVar("T")


# Thinking switched off (enable_thinking false) closes an empty thinking block, as Qwen3's does.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>"
                 "{% if enable_thinking is defined and not enable_thinking %} <think></think>"
                 "{% endif %}{% endif %}")


class FakeTokenizer:
    """Words are tokens; ids are given in first-seen order from 10 on (stable per instance).
    Chats render as `<|role|> content` lines, then `<|assistant|>` to open the answer."""

    vocab_size = 100_000
    eos_token_ids = frozenset({EOS_ID})
    media = None  # text only
    token_bound = None  # a word is a token, however long: no bound by bytes

    def __init__(self, template: str = "") -> None:
        self._ids: dict[str, int] = {}
        self._words: dict[int, str] = {EOS_ID: "</s>"}
        self.template = template or CHAT_TEMPLATE  # a model family's, in tests of formats

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self._id(word) for word in text.split()]  # it has no special tokens to add

    def encode_media_prompt(self, text: str, media: tuple) -> list[int]:
        return self.encode(text)  # a media part's placeholder is a word: one token

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        words = self.token_strings([i for i in ids if not (skip_special_tokens and i == EOS_ID)])
        return " ".join(words)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self._words.get(i, f"<{i}>") for i in ids]  # an id never seen is no word yet

    def chat_template(self, tools: list[dict[str, Any]] | None = None) -> str:
        return self.template

    def render_chat(self, template: str, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                    continue_final_message: bool,
                    variables: dict[str, Any] | None = None) -> str:
        return jinja2.Template(template).render(messages=messages, tools=tools,
                                                add_generation_prompt=add_generation_prompt,
                                                **(variables or {}))

    def _id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self._ids) + 10
            self._words[self._ids[word]] = word
        return self._ids[word]


def _markers(prompt: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2) or 0) for m in MARKER.finditer(prompt)}


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    max_model_len: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name (it runs them alike)
    lora: bool = True  # false: LoRA is off, as option.enable_lora=false turns a real engine's
    answer_parsing: Any = None  # chat answers are read by the protocols' parsers
    group_window: int | None = None  # engine requests of one client request held at once
    token_delay: float = 0.0  # seconds per engine step
    tokens_per_step: int = 1
    ready: bool = True
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    requests: list[GenerationRequest] = field(default_factory=list)  # every generate() call
    aborted: list[str] = field(default_factory=list)  # ids closed or aborted before finishing
    finished: list[str] = field(default_factory=list)  # ids that ran to their end
    generated: dict[str, int] = field(default_factory=dict)  # id -> tokens yielded, all sequences
    released_sessions: list[str] = field(default_factory=list)  # release_session() calls
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def health(self) -> bool:
        return self.ready

    def validate(self, request: GenerationRequest) -> None:
        if "[[invalid]]" in request.prompt:
            raise RequestValidationError("inputs", "the prompt carries the [[invalid]] marker")
        if request.adapter is not None and request.adapter not in self.adapters:
            raise RequestValidationError("adapter", f"no LoRA adapter {request.adapter!r}")
        ids = self.tokenizer.encode(request.prompt)
        if request.params.truncate:
            ids = ids[-request.params.truncate :]
        if len(ids) > self.max_model_len:
            message = f"the prompt has {len(ids)} tokens, more than {self.max_model_len}"
            raise RequestValidationError("inputs", message)
        request.prompt_token_ids = ids

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        self.generated[request.request_id] = 0
        self._changed.set()
        finished = False
        try:
            async for output in self._run(request):
                finished = output.finished
                if finished:
                    self.finished.append(request.request_id)
                self.generated[request.request_id] += sum(len(s.tokens) for s in output.outputs)
                self._changed.set()
                yield output
        finally:
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0)  # as in a real engine, aborting awaits (a lock, a queue...)
        if request_id not in self.aborted:
            self.aborted.append(request_id)
        self._changed.set()

    async def until(self, check: Callable[[], bool], guard: float = HANG_GUARD_S) -> None:
        """Return once `check()` holds, re-checked each time a request arrives, yields an output,
        or is aborted: an event, not a poll. `guard` only keeps a broken test from hanging."""
        async with asyncio.timeout(guard):
            while not check():
                self._changed.clear()
                await self._changed.wait()

    def stats(self) -> dict[str, int]:
        running = len(self.requests) - len(self.finished) - len(self.aborted)
        return {"running_requests": running, "finished_requests": len(self.finished)}

    def adapter_activity(self) -> AdapterActivity | None:
        # None says LoRA is off; the real engines' activity has tests of its own.
        return AdapterActivity(4, (), ()) if self.lora else None

    async def add_adapter(self, name: str, path: Path) -> None:
        if not self.lora:
            raise AdapterError("LoRA is off: set option.enable_lora=true to register adapters")
        self.adapters = (*self.adapters, name)  # runs like the base model, as every adapter

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        if name not in self.adapters:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)

    async def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"no LoRA adapter {name!r} is served", missing=True)
        self.adapters = tuple(a for a in self.adapters if a != name)

    async def release_session(self, session: str) -> None:
        self.released_sessions.append(session)

    async def start(self) -> None:
        self.ready = True

    async def shutdown(self) -> None:
        self.ready = False

    async def _run(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        params = request.params
        words = [w for w in request.prompt.split() if not MARKER.fullmatch(w)] or ["word"]
        marks = _markers(request.prompt)
        metrics = RequestMetrics(request.arrival_time, first_scheduled_time=time.monotonic())
        seqs = [_Sequence(s, _rotate(words, s)) for s in range(params.num_sequences)]
        prompt_logprobs = self._prompt_logprobs(request) if params.prompt_logprobs else None
        while not all(s.done for s in seqs):
            await asyncio.sleep(self.token_delay)
            if "stall" in marks and seqs[0].count >= marks["stall"]:
                await asyncio.Event().wait()  # until the request is cancelled
            if "raise" in marks and seqs[0].count >= marks["raise"]:
                raise RuntimeError(f"scripted failure after {seqs[0].count} tokens")
            outputs = [s.step(self, params, marks) for s in seqs if not s.done]
            done = all(s.done for s in seqs)
            yield RequestOutput(
                request_id=request.request_id,
                outputs=outputs,
                prompt_token_count=len(request.prompt_token_ids or []),
                metrics=metrics,
                finished=done,
                prompt_logprobs=prompt_logprobs,
            )
            prompt_logprobs = None

    def _prompt_logprobs(self, request: GenerationRequest) -> list[Token]:
        ids = request.prompt_token_ids or self.tokenizer.encode(request.prompt)
        return [
            Token(id=i, text=self.tokenizer.decode([i]), logprob=None if k == 0 else -2.0)
            for k, i in enumerate(ids)
        ]


@dataclass
class _Sequence:
    index: int
    words: list[str]
    count: int = 0
    cumulative: float = 0.0
    done: bool = False

    def step(
        self, engine: FakeEngine, params: SamplingParams, marks: dict[str, int]
    ) -> SequenceOutput:
        logprob = -1.0 / 2**self.index
        tokens: list[Token] = []
        reason: FinishReason | None = None
        error = None
        for _ in range(engine.tokens_per_step):
            if "error" in marks and self.count >= marks["error"]:
                reason, error = FinishReason.ERROR, f"scripted error after {self.count} tokens"
                break
            if "eos" in marks and self.count >= marks["eos"] and not params.ignore_eos:
                tokens.append(Token(EOS_ID, "", logprob, special=True))
                self.count += 1
                reason = FinishReason.EOS
                break
            word = self.words[self.count % len(self.words)]
            token_id = engine.tokenizer.encode(word)[0]
            top = _top(token_id, " " + word, logprob, params.top_logprobs)
            tokens.append(Token(token_id, " " + word, logprob, top=top))
            self.count += 1
            if self.count >= params.max_new_tokens:
                reason = FinishReason.LENGTH
                break
        self.cumulative += logprob * len(tokens)
        self.done = reason is not None
        return SequenceOutput(self.index, tokens, reason, error, self.cumulative, self.count)


@dataclass
class ScriptedEngine(FakeEngine):
    """Answers every request with `script`, one token per piece, whatever the prompt (a
    reasoning model's thinking, a family's tool-call format), then EOS; `max_new_tokens` cuts
    it as it cuts any output."""

    script: tuple[str, ...] = ()

    async def _run(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        metrics = RequestMetrics(request.arrival_time, first_scheduled_time=time.monotonic())
        limit = request.params.max_new_tokens
        for count, piece in enumerate(self.script[:limit], start=1):
            await asyncio.sleep(self.token_delay)
            last = count == min(limit, len(self.script))
            reason = None if not last else (FinishReason.LENGTH if count == limit
                                            and limit < len(self.script) else FinishReason.EOS)
            token = Token(self.tokenizer.encode(piece.strip() or "x")[0], piece, -1.0)
            yield RequestOutput(request.request_id, [SequenceOutput(0, [token], reason, None,
                                                                    -float(count), count)],
                                len(request.prompt_token_ids or []), metrics, finished=last)


def _rotate(words: list[str], by: int) -> list[str]:
    by %= len(words)
    return words[by:] + words[:by]


def _top(token_id: int, text: str, logprob: float, k: int) -> list[TopToken]:
    if k == 0:
        return []
    alternatives = [TopToken(ALT_ID + j, f" alt{j}", logprob - j) for j in range(1, k)]
    return [TopToken(token_id, text, logprob), *alternatives]


class FakeClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a fake clock that starts at 0: time stands still while any callback is
    ready or any I/O is pending, and jumps straight to the next timer when the loop would
    otherwise sleep (trio's autojump clock). Timers (sleep, wait_for, timeout) fire in their
    order and at their exact time however loaded the machine. For code without threads."""

    def __init__(self) -> None:
        self._selector_clock = _JumpingSelector()
        super().__init__(self._selector_clock)

    def time(self) -> float:
        return self._selector_clock.now


class _JumpingSelector(selectors.DefaultSelector):
    now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0:
            return ready if ready or timeout is not None else super().select(None)
        self.now += timeout  # the loop would sleep until its next timer: be there at once
        return []


def on_fake_clock(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a FakeClockLoop; its value."""
    with asyncio.Runner(loop_factory=FakeClockLoop) as runner:
        return runner.run(main)


@dataclass
class FakeEmbeddingEngine:
    """A deterministic embedding engine: each text's vector is made of its word and character
    counts; a word is a token; the instruction is prepended as the real engine does."""

    model_name: str = "fake-embedder"
    dimension: int = 4

    async def embed(self, texts: list[str], instruction: str | None = None,
                    truncate: bool = True) -> EmbeddingResult:
        await asyncio.sleep(0)
        prompted = [(instruction or "") + text for text in texts]
        vectors = [[float(len(t.split())), float(len(t)), 0.5, -1.0] for t in prompted]
        return EmbeddingResult(vectors, sum(len(t.split()) for t in prompted))

    def health(self) -> bool:
        return True

    def stop(self) -> None:
        return None


def served_app(engine: FakeEngine | None, embedder: FakeEmbeddingEngine | None = None, *,
               loaded: bool = True, model_name: str = "fake-model",
               dynamic: tuple[int, int, bool] | None = None, embeddings_only: bool = False,
               fleet: Any = None, clock: Callable[[], float] = time.time,
               model_code: Any = None, **settings: Any) -> Any:
    """The server's app over fake engines, as `lmi-serve` composes it: `dynamic` is
    (batch_size, max_batch_delay ms, enable_streaming) for LMI's dynamic batching; an
    embeddings-only server serves `embedder` alone; until `loaded`, nothing is attached;
    `fleet` loads models at runtime; `clock`: the wall clock sessions expire by; `model_code`
    is a model.py's (handlers.djl.model_code's ModelCodes), applied at LMI's entry."""
    from handlers.engine.dynamic_batch import DynamicBatcher
    from handlers.server.app import create_app
    from handlers.server.context import Served, ServerContext, ServerSettings

    generator = None
    if not embeddings_only:
        served: Any = engine
        if dynamic is not None:
            served = DynamicBatcher(engine, dynamic[0], dynamic[1])
        generator = Served(model_name, served if loaded else None)
    else:
        model_name = embedder.model_name
    embedded = Served(model_name if embeddings_only else None) if embedder is not None else None
    if embedded is not None and loaded:
        embedded.attach(embedder)
    settings = ServerSettings(model_name, dynamic_batching=dynamic is not None,
                              dynamic_streaming=bool(dynamic and dynamic[2]), **settings)
    ctx = ServerContext(settings, generator, embedded, clock=clock)
    if fleet is not None:  # models loaded at runtime (handlers/server/fleet.py)
        ctx.load_models_with(fleet)
    if model_code is not None:
        from handlers.djl.custom_entry import CustomEntry

        ctx.entry_code = CustomEntry(model_code)
    return create_app(ctx)
