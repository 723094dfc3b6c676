"""vLLM's RequestOutputs (DELTA kind: each carries what is new) -> the engine's RequestOutputs,
so every formatter and protocol reads the vLLM engine as it reads the torch engine.

vLLM hands over a sequence's new text per output, and an output may carry several tokens (the
engine ran ahead of the event loop). Each token gets the text it releases from our incremental
detokenizer, kept a prefix of vLLM's text; the last token of an output takes whatever of vLLM's
text is left, so a sequence's token texts always add up to vLLM's text. A finish becomes LMI's
reason (vLLM's "stop" is a stop string or stop token when `stop_reason` says which, else the
end-of-sequence token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from handlers.engine.detokenize import IncrementalDetokenizer, token_text
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SequenceOutput,
    Token,
    TopToken,
)
from handlers.engine.vllm.sampling import greedy_copies

_FINISH = {"length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "error": FinishReason.ERROR}


class OutputMapper:
    """Maps one request's vLLM outputs, keeping its running counts."""

    def __init__(self, request: GenerationRequest, tokenizer: Any,
                 special_ids: frozenset[int]) -> None:
        self.request = request
        self.tokenizer = tokenizer  # the Hugging Face tokenizer
        self.special_ids = special_ids
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._generated: dict[int, int] = {}
        self._texts: dict[int, _SequenceText] = {}
        self.copies = greedy_copies(request.params)  # indices each vLLM sequence stands for

    def map(self, out: Any, batch_size: int) -> RequestOutput:
        """Ours for `out` (a vllm.RequestOutput); `batch_size`: requests in vLLM's batch."""
        now = time.monotonic()
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_scheduled_time = metrics.first_token_time = now
        metrics.batch_size = batch_size
        if out.finished:
            metrics.finished_time = now
        first = self._generated == {}
        sequences = [copy for seq in out.outputs
                     for copy in _copies(self._sequence(seq), self.copies)]
        prompt = self._prompt_logprobs(out) if first else None
        return RequestOutput(request_id=self.request.request_id, outputs=sequences,
                             prompt_token_count=len(out.prompt_token_ids
                                                    or self.request.prompt_token_ids or ()),
                             metrics=metrics, finished=out.finished, prompt_logprobs=prompt)

    def _sequence(self, seq: Any) -> SequenceOutput:
        ids = list(seq.token_ids)
        tokens = [self._token(token_id, seq.logprobs[i] if seq.logprobs else None)
                  for i, token_id in enumerate(ids)]
        if seq.index not in self._texts:
            self._texts[seq.index] = _SequenceText(self._detokenizer())
        for token, text in zip(tokens, self._texts[seq.index].split(ids, seq.text), strict=True):
            token.text = text
        count = self._generated[seq.index] = self._generated.get(seq.index, 0) + len(ids)
        return SequenceOutput(index=seq.index, tokens=tokens,
                              finish_reason=finish_reason(seq.finish_reason, seq.stop_reason),
                              error="vLLM failed the request" if seq.finish_reason == "error"
                              else None,
                              cumulative_logprob=seq.cumulative_logprob or 0.0,
                              generated_tokens=count)

    def _token(self, token_id: int, logprobs: Mapping[int, Any] | None) -> Token:
        entry = logprobs.get(token_id) if logprobs else None
        return Token(id=token_id, text="", logprob=entry.logprob if entry else None,
                     special=token_id in self.special_ids, top=top_tokens(logprobs or {},
                     self.request.params.top_logprobs))

    def _prompt_logprobs(self, out: Any) -> list[Token] | None:
        if not self.request.params.prompt_logprobs or out.prompt_logprobs is None:
            return None
        tokens = []
        for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
            own = entry.get(token_id) if entry else None  # none for the first token
            tokens.append(Token(id=token_id, text=token_text(self.tokenizer, token_id),
                                logprob=own.logprob if own else None,
                                special=token_id in self.special_ids))
        return tokens


    def _detokenizer(self) -> IncrementalDetokenizer:
        params = self.request.params
        return IncrementalDetokenizer(
            self.tokenizer, self.request.prompt_token_ids or (),
            skip_special_tokens=params.skip_special_tokens, stop_sequences=params.stop_sequences,
            include_stop_str_in_output=params.include_stop_str_in_output)


def _copies(sequence: SequenceOutput, count: int) -> list[SequenceOutput]:
    """`sequence` (index 0) as indices 0..count-1, each with tokens of its own."""
    if count == 1:
        return [sequence]
    return [dataclasses.replace(sequence, index=i, tokens=[dataclasses.replace(t)
                                                           for t in sequence.tokens])
            for i in range(count)]


class _SequenceText:
    """Splits one sequence's text deltas over its tokens."""

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.vllm = ""  # vLLM's text so far
        self.given = 0  # how much of it the tokens have released

    def split(self, ids: list[int], delta: str) -> list[str]:
        self.vllm += delta
        texts = []
        for token_id in ids:
            piece = self.detokenizer.add(token_id)
            if not self.vllm.startswith(piece, self.given):
                piece = ""  # ours differs (a stop string's cut): vLLM's text decides
            self.given += len(piece)
            texts.append(piece)
        if texts:
            texts[-1] += self.vllm[self.given:]
            self.given = len(self.vllm)
        return texts


def finish_reason(reason: str | None, stop_reason: int | str | None) -> FinishReason | None:
    if reason is None:
        return None
    if reason == "stop":
        return FinishReason.EOS if stop_reason is None else FinishReason.STOP
    return _FINISH.get(reason, FinishReason.ERROR)


def top_tokens(logprobs: Mapping[int, Any], k: int) -> list[TopToken]:
    """The k most likely tokens (vLLM adds the sampled one to them, ranked wherever it was)."""
    ranked = sorted(((entry.rank, token_id, entry) for token_id, entry in logprobs.items()
                     if entry.rank is not None and entry.rank <= k))
    return [TopToken(id=token_id, text=entry.decoded_token or "", logprob=entry.logprob)
            for _rank, token_id, entry in ranked]
