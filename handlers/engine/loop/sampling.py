"""Batched per-request logits processing and sampling.

Each row of a decode step's logits belongs to a different sequence with its own `SamplingParams`;
`sample` processes and samples all rows at once, vectorized across rows. The order is vLLM's, with
Hugging Face's typical_p (which vLLM lacks) last, where Hugging Face applies it:

1. every row: min_new_tokens masking, logit_bias, repetition / frequency / presence penalties,
   the watermark's green-list bias (watermark.py);
2. greedy rows (`do_sample=False`, or a temperature below 1e-5 as in vLLM): argmax
   (row_reductions.py);
3. sampled rows: temperature, min_p, top_k, top_p, typical_p, then one draw per row.

Reported log-probabilities are the log-softmax of the model's raw logits (each a logit less
its row's log-sum-exp, row_reductions.py), before any of the processing above (vLLM's default
"raw_logprobs"): they do not depend on a request's temperature, penalties or filters. A
structured-output grammar's mask is applied before `sample` (as in vLLM), so they are those of
the masked distribution: tokens the grammar forbids have probability 0 and are never listed as
alternatives.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from handlers.engine.loop import watermark
from handlers.engine.loop.row_reductions import row_argmax, row_logsumexp
from handlers.engine.types import SamplingParams

_SAMPLING_EPS = 1e-5  # a lower temperature means greedy, as in vLLM
_WINDOW = 256  # top-k / top-p look first among this many most likely tokens (see _nucleus)
_PROMPT_CHUNK = 256  # prompt positions log-softmaxed at once, to bound memory on long prompts


class SequenceSampler:
    """One sequence's sampling state: its settings, seeded generator and generated-token counts.

    Create it when the sequence starts; call `append` with every token it generates. Its
    parameters were checked before admission (engine/limits.py): none breaks a batch step.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: set[int],
        vocab_size: int,
        device: torch.device,
        seed_offset: int = 0,
    ) -> None:
        self.params = params
        self.generated = 0
        self.last_token = prompt_token_ids[-1] if prompt_token_ids else 0  # for the watermark
        self.sampled = params.do_sample and params.temperature >= _SAMPLING_EPS
        self.generator: torch.Generator | None = None
        if self.sampled and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed((params.seed + seed_offset) % 2**64)
        stops = {*eos_token_ids, *params.stop_token_ids}
        self._stop_ids = _ids([t for t in sorted(stops) if 0 <= t < vocab_size], device)
        self._bias_ids = _ids(list(params.logit_bias), device)
        self._bias = torch.tensor(list(params.logit_bias.values()), device=device)
        self._seen: _Occurrences | None = None  # prompt and output tokens: repetition penalty
        self._output: _Occurrences | None = None  # output tokens: frequency / presence penalties
        if params.repetition_penalty != 1.0:
            self._seen = _Occurrences(prompt_token_ids, device)
        if params.frequency_penalty or params.presence_penalty:
            self._output = _Occurrences([], device)

    def append(self, token_id: int) -> None:
        """Record a generated token (for the penalties, min_new_tokens and the watermark)."""
        self.generated += 1
        self.last_token = token_id
        for occurrences in (self._seen, self._output):
            if occurrences is not None:
                occurrences.add(token_id)


class _Occurrences:
    """The distinct tokens of a sequence and how often each occurred, kept as small tensors that
    grow with the sequence: the penalties then touch only these tokens, not the vocabulary."""

    def __init__(self, token_ids: list[int], device: torch.device) -> None:
        counts = Counter(token_ids)
        self._position = {token: i for i, token in enumerate(counts)}
        self.ids = _ids(list(counts), device)
        self.counts = torch.tensor(list(counts.values()), dtype=torch.float32, device=device)

    def add(self, token_id: int) -> None:
        position = self._position.setdefault(token_id, len(self._position))
        if position == len(self.ids):
            self.ids = torch.cat((self.ids, _ids([token_id], self.ids.device)))
            self.counts = torch.cat((self.counts, self.counts.new_ones(1)))
        else:
            self.counts[position] += 1


@dataclass
class SampleResult:
    """What `sample` chose for each row of the batch, in row order."""

    token_ids: list[int]  # chosen token per row
    logprobs: list[float]  # raw log-prob of the chosen token per row
    top: list[list[tuple[int, float]]]  # per row, its top `top_logprobs` (id, raw log-prob)


def sample(logits: torch.Tensor, samplers: list[SequenceSampler]) -> SampleResult:
    """Choose every row's next token with its own sequence's settings.

    `logits` is [B, V] (row i for `samplers[i]`; processed in float32) and is not modified. The
    log-probs in the result are those of these raw logits (log-softmax before any processing), as
    vLLM reports them by default; `top` lists each row's most likely raw alternatives, best first.
    """
    logits = logits.float()
    processed = _process(logits, samplers)
    rows = [i for i, s in enumerate(samplers) if s.sampled]
    if len(rows) == len(samplers):
        tokens = _draw(processed, samplers)
    else:
        tokens = row_argmax(processed)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = _draw(processed[index], [samplers[i] for i in rows])
    return _result(tokens, logits, samplers)


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int]) -> list[float | None]:
    """Log-prob of each prompt token given its prefix; None for the first token.

    `logits` are the prefill's [L, V] scores, row i predicting prompt token i + 1.
    """
    targets = _ids(prompt_token_ids[1:], logits.device).unsqueeze(1)
    values: list[float] = []
    for start in range(0, len(targets), _PROMPT_CHUNK):
        chunk = logits[start : start + _PROMPT_CHUNK].float().log_softmax(-1)
        values += chunk.gather(1, targets[start : start + _PROMPT_CHUNK]).squeeze(1).tolist()
    return [None, *values] if prompt_token_ids else []


def _ids(token_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long, device=device)


def _process(logits: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """Apply min_new_tokens, logit_bias, the penalties and the watermark; a copy, or `logits`
    when none apply."""
    early = [i for i, s in enumerate(samplers) if s.generated < s.params.min_new_tokens]
    stops = [(i, samplers[i]._stop_ids) for i in early]
    biased = [(i, s._bias_ids) for i, s in enumerate(samplers) if s.params.logit_bias]
    repeat = [i for i, s in enumerate(samplers) if s._seen is not None]
    counted = [i for i, s in enumerate(samplers) if s._output is not None]
    marked = [(i, s.last_token) for i, s in enumerate(samplers) if s.params.watermark]
    if not (stops or biased or repeat or counted or marked):
        return logits
    logits = logits.clone()
    if stops:
        logits[_coordinates(stops)] = -math.inf
    if biased:
        bias = torch.cat([samplers[i]._bias for i, _ in biased])
        logits.index_put_(_coordinates(biased), bias, accumulate=True)
    if repeat:
        _repetition_penalty(logits, repeat, samplers)
    if counted:
        _frequency_presence_penalty(logits, counted, samplers)
    if marked:
        watermark.mark(logits, marked)
    return logits


def _coordinates(entries: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors addressing the given token ids of the given rows."""
    rows = torch.cat([torch.full_like(ids, i) for i, ids in entries])
    return rows, torch.cat([ids for _, ids in entries])


def _repetition_penalty(
    logits: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]
) -> None:
    """HF / CTRL: a seen token's logit is divided by the penalty if positive, else multiplied."""
    entries = [(i, samplers[i]._seen.ids) for i in rows]
    penalty = _spread([samplers[i].params.repetition_penalty for i in rows], entries)
    index = _coordinates(entries)
    scores = logits[index]
    logits[index] = torch.where(scores > 0, scores / penalty, scores * penalty)


def _frequency_presence_penalty(
    logits: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]
) -> None:
    """OpenAI / vLLM: logit -= frequency * count + presence, on generated tokens only."""
    entries = [(i, samplers[i]._output.ids) for i in rows]
    counts = torch.cat([samplers[i]._output.counts for i in rows])
    frequency = _spread([samplers[i].params.frequency_penalty for i in rows], entries)
    presence = _spread([samplers[i].params.presence_penalty for i in rows], entries)
    logits.index_put_(_coordinates(entries), -(frequency * counts + presence), accumulate=True)


def _spread(values: list[float], entries: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Each row's value repeated once per token id of its entry (to line up with _coordinates)."""
    pairs = zip(values, entries, strict=True)
    return torch.cat([torch.full(ids.shape, v, device=ids.device) for v, (_, ids) in pairs])


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _draw(logits: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """Sample one token per row of processed logits with the row's own filters and generator."""
    temperature = [s.params.temperature for s in samplers]
    if any(t != 1.0 for t in temperature):
        logits = logits / _column(temperature, logits.device)
    probs = logits.softmax(-1)
    probs = _min_p(probs, samplers)
    probs = _top_k_top_p(probs, samplers)
    probs = _typical_p(probs, samplers)
    return _inverse_cdf(probs, _uniforms(samplers, logits.device))


def _min_p(probs: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """vLLM's min_p: drop tokens less likely than min_p times the row's most likely one."""
    min_p = [s.params.min_p for s in samplers]
    if not any(min_p):
        return probs
    threshold = probs.amax(-1, keepdim=True) * _column(min_p, probs.device)
    return probs.masked_fill_(probs < threshold, 0.0)


def _top_k_top_p(probs: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """Zero (in place), in the rows that ask, the tokens outside top_k, then outside top_p."""
    vocab = probs.shape[-1]
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in samplers]
    rows = [i for i, s in enumerate(samplers) if top_k[i] < vocab or s.params.top_p < 1]
    if not rows:
        return probs
    k = _ids([top_k[i] for i in rows], probs.device).unsqueeze(1)
    top_p = [samplers[i].params.top_p for i in rows]
    p = _column([v if v < 1 else math.inf for v in top_p], probs.device)
    floor = _WINDOW if any(v < 1 for v in top_p) else 1  # top_k alone needs only k tokens
    window = min(vocab, max([floor, *(top_k[i] for i in rows if top_k[i] < vocab)]))
    if len(rows) == len(samplers):
        return _nucleus(probs, k, p, window)
    index = torch.tensor(rows, device=probs.device)
    probs[index] = _nucleus(probs[index], k, p, window)
    return probs


def _nucleus(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor, window: int) -> torch.Tensor:
    """HF / vLLM top-k (ties with the k-th kept) then top-p (keep the most likely tokens until
    they hold p of the remaining mass, the one crossing p included) on unnormalized `probs`,
    in place.

    Only the `window` most likely tokens are ranked (a topk, far cheaper than sorting the
    vocabulary on CPU); rows whose nucleus may reach past the window are redone with a wider one.
    `k` is [R, 1] (the vocabulary size when off, else at most `window`), `p` [R, 1] (inf when off).
    """
    vocab = probs.shape[-1]
    values, ids = probs.topk(window)
    kth = values.gather(1, (k - 1).clamp(max=window - 1))
    values = values.masked_fill((values < kth) & (k <= window), 0.0)
    cumulative = values.cumsum(-1)
    mass = torch.where(k <= window, cumulative[:, -1:], probs.sum(-1, keepdim=True))
    limit = p * mass
    short = ((k > window) & (cumulative[:, -1:] < limit)).squeeze(1)
    redo = short.nonzero().squeeze(1)
    wider = None
    if window < vocab and len(redo):
        wider = _nucleus(probs[redo], k[redo], p[redo], min(vocab, window * 8))
    values.masked_fill_(cumulative - values >= limit, 0.0)
    probs.zero_().scatter_(1, ids, values)
    if wider is not None:
        probs[redo] = wider
    return probs


def _typical_p(probs: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
    """Hugging Face's typical_p (its own warper), one call per distinct mass in the batch."""
    from transformers import TypicalLogitsWarper  # ~1 s to import: only when asked for

    for mass in {s.params.typical_p for s in samplers if s.params.typical_p < 1}:
        rows = [i for i, s in enumerate(samplers) if s.params.typical_p == mass]
        index = torch.tensor(rows, device=probs.device)
        scores = TypicalLogitsWarper(mass)(None, probs[index].log())
        probs[index] = probs[index].masked_fill(scores.isneginf(), 0.0)
    return probs


def _uniforms(samplers: list[SequenceSampler], device: torch.device) -> torch.Tensor:
    """One uniform per row; a seeded row's comes from its own generator, so that its tokens do
    not depend on what else is in the batch or where its row sits."""
    u = torch.rand(len(samplers), 1, dtype=torch.float64, device=device)
    for i, s in enumerate(samplers):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator, dtype=torch.float64, device=device)
    return u


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative (unnormalized) distribution first exceeds u * mass.

    One uniform per row instead of a vocabulary of exponential noise (~30x cheaper on CPU); float64
    keeps the share of unlikely tokens exact. Zero-probability tokens can never be picked.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return picks.clamp_(max=probs.shape[-1] - 1)


def _result(
    tokens: torch.Tensor, logits: torch.Tensor, samplers: list[SequenceSampler]
) -> SampleResult:
    """The chosen tokens with their raw log-probs (each a logit less its row's log-sum-exp:
    the log-softmax of the few tokens reported, not of all)."""
    normalizer = row_logsumexp(logits)
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - normalizer
    wanted = [min(s.params.top_logprobs, logits.shape[-1]) for s in samplers]
    top: list[list[tuple[int, float]]] = [[] for _ in samplers]
    if max(wanted, default=0):
        values, ids = logits.topk(max(wanted))
        values, ids = (values - normalizer.unsqueeze(1)).tolist(), ids.tolist()
        top = [[(t, v) for t, v in zip(ids[i][:n], values[i][:n], strict=True) if v > -math.inf]
               for i, n in enumerate(wanted)]
    return SampleResult(tokens.tolist(), chosen.tolist(), top)
