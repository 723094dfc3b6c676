"""The continuous-batching torch engine on a tiny random-weight Llama with the real tokenizer.

Greedy output is checked token for token against Hugging Face `generate()` on transformers' own
model of the same checkpoint,
alone, in a batch that others join mid-flight, and with prompts prefilled in small chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import torch
from engine_requests import (
    Tokens,
    collect,
    prompt_moved_mid_prefill,
    random_schedule,
    run,
    token_request,
)
from tiny_model import make_tiny_model_dir
from transformers import AutoModelForCausalLM

from handlers.engine.loop import sampling
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.torch import cuda_graphs, model_runner
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestValidationError,
    SamplingParams,
)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Deep learning is",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books "
    "about the history of mathematics and the people who made it.",
    "你好，世界！今天天气很好。",
]


@pytest.fixture
async def engine(loaded, request):
    options = getattr(request, "param", {})
    eng = TorchEngine(loaded, max_batch_size=options.get("max_batch_size", 8),
                      max_prefill_tokens=options.get("max_prefill_tokens", 512),
                      prefix_cache_bytes=options.get("prefix_cache_bytes", 0),
                      cuda_graphs=options.get("cuda_graphs", False))
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.fixture(scope="module")
def reference(loaded):
    """transformers' own model of the same checkpoint: what the engine's tokens are checked by."""
    return AutoModelForCausalLM.from_pretrained(loaded.source, dtype=torch.float32).eval()


def hf_greedy(reference, loaded, prompt: str | list[int], n: int) -> list[int]:
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) \
        else prompt
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False,
        )
    return out[0, len(ids):].tolist()


async def test_greedy_matches_generate(reference, engine, loaded):
    for prompt in PROMPTS:
        [seq] = await run(engine, prompt, max_new_tokens=24, ignore_eos=True)
        assert seq["ids"] == hf_greedy(reference, loaded, prompt, 24)
        assert seq["finish"] == FinishReason.LENGTH


@pytest.mark.parametrize("engine", [{"max_prefill_tokens": 7}], indirect=True)
async def test_chunked_prefill_matches_generate(reference, engine, loaded):
    results = await asyncio.gather(*(run(engine, p, max_new_tokens=16, ignore_eos=True)
                                     for p in PROMPTS))
    for prompt, [seq] in zip(PROMPTS, results, strict=True):
        assert seq["ids"] == hf_greedy(reference, loaded, prompt, 16)


SYSTEM = " ".join(PROMPTS[:3]) * 2  # a shared "system prompt" of several 16-token blocks


@pytest.mark.parametrize("engine", [{"prefix_cache_bytes": 64 << 20, "max_prefill_tokens": 20}],
                         indirect=True)
async def test_prompts_sharing_a_prefix_prefill_only_what_is_new(reference, engine, loaded):
    """A prompt that begins as an earlier one did starts from its cached keys/values, and
    answers exactly as Hugging Face generate() does from scratch."""
    shared = len(loaded.tokenizer.encode(SYSTEM, add_special_tokens=False))
    for prompt in (SYSTEM + " Question one?", SYSTEM + " And a second one.", SYSTEM):
        [seq] = await run(engine, prompt, max_new_tokens=12, ignore_eos=True)
        assert seq["ids"] == hf_greedy(reference, loaded, prompt, 12)
    stats = engine.stats()
    # the second found all of SYSTEM (and the space after it); the third, SYSTEM but its end
    assert stats["prefix_cache_hits"] >= 2 * (shared - 1)
    assert stats["prefix_cache_queries"] == stats["prompt_tokens"]
    await run(engine, SYSTEM, max_new_tokens=1, prompt_logprobs=True)
    assert engine.stats()["prefix_cache_hits"] == stats["prefix_cache_hits"]  # none reused


async def test_requests_join_mid_flight(reference, engine, loaded):
    """A request that arrives while another decodes starts at once, and both stay exact."""
    long_req = GenerationRequest(prompt=PROMPTS[0],
                                 params=SamplingParams(max_new_tokens=120, ignore_eos=True))
    long_ids, late = [], None
    async for out in engine.generate(long_req):
        long_ids += [t.id for s in out.outputs for t in s.tokens]
        if len(long_ids) >= 5 and late is None:
            late = asyncio.create_task(run(engine, PROMPTS[1], max_new_tokens=10, ignore_eos=True))
        if late is not None and late.done() and not out.finished:
            late_finished_while_long_ran = True
            break
    else:
        late_finished_while_long_ran = False
    assert late_finished_while_long_ran, "the late request waited for the long one"
    [seq] = await late
    assert seq["ids"] == hf_greedy(reference, loaded, PROMPTS[1], 10)
    assert long_ids == hf_greedy(reference, loaded, PROMPTS[0], len(long_ids))


def assert_logprobs_are_the_models(reference, loaded, prompt: str, seq: dict) -> None:
    """Each generated token's log-probability is the reference model's, given what precedes."""
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        logits = reference(torch.tensor([ids + seq["ids"]])).logits[0].float()
    expected = logits.log_softmax(-1)[len(ids) - 1 : -1]
    got = torch.tensor([token.logprob for token in seq["tokens"]])
    torch.testing.assert_close(got, expected[range(len(got)), seq["ids"]], rtol=0, atol=1e-4)


class EagerReplay(cuda_graphs.CudaDecodeGraphs):
    """What a CUDA graph replays, run eagerly where there is no GPU: the step as captured, on
    the cache buffers it was captured on (a graph keeps their addresses)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.captured: list[tuple[int, int]] = []  # (rows, cache capacity) of each capture

    def _record(self, step):
        cache = self._cache
        buffers = list(cache.keys), list(cache.values)

        def replay():
            live = cache.keys, cache.values
            cache.keys, cache.values = buffers
            try:
                return step()
            finally:
                cache.keys, cache.values = live

        logits = replay()
        self.captured.append((logits.shape[0], self._cache.capacity))
        return lambda: logits.copy_(replay()), logits


async def test_the_decode_step_as_cuda_graphs_answers_as_generate(reference, loaded, monkeypatch):
    """The CUDA-graph decode's own logic, replayed eagerly: rows padded up to a bucket (1, 2, 4
    or 6 of them) while later prompts prefill in the slots past them (padding writes a scratch
    slot of its own), attention over the cache's whole capacity, and graphs captured again once
    the longest sequence grows the cache past 256 positions."""
    if loaded.device.type == "cuda":
        pytest.skip("a GPU replays real graphs: test_on_a_gpu_the_captured_decode_step_...")
    monkeypatch.setattr(model_runner, "CudaDecodeGraphs", EagerReplay)
    engine = TorchEngine(loaded, max_batch_size=6, max_prefill_tokens=8, cuda_graphs=True)
    await engine.start()
    try:
        early = [(PROMPTS[0], 40), (PROMPTS[1], 60)]  # beside the long one: 3 rows, padded to 4
        late = [(PROMPTS[3], 25), (PROMPTS[0], 7)]  # 26 and 10 tokens, prefilled 8 a step
        tasks = [asyncio.create_task(run(engine, p, max_new_tokens=n, ignore_eos=True,
                                         top_logprobs=1)) for p, n in early]
        long_request = GenerationRequest(prompt=PROMPTS[2], params=SamplingParams(
            max_new_tokens=250, ignore_eos=True))  # 32 + 250 positions: the cache grows
        long_ids: list[int] = []
        async for out in engine.generate(long_request):
            long_ids += [t.id for s in out.outputs for t in s.tokens]
            if len(long_ids) == 5:
                tasks += [asyncio.create_task(run(engine, p, max_new_tokens=n, ignore_eos=True,
                                                  top_logprobs=1)) for p, n in late]
        assert long_ids == hf_greedy(reference, loaded, PROMPTS[2], 250)
        for (prompt, n), [seq] in zip(early + late, await asyncio.gather(*tasks), strict=True):
            assert seq["ids"] == hf_greedy(reference, loaded, prompt, n)
            # a key written over moves log-probabilities long before it flips a token
            assert_logprobs_are_the_models(reference, loaded, prompt, seq)
        captured = engine.batcher.runner.cuda_graphs.captured
        assert {(4, 256), (1, 512)} <= set(captured)
    finally:
        await engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU")
@pytest.mark.parametrize("engine", [{"cuda_graphs": True, "max_batch_size": 6}], indirect=True)
async def test_on_a_gpu_the_captured_decode_step_answers_as_generate(reference, engine, loaded):
    """Real CUDA graphs: full and padded buckets answer as generate() does (short answers:
    float32 on the GPU and on the CPU agree token for token only so far on random weights)."""
    lengths = [16, 12, 20, 8, 5, 18]
    prompts = (PROMPTS * 2)[: len(lengths)]
    results = await asyncio.gather(*(run(engine, p, max_new_tokens=n, ignore_eos=True)
                                     for p, n in zip(prompts, lengths, strict=True)))
    for prompt, n, [seq] in zip(prompts, lengths, results, strict=True):
        assert seq["ids"] == hf_greedy(reference, loaded, prompt, n)
    assert engine.stats()["decode_graphs_ready"] >= 3


@pytest.mark.parametrize("engine", [{"max_batch_size": 2}], indirect=True)
async def test_more_requests_than_slots_all_complete(reference, engine, loaded):
    results = await asyncio.gather(*(run(engine, p, max_new_tokens=8, ignore_eos=True)
                                     for p in PROMPTS))
    for prompt, [seq] in zip(PROMPTS, results, strict=True):
        assert seq["ids"] == hf_greedy(reference, loaded, prompt, 8)
    assert engine.batcher.running == 0


async def test_seed_gives_same_text_whatever_the_batch(engine):
    params = dict(do_sample=True, temperature=1.0, top_p=0.9, seed=42, max_new_tokens=16,
                  ignore_eos=True)
    [alone] = await run(engine, PROMPTS[1], **params)
    crowd = await asyncio.gather(
        run(engine, PROMPTS[0], do_sample=True, max_new_tokens=20, ignore_eos=True),
        run(engine, PROMPTS[1], **params),
        run(engine, PROMPTS[2], do_sample=True, seed=7, max_new_tokens=12, ignore_eos=True),
    )
    assert crowd[1][0]["ids"] == alone["ids"]
    [other_seed] = await run(engine, PROMPTS[1], **{**params, "seed": 43})
    assert other_seed["ids"] != alone["ids"]


async def test_seed_gives_same_text_whatever_the_batch_in_bf16(tmp_path):
    """bf16 (what option.dtype=auto serves where this CPU multiplies it fastest) keeps the
    guarantee: a seeded request's tokens do not depend on the rest of the batch."""
    bf16 = load_model(make_tiny_model_dir(tmp_path), dtype="bf16")
    engine = TorchEngine(bf16, max_batch_size=8)
    await engine.start()
    try:
        await test_seed_gives_same_text_whatever_the_batch(engine)
    finally:
        await engine.shutdown()


async def test_n_sequences_differ_and_best_of_ranks(engine):
    seqs = await run(engine, PROMPTS[1], n=3, do_sample=True, seed=3, max_new_tokens=12,
                     ignore_eos=True)
    assert len(seqs) == 3
    assert len({tuple(s["ids"]) for s in seqs}) == 3
    assert all(s["finish"] == FinishReason.LENGTH for s in seqs)
    for s in seqs:
        assert s["cumulative"] == pytest.approx(sum(t.logprob for t in s["tokens"]), abs=1e-4)


async def test_stop_sequence_across_token_boundaries(engine, loaded):
    [free] = await run(engine, PROMPTS[0], max_new_tokens=20, ignore_eos=True)
    pieces = [loaded.tokenizer.decode(free["ids"][: i + 1]) for i in range(len(free["ids"]))]
    # A stop string spanning the end of token 3 and the start of token 4's text.
    text4, text5 = pieces[3], pieces[4]
    stop = text4[-2:] + text5[len(text4): len(text4) + 2]
    assert len(stop) >= 3
    [seq] = await run(engine, PROMPTS[0], max_new_tokens=20, ignore_eos=True,
                      stop_sequences=[stop])
    assert seq["finish"] == FinishReason.STOP
    assert seq["text"] == text5[: text5.index(stop)]
    [kept] = await run(engine, PROMPTS[0], max_new_tokens=20, ignore_eos=True,
                       stop_sequences=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text5[: text5.index(stop)] + stop


async def test_stop_token_ids_and_max_new_tokens(engine):
    [free] = await run(engine, PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    [seq] = await run(engine, PROMPTS[2], max_new_tokens=10, ignore_eos=True,
                      stop_token_ids=[free["ids"][3]])
    assert seq["finish"] == FinishReason.STOP
    assert seq["ids"] == free["ids"][: free["ids"].index(free["ids"][3]) + 1]
    assert len(free["ids"]) == 10 and free["finish"] == FinishReason.LENGTH


async def test_streamed_text_equals_the_decoded_ids(engine, loaded):
    """Token texts (multi-byte characters split across tokens included) add up to the decode.
    A random model can emit invalid UTF-8, which decodes to U+FFFD in both; a character cut off
    at the end is left out of the stream."""
    for prompt in PROMPTS:
        [seq] = await run(engine, prompt, max_new_tokens=30, ignore_eos=True,
                          do_sample=True, seed=11)
        full = loaded.tokenizer.decode(seq["ids"], skip_special_tokens=True)
        assert "".join(t.text for t in seq["tokens"]) == seq["text"] == full.rstrip("\ufffd")


async def test_logprobs_match_the_model(reference, engine, loaded):
    [seq] = await run(engine, PROMPTS[1], max_new_tokens=4, ignore_eos=True, top_logprobs=3)
    ids = loaded.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    with torch.inference_mode():
        logits = reference(torch.tensor([ids + seq["ids"]])).logits[0].float()
    expected = logits.log_softmax(-1)
    for i, token in enumerate(seq["tokens"]):
        row = expected[len(ids) - 1 + i]
        assert token.logprob == pytest.approx(row[token.id].item(), abs=1e-3)
        assert [t.id for t in token.top] == row.topk(3).indices.tolist()


async def test_prompt_logprobs(reference, engine, loaded):
    request = GenerationRequest(prompt=PROMPTS[0],
                                params=SamplingParams(max_new_tokens=2, prompt_logprobs=True))
    outputs = [out async for out in engine.generate(request)]
    prefill = outputs[0].prompt_logprobs
    ids = loaded.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for i in range(1, len(ids)):
        assert prefill[i].logprob == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-3)


async def test_abort_frees_the_slot(engine):
    request = GenerationRequest(prompt=PROMPTS[0],
                                params=SamplingParams(max_new_tokens=400, ignore_eos=True))
    stream = engine.generate(request)
    await anext(stream)
    await anext(stream)
    await stream.aclose()  # what a disconnecting client's handler does
    async with asyncio.timeout(60):  # only a guard against hanging: the abort is awaited
        while engine.batcher.running or engine.batcher.states:
            await asyncio.sleep(0.01)
    assert engine.batcher.stats()["kv_cache_slots_in_use"] == 0
    [seq] = await run(engine, PROMPTS[1], max_new_tokens=3)
    assert len(seq["ids"]) >= 1


async def test_validation_rejects_before_admission(engine):
    too_long = " ".join(["word"] * 600)
    with pytest.raises(RequestValidationError) as err:
        engine.validate(GenerationRequest(prompt=too_long))
    assert err.value.field == "inputs"
    truncated = GenerationRequest(prompt=too_long, params=SamplingParams(truncate=10))
    engine.validate(truncated)
    assert len(truncated.prompt_token_ids) == 10


async def test_a_failing_request_fails_alone(reference, engine, loaded, monkeypatch):
    real_sample = sampling.sample

    def flaky(logits, samplers):
        if any(s.params.seed == 666 for s in samplers):
            raise RuntimeError("boom")
        return real_sample(logits, samplers)

    monkeypatch.setattr(sampling, "sample", flaky)
    bad, good = await asyncio.gather(
        run(engine, PROMPTS[0], do_sample=True, seed=666, max_new_tokens=10),
        run(engine, PROMPTS[1], max_new_tokens=10, ignore_eos=True),
    )
    assert bad[0]["finish"] == FinishReason.ERROR
    assert good[0]["finish"] == FinishReason.LENGTH
    assert good[0]["ids"] == hf_greedy(reference, loaded, PROMPTS[1], 10)
    assert engine.batcher.running == 0


def test_stepped_by_its_caller_one_token_per_sequence_per_step(reference, loaded):
    """The DJL entry's use: add() (tokenizing what was not validated) and step() in the caller's
    thread; each step gives every running sequence one token, as vLLM's steps give DJL."""
    stepped = DirectStepper(TorchEngine(loaded, max_batch_size=4))
    requests = [GenerationRequest(prompt=p, params=SamplingParams(max_new_tokens=6,
                                                                  ignore_eos=True))
                for p in PROMPTS[:3]]
    stepped.add(requests[0])
    first = stepped.step()
    stepped.add(requests[1])
    stepped.add(requests[2])
    steps = [first]
    while stepped.has_work:
        steps.append(stepped.step())

    ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for outputs in steps:
        for out in outputs:
            [seq] = out.outputs
            assert len(seq.tokens) == 1  # never two tokens in one step
            ids[out.request_id] += [t.id for t in seq.tokens]
    assert [ids[r.request_id] for r in requests] == [hf_greedy(reference, loaded, p, 6)
                                                     for p in PROMPTS[:3]]
    assert len(steps) == 7  # request 0: steps 1-6; requests 1 and 2 join at step 2, end at 7


def test_a_prompt_moved_mid_prefill_keeps_the_chunk_just_written(reference, loaded):
    """Prompt A ends its prefill in the pass that also prefills B's first chunk, and takes the
    decode slot B sits in: B moves elsewhere with that chunk's keys and values (it lost them
    once, answering otherwise than generate()), and both answer as generate() does."""
    stepped = DirectStepper(TorchEngine(loaded, max_batch_size=4, max_prefill_tokens=8))
    ids = loaded.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    requests, tokens = prompt_moved_mid_prefill(stepped, ids)
    for req in requests:
        assert_models_own(reference, loaded, req.prompt_token_ids, tokens[req.request_id, 0],
                          req.params.max_new_tokens)


def test_client_requests_take_the_batch_in_turn(loaded):
    """A client request of 12 prompts fills a batch of 4 when another client's prompt arrives:
    the newcomer takes the first slot that frees, not the one after the 8 prompts still
    waiting; each client request's prompts keep their order, and a better priority still goes
    first."""
    stepped = DirectStepper(TorchEngine(loaded, max_batch_size=4))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    big = [GenerationRequest(PROMPTS[1], params, group="big") for _ in range(12)]
    bystander = GenerationRequest(PROMPTS[0], params, group="bystander")
    urgent = GenerationRequest(PROMPTS[0], params, group="urgent", priority=-1)
    events: list[tuple[str, str]] = []  # ("token" | "finished", request id), as they came
    for request in big:
        stepped.add(request)
    for step in itertools.count():
        if step == 1:  # the big request's first 4 prompts are running
            stepped.add(bystander)
            stepped.add(urgent)
        if not stepped.has_work:
            break
        for out in stepped.step():
            events += [("token", out.request_id)] + [("finished", out.request_id)] * out.finished
    first = {rid: events.index(("token", rid)) for _, rid in events}
    big_done = [i for i, (kind, rid) in enumerate(events)
                if kind == "finished" and rid in {r.request_id for r in big}]
    assert first[urgent.request_id] < first[bystander.request_id] < big_done[4]
    starts = [first[request.request_id] for request in big]
    assert starts == sorted(starts)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_short_prompt_behind_two_long_ones_answers_first(reference, loaded, chunked):
    """Two long prompts are prefilling, 16 tokens a step, when a 3-token one arrives: it has
    its answer within two steps, long before either long prompt's first token, and all three
    answer as generate() does. Without chunked prefill (a budget of the whole context) the
    prompts are read whole, and the short one in the next step still."""
    budget = 16 if chunked else loaded.max_model_len
    stepped = DirectStepper(TorchEngine(loaded, max_batch_size=4, max_prefill_tokens=budget))
    ids = loaded.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    longs = [token_request(ids * 3, 2), token_request(ids[1:] * 3, 2)]
    short = token_request(ids[:3], 2)
    tokens: Tokens = {}
    for request in longs:
        stepped.add(request)
    collect(stepped.step(), tokens)
    stepped.add(short)
    steps = 0
    while (short.request_id, 0) not in tokens:
        collect(stepped.step(), tokens)
        steps += 1
    assert steps <= 2
    assert chunked == all((r.request_id, 0) not in tokens for r in longs)
    while stepped.has_work:
        collect(stepped.step(), tokens)
    for request in (*longs, short):
        assert [t.id for t in tokens[request.request_id, 0]] == hf_greedy(
            reference, loaded, request.prompt_token_ids, 2)


def assert_models_own(reference, loaded, prompt: list[int], got: list, n: int) -> None:
    """`got` (perhaps cut short) is the first of the model's n greedy tokens for `prompt`,
    with their log-probabilities (greedy may survive a corrupted cache; these do not)."""
    want = hf_greedy(reference, loaded, prompt, n)
    assert [t.id for t in got] == want[: len(got)]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 :]
    expected = logits.float().log_softmax(-1)
    assert [t.logprob for t in got] == pytest.approx(
        [expected[i, t].item() for i, t in enumerate(want[: len(got)])], abs=1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_each_request_gets_the_models_own_answer_whatever_the_schedule(reference, loaded, seed):
    """Random arrivals, prompts (half of them sharing an opening), lengths, n, aborts and a small
    batch and prefill budget exercise slot moves, chunking, prefix reuse and compaction
    together: every sequence's tokens and logprobs (an aborted one's, up to its abort) are
    still the model's own for its prompt alone, and every slot is free at the end."""
    rng = random.Random(seed)
    stepped = DirectStepper(TorchEngine(loaded, max_batch_size=4,
                                        max_prefill_tokens=rng.choice([5, 8, 13]),
                                        prefix_cache_bytes=1 << 20))
    text = loaded.tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)
    requests, tokens, aborted = random_schedule(stepped, text, rng)
    assert stepped.engine.batcher.stats()["kv_cache_slots_in_use"] == 0
    for req in requests:
        for index in range(req.params.n):
            got = tokens.get((req.request_id, index), [])
            if req.request_id not in aborted:
                assert len(got) == req.params.max_new_tokens
            assert_models_own(reference, loaded, req.prompt_token_ids, got,
                              req.params.max_new_tokens)


# Room for ~200 of the tiny model's tokens (256 bytes each in its float16 cache): the session's
# ~105 and the other prompts' ~210 cannot all stay.
@pytest.mark.parametrize("engine", [{"prefix_cache_bytes": 200 * 256}], indirect=True)
async def test_a_sessions_next_turn_prefills_only_what_is_new(reference, engine, loaded):
    """A stateful session's turn pins its whole conversation (prompt and answer): the next turn,
    which repeats it and adds a question, finds all of it cached although a stream of other
    prompts went through the cache between the turns, and answers as generate() does; once
    the session is released, the same turn finds nothing."""
    tokenizer = loaded.tokenizer
    first_prompt = tokenizer.encode(SYSTEM + " Question one?", add_special_tokens=False)
    first = GenerationRequest(prompt="", prompt_token_ids=first_prompt, session="s1",
                              params=SamplingParams(max_new_tokens=10, ignore_eos=True))
    answer = [t.id for out in [o async for o in engine.generate(first)]
              for s in out.outputs for t in s.tokens]
    for prompt in PROMPTS:  # others fill the cache, unpinned
        await run(engine, prompt * 3, max_new_tokens=2, ignore_eos=True)
    assert engine.batcher.prefix.max_tokens == 200
    second_prompt = first_prompt + answer + tokenizer.encode(" And then?",
                                                             add_special_tokens=False)
    before = engine.stats()["prefix_cache_hits"]
    second = GenerationRequest(prompt="", prompt_token_ids=second_prompt, session="s1",
                               params=SamplingParams(max_new_tokens=6, ignore_eos=True))
    ids = [t.id for out in [o async for o in engine.generate(second)]
           for s in out.outputs for t in s.tokens]
    conversation = len(first_prompt) + len(answer) - 1  # the last answer token was not fed
    assert engine.stats()["prefix_cache_hits"] - before == conversation
    assert ids == hf_greedy(reference, loaded, second_prompt, 6)
    await engine.release_session("s1")
    await engine.release_session("s1")  # a second release is harmless
    before = engine.stats()["prefix_cache_hits"]
    await run(engine, tokenizer.decode(second_prompt + ids), max_new_tokens=1)
    assert engine.stats()["prefix_cache_hits"] - before < conversation
