"""Dynamic batching (`option.rolling_batch=disable`): the DynamicBatcher over the FakeEngine, the
dynamic-batch schema's pure functions, and its routes (tests/fakes.py scripts the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from fakes import HANG_GUARD_S, FakeEngine, on_fake_clock, served_app
from server_process import serving_here
from tiny_model import make_tiny_model_dir

from handlers.engine.dynamic_batch import DynamicBatcher
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.engine.types import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SequenceOutput,
    Token,
)
from handlers.protocols.lmi.dynamic import DynamicError, StreamLines, parse_dynamic_request
from handlers.server.framing import Framing
from handlers.server.status import LMI_HTTP


@dataclass
class RecordingEngine(FakeEngine):
    """Records the order in which the engine started and finished each prompt, and when (on the
    event loop's clock: run on `on_fake_clock`, the times are exact)."""

    events: list[tuple[str, str]] = field(default_factory=list)
    times: dict[tuple[str, str], float] = field(default_factory=dict)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self._record("start", request.prompt)
        async for output in super().generate(request):
            yield output
        self._record("end", request.prompt)

    def _record(self, kind: str, prompt: str) -> None:
        self.events.append((kind, prompt))
        self.times[kind, prompt] = asyncio.get_running_loop().time()

    def started(self, *prompts: str) -> list[float]:
        return [self.times["start", p] for p in prompts]


def req(prompt: str, max_new_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=max_new_tokens))


async def texts(batcher: DynamicBatcher, requests: list[GenerationRequest]) -> list[str]:
    """Run one job to its end; the text of each of its prompts, in prompt order."""
    out = [""] * len(requests)
    async for pairs in batcher.submit(requests):
        for index, output in pairs:
            out[index] += "".join(s.text for s in output.outputs)
    return out


# --- the batcher ----------------------------------------------------------------------------


# These run on a fake clock (tests/fakes.py): it stands still while the batcher has work and
# jumps to the next timer when all wait, so when a batch started is exact, not a window.


def test_batches_close_at_batch_size_and_run_one_after_the_other():
    engine = RecordingEngine(token_delay=0.01)
    batcher = DynamicBatcher(engine, batch_size=4, max_batch_delay_ms=60_000)
    prompts = [f"p{i}" for i in range(8)]

    async def main() -> None:
        await asyncio.gather(*(texts(batcher, [req(p)]) for p in prompts))

    on_fake_clock(main())
    kinds = [kind for kind, _ in engine.events]
    assert kinds == ["start"] * 4 + ["end"] * 4 + ["start"] * 4 + ["end"] * 4
    first, second = [p for _, p in engine.events[:4]], [p for _, p in engine.events[8:12]]
    assert set(first) == set(prompts[:4])
    # Neither batch waited for the 60 s delay: the first started at once, the second the moment
    # the first ended (3 steps of 0.01 s).
    assert engine.started(*first) == [0.0] * 4
    assert engine.started(*second) == [engine.times["end", first[-1]]] * 4
    assert engine.times["end", first[-1]] == pytest.approx(0.03)
    stats = batcher.stats()
    assert (stats["dynamic_batches"], stats["dynamic_batch_requests"]) == (2, 8)


def test_a_batch_closes_after_max_batch_delay_with_fewer_requests():
    engine = RecordingEngine()
    batcher = DynamicBatcher(engine, batch_size=4, max_batch_delay_ms=200)
    assert on_fake_clock(texts(batcher, [req("a b")])) == [" a b a"]
    assert engine.started("a b") == [pytest.approx(0.2)]  # not before the delay, nor later
    assert batcher.stats()["dynamic_batches"] == 1


def test_a_list_input_is_one_request_and_keeps_input_order():
    engine = RecordingEngine()
    batcher = DynamicBatcher(engine, batch_size=2, max_batch_delay_ms=60_000)

    async def main() -> tuple[list[str], list[str]]:
        return await asyncio.gather(
            texts(batcher, [req("a b", 2), req("c d e", 3), req("f", 1)]),
            texts(batcher, [req("g h", 2)]),
        )

    listed, single = on_fake_clock(main())
    assert listed == [" a b", " c d e", " f"]
    assert single == [" g h"]
    assert batcher.stats()["dynamic_batches"] == 1
    assert engine.started("a b", "c d e", "f", "g h") == [0.0] * 4  # 2 jobs: no 60 s delay


async def test_requests_in_one_batch_keep_their_own_parameters():
    batcher = DynamicBatcher(FakeEngine(), batch_size=2, max_batch_delay_ms=60_000)
    short, long = await asyncio.gather(
        texts(batcher, [req("a b c", 1)]), texts(batcher, [req("a b c", 5)])
    )
    assert (short, long) == ([" a"], [" a b c a b"])


async def test_a_failing_request_fails_only_itself():
    batcher = DynamicBatcher(FakeEngine(), batch_size=3, max_batch_delay_ms=60_000)
    results = await asyncio.gather(
        texts(batcher, [req("a b")]),
        texts(batcher, [req("x y [[raise:1]]")]),
        texts(batcher, [req("c d")]),
        return_exceptions=True,
    )
    assert results[0] == [" a b a"] and results[2] == [" c d c"]
    assert isinstance(results[1], RuntimeError) and "scripted failure" in str(results[1])


def test_a_request_closed_while_queued_never_runs_nor_counts():
    engine = RecordingEngine()
    batcher = DynamicBatcher(engine, batch_size=2, max_batch_delay_ms=60_000)

    async def main() -> list[list[str]]:
        gone = batcher.submit([req("gone")])
        assert batcher.stats()["waiting_requests"] == 1
        await gone.aclose()
        assert batcher.stats()["waiting_requests"] == 0
        return await asyncio.gather(texts(batcher, [req("a")]), texts(batcher, [req("b")]))

    assert on_fake_clock(main()) == [[" a a a"], [" b b b"]]
    assert "gone" not in [p for _, p in engine.events]
    assert engine.started("a", "b") == [0.0, 0.0]  # "a" and "b" filled the batch: no delay
    assert batcher.stats()["dynamic_batch_requests"] == 2


def test_aborting_a_running_request_frees_the_batch_for_the_next():
    engine = RecordingEngine(token_delay=0.01)
    batcher = DynamicBatcher(engine, batch_size=1, max_batch_delay_ms=0)
    request = req("a b", max_new_tokens=100_000)  # 1000 s of steps, were it not aborted

    async def main() -> list[str]:
        stream = batcher.generate(request)
        await anext(stream)
        await stream.aclose()
        await batcher.abort(request.request_id)
        return await texts(batcher, [req("c", 2)])

    assert on_fake_clock(main()) == [" c c"]
    assert request.request_id in engine.aborted and engine.generated[request.request_id] == 1
    assert engine.started("c") == [pytest.approx(0.01)]  # right after the aborted one's 1 step


async def test_the_torch_engine_runs_each_batch_together_and_alone(tmp_path):
    engine = TorchEngine(load_model(make_tiny_model_dir(tmp_path), dtype="fp32"))
    await engine.start()
    batcher = DynamicBatcher(engine, batch_size=4, max_batch_delay_ms=60_000)

    async def running_per_step(i: int) -> set[int]:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        request = GenerationRequest(f"prompt {i}", params)
        batcher.validate(request)
        return {engine.stats()["running_requests"] async for _ in batcher.submit([request])}

    try:
        async with asyncio.timeout(HANG_GUARD_S):  # against a hang only: no verdict on time
            seen = await asyncio.gather(*(running_per_step(i) for i in range(8)))
    finally:
        await batcher.shutdown()
    assert max(set().union(*seen)) == 4  # a batch's 4 prompts ran together; 8 never did


# --- the schema -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"parameters": {}}, "inputs: Field required"),
        ({"inputs": 5}, "inputs: Value error, must be a string or a list of strings"),
        ({"inputs": []}, "inputs: List should have at least 1 item"),
        ({"inputs": ["a", ""]}, "inputs.1: String should have at least 1 character"),
        ({"inputs": "a", "parameters": {"top_p": 2}}, "parameters.top_p: Input should be"),
        ({"inputs": "a", "parameters": {"n": 2}}, "parameters.n: n and best_of > 1 are not"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body, message):
    with pytest.raises(DynamicError) as caught:
        parse_dynamic_request(body)
    assert LMI_HTTP[caught.value.kind] == 424
    assert caught.value.message.startswith(message)


def test_a_string_input_is_a_list_of_one():
    assert parse_dynamic_request({"inputs": "hi"}).inputs == ["hi"]


def output(rid: str, text: str, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    seq = SequenceOutput(0, [Token(1, text, -1.0)] if text else [], reason)
    return RequestOutput(rid, [seq], 1, RequestMetrics(0.0), finished=finished)


def test_stream_lines_hold_one_text_per_input_and_skip_silent_steps():
    lines = StreamLines(3)
    assert Framing.JSONLINES.frame(lines.feed([(0, output("a", " x")), (2, output("c", " z"))])
                                   .data) == b'{"outputs":[" x",""," z"]}\n'
    assert lines.feed([(1, output("b", ""))]) is None
    assert not lines.done
    lines.feed([(i, output(r, "", finished=True)) for i, r in enumerate("abc")])
    assert lines.done and lines.failure is None


# --- the routes -----------------------------------------------------------------------------


def served(engine: FakeEngine, batch_size: int = 4, delay_ms: int = 50,
           streaming: bool = False) -> Any:
    return served_app(engine, dynamic=(batch_size, delay_ms, streaming))


def client_for(engine: FakeEngine, **kwargs) -> httpx.AsyncClient:
    app = served(engine, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lmi")


def lines_of(response: httpx.Response) -> list[dict]:
    return [orjson.loads(line) for line in response.text.splitlines()]


async def test_answers_are_lists_in_input_order_and_details_and_stream_change_nothing():
    async with client_for(FakeEngine()) as client:
        single, listed = await asyncio.gather(
            client.post("/invocations", json={
                "inputs": "a b", "parameters": {"max_new_tokens": 3}, "stream": True
            }),
            client.post("/predictions/fake-model", json={
                "inputs": ["c d", "e"], "parameters": {"max_new_tokens": 2, "details": True}
            }),
        )
    assert single.headers["content-type"] == "application/json"
    # As DJL's handler, which decodes each whole sequence: the prompt, then the generation.
    assert single.json() == [{"generated_text": "a b a b a"}]
    assert listed.json() == [{"generated_text": "c d c d"}, {"generated_text": "e e e"}]


@pytest.mark.parametrize(("full", "texts"), [(True, ["a a", "b b"]), (False, [" a", " b"])])
async def test_return_full_text_decides_whether_the_prompt_leads(full, texts):
    async with client_for(FakeEngine()) as client:
        body = {"inputs": ["a", "b"], "parameters": {"max_new_tokens": 1, "return_full_text": full}}
        response = await client.post("/invocations", json=body)
    assert response.json() == [{"generated_text": text} for text in texts]


async def test_bad_requests_in_a_batch_get_424_and_the_others_succeed():
    engine = FakeEngine()
    async with client_for(engine, batch_size=4, delay_ms=60_000) as client:
        responses = await asyncio.gather(*(client.post("/invocations", json=body) for body in [
            {"inputs": "a", "parameters": {"max_new_tokens": 3}},
            {"inputs": ["b", "c [[invalid]]"]},
            {"inputs": "d [[raise:1]]"},
            {"inputs": "e [[error:1]]"},
            {"inputs": "f", "parameters": {"max_new_tokens": 3}},
        ]))
        metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [200, 424, 424, 424, 200]
    assert responses[1].json() == {
        "code": 424,
        "message": "invoke handler failure",
        "error": "inputs.1: the prompt carries the [[invalid]] marker",
    }
    assert "scripted failure" in responses[2].json()["error"]
    assert "scripted error" in responses[3].json()["error"]
    assert responses[4].json() == [{"generated_text": "f f f f"}]
    # The invalid request never joined a batch: 4 requests made the one batch.
    assert 'lmi_dynamic_batch_size_count{model="fake-model"} 1.0' in metrics
    assert 'lmi_dynamic_batch_size_sum{model="fake-model"} 4.0' in metrics


async def test_enable_streaming_streams_outputs_lines():
    async with client_for(FakeEngine(token_delay=0.01), streaming=True) as client:
        body = {"inputs": ["a b", "c"], "parameters": {"max_new_tokens": 3}}
        response = await client.post("/invocations", json=body)
    assert response.headers["content-type"] == "application/jsonlines"
    outputs = [line["outputs"] for line in lines_of(response)]
    assert len(outputs) > 1 and all(len(texts) == 2 for texts in outputs)
    assert ["".join(column) for column in zip(*outputs, strict=True)] == [" a b a", " c c c"]


async def test_a_stream_failing_after_text_ends_with_the_failure_body():
    async with client_for(FakeEngine(), streaming=True) as client:
        streamed, early = await asyncio.gather(
            client.post("/invocations", json={"inputs": "a [[raise:2]]"}),
            client.post("/invocations", json={"inputs": "b [[error:0]]"}),
        )
    assert streamed.status_code == 200
    assert lines_of(streamed)[:2] == [{"outputs": [" a"]}, {"outputs": [" a"]}]
    last = lines_of(streamed)[-1]
    assert (last["code"], last["message"]) == (424, "invoke handler failure")
    assert "scripted failure after 2 tokens" in last["error"]
    assert early.status_code == 424 and "scripted error" in early.json()["error"]


# --- a client that goes away, over a real socket --------------------------------------------


@pytest.fixture
async def live(request) -> AsyncIterator[tuple[FakeEngine, str]]:
    # A context as long as the request it runs, which would take 1000 s to its end.
    engine = FakeEngine(token_delay=0.01, max_model_len=100_000)
    async with serving_here(served(engine, batch_size=1, delay_ms=0,
                                   streaming=request.param)) as url:
        yield engine, url


@pytest.mark.parametrize("live", [False, True], indirect=True, ids=["json", "stream"])
async def test_a_client_that_disconnects_is_aborted_and_frees_the_batch(live):
    engine, url = live
    long = {"inputs": "a b", "parameters": {"max_new_tokens": 100_000}}
    async with httpx.AsyncClient(base_url=url) as client:
        pending = asyncio.create_task(client.post("/invocations", json=long))
        await engine.until(lambda: bool(engine.requests))
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        first = engine.requests[0].request_id
        await engine.until(lambda: first in engine.aborted)  # the disconnect reached the engine
        # batch_size=1: this runs only once the first is gone (else after its 1000 s of steps)
        async with asyncio.timeout(HANG_GUARD_S):  # against a hang only
            response = await client.post("/invocations", json={"inputs": "c"})  # 30 tokens
    assert response.status_code == 200
    assert engine.generated[first] < 100_000 and len(engine.requests) == 2
