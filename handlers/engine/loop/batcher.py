"""Continuous batching: the synchronous `step()` at the heart of the engines that step in a
thread (torch, llama.cpp), over the engine's `Runner`.

Each step admits waiting requests while cache slots are free and, where the engine has a KV
budget, while the positions they may need fit it (admission.py; a prompt that begins as a recent
one did starts from that one's keys/values: prefix_cache.py), runs one prefill chunk for
requests still reading their prompt (bounded by `max_prefill_tokens`, so running sequences never
stall for long, and shared so that a short prompt never waits behind long ones:
`_prefill_plan`), runs one decode pass over every running sequence, samples each row with its
own settings and emits one output per request that moved. A finished or aborted sequence frees
its slot at once. Running sequences always sit in slots 0..B-1 (the decode pass reads a view of
the cache); a sequence that finishes hands its slot to the last one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from handlers.engine.detokenize import IncrementalDetokenizer, token_text
from handlers.engine.grammars import Grammars, mask_logits
from handlers.engine.kv_budget import KVBudget
from handlers.engine.loop import sampling
from handlers.engine.loop.admission import TokenBudget
from handlers.engine.loop.prefix_cache import BLOCK, PrefixCache
from handlers.engine.loop.runner import PrefillChunk, Runner
from handlers.engine.loop.sequence import RequestState, Sequence, Thinking, make_token
from handlers.engine.loop.speculation import NgramSettings, Speculator
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SequenceOutput,
    Token,
)

log = logging.getLogger(__name__)


class ContinuousBatcher:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_batch_size: int,
        max_prefill_tokens: int,
        max_model_len: int,
        counters: dict[str, int] | None = None,  # carried over from a batcher this replaces
        prefix_cache_bytes: int = 0,  # keys/values of recent prompts kept for reuse; 0: none
        kv_budget: KVBudget | None = None,  # what the running sequences' keys/values may take
        speculation: NgramSettings | None = None,  # n-gram proposals (a VerifyingRunner's)
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []))
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.grammars = Grammars(tokenizer, runner.vocab_size, eos_token_ids)
        self.waiting: list[GenerationRequest] = []  # by priority, then arrival
        # The LoRA adapters of running and of waiting requests, as of the last step.
        self.adapters_in_use: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.prefilling: list[RequestState] = []  # FIFO, each holds a slot for its sequence 0
        self.decoding: list[Sequence] = []  # decoding[i].slot == i
        self.states: dict[str, RequestState] = {}
        self._owner: list[Sequence | None] = [None] * max_batch_size
        self._unstarted_failures: list[RequestOutput] = []
        self.counters = counters or {"prompt_tokens": 0, "generated_tokens": 0,
                                     "finished_requests": 0}
        self.prefix = (PrefixCache(runner, prefix_cache_bytes // runner.kv_bytes_per_token,
                                   self.counters, runner.prefix_places)
                       if prefix_cache_bytes else None)
        self.admission = TokenBudget.of(kv_budget, runner.kv_bytes_per_token, max_model_len)
        self.speculator = Speculator(speculation, self.counters) if speculation else None

    # -- public surface -------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Queue a validated request (its prompt_token_ids set) behind those of its priority."""
        bisect.insort_right(self.waiting, request, key=lambda r: r.priority)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now; its slots are free before this returns."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.admission.release(request_id)
                return None
        state = self.states.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            seq.finish(FinishReason.ABORT)
        self._release_finished()
        return state.take_output()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def stats(self) -> dict[str, int]:
        """Read from other threads: plain ints, so a slightly stale view at worst."""
        stats = {"running_requests": len(self.states), "waiting_requests": len(self.waiting),
                 "kv_cache_slots_in_use": self._used_slots(),
                 "kv_cache_slots_total": self.max_batch_size, **self.counters}
        # What the slots and the kept prefixes can hold, in the prefix cache's blocks.
        kept = self.prefix.max_tokens if self.prefix is not None else 0
        stats["kv_cache_block_size"] = BLOCK
        slots = min(self.max_batch_size * self.max_model_len, self.admission.tokens)
        stats.update(self.admission.stats())
        stats["kv_cache_blocks"] = (slots + kept) // BLOCK
        if self.prefix is not None:
            stats["prefix_cache_pinned_tokens"] = self.prefix.pinned_tokens
        return stats

    def forget_adapter(self, adapter: str) -> None:
        """LoRA adapter `adapter` was removed: drop the prefixes computed with it."""
        if self.prefix is not None:
            self.prefix.forget(adapter)

    def release_session(self, session: str) -> None:
        """Stateful session `session` ended: unpin its conversation's keys/values."""
        if self.prefix is not None:
            self.prefix.release(session)

    @property
    def running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    def step(self, emit_first: Callable[[RequestOutput], None] | None = None
             ) -> list[RequestOutput]:
        """Admit, prefill one chunk, decode one token for every running sequence; return the
        outputs. With `emit_first`, the first tokens that this step's prefill produced go there
        before the decode pass runs, so a new request's time to first token does not include it.
        Without it (a caller stepping the engine itself: the DJL entry), the sequences this step
        started decode from the next step on: one token per sequence per step, as DJL gets from
        vLLM's steps.
        """
        self._admit()
        touched: dict[str, RequestState] = {}
        running = len(self.decoding)  # started sequences take the slots after these
        stepped = {seq.request_id for seq in self.decoding}  # the requests this step runs
        if self.prefilling:
            self._prefill(touched)
            self._release_finished()  # e.g. max_new_tokens=1: no decode pass for them
            stepped |= touched.keys()
            if emit_first is not None:
                for output in self._take_outputs(touched, len(stepped)):
                    emit_first(output)
                touched = {}
                running = len(self.decoding)
        if running:
            self._decode(touched, running)
        self._release_finished()
        outputs = self._take_outputs(touched, len(stepped))
        if not self.has_work:
            self.runner.cache.shrink()
        self._note_adapters()
        return outputs

    def _note_adapters(self) -> None:
        """What `adapters_in_use` reports to other threads (one tuple, replaced whole)."""
        running = {state.request.adapter for state in self.states.values()}
        waiting = {request.adapter for request in self.waiting}
        self.adapters_in_use = (tuple(sorted(running - {None})), tuple(sorted(waiting - {None})))

    def _take_outputs(self, touched: dict[str, RequestState], batch: int
                      ) -> list[RequestOutput]:
        """The outputs of the requests this step touched; `batch`: how many requests it ran."""
        for state in touched.values():
            state.metrics.batch_size = batch
        outputs = [out for state in touched.values() if (out := state.take_output())]
        outputs += self._unstarted_failures
        self._unstarted_failures = []
        return outputs

    # -- admission ------------------------------------------------------------------------------

    def _used_slots(self) -> int:
        return len(self.decoding) + sum(len(s.sequences) for s in self.prefilling)

    def _admit(self) -> None:
        """Start waiting requests while slots last, shared between client requests (`_next`);
        one whose LoRA adapter cannot join the running ones yet (max_loras) waits, and those
        behind it may start."""
        held = []
        in_batch: Counter[str] = Counter()  # sequences in the batch, by client request
        for state in self.states.values():
            in_batch[_group(state.request)] += len(state.sequences)
        while self.waiting:
            index = self._next(in_batch)
            request = self.waiting[index]
            if self._used_slots() + request.params.num_sequences > self.max_batch_size \
                    or not self.admission.fits(request, self.waiting):
                break  # it waits for room, and so do those behind it
            del self.waiting[index]
            slot = self._free_slot()
            try:
                if not self.runner.use_adapter(slot, request.adapter):
                    held.append(request)
                    continue
                self.admission.reserve(request)  # before its sequences read max_new_tokens
                state = self._new_state(request)
            except Exception as exc:  # a request that cannot start fails alone
                log.exception("request %s failed to start", request.request_id)
                self.runner.use_adapter(slot, None)
                self.admission.release(request.request_id)
                self._fail_unstarted(request, exc)
                continue
            in_batch[_group(request)] += len(state.sequences)
            self.counters["prompt_tokens"] += len(state.prompt_ids)
            first = state.sequences[0]
            first.slot = slot
            self._owner[slot] = first
            if self.prefix is not None and state.prompt_logprobs is None:
                first.cached = self.prefix.restore(state.cache_ids, slot, request.adapter)
            self.prefilling.append(state)
            self.states[request.request_id] = state
        self.waiting[:0] = held  # of the first priorities taken: still in priority order

    def _next(self, in_batch: Counter[str]) -> int:
        """Where the waiting request to start next is: of the first priority, the one whose
        client request has the fewest sequences in the batch (the earliest of those), so that
        client requests take the batch's slots in turn and a bystander never waits behind
        another request's whole batch of prompts."""
        priority = self.waiting[0].priority
        best, fewest, seen = 0, None, set()
        for index, request in enumerate(self.waiting):
            if request.priority != priority or fewest == 0:
                break
            group = _group(request)
            if group in seen:
                continue
            seen.add(group)
            if fewest is None or in_batch[group] < fewest:
                best, fewest = index, in_batch[group]
        return best

    def _new_state(self, request: GenerationRequest) -> RequestState:
        params, prompt = request.params, request.prompt_token_ids or []
        thinking = self._thinking(params)
        sequences = [
            Sequence(
                request_id=request.request_id,
                params=params,
                index=i,
                token_ids=list(prompt),
                sampler=sampling.SequenceSampler(
                    params, prompt, self.eos_token_ids, self.runner.vocab_size,
                    self.runner.device, seed_offset=i,
                ),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt,
                    skip_special_tokens=params.skip_special_tokens,
                    stop_sequences=params.stop_sequences,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                grammar=self.grammars.start(params.structured) if params.structured else None,
                thinking=thinking(),
            )
            for i in range(params.num_sequences)
        ]
        metrics = RequestMetrics(arrival_time=request.arrival_time,
                                 first_scheduled_time=time.monotonic())
        state = RequestState(request=request, sequences=sequences, metrics=metrics)
        if params.prompt_logprobs:
            state.prompt_logprobs = [Token(id=prompt[0], text=token_text(self.tokenizer, prompt[0]),
                                           logprob=None, special=prompt[0] in self.special_ids)]
        return state

    def _thinking(self, params: SamplingParams) -> Callable[[], Thinking | None]:
        """What makes each sequence's Thinking (the markers tokenized once per request)."""
        if not params.thinking_end:
            return lambda: None
        end_ids = self.tokenizer.encode(params.thinking_end[0], add_special_tokens=False)
        open_id = None
        if params.thinking_start:
            opening = self.tokenizer.encode(params.thinking_start[0], add_special_tokens=False)
            # An opening of several tokens cannot be allowed beside a grammar: no thinking.
            open_id = opening[0] if len(opening) == 1 else -1
        return lambda: Thinking(params.thinking_end, list(end_ids), params.max_thinking_tokens,
                                open_id)

    def _fail_unstarted(self, request: GenerationRequest, exc: Exception) -> None:
        error = SequenceOutput(index=0, tokens=[], finish_reason=FinishReason.ERROR,
                               error=f"{type(exc).__name__}: {exc}")
        self._unstarted_failures.append(RequestOutput(
            request_id=request.request_id, outputs=[error],
            prompt_token_count=len(request.prompt_token_ids or []),
            metrics=RequestMetrics(arrival_time=request.arrival_time), finished=True))

    def _free_slot(self) -> int:
        return self._owner.index(None)

    def _free(self, slot: int) -> None:
        self._owner[slot] = None
        self.runner.release(slot)

    # -- prefill --------------------------------------------------------------------------------

    def _prefill_plan(self) -> dict[str, int]:
        """How many prompt tokens each prefilling request reads this step, `max_prefill_tokens`
        in all. The oldest is sure of half the budget, so it always progresses; the rest goes
        to the prompts with the fewest tokens left, so a short prompt that arrives behind long
        ones starts within a step or two instead of after them. Without chunked prefill (a
        budget of the whole context) prompts are read whole."""
        def remaining(state: RequestState) -> int:
            return len(state.prompt_ids) - state.sequences[0].cached

        oldest = self.prefilling[0]
        whole = self.max_prefill_tokens >= self.max_model_len  # chunked prefill is off
        share = self.max_prefill_tokens if whole or len(self.prefilling) == 1 \
            else self.max_prefill_tokens // 2
        plan = {oldest.request_id: min(remaining(oldest), share)}
        left = self.max_prefill_tokens - plan[oldest.request_id]
        for state in sorted(self.prefilling, key=remaining):
            planned = plan.get(state.request_id, 0)
            more = min(remaining(state) - planned, left)
            if whole and more < remaining(state) - planned:
                break  # it would not be read whole; neither would a longer one
            plan[state.request_id] = planned + more
            left -= more
        return plan

    def _prefill(self, touched: dict[str, RequestState]) -> None:
        plan, chunks, states = self._prefill_plan(), [], []
        for state in list(self.prefilling):  # oldest first, as the pass has always run them
            if (size := plan.get(state.request_id, 0)) <= 0:
                continue
            seq = state.sequences[0]
            try:
                embeds = self._media_embeds(state, seq.cached, size)
            except Exception as exc:  # its media fail it alone
                log.exception("request %s: encoding its media failed", state.request_id)
                self._fail(state, exc, touched)
                continue
            chunks.append(PrefillChunk(slot=seq.slot, start=seq.cached,
                                       token_ids=state.prompt_ids[seq.cached : seq.cached + size],
                                       all_logits=state.prompt_logprobs is not None,
                                       embeds=embeds))
            states.append(state)
        if not chunks:
            return
        try:
            logits = self.runner.prefill(chunks)
        except Exception as exc:
            log.exception("prefill failed")
            for state in states:
                self._fail(state, exc, touched)
            return
        # Every chunk counts as cached before any sequence starts decoding: starting one may
        # move another prompt of this pass to a new slot, with what it has cached.
        for state, chunk in zip(states, chunks, strict=True):
            state.sequences[0].cached += len(chunk.token_ids)
        for state, chunk, chunk_logits in zip(states, chunks, logits, strict=True):
            try:
                self._after_prefill_chunk(state, chunk, chunk_logits, touched)
            except Exception as exc:
                log.exception("request %s failed in prefill", state.request_id)
                self._fail(state, exc, touched)

    def _media_embeds(self, state: RequestState, start: int, size: int) -> torch.Tensor | None:
        """A prompt with media: its chunk's input embeddings, the encoders run at its first
        chunk (here, in the engine's thread) for the whole prompt, so no chunk splits media."""
        inputs = state.request.media_inputs
        if inputs is None:
            return None
        if state.embeds is None:
            state.embeds = self.runner.prompt_embeddings(inputs)
        return state.embeds[start : start + size]

    def _after_prefill_chunk(self, state: RequestState, chunk: PrefillChunk,
                             logits: torch.Tensor, touched: dict[str, RequestState]) -> None:
        first = state.sequences[0]
        if state.prompt_logprobs is not None:
            self._record_prompt_logprobs(state, chunk, logits)
        if first.cached < len(state.prompt_ids):
            return
        state.embeds = None  # read whole: the decode steps read tokens
        if self.prefix is not None:
            self.prefix.keep(state.cache_ids, first.slot, state.request.adapter)
        self.prefilling.remove(state)
        self._start_decoding(state, logits[-1:])
        touched[state.request_id] = state

    def _record_prompt_logprobs(self, state: RequestState, chunk: PrefillChunk,
                                logits: torch.Tensor) -> None:
        end = chunk.start + len(chunk.token_ids)
        targets = state.prompt_ids[chunk.start : end + 1]
        values = sampling.prompt_logprobs(logits[: len(targets) - 1], targets)[1:]
        for token_id, logprob in zip(targets[1:], values, strict=True):
            state.prompt_logprobs.append(Token(
                id=token_id, text=token_text(self.tokenizer, token_id), logprob=logprob,
                special=token_id in self.special_ids))

    def _start_decoding(self, state: RequestState, logits: torch.Tensor) -> None:
        """Move the prompt's cache into the decode region (once per sequence) and sample each
        sequence's first token from the prompt's last logits."""
        first = state.sequences[0]
        source = home = first.slot  # home: where the prompt's cache is
        for seq in state.sequences:
            slot, traded = self._claim_decode_slot(home, first.cached)
            if traded:
                home = slot  # the prompt's cache is in this slot now
            elif slot != home:
                self.runner.move(home, slot, first.cached)
            seq.slot, seq.cached = slot, first.cached
            self._owner[slot] = seq
            self.decoding.append(seq)
        if self._owner[source] is first and first.slot != source:
            self._free(source)
        state.metrics.first_token_time = time.monotonic()
        rows = state.sequences
        logits = logits.expand(len(rows), -1)
        params = state.request.params
        if params.structured is not None or params.thinking_end:
            logits = logits.clone()  # each sequence masks its own row (grammar, forced end)
        self._sample_rows(logits, rows)

    def _claim_decode_slot(self, home: int, length: int) -> tuple[int, bool]:
        """Slot len(decoding), for a sequence of the prompt whose `length` cached positions are
        in slot `home`. A prompt still prefilling that sits there moves to a free slot or, when
        every slot is held, trades places with this prompt: then True (the cache is in the
        returned slot)."""
        slot = len(self.decoding)
        owner = self._owner[slot]
        if owner is None or slot == home:
            return slot, False
        traded = None not in self._owner
        if traded:
            free = home
            self.runner.swap(slot, home, owner.cached, length)
        else:
            free = self._free_slot()
            self.runner.move(slot, free, owner.cached)
        owner.slot = free
        self._owner[free] = owner
        self._owner[slot] = None
        return slot, traded

    # -- decode ---------------------------------------------------------------------------------

    def _decode(self, touched: dict[str, RequestState], count: int) -> None:
        """Decode the sequences in slots 0..count-1 (with their proposals, where speculating)."""
        rows = self.decoding[:count]
        if self.speculator is not None and self._speculate(rows, touched):
            return
        tokens = [seq.token_ids[-1] for seq in rows]
        lengths = [seq.cached for seq in rows]
        try:
            logits = self.runner.decode(tokens, lengths)
        except Exception:
            log.exception("decode pass over %d rows failed; retrying row by row", len(rows))
            logits = self._decode_rows_alone(rows, tokens, lengths, touched)
        for seq in rows:
            seq.cached += 1
        live = [i for i, seq in enumerate(rows) if not seq.finished]
        if len(live) < len(rows):
            logits, rows = logits[live], [rows[i] for i in live]
        self._sample_rows(logits, rows)
        for seq in rows:
            touched[self._state_of(seq).request_id] = self._state_of(seq)

    def _speculate(self, rows: list[Sequence], touched: dict[str, RequestState]) -> bool:
        """One pass over every row's last token and its proposals, if any row has some
        (speculation.py); False when none has: the plain decode pass runs."""
        # Every position the pass writes (rows pad to the longest) stays within the context.
        room = self.max_model_len - 1 - max(seq.cached for seq in rows)
        limits = [min(room, seq.params.max_new_tokens - seq.generated - 1,
                      self.max_model_len - len(seq.token_ids) - 1) for seq in rows]
        proposals = self.speculator.propose(rows, limits)
        if not any(proposals):
            return False
        chains = [[seq.token_ids[-1], *proposal] for seq, proposal in zip(rows, proposals,
                                                                          strict=True)]
        try:
            logits = self.runner.verify(chains, [seq.cached for seq in rows])
        except Exception:
            log.exception("verifying proposals over %d rows failed; decoding without", len(rows))
            return False
        accepted = [0] * len(rows)
        live, position = list(range(len(rows))), 0
        while live:  # rows whose tokens so far were all accepted, sampled at `position`
            for i in live:
                rows[i].cached += 1  # its token at `position` is in the cache, accepted
            self._sample_rows(torch.stack([logits[i][position] for i in live]),
                              [rows[i] for i in live])
            live = [i for i in live if not rows[i].finished and position + 1 < len(chains[i])
                    and rows[i].token_ids[-1] == chains[i][position + 1]]
            for i in live:
                accepted[i] += 1
            position += 1
        for seq, proposal, count in zip(rows, proposals, accepted, strict=True):
            self.runner.truncate(seq.slot, seq.cached)
            self.speculator.verified(seq, len(proposal), count)
            touched[self._state_of(seq).request_id] = self._state_of(seq)
        return True

    def _decode_rows_alone(self, rows, tokens, lengths, touched) -> torch.Tensor:
        """Isolate a failing row: the rows that fail alone finish with an error; others go on."""
        out = torch.zeros((len(rows), self.runner.vocab_size), device=self.runner.device)
        for i, seq in enumerate(rows):
            try:
                out[i] = self.runner.decode([tokens[i]], [lengths[i]], first_slot=i)[0]
            except Exception as exc:
                self._fail(self._state_of(seq), exc, touched)
        return out

    def _sample_rows(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        if not rows:
            return
        try:
            opening = _thinking_openings(logits, rows)
            mask_logits(logits, [seq.constraint for seq in rows])
            _force_thinking_end(logits, rows, opening)
            result = sampling.sample(logits, [seq.sampler for seq in rows])
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
            for i, seq in enumerate(rows):
                try:
                    row = logits[i : i + 1]
                    opening = _thinking_openings(row, [seq])
                    mask_logits(row, [seq.constraint])  # masking is idempotent
                    _force_thinking_end(row, [seq], opening)
                    one = sampling.sample(logits[i : i + 1], [seq.sampler])
                    self._append(seq, one.token_ids[0], one.logprobs[0], one.top[0])
                except Exception as exc:
                    seq.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
            return
        for i, seq in enumerate(rows):
            try:
                self._append(seq, result.token_ids[i], result.logprobs[i], result.top[i])
            except Exception as exc:
                log.exception("sequence failed while appending a token")
                seq.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _append(self, seq: Sequence, token_id: int, logprob: float,
                top: list[tuple[int, float]]) -> None:
        """Record a sampled token, release its text, and decide whether the sequence stops."""
        thinking = seq.thinking
        opens = thinking is not None and thinking.undecided and token_id == thinking.open_id
        grammar = None if opens else seq.constraint
        if grammar is not None and not grammar.accept(token_id):
            self._grammar_rejected(seq, token_id)
            return
        params = seq.params
        seq.token_ids.append(token_id)
        seq.generated += 1
        self.counters["generated_tokens"] += 1
        seq.cumulative_logprob += logprob
        seq.sampler.append(token_id)
        text = seq.detokenizer.add(token_id)
        seq.pending.append(make_token(self.tokenizer, token_id, text, logprob, top,
                                      self.special_ids))
        if seq.thinking is not None:  # the token's own text: the released text may lag
            seq.thinking.add(token_id, token_text(self.tokenizer, token_id))
        if token_id in self.eos_token_ids and not params.ignore_eos:
            seq.finish(FinishReason.EOS)
        elif token_id in params.stop_token_ids or seq.detokenizer.stopped:
            seq.finish(FinishReason.STOP)
        elif grammar is not None and grammar.is_over():  # as if it took the forced EOS
            seq.finish(FinishReason.EOS)
        elif seq.generated >= params.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish(FinishReason.LENGTH)

    @staticmethod
    def _grammar_rejected(seq: Sequence, token_id: int) -> None:
        """The sampled token is not the grammar's: the sampler's own masks (min_new_tokens
        holding back stop tokens) left none of the tokens it allows. A whole output ends there,
        without the token; a partial one fails."""
        if seq.grammar.is_completed():
            seq.finish(FinishReason.STOP)
        else:
            seq.finish(FinishReason.REFUSED, "no token fits the structured output here (its "
                       "grammar, less what min_new_tokens and stop tokens hold back, allows "
                       "none): it cannot go on")

    # -- finishing ------------------------------------------------------------------------------

    def _state_of(self, seq: Sequence) -> RequestState:
        return self.states[seq.request_id]

    def _fail(self, state: RequestState, exc: Exception, touched: dict[str, RequestState]) -> None:
        for seq in state.sequences:
            seq.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        touched[state.request_id] = state

    def _pin_session(self, seq: Sequence) -> None:
        """A session's answer ended: pin its conversation so far (every token whose keys and
        values the slot holds) for the session's next turn."""
        state = self._state_of(seq)
        request = state.request
        if self.prefix is not None and request.session is not None and seq.index == 0 and \
                seq.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
            prompt = len(state.prompt_ids)  # its media tokens keyed by their content
            tokens = [*state.cache_ids, *seq.token_ids[prompt : seq.cached]]
            self.prefix.pin(request.session, tokens[: seq.cached], seq.slot, request.adapter)

    def _release_finished(self) -> None:
        """Free the slots of finished sequences, keeping running ones in slots 0..B-1."""
        for seq in sorted((s for s in self.decoding if s.finished), key=lambda s: -s.slot):
            self._pin_session(seq)
            last = self.decoding.pop()
            freed = last.slot
            if last is not seq:
                self.runner.move(last.slot, seq.slot, last.cached)
                last.slot = seq.slot
                self.decoding[seq.slot] = last
                self._owner[seq.slot] = last
            self._free(freed)
        for state in [s for s in self.prefilling if s.finished]:
            self.prefilling.remove(state)
            self._free(state.sequences[0].slot)
        for request_id in [r for r, s in self.states.items() if s.finished]:
            del self.states[request_id]
            self.counters["finished_requests"] += 1
            self.admission.release(request_id)


def _group(request: GenerationRequest) -> str:
    return request.group or request.request_id


def _thinking_openings(logits: torch.Tensor, rows: list[Sequence]
                       ) -> list[tuple[int, int, torch.Tensor]]:
    """(row, token, logit) of the thinking's opening for rows whose first token decides
    whether they think: it stays allowed beside the grammar's tokens."""
    openings = []
    for i, seq in enumerate(rows):
        thinking = seq.thinking
        if thinking is not None and thinking.undecided and thinking.open_id >= 0:
            openings.append((i, thinking.open_id, logits[i, thinking.open_id].clone()))
    return openings


def _force_thinking_end(logits: torch.Tensor, rows: list[Sequence],
                        openings: list[tuple[int, int, torch.Tensor]]) -> None:
    """After the grammar's mask: the thinking's opening allowed again where it may come
    (`openings`), and rows whose thinking budget is spent left only the next token of the
    thinking's end."""
    for i, token, logit in openings:
        logits[i, token] = logit
    for i, seq in enumerate(rows):
        forced = seq.thinking.forced if seq.thinking is not None else None
        if forced is not None:
            keep = logits[i, forced].clone()
            logits[i] = -torch.inf
            logits[i, forced] = keep
