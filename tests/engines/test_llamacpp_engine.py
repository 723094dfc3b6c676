"""The llama.cpp engine on the embedded SmolLM2 GGUF: greedy tokens against llama-cpp-python's
own `Llama` on the same file, continuous batching (one llama_decode per step), KV sequences
freed on abort, n > 1, structured output, stop sequences, seeds, the context limit.

llama.cpp's CPU kernels change numerics with the tokens in one pass: a prompt of 64 tokens or more
run in one pass gives logits up to ~0.7 away from the same prompt run in 16-token chunks (measured
on this GGUF; 63 tokens or fewer: bit-identical, and so were rows decoded together or alone). So
the engine here prefills at most 48 tokens per step, and the requests' greedy tokens must equal
`Llama`'s for each alone, token for token. That is no general guarantee: under a server's load
(cells of the shared KV pool reused out of order) texts do drift, unlike the torch engine's.

Runs where llama-cpp-python is installed (`LMI_VENV=.venv-llamacpp LMI_EXTRAS=llamacpp ./dev
test tests/engines/test_llamacpp_engine.py`); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random

import numpy as np
import pytest
from optional_deps import need

llama_cpp = need(
    "llama_cpp", "llama-cpp-python is not installed (the `llamacpp` extra: "
    "LMI_VENV=.venv-llamacpp LMI_EXTRAS=llamacpp ./dev test)")

from engine_requests import prompt_moved_mid_prefill, random_schedule, run  # noqa: E402

from handlers.config import load_config  # noqa: E402
from handlers.config.args import parse_args  # noqa: E402
from handlers.engine.llamacpp.build import build  # noqa: E402
from handlers.engine.llamacpp.model import llama_token_ids  # noqa: E402
from handlers.engine.llamacpp.runner import LlamaCppRunner  # noqa: E402
from handlers.engine.loop.runner import PrefillChunk  # noqa: E402
from handlers.engine.types import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    RequestValidationError,
    SamplingParams,
    StructuredOutput,
)
from handlers.model_source import default_model_path  # noqa: E402

pytestmark = pytest.mark.slow

CONTEXT = 512
QUESTIONS = ["What is deep learning?", "Name three colors.", "Why is the sky blue?",
             "Write one sentence about cats.", "What is 2 + 2?", "Say hello in Chinese."]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    args = parse_args(["--model-dir", str(tmp_path_factory.mktemp("empty")),
                       "--option", "option.rolling_batch=llamacpp",
                       "--option", f"option.max_model_len={CONTEXT}",
                       "--option", "option.max_rolling_batch_size=8",
                       "--option", "option.max_rolling_batch_prefill_tokens=48"])
    return build(load_config(args, {}))


@pytest.fixture(scope="module")
def engine(built):
    """Started once: an engine that was shut down does not start again."""
    eng = built.engine
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def reference():
    """llama-cpp-python's high-level Llama on the same file, as its users run it."""
    llm = llama_cpp.Llama(str(default_model_path()), n_ctx=CONTEXT, flash_attn=True,
                          n_threads=len(os.sched_getaffinity(0)), verbose=False)

    def greedy(prompt: str | list[int], n: int) -> list[int]:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True) \
            if isinstance(prompt, str) else prompt
        out = []
        for token in llm.generate(ids, temp=0.0, reset=True):
            out.append(token)
            if len(out) == n:
                return out
        return out

    return greedy


def test_transformers_ids_are_llama_cpp_ids(built):
    tokenizer = built.engine.tokenizer
    vocab = llama_cpp.llama_model_get_vocab(built.engine.loaded.handle)
    for text in [chat(q) for q in QUESTIONS] + ["café 😀 你好\n\t  x = [1, 2]"]:
        assert tokenizer.encode(text) == llama_token_ids(vocab, text)
    assert built.engine.vocab_size == len(tokenizer.hf) == 49152
    assert built.engine.dtype == "q4_1"


async def test_greedy_equals_llama_cpp_alone(engine, reference):
    for question in QUESTIONS[:3]:
        [seq] = await run(engine, chat(question), max_new_tokens=32, ignore_eos=True)
        assert seq["ids"] == reference(chat(question), 32)
        assert seq["finish"] == FinishReason.LENGTH


async def test_greedy_equals_llama_cpp_when_batched(engine, reference):
    results = await asyncio.gather(*(run(engine, chat(q), max_new_tokens=24, ignore_eos=True)
                                     for q in QUESTIONS))
    for question, [seq] in zip(QUESTIONS, results, strict=True):
        assert seq["ids"] == reference(chat(question), 24)


SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face. Answer clearly and briefly.<|im_end|>\n")


async def test_prompts_sharing_a_system_prompt_reuse_its_cells(engine, reference):
    """The second prompt starts from the first one's kept prefix (a spare llama.cpp sequence)
    and still answers as `Llama` does from scratch."""
    first, second = (SYSTEM + chat(q) for q in QUESTIONS[:2])
    ids = [engine.tokenizer.encode(p) for p in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert shared >= 16
    before = engine.stats()["prefix_cache_hits"]
    for prompt in (first, second):
        [seq] = await run(engine, prompt, max_new_tokens=16, ignore_eos=True)
        assert seq["ids"] == reference(prompt, 16)
    assert engine.stats()["prefix_cache_hits"] - before == shared
    memory = engine.batcher.runner.cache  # the spare sequences after the 8 slots keep prompts
    assert any(memory.positions(seq) == (0, len(ids[0]) - 1) for seq in range(8, 16))


async def test_one_decode_call_per_step_over_all_sequences(engine, monkeypatch):
    runner = engine.batcher.runner
    sizes: list[int] = []
    original = llama_cpp.llama_decode

    def counting(ctx, batch):
        sizes.append(batch.n_tokens)
        return original(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    await asyncio.gather(*(run(engine, chat(q), max_new_tokens=12, ignore_eos=True)
                           for q in QUESTIONS[:4]))
    assert runner is engine.batcher.runner
    assert 4 in sizes  # a decode step ran the 4 sequences in one call
    assert len(sizes) < 4 * 12  # not one call per sequence and token


def stepped_engine(model_dir, prefill_tokens: int):
    """A new engine of 4 slots that prefills `prefill_tokens` a step, stepped by hand."""
    args = parse_args(["--model-dir", str(model_dir), "--option", "option.rolling_batch=llamacpp",
                       "--option", f"option.max_model_len={CONTEXT}",
                       "--option", "option.max_rolling_batch_size=4", "--option",
                       f"option.max_rolling_batch_prefill_tokens={prefill_tokens}"])
    return build(load_config(args, {})).steppable


def test_a_prompt_moved_mid_prefill_keeps_the_chunk_just_written(tmp_path, reference):
    """Prompt A ends its prefill in the pass that also runs B's first chunk, and takes the
    decode slot B sits in: B's sequence moves with that chunk's cells (it lost them once, and
    answered otherwise than `Llama`)."""
    stepped = stepped_engine(tmp_path, 8)
    requests, tokens = prompt_moved_mid_prefill(stepped, stepped.engine.tokenizer.encode(SYSTEM))
    for req in requests:
        assert [t.id for t in tokens[req.request_id, 0]] == reference(
            req.prompt_token_ids, req.params.max_new_tokens)


@pytest.fixture(scope="module")
def reference_logprobs():
    """Each position's log-probabilities from `Llama` over the given ids, in one pass."""
    llm = llama_cpp.Llama(str(default_model_path()), n_ctx=CONTEXT, flash_attn=True,
                          logits_all=True, n_threads=len(os.sched_getaffinity(0)), verbose=False)

    def logprobs(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        top = scores.max(-1, keepdims=True)
        return scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))

    return logprobs


@pytest.mark.parametrize("seed", range(4))
def test_each_request_keeps_its_own_context_whatever_the_schedule(tmp_path, reference_logprobs,
                                                                  seed):
    """Random arrivals, prompts (half of them sharing an opening), lengths, n, aborts and a small
    batch and prefill budget exercise slot moves and trades, chunking, prefix reuse and
    compaction together. llama.cpp's rounding depends on the pass's rows (see above), so greedy
    texts may part from `Llama`'s alone at near ties; what must hold is that every token's
    log-probability is the model's for that sequence's own prompt and tokens (within 1 nat:
    differences reached ~0.9), every sequence not aborted runs to its length, and no KV cell
    stays taken."""
    rng = random.Random(seed)
    stepped = stepped_engine(tmp_path, rng.choice([5, 8, 13]))
    text = stepped.engine.tokenizer.encode(SYSTEM + "".join(chat(q) for q in QUESTIONS))
    requests, got, aborted = random_schedule(stepped, text, rng)
    memory = stepped.engine.batcher.runner.cache
    assert all(memory.positions(slot) == (-1, -1) for slot in range(4))
    for req in requests:
        prompt = req.prompt_token_ids
        for index in range(req.params.n):
            tokens = got.get((req.request_id, index), [])
            if req.request_id not in aborted:
                assert len(tokens) == req.params.max_new_tokens
            expected = reference_logprobs(prompt + [t.id for t in tokens])[len(prompt) - 1 :]
            assert [t.logprob for t in tokens] == pytest.approx(
                [expected[i, t.id] for i, t in enumerate(tokens)], abs=1.0)


async def test_requests_join_mid_flight(engine, reference):
    long_req = GenerationRequest(prompt=chat(QUESTIONS[0]),
                                 params=SamplingParams(max_new_tokens=80, ignore_eos=True))
    long_ids, late, joined = [], None, False
    async with contextlib.aclosing(engine.generate(long_req)) as stream:  # aborts it at the end
        async for out in stream:
            long_ids += [t.id for s in out.outputs for t in s.tokens]
            if len(long_ids) >= 5 and late is None:
                late = asyncio.create_task(run(engine, chat(QUESTIONS[1]), max_new_tokens=10,
                                               ignore_eos=True))
            if late is not None and late.done() and not out.finished:
                joined = True
                break
    assert joined, "the late request waited for the long one"
    [seq] = await late
    assert seq["ids"] == reference(chat(QUESTIONS[1]), 10)
    assert long_ids == reference(chat(QUESTIONS[0]), len(long_ids))


async def test_abort_frees_the_sequence_in_llama_cpp_memory(engine):
    request = GenerationRequest(prompt=chat(QUESTIONS[2]),
                                params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    stream = engine.generate(request)
    await anext(stream)
    await anext(stream)
    memory = engine.batcher.runner.cache
    assert memory.positions(0)[1] > 10  # slot 0 = llama.cpp sequence 0 holds the prompt and more
    await stream.aclose()  # the caller goes away: the engine aborts the request
    async with asyncio.timeout(60):  # only a guard against hanging: the abort is awaited
        while engine.batcher.has_work:
            await asyncio.sleep(0.01)
    assert engine.batcher.running == 0
    assert [memory.positions(slot) for slot in range(8)] == [(-1, -1)] * 8


async def test_n_sequences_share_the_prompt_and_differ(engine):
    seqs = await run(engine, chat(QUESTIONS[3]), n=3, do_sample=True, seed=5,
                     max_new_tokens=16, ignore_eos=True)
    assert len(seqs) == 3 and len({tuple(s["ids"]) for s in seqs}) == 3
    assert all(s["finish"] == FinishReason.LENGTH for s in seqs)


async def test_seed_reproduces(engine):
    params = dict(do_sample=True, temperature=0.9, top_p=0.9, seed=1234, max_new_tokens=16,
                  ignore_eos=True)
    [alone] = await run(engine, chat(QUESTIONS[4]), **params)
    [again] = await run(engine, chat(QUESTIONS[4]), **params)
    assert again["ids"] == alone["ids"]
    [other] = await run(engine, chat(QUESTIONS[4]), **{**params, "seed": 4321})
    assert other["ids"] != alone["ids"]


async def test_structured_output_follows_the_schema(engine):
    schema = {"type": "object", "properties": {"color": {"type": "string"},
                                               "count": {"type": "integer"}},
              "required": ["color", "count"]}
    [seq] = await run(engine, chat("Give a color and a number as JSON."), max_new_tokens=60,
                      structured=StructuredOutput("json_schema", json.dumps(schema)))
    value = json.loads(seq["text"])
    assert set(value) == {"color", "count"} and isinstance(value["count"], int)
    assert seq["finish"] == FinishReason.EOS


async def test_stop_sequence(engine):
    [free] = await run(engine, chat(QUESTIONS[0]), max_new_tokens=24, ignore_eos=True)
    words = free["text"].split()
    stop = words[3]
    [seq] = await run(engine, chat(QUESTIONS[0]), max_new_tokens=24, ignore_eos=True,
                      stop_sequences=[stop])
    assert seq["finish"] == FinishReason.STOP
    assert seq["text"] == free["text"][: free["text"].index(stop)]


async def test_prompt_over_the_context_is_refused(engine):
    with pytest.raises(RequestValidationError, match="context"):
        await run(engine, "word " * CONTEXT, max_new_tokens=4)
    [seq] = await run(engine, chat(QUESTIONS[4]), max_new_tokens=4)  # still serving
    assert seq["ids"]


async def test_generation_stops_at_the_context(engine):
    prompt = chat("Count " * 200)
    [seq] = await run(engine, prompt, max_new_tokens=2000, ignore_eos=True)
    assert seq["finish"] == FinishReason.LENGTH
    assert len(engine.tokenizer.encode(prompt)) + len(seq["ids"]) == CONTEXT



def test_an_8bit_kv_cache_is_llama_cpps_q8_0_in_about_half_the_memory(tmp_path, built):
    """option.kv_cache_dtype=fp8: llama.cpp's cells are q8_0 (34 bytes per 32 elements against
    float16's 64), in the context itself: a sequence's saved state shrinks by as much; and it
    answers."""
    args = parse_args(["--model-dir", str(tmp_path), "--option", "option.rolling_batch=llamacpp",
                       "--option", f"option.max_model_len={CONTEXT}",
                       "--option", "option.max_rolling_batch_size=8",
                       "--option", "option.max_rolling_batch_prefill_tokens=48",
                       "--option", "option.kv_cache_dtype=fp8"])
    eight = build(load_config(args, {}))
    f16, q8 = built.engine.loaded, eight.engine.loaded
    assert (q8.kv_type.name, f16.kv_type.name) == ("q8_0", "f16")
    assert q8.kv_bytes_per_token * 64 == f16.kv_bytes_per_token * 34
    prompt = llama_token_ids(llama_cpp.llama_model_get_vocab(f16.handle), chat(QUESTIONS[0]))
    sizes = {}
    for model in (f16, q8):
        runner = LlamaCppRunner(model, 2, 48, CONTEXT)
        runner.prefill([PrefillChunk(slot=0, token_ids=prompt[:40], start=0)])
        sizes[model.kv_type.name] = llama_cpp.llama_state_seq_get_size(runner._ctx, 0)
    assert sizes["q8_0"] < 0.7 * sizes["f16"]
    engine = eight.engine
    asyncio.run(engine.start())
    try:
        [answer] = asyncio.run(run(engine, chat(QUESTIONS[0]), max_new_tokens=8,
                                    ignore_eos=True))
    finally:
        asyncio.run(engine.shutdown())
    assert len(answer["ids"]) == 8
