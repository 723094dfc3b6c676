"""Speculative decoding (option.speculative_config, n-gram) on the real server with the embedded
SmolLM2: greedy answers through LMI's /invocations and OpenAI's chat (the openai client) are
the ones a server without speculation gives, alone and beside requests that propose nothing;
proposals were accepted (vLLM's counters in /metrics); stop strings and max_new_tokens hold;
and rejected proposals leave nothing a later request sharing the prefix could read."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from server_process import server_process

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Eager, both: the verify pass is eager, and two servers compiling decode graphs beside the
# tests took minutes of both cores.
COMMON = ("option.rolling_batch=torch", "option.dtype=fp32", "option.quantize=none",
          "option.max_model_len=1024", "option.embedding_model_id=none",
          "option.enforce_eager=true")
# An input-grounded request: the answer copies the prompt's text.
TEXT = ("The quarterly report shows revenue of 4.2 million dollars, up 12 percent from last "
        "year, driven by strong sales in the northern region and lower shipping costs.")
GROUNDED = f"Repeat this sentence exactly, word for word:\n{TEXT}"
FREE = "Write a short poem about autumn leaves."


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(with speculation, without): two servers of the embedded model, eager float32."""
    logs = tmp_path_factory.mktemp("speculation")
    with contextlib.ExitStack() as stack:
        _, on = stack.enter_context(server_process(
            *COMMON, f"option.speculative_config={json.dumps(SPEC)}", log_path=logs / "on.log"))
        _, off = stack.enter_context(server_process(*COMMON, log_path=logs / "off.log"))
        yield on, off


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text,
                                            re.MULTILINE))


def lmi(url: str, prompt: str, **parameters) -> dict:
    """LMI's answer to `prompt` as a chat turn (SmolLM2's template: a bare instruction is
    answered with EOS at once)."""
    turn = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    body = {"inputs": turn, "parameters": {"max_new_tokens": 32, "details": True,
                                              **parameters}}
    response = httpx.post(f"{url}/invocations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def chat(url: str, prompt: str) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompt}],
        max_tokens=40, temperature=0)
    return answer.choices[0].message.content


def assert_same(answer: dict, other: dict) -> None:
    """The same text, tokens and finish; log-probs equal to 1e-3. (float32 linears run oneDNN's
    GEMV for one row and its GEMM for more, ~1e-5 apart in the logits: one stream's steps and a
    verify pass differ that much, as one stream and two do without speculation.)"""
    assert answer["generated_text"] == other["generated_text"]
    tokens = [[(t["id"], t["text"]) for t in a["details"]["tokens"]] for a in (answer, other)]
    assert tokens[0] == tokens[1]
    assert answer["details"]["finish_reason"] == other["details"]["finish_reason"]
    logprobs = [[t["log_prob"] for t in a["details"]["tokens"]] for a in (answer, other)]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-3)


def test_greedy_answers_are_those_without_speculation(urls):
    on, off = urls
    drafts = counter(on, "vllm:spec_decode_num_drafts_total")
    accepted = counter(on, "vllm:spec_decode_num_accepted_tokens_total")
    assert chat(on, GROUNDED) == chat(off, GROUNDED)
    answer = lmi(on, GROUNDED)
    assert_same(answer, lmi(off, GROUNDED))
    assert answer["details"]["generated_tokens"] > 8
    assert counter(on, "vllm:spec_decode_num_drafts_total") > drafts
    assert counter(on, "vllm:spec_decode_num_accepted_tokens_total") > accepted
    assert counter(on, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == \
        counter(on, "vllm:spec_decode_num_accepted_tokens_total")
    assert counter(off, "vllm:spec_decode_num_drafts_total") == 0  # not exposed without


def test_rows_with_and_without_proposals_share_steps(urls):
    """Grounded and free-text requests at once: each answers as it does alone, without
    speculation."""
    on, off = urls
    prompts = [GROUNDED, FREE, f"Summarize: {TEXT}"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: chat(on, p), prompts))
    assert together == [chat(off, p) for p in prompts]


def test_stop_strings_and_max_new_tokens_hold(urls):
    on, off = urls
    words = lmi(off, GROUNDED)["generated_text"].split()
    stop = [words[len(words) // 2]]  # a word the answer reaches halfway
    stopped = lmi(on, GROUNDED, stop=stop)
    assert_same(stopped, lmi(off, GROUNDED, stop=stop))
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    short = lmi(on, GROUNDED, max_new_tokens=5)
    assert_same(short, lmi(off, GROUNDED, max_new_tokens=5))
    assert short["details"]["generated_tokens"] == 5


def test_rejected_proposals_leave_no_trace(urls):
    """Requests whose proposals are partly rejected (a free text, a summary), then a prompt that
    shares the grounded one's prefix (kept in the prefix cache) but goes on otherwise: every
    answer is the one without speculation."""
    on, off = urls
    rejected = counter(on, "vllm:spec_decode_num_draft_tokens_total") - \
        counter(on, "vllm:spec_decode_num_accepted_tokens_total")
    for prompt in (FREE, f"Summarize: {TEXT}", GROUNDED):
        assert_same(lmi(on, prompt, max_new_tokens=40), lmi(off, prompt, max_new_tokens=40))
    assert counter(on, "vllm:spec_decode_num_draft_tokens_total") - \
        counter(on, "vllm:spec_decode_num_accepted_tokens_total") > rejected
    later = GROUNDED + "\nNow say it again, in other words:"
    assert_same(lmi(on, later), lmi(off, later))
