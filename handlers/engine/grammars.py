"""Constrained decoding (structured output) with xgrammar, for every engine: the shared batcher
(loop/) masks and advances grammars itself; vLLM, which constrains its own sampling, compiles
here only to validate a request.

`Grammars` (one per engine, so per tokenizer) compiles a request's `StructuredOutput` when the
engine validates it: a bad schema is a clean `RequestValidationError` before admission, and
xgrammar's compiler cache (keyed by the grammar text and options) turns the batcher's second
`compile` into a lookup. Each generated sequence gets its own `SequenceGrammar`; before sampling,
`mask_logits` sets the tokens a row's grammar forbids next to -inf, and the batcher feeds the
sampled token back with `accept`. The grammar allows the model's EOS only once it is complete, so
a constrained sequence ends exactly there; once nothing but EOS may follow (a JSON answer's closing
brace), `is_over` says so and the batcher ends the sequence without spending a step on the EOS.
The answer is then whole even when it filled `max_new_tokens` exactly.

A JSON schema is first rewritten into what xgrammar enforces, or refused naming what it cannot
enforce (schema_enforcement.py), so an answer under a schema always validates.

JSON is compiled without free whitespace (`any_whitespace=False`: ", " and ": " separators, no
newlines): small models otherwise tend to loop in whitespace until max_new_tokens. Compact JSON
then never holds a raw control character, and tokens with one are refused outright: xgrammar
0.2.8 lets strings with a maxLength take them (mlc-ai/xgrammar#800), which strict parsers reject.
xgrammar is imported on the first structured request, so other requests never pay for it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from handlers.engine import grammar_language
from handlers.engine.plain_tokenizer import PlainTokenizer
from handlers.engine.schema_enforcement import enforced_text
from handlers.engine.types import RequestValidationError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

_CACHE_BYTES = 128 << 20  # compiled grammars kept for reuse (a typical schema: ~0.5 MB)
# The longest spec compiled: compiling takes time and memory in proportion (a 20,000-value enum,
# ~200 KB, takes 2.4 s on a 2-core Xeon), in a worker, and only one request asked for it.
MAX_SPEC_CHARS = 256 << 10
_ANY_OBJECT = '{"type": "object"}'
_CONTROL = re.compile(rb"[\x00-\x1f]")
# the C++ prefixes of xgrammar's errors: "[time] file.cc:123: " and "Check failed: (...) is false: "
_NOISE = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")

_COMPILE: dict[str, Callable[[xgr.GrammarCompiler, str], xgr.CompiledGrammar]] = {
    "json_object": lambda c, _: c.compile_json_schema(_ANY_OBJECT, any_whitespace=False),
    "json_schema": lambda c, text: c.compile_json_schema(text, any_whitespace=False),
    "regex": lambda c, text: c.compile_regex(text),
    "grammar": lambda c, text: c.compile_grammar(text),
}
_JSON_KINDS = ("json_object", "json_schema")


class SequenceGrammar:
    """One sequence's progress through its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, banned: torch.Tensor | None,
                 vocab_size: int, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.banned = banned  # token ids masked whatever the grammar allows
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def is_completed(self) -> bool:
        """The text so far is a whole match (only EOS, or a longer match, may follow)."""
        return self.matcher.is_completed()

    def is_over(self) -> bool:
        """The output is whole: the grammar took its EOS, or allows nothing else next."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():  # the usual case: no mask to compute
            return False
        allowed = torch.zeros(1, self._vocab_size)
        mask_logits(allowed, [self])
        allowed[0, self._stop_token_ids] = -torch.inf
        return not bool(allowed.isfinite().any())


class Grammars:
    """Compiles structured-output specs for one tokenizer and starts per-sequence grammars.

    Safe to call from several threads (the server validates, the engine thread starts sequences).
    `vocab_size` is the model's logits width, which may differ from the tokenizer's length (padded
    embeddings, or tokens the model lacks): masks are sized to the logits.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._control_ids: torch.Tensor | None = None  # tokens holding a raw control character
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`, checked to admit some output (what validation
        asks); raises RequestValidationError(spec.param, ...)."""
        compiled = self._build(spec)
        if grammar_language.is_empty(str(compiled.grammar)):
            raise RequestValidationError(
                spec.param, f"the {spec.kind} admits no output: no finite text matches it (a "
                "schema whose objects must hold themselves, say)")
        if not _can_start(compiled, self._vocab_size):
            raise RequestValidationError(
                spec.param, f"the {spec.kind} admits no output: no token of the vocabulary "
                "starts a match")
        return compiled

    def start(self, spec: StructuredOutput) -> SequenceGrammar:
        """A sequence's grammar, at its start (its spec was `compile`d at validation: this is
        a cache lookup, without those checks again on the engine's thread)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self._build(spec))
        banned = self._control_ids if spec.kind in _JSON_KINDS else None
        return SequenceGrammar(matcher, banned, self._vocab_size, self._stop_token_ids)

    def _build(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        build = _COMPILE.get(spec.kind)
        if len(spec.spec or "") > MAX_SPEC_CHARS:
            raise RequestValidationError(
                spec.param, f"the {spec.kind} is {len(spec.spec)} characters; at most "
                f"{MAX_SPEC_CHARS} are compiled")
        if build is None:
            raise RequestValidationError(
                spec.param, f"unknown structured output kind {spec.kind!r}; "
                f"expected one of {', '.join(_COMPILE)}")
        text = enforced_text(spec.spec, spec.param) if spec.kind == "json_schema" else spec.spec
        try:
            return build(self._get_compiler(spec.param), text)
        except RuntimeError as exc:  # xgrammar's errors (bad JSON, unsupported schema...)
            message = f"invalid {spec.kind}: {_reason(exc)}"
            raise RequestValidationError(spec.param, message) from exc

    def _get_compiler(self, param: str) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise RequestValidationError(
                        param, "structured output needs the xgrammar package") from exc
                hf = (self._tokenizer.transformers()  # xgrammar reads transformers' only
                      if isinstance(self._tokenizer, PlainTokenizer) else self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._control_ids = torch.tensor([i for i, piece in enumerate(info.decoded_vocab)
                                                  if _CONTROL.search(piece)], dtype=torch.long)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=_CACHE_BYTES)
            return self._compiler


def mask_logits(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """Set to -inf, in place, the logits that row i's grammar forbids next (`grammars[i]`);
    rows without a grammar are not touched. `logits` is [B, V] with distinct rows."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    for i in rows:
        if grammars[i].banned is not None:
            logits[i, grammars[i].banned.to(logits.device)] = -torch.inf


def _can_start(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether the grammar allows some first token (EOS too, when it accepts the empty text)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ prefixes, on one line."""
    lines = [_NOISE.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line)[:300]
