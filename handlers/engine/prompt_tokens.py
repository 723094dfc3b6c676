"""A prompt's tokens at a cost the context bounds, not the prompt: a prompt that provably holds
more tokens than the context is refused before it is tokenized (a 5 MB prompt used to cost
~500 MB of memory and seconds of a worker to learn that), and one kept to its end by `truncate`
has only its tail tokenized.

The bound (`TokenBound`). In a tokenizer that covers its input (no character is dropped by its
pre-tokenizer, no text is shortened by its normalizer, and no unknown token stands for a run of
text), the tokens of a text partition it (normalized: never shorter here), and no token covers
more than `max_token_bytes` of it: the longest string in the vocabulary (for byte-level
vocabularies, one character per byte) or added token. A byte-level vocabulary may lack a few
byte values (SmolLM2's lacks 21: six control characters, and bytes valid UTF-8 never or hardly
uses): those bytes are dropped and not counted. So a text of B counted bytes has at least
ceil(B / max_token_bytes) tokens, and one of more than (n - 1) x max_token_bytes has at least n.
SmolLM2's longest token is 81 bytes (a newline and 80 spaces): at its 8,192-token context, a
prompt of more than 663,471 counted bytes cannot fit, whatever it says. A prompt no longer is
tokenized whole and its exact count decides, so too long a prompt costs at most what tokenizing
that many bytes costs (there: 0.4 s and ~60 MB, where 5 MB took 3 s and ~500 MB).

There is no bound (None) where a tokenizer is not proven to cover its input: a normalizer that
may shorten text (NFKC, lowercasing, accent stripping), a pre-tokenizer that drops whitespace,
WordPiece's [UNK] for a whole word, an added token that swallows the spaces beside it. Their
prompts are tokenized whole, as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

from handlers.engine.types import GenerationRequest, RequestValidationError


@dataclass(frozen=True)
class TokenBound:
    """The fewest tokens a text can be, by its bytes (see the module's docstring)."""

    max_token_bytes: int  # the most bytes of text one token covers
    unspelled: bytes = b""  # byte values no token spells: dropped, so not counted

    def counted_bytes(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        return len(data.translate(None, self.unspelled) if self.unspelled else data)

    def fewest(self, text: str) -> int:
        return math.ceil(self.counted_bytes(text) / self.max_token_bytes)


class Encoder(Protocol):
    token_bound: TokenBound | None  # None: no bound is proven for this tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


def prompt_ids(request: GenerationRequest, tokenizer: Encoder, max_model_len: int) -> list[int]:
    """The request's prompt tokens (encoded unless given), cut to `params.truncate`; refused
    when empty or when they leave no room to generate within `max_model_len` (before encoding,
    where the prompt's bytes prove it)."""
    truncate = request.params.truncate
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
    elif truncate is None:
        refuse_unread(request.prompt, tokenizer.token_bound, max_model_len)
        ids = tokenizer.encode(request.prompt)
    else:
        ids = tokenizer.encode(tail(request.prompt, truncate, tokenizer.token_bound))
    if truncate is not None and len(ids) > truncate:
        ids = ids[-truncate:]
    if not ids:
        raise RequestValidationError("inputs", "the prompt is empty after tokenization")
    if len(ids) >= max_model_len:
        raise RequestValidationError(
            "inputs", f"the prompt is {len(ids)} tokens, but the model's context is "
            f"{max_model_len} tokens (prompt and generated tokens together)")
    return ids


def fewest_tokens(text: str, bound: TokenBound | None) -> int:
    """The fewest tokens `text` can be (0 where the tokenizer gives no bound)."""
    return 0 if bound is None else bound.fewest(text)


def refuse_unread(prompt: str, bound: TokenBound | None, max_model_len: int) -> None:
    """RequestValidationError ("inputs") when the prompt's bytes prove that it holds at least
    `max_model_len` tokens."""
    if bound is not None and (fewest := bound.fewest(prompt)) >= max_model_len:
        raise RequestValidationError(
            "inputs", f"the prompt is {bound.counted_bytes(prompt)} bytes, so at least "
            f"{fewest} tokens (no token is longer than {bound.max_token_bytes} bytes), but the "
            f"model's context is {max_model_len} tokens (prompt and generated tokens together)")


def tail(prompt: str, keep: int, bound: TokenBound | None) -> str:
    """The end of `prompt` to tokenize for its last `keep` tokens: its last
    (keep + 1) x max_token_bytes bytes, which hold at least keep + 1 tokens by the bound (the
    whole prompt where it is no longer, where they do not, or where there is no bound). The
    first of their tokens, which the cut may split, is never kept; the kept ones are the whole
    prompt's except, at most, those of the word the cut falls in."""
    if bound is None:
        return prompt
    data = prompt.encode("utf-8", "surrogatepass")
    start = len(data) - (keep + 1) * bound.max_token_bytes
    if start <= 0:
        return prompt
    while data[start] & 0xC0 == 0x80:  # back to the first byte of a character
        start -= 1
    end = data[start:].decode("utf-8", "surrogatepass")
    return end if bound.fewest(end) > keep else prompt


# Normalizers that never shorten a text, pre-tokenizers that keep every character.
_GROWING_NORMALIZERS = {"Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation"}


def token_bound(backend: Any) -> TokenBound | None:
    """The bound of `backend` (a `tokenizers.Tokenizer`), where its tokens are proven to cover
    the whole text (see the module's docstring); else None."""
    normalizer, pre_tokenizer = (None if part is None else json.loads(part.__getstate__())
                                 for part in (backend.normalizer, backend.pre_tokenizer))
    if not (_never_shortens(normalizer) and _keeps_all(pre_tokenizer)):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):  # it swallows spaces beside it
        return None
    byte_level = "ByteLevel" in _types(pre_tokenizer)
    vocab = backend.get_vocab(with_added_tokens=False)
    unspelled = _unspelled(backend.model, vocab, byte_level)
    if unspelled is None:
        return None
    # A byte-level vocabulary spells each byte as one character.
    longest = max(len(token) if byte_level else len(token.encode()) for token in vocab)
    return TokenBound(max([longest, *(len(token.content.encode()) for token in added)]),
                      unspelled)


def _types(part: dict[str, Any] | None) -> list[str]:
    if part is None:
        return []
    children = part.get("normalizers") or part.get("pretokenizers")
    if part["type"] == "Sequence" and children is not None:
        return [kind for child in children for kind in _types(child)]
    return [part["type"]]


def _never_shortens(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    if normalizer["type"] == "Sequence":
        return all(_never_shortens(child) for child in normalizer["normalizers"])
    if normalizer["type"] == "Replace":  # a string for one at least as long (never a regex)
        pattern = normalizer["pattern"].get("String")
        return bool(pattern) and len(normalizer["content"].encode()) >= len(pattern.encode())
    return normalizer["type"] in _GROWING_NORMALIZERS


def _keeps_all(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer["type"] == "Sequence":
        return all(_keeps_all(child) for child in pre_tokenizer["pretokenizers"])
    return pre_tokenizer["type"] in _KEEPING_PRE_TOKENIZERS \
        and pre_tokenizer.get("behavior") != "Removed"


def _unspelled(model: Any, vocab: dict[str, int], byte_level: bool) -> bytes | None:
    """The byte values no token spells, where every other byte has its token so that nothing
    else is unknown (byte-level vocabularies; BPE's byte fallback with all 256 byte tokens);
    None where an unknown token may stand for more (WordPiece's whole words, Unigram's)."""
    kind = type(model).__name__
    if byte_level and kind == "BPE":  # a byte without its character is dropped
        return bytes(byte for byte, char in enumerate(_byte_level_chars()) if char not in vocab)
    fallback = model.byte_fallback if kind == "BPE" \
        else kind == "Unigram" and json.loads(model.__getstate__()).get("byte_fallback", False)
    if fallback and all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
        return b""
    return None


def _byte_level_chars() -> list[str]:
    """The character a byte-level vocabulary spells each byte with (GPT-2's table, which the
    tokenizers library's ByteLevel uses): printable bytes as themselves, the others as the
    characters from U+0100 on, in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(0x100, 0x200))
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]
