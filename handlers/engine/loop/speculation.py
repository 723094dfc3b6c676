"""Speculative decoding by n-gram lookup (prompt lookup decoding) for the continuous batcher.

Each decoding row looks for the latest earlier occurrence of its last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) among its own tokens, prompt and generated, and
proposes the up to k tokens that followed it. The batcher then runs one pass over every row's
last token and proposals (`Runner.verify`) and samples the positions in order, each with the
row's state after the tokens before it (penalties, grammar, stop strings, max_new_tokens): a
proposal is accepted while the sampled token equals it, and the first token that differs (or
the one after the last proposal) is the model's own. For greedy rows that is the longest
prefix where the model's argmax equals the proposal; for sampled rows it is the standard
rejection rule for a draft that proposes one token with certainty (accepted with the model's
probability of it, else a token drawn from the model's distribution without it): either way
the text is the one decoding without speculation gives. The cache keeps the keys of accepted
positions only (`Runner.truncate`).

A row whose proposals keep being rejected waits before proposing again, twice as long after
each miss, so text that does not repeat itself costs few extra positions.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from handlers.config import ConfigError

_TOKEN_BYTES = array("i").itemsize
_MAX_WAIT = 64  # steps a row that keeps missing waits at most before proposing again


@dataclass(frozen=True)
class NgramSettings:
    """option.speculative_config's n-gram proposals, as the torch engine runs them."""

    num_tokens: int  # k: proposed per row and step, at most
    lookup_min: int  # the shortest suffix matched
    lookup_max: int  # the longest suffix matched (tried first)

    KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min",
                      "prompt_lookup_max"})

    @staticmethod
    def of(spec: dict[str, Any] | None, source: str) -> NgramSettings | None:
        """The settings of an option.speculative_config the parser accepted (None: off);
        ConfigError for what this engine cannot run."""
        if spec is None:
            return None
        where = f"option.speculative_config ({source})"
        if "model" in spec:
            raise ConfigError(f"{where}: a draft model ({spec['model']!r}) is not supported by "
                              'the torch engine, which proposes by n-gram lookup: use '
                              '{"method": "ngram", "num_speculative_tokens": 4} (or the vllm '
                              "engine for a draft model)")
        if spec["method"] != "ngram":
            raise ConfigError(f"{where}: method {spec['method']!r} is not supported by the torch "
                              "engine, which runs method ngram (the vllm engine runs vLLM's)")
        if "num_speculative_tokens" not in spec:
            raise ConfigError(f"{where}: method ngram needs num_speculative_tokens")
        if other := sorted(set(spec) - NgramSettings.KEYS):
            raise ConfigError(f"{where}: {', '.join(other)} not supported by the torch engine, "
                              f"which takes {', '.join(sorted(NgramSettings.KEYS))}")
        low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        low = low or min(2, high or 2)
        return NgramSettings(spec["num_speculative_tokens"], low, high or max(low, 3))


def ngram_proposal(tokens: list[int], settings: NgramSettings, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of `tokens`' last n
    tokens (the longest n that occurs first); [] when none does."""
    if limit <= 0 or len(tokens) <= settings.lookup_min:
        return []
    packed = array("i", tokens).tobytes()
    end = (len(tokens) - 1) * _TOKEN_BYTES  # an occurrence must end before the last token
    for n in range(min(settings.lookup_max, len(tokens) - 1), settings.lookup_min - 1, -1):
        suffix = packed[-n * _TOKEN_BYTES:]
        at = packed.rfind(suffix, 0, end)
        while at > 0 and at % _TOKEN_BYTES:  # a match across token boundaries: look earlier
            at = packed.rfind(suffix, 0, at + len(suffix) - 1)
        if at >= 0:
            return _continuation(tokens, at // _TOKEN_BYTES + n, min(limit, settings.num_tokens))
    return []


def _continuation(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens from `start` on, of `tokens` extended by these very tokens: a match
    close to the end (a repeating run) goes on repeating instead of stopping at the end."""
    out = tokens[start : start + count]
    while len(out) < count:
        out.append(out[len(out) - (len(tokens) - start)])
    return out


@dataclass
class _RowState:
    misses: int = 0  # proposals in a row with none accepted
    wait: int = 0  # steps left before this row proposes again


@dataclass
class Speculator:
    """Proposals per row with back-off, and vLLM's counters (`counters`, the batcher's)."""

    settings: NgramSettings
    counters: dict[str, int]
    _rows: dict[tuple[str, int], _RowState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            self.counters.setdefault(f"spec_decode_{name}", 0)
        for position in range(self.settings.num_tokens):
            self.counters.setdefault(f"spec_decode_accepted_at_{position}", 0)

    def propose(self, rows: list[Any], limits: list[int]) -> list[list[int]]:
        """Per row (a batcher Sequence), its proposal of at most `limits[i]` tokens."""
        self._rows = {key: self._rows.get(key, _RowState())
                      for key in ((seq.request_id, seq.index) for seq in rows)}
        proposals = []
        for seq, limit in zip(rows, limits, strict=True):
            state = self._rows[seq.request_id, seq.index]
            if state.wait > 0:
                state.wait -= 1
                proposals.append([])
                continue
            proposals.append(ngram_proposal(seq.token_ids, self.settings, limit))
        return proposals

    def verified(self, seq: Any, proposed: int, accepted: int) -> None:
        """`seq`'s proposal of `proposed` tokens had its first `accepted` accepted."""
        if not proposed:
            return
        counters = self.counters
        counters["spec_decode_num_drafts"] += 1
        counters["spec_decode_num_draft_tokens"] += proposed
        counters["spec_decode_num_accepted_tokens"] += accepted
        for position in range(accepted):
            counters[f"spec_decode_accepted_at_{position}"] += 1
        state = self._rows.get((seq.request_id, seq.index))
        if state is None:
            return
        state.misses = 0 if accepted else state.misses + 1
        state.wait = min(2 ** state.misses - 1, _MAX_WAIT) if state.misses else 0
