"""Admission within the KV cache's budget (loop/admission.py) on the torch engine over the tiny
model, stepped by hand so that every step's batch is known: requests beyond the budget wait and
then finish as they do alone, none overtakes one that waits, one that needs more than the whole
budget runs alone and stops at it, and a prompt that can never fit is refused at validation."""

from __future__ import annotations

import pytest
from engine_requests import Tokens, collect, token_request

from handlers.engine.kv_budget import KVBudget
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.types import FinishReason, RequestValidationError

SOURCE = "the test's budget"


@pytest.fixture
def stepper(loaded):
    # 200 positions of the tiny model's float16 cache (2 layers x 2 heads x 16 x 2 bytes, K and V)
    engine = TorchEngine(loaded, max_batch_size=8, kv_budget=KVBudget(200 * 256, SOURCE))
    assert engine.batcher.runner.kv_bytes_per_token == 256
    return DirectStepper(engine)


def prompt(loaded, length: int, start: int = 0) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog and runs far away. " * 40
    return loaded.tokenizer.encode(text, add_special_tokens=False)[start : start + length]


def run_all(stepper, requests) -> tuple[Tokens, list[dict]]:
    """Add `requests` at once and step until done; each step's stats."""
    tokens: Tokens = {}
    for request in requests:
        stepper.add(request)
    steps = []
    while stepper.has_work:
        collect(stepper.step(), tokens)
        steps.append(stepper.engine.stats())
    return tokens, steps


def test_requests_beyond_the_budget_wait_and_finish_as_they_do_alone(stepper, loaded):
    budget = stepper.engine.batcher.admission
    assert budget.tokens == 200
    # 80 positions each: two fit in 200, a third does not
    requests = [token_request(prompt(loaded, 20, start=i), 60) for i in range(6)]
    tokens, steps = run_all(stepper, requests)
    assert (steps[0]["running_requests"], steps[0]["waiting_requests"]) == (2, 4)
    assert max(step["running_requests"] for step in steps) == 2
    assert max(step["kv_cache_reserved_tokens"] for step in steps) == 160
    final = steps[-1]
    assert (final["kv_cache_budget_waits"], final["kv_cache_reserved_tokens_peak"],
            final["kv_cache_reserved_tokens"], final["finished_requests"]) == (4, 160, 0, 6)
    for request in requests:
        alone, _ = run_all(stepper, [token_request(request.prompt_token_ids, 60)])
        [ids] = [[t.id for t in seq] for seq in alone.values()]
        assert [t.id for t in tokens[(request.request_id, 0)]] == ids
        assert len(ids) == 60


def test_none_overtakes_a_request_that_waits_for_room(stepper, loaded):
    """A needs 80, B all 200: B waits for A, and C (80, which would fit beside A) waits behind
    B rather than starting before it."""
    a, b, c = (token_request(prompt(loaded, 20), 60), token_request(prompt(loaded, 20), 180),
               token_request(prompt(loaded, 20), 60))
    tokens: Tokens = {}
    for request in (a, b, c):
        stepper.add(request)
    order = []  # the requests each step's batch runs
    while stepper.has_work:
        collect(stepper.step(), tokens)
        order.append(set(stepper.engine.batcher.states))
    assert {a.request_id} == order[0]
    b_runs = [i for i, ids in enumerate(order) if b.request_id in ids]
    c_runs = [i for i, ids in enumerate(order) if c.request_id in ids]
    assert all(a.request_id not in order[i] for i in b_runs)
    assert min(c_runs) > max(b_runs)
    assert [len(tokens[(r.request_id, 0)]) for r in (a, b, c)] == [60, 180, 60]


def test_a_request_needing_more_than_the_budget_runs_alone_and_stops_at_it(stepper, loaded):
    small, big = token_request(prompt(loaded, 20), 10), token_request(prompt(loaded, 20), 400)
    outputs = []
    stepper.add(small)
    stepper.add(big)
    while stepper.has_work:
        outputs += stepper.step()
        assert len(stepper.engine.batcher.states) <= 1
    last = [out for out in outputs if out.request_id == big.request_id][-1]
    generated = sum(len(seq.tokens) for out in outputs if out.request_id == big.request_id
                    for seq in out.outputs)
    assert last.outputs[0].finish_reason == FinishReason.LENGTH
    assert generated == 200 - 20  # its prompt and what it generated fill the budget


@pytest.mark.parametrize(("length", "n", "refused"), [(199, 1, False), (200, 1, True),
                                                        (99, 2, False), (100, 2, True)])
def test_a_prompt_that_can_never_fit_is_refused_naming_the_budget(stepper, loaded, length, n,
                                                                  refused):
    request = token_request(prompt(loaded, length), 1, n=n)
    if not refused:
        stepper.engine.validate(request)
        return
    with pytest.raises(RequestValidationError) as error:
        stepper.engine.validate(request)
    assert error.value.field == "inputs"
    assert "budget holds 200 tokens" in error.value.message
    assert SOURCE in error.value.message


def test_a_prompt_added_unvalidated_that_cannot_fit_fails_alone(stepper, loaded):
    """The DJL entry's path may add a tokenized request without validating it: it fails at
    admission, and the one behind it still runs."""
    over, after = token_request(prompt(loaded, 250), 5), token_request(prompt(loaded, 20), 5)
    outputs = []
    stepper.add(over)
    stepper.add(after)
    while stepper.has_work:
        outputs += stepper.step()
    failed = [out for out in outputs if out.request_id == over.request_id]
    assert failed[0].outputs[0].finish_reason == FinishReason.ERROR
    assert "budget holds 200 tokens" in failed[0].outputs[0].error
    done = [out for out in outputs if out.request_id == after.request_id][-1]
    assert done.finished and done.outputs[0].finish_reason == FinishReason.LENGTH


def test_prompts_prefilled_in_chunks_wait_and_finish_too(loaded):
    """Prompts longer than a step's prefill (chunked), two fitting at a time."""
    engine = TorchEngine(loaded, max_batch_size=8, max_prefill_tokens=16,
                         kv_budget=KVBudget(200 * 256, SOURCE))
    stepper = DirectStepper(engine)
    requests = [token_request(prompt(loaded, 60, start=i), 20) for i in range(5)]
    tokens, steps = run_all(stepper, requests)
    assert max(step["running_requests"] for step in steps) == 2
    assert steps[-1]["finished_requests"] == 5
    assert [len(tokens[(r.request_id, 0)]) for r in requests] == [20] * 5
