"""The generation driver on the FakeEngine: validation with a protocol's checks (new requests,
never edited), streams that fail before or after their first events, a renderer that ends
early, and `complete` failing as soon as one request fails. Every protocol's route runs through
these (the protocol tests check each one's wire)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest
from fakes import FakeEngine

from handlers.engine.base import Pair
from handlers.engine.types import GenerationRequest, RequestOutput, RequestValidationError
from handlers.protocols.checks import Checks, with_max_new_tokens
from handlers.protocols.errors import ErrorKind, GenerationError, ProtocolError
from handlers.protocols.outputs import Event, Renderer, raise_failure
from handlers.server.driver import complete, events, stream, validated
from handlers.server.framing import Framing
from handlers.server.generation import Admission, Generation


class Refused(ProtocolError):
    pass


def refusal(exc: RequestValidationError, index: int) -> Refused:
    return Refused(f"prompt {index}, {exc.field}: {exc.message}")


class Texts(Renderer):
    """Each output's token texts as events; a failure, one event saying it."""

    def __init__(self, ends_after: int | None = None) -> None:
        self.seen = 0
        self.ends_after = ends_after

    def feed(self, pairs: list[Pair]) -> list[Event]:
        out = []
        for index, output in pairs:
            raise_failure(output)
            self.seen += 1
            out += [Event((index, t.text)) for s in output.outputs for t in s.tokens]
        return out

    def failed(self, error: GenerationError) -> list[Event]:
        return [Event(("failed", error.message), failure=error.message)]

    @property
    def ended(self) -> bool:
        return self.ends_after is not None and self.seen >= self.ends_after


def request(prompt: str, tokens: int = 3) -> GenerationRequest:
    gen = GenerationRequest(prompt)
    return replace(gen, params=replace(gen.params, max_new_tokens=tokens))


def test_a_refusal_names_the_request_by_its_index():
    engine = FakeEngine()
    with pytest.raises(Refused, match=r"prompt 1, inputs: the prompt carries"):
        validated(engine, [request("a b"), request("c [[invalid]]")], Checks(refusal))


def test_fitting_returns_new_requests_and_edits_none():
    engine = FakeEngine()
    given = [request("a b c", 3), request("d e", 3)]
    fit = Checks(refusal, lambda gen, context: with_max_new_tokens(
        gen, context - len(gen.prompt_token_ids or [])))
    fitted = validated(engine, given, fit)
    assert [g.params.max_new_tokens for g in fitted] == [61, 62]
    assert [g.params.max_new_tokens for g in given] == [3, 3]
    assert [g.request_id for g in fitted] == [g.request_id for g in given]


def test_a_prompt_too_long_is_shortened_only_where_the_protocol_says():
    engine = FakeEngine()
    long = request(" ".join(["w"] * 80))
    with pytest.raises(Refused, match="80 tokens"):
        validated(engine, [long], Checks(refusal))
    keep_end = Checks(refusal, shorten=lambda gen, context: replace(
        gen, params=replace(gen.params, truncate=context - 4)))
    (short,) = validated(engine, [long], keep_end)
    assert len(short.prompt_token_ids) == 60 and long.params.truncate is None


async def test_a_failure_before_the_first_event_raises_and_frees_everything():
    engine, admission = FakeEngine(), Admission(4)
    generation = Generation(engine, validated(engine, [request("a [[error:0]]")],
                                              Checks(refusal)), admission)
    with pytest.raises(GenerationError):
        await stream(generation, Texts(), Framing.SSE)
    assert admission.held == 0


async def test_a_failure_mid_stream_ends_it_with_the_renderers_events():
    engine = FakeEngine()
    generation = Generation(engine, validated(engine, [request("a b [[error:2]]", 5)],
                                              Checks(refusal)), Admission(4))
    reply = await stream(generation, Texts(), Framing.SSE)
    chunks = [chunk async for chunk in reply.chunks]
    texts = [event.data for chunk in chunks for event in chunk]
    assert texts == [(0, " a"), (0, " b"), ("failed", "scripted error after 2 tokens")]
    assert chunks[-1][0].failure is not None


async def test_a_renderer_that_ended_stops_the_stream_and_aborts_what_runs():
    engine = FakeEngine()
    gens = validated(engine, [request("a [[stall:1]]", 9), request("b", 1)], Checks(refusal))
    generation = Generation(engine, gens, Admission(4))
    got = [chunk async for chunk in events(generation, Texts(ends_after=2))]
    assert got and gens[0].request_id in engine.aborted


async def test_complete_raises_once_one_request_fails_and_aborts_the_others():
    engine = FakeEngine()
    gens = validated(engine, [request("a [[stall:1]]", 9), request("b [[error:1]]")],
                     Checks(refusal))
    with pytest.raises(GenerationError) as failed:
        await complete(Generation(engine, gens, Admission(4)))
    assert failed.value.kind is ErrorKind.FAILED
    assert gens[0].request_id in engine.aborted


async def test_a_cut_stream_ends_with_the_renderers_events_and_frees_its_slot():
    engine, admission = FakeEngine(), Admission(4)
    (gen,) = validated(engine, [request("a [[stall:1]]", 9)], Checks(refusal))
    generation = Generation(engine, [gen], admission)
    chunks = events(generation, Texts())
    assert [e.data for e in await anext(chunks)] == [(0, " a")]
    waiting = asyncio.ensure_future(anext(chunks))  # stalled: waits for the engine
    await asyncio.sleep(0)
    generation.cut("the server is stopping")
    assert [e.data for e in await waiting] == [("failed", "the server is stopping")]
    assert gen.request_id in engine.aborted and admission.held == 0


async def test_a_cut_ends_a_collected_answer_inside_its_disconnect_watch():
    engine = FakeEngine()
    gens = validated(engine, [request("a [[stall:1]]", 9)], Checks(refusal))
    generation = Generation(engine, gens, Admission(4))

    async def never_gone() -> None:
        await asyncio.Event().wait()

    asyncio.get_running_loop().call_later(0.05, generation.cut, "the server is stopping")
    with pytest.raises(GenerationError) as cut:
        await complete(generation, never_gone)
    assert cut.value.kind is ErrorKind.UNAVAILABLE
    cancelling = getattr(asyncio.current_task(), "cancelling", lambda: 0)  # Python >= 3.11
    assert cancelling() == 0  # the cut's cancel was taken back


@dataclass
class Counted(FakeEngine):
    held: list[int] = field(default_factory=list)  # requests in it as each one arrives

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.held.append(len(self.requests) + 1 - len(self.finished) - len(self.aborted))
        async for output in super().generate(request):
            yield output


async def test_an_engine_with_a_window_holds_that_many_of_a_client_requests_prompts():
    """An engine that serves its queue first come first served (vLLM) gets one client request's
    prompts a window at a time, each next one once one finished; every engine request of the
    client request carries its group; the answers are whole and in order."""
    engine = Counted(group_window=2)
    gens = validated(engine, [request(f"p{i} q", 2) for i in range(5)], Checks(refusal))
    folded = await complete(Generation(engine, gens, Admission(8)))
    assert len(engine.held) == 5 and max(engine.held) == 2
    assert [acc.sequences[0].text for acc in folded] == [f" p{i} q" for i in range(5)]
    assert {r.group for r in engine.requests} == {gens[0].request_id}
