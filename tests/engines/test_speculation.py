"""Speculative decoding on the torch engine (handlers/engine/loop/speculation.py): n-gram
proposals verified in one pass give the text decoding without them gives (greedy, seeded
sampling, stop strings, max_new_tokens, log-probs, grammars, rows with and without proposals in
one step), rejected positions leave nothing behind, and the settings are checked at startup."""

from __future__ import annotations

import json

import pytest
import torch
from engine_requests import collect

from handlers.config import ConfigError, load_config, parse_args
from handlers.engine import registry
from handlers.engine.loop.direct import DirectStepper
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.loop.speculation import NgramSettings, ngram_proposal
from handlers.engine.torch.engine import TorchEngine
from handlers.engine.torch.loader import load_model
from handlers.engine.torch.model_runner import ModelRunner
from handlers.engine.types import FinishReason, GenerationRequest, SamplingParams, StructuredOutput

NGRAM = NgramSettings(num_tokens=4, lookup_min=1, lookup_max=3)
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "def add(x, y):\n    return x + y\n\ndef sub(x, y):\n    return",
    "Hello world",
]


# -- settings ----------------------------------------------------------------------------------


def config(tmp_path, *options: str):
    argv = ["--model-dir", str(tmp_path)]
    for option in options:
        argv += ["--option", option]
    return load_config(parse_args(argv), env={})


def spec(value: dict) -> str:
    return f"option.speculative_config={json.dumps(value)}"


def test_ngram_settings_reach_the_torch_engine(tmp_path):
    got = config(tmp_path, spec({"method": "ngram", "num_speculative_tokens": 5,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    assert NgramSettings.of(got.speculative_config, got.sources["speculative_config"]) == \
        NgramSettings(5, 2, 4)
    only_max = config(tmp_path, spec({"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_max": 1}))
    assert NgramSettings.of(only_max.speculative_config, "") == NgramSettings(3, 1, 1)


@pytest.mark.parametrize(("value", "message"), [
    ("{not json", "option.speculative_config=.* is invalid: expected a JSON object"),
    ('["ngram"]', "expected a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens to be an "
                                                         "integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"num_speculative_tokens": 2}', 'a "method"'),
])
def test_bad_speculative_config_stops_startup_naming_the_key(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, f"option.speculative_config={value}")


@pytest.mark.parametrize(("value", "message"), [
    ({"model": "some/draft", "num_speculative_tokens": 4}, "a draft model .* is not supported "
                                                           "by the torch engine"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "method 'eagle' is not supported"),
    ({"method": "ngram"}, "method ngram needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 4},
     "disable_by_batch_size not supported by the torch engine"),
])
def test_the_torch_engine_refuses_what_it_cannot_run(tmp_path, value, message):
    got = config(tmp_path, spec(value))
    with pytest.raises(ConfigError, match=f"option.speculative_config \\(command line\\): "
                                          f"{message}"):
        NgramSettings.of(got.speculative_config, got.sources["speculative_config"])


def test_djls_older_names_map_onto_speculative_config(tmp_path):
    got = config(tmp_path, "option.speculative_draft_model=some/draft",
                 "option.speculative_length=3")
    assert got.speculative_config == {"model": "some/draft", "num_speculative_tokens": 3}
    assert "option.speculative_draft_model" in got.sources["speculative_config"]
    assert config(tmp_path, "option.speculative_draft_model=d").speculative_config == \
        {"model": "d", "num_speculative_tokens": 5}
    with pytest.raises(ConfigError, match="option.speculative_length=3 .* needs "
                                          "option.speculative_draft_model"):
        config(tmp_path, "option.speculative_length=3")
    with pytest.raises(ConfigError, match="both configure speculative decoding"):
        config(tmp_path, "option.speculative_draft_model=d",
               spec({"method": "ngram", "num_speculative_tokens": 2}))


def test_vllm_gets_speculative_config_and_llama_cpp_refuses_it(tmp_path, monkeypatch):
    from handlers.engine.vllm.args import engine_kwargs

    value = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    vllm = config(tmp_path, "option.rolling_batch=vllm", spec(value))
    assert engine_kwargs(vllm, "/m", {}, 1)["speculative_config"] == value
    older = config(tmp_path, "option.rolling_batch=vllm", "option.speculative_draft_model=d")
    assert engine_kwargs(older, "/m", {}, 1)["speculative_config"] == \
        {"model": "d", "num_speculative_tokens": 5}
    monkeypatch.setattr(registry, "_check_llamacpp", lambda config: None)
    for option in (spec(value), "option.speculative_draft_model=d"):
        with pytest.raises(ConfigError, match="is not supported by the llamacpp engine "
                                              r"\(supported by: torch, vllm\)"):
            registry.check(config(tmp_path, "option.rolling_batch=llamacpp", option))


# -- proposals ---------------------------------------------------------------------------------


def test_proposals_follow_the_latest_occurrence_of_the_longest_suffix():
    settings = NgramSettings(num_tokens=3, lookup_min=1, lookup_max=2)
    #              0  1  2  3  4  5  6  7  8
    assert ngram_proposal([1, 2, 3, 4, 9, 2, 3, 5, 2, 3], settings, 3) == [5, 2, 3]
    assert ngram_proposal([7, 8, 9, 8], settings, 3) == [9, 8, 9]  # 8 at 1: 9, then itself
    assert ngram_proposal([7, 7, 7], settings, 2) == [7, 7]
    assert ngram_proposal([1, 2, 3, 4], settings, 3) == []  # nothing repeats
    assert ngram_proposal([1, 2, 1], settings, 0) == []  # no room
    # 256 and 1 share bytes: a match across token boundaries is no match
    assert ngram_proposal([256, 0, 5, 1, 0], NgramSettings(2, 2, 2), 2) == []


# -- the verify pass ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_verify_pass_gives_each_position_a_decode_steps_bits(tiny_dir, dtype):
    """Why greedy text is the same with and without speculation: the logits of k+1 tokens in
    one pass are, bit for bit, those of k+1 one-token decode steps."""
    model = load_model(tiny_dir, dtype=dtype).model
    runner = ModelRunner(model, 4, 256, kv_dtype=model.dtype)
    prompt, chain = list(range(100, 140)), [5, 6, 7, 8, 9]
    for slot in (0, 1):
        runner.prefill([PrefillChunk(slot=slot, token_ids=prompt, start=0)])
    stepped = torch.stack([runner.decode([token], [len(prompt) + i])[0]
                           for i, token in enumerate(chain)])
    runner.truncate(0, len(prompt))
    verified = runner.verify([chain, chain[:1]], [len(prompt), len(prompt)])
    assert torch.equal(verified[0], stepped)
    assert torch.equal(verified[1], stepped[:1])  # slot 1: one token, padded beside slot 0's


# -- the engine --------------------------------------------------------------------------------


def run_all(loaded, speculation, requests) -> tuple[list, dict]:
    """Every request's tokens (ids, texts, log-probs) and finish reason, stepped together."""
    engine = TorchEngine(loaded, max_batch_size=4, speculation=speculation,
                         prefix_cache_bytes=1 << 20)
    stepped, tokens, finish = DirectStepper(engine), {}, {}
    for request in requests:
        stepped.add(request)
    while stepped.has_work:
        outputs = stepped.step()
        collect(outputs, tokens)
        for out in outputs:
            for seq in out.outputs:
                finish[out.request_id, seq.index] = seq.finish_reason
    answers = [([(t.id, t.text, t.logprob, [(a.id, a.logprob) for a in t.top])
                 for t in tokens.get((r.request_id, 0), [])], finish[r.request_id, 0])
               for r in requests]
    return answers, engine.stats()


def requests(loaded, prompts=tuple(PROMPTS), **params) -> list[GenerationRequest]:
    return [GenerationRequest(prompt="", prompt_token_ids=loaded.tokenizer.encode(p),
                              params=SamplingParams(**params)) for p in prompts]


@pytest.mark.parametrize("params", [
    {"max_new_tokens": 40, "ignore_eos": True, "top_logprobs": 2},
    {"max_new_tokens": 7, "ignore_eos": True},  # never beyond max_new_tokens
    {"max_new_tokens": 40, "do_sample": True, "temperature": 0.05, "seed": 7},
    {"max_new_tokens": 40, "ignore_eos": True, "repetition_penalty": 1.3},
])
def test_speculation_answers_as_decoding_without_it(loaded, params):
    """Rows with and without proposals in one step: the same tokens, texts, log-probs and
    finish reasons as without speculation, and proposals were accepted."""
    without, _ = run_all(loaded, None, requests(loaded, **params))
    with_, stats = run_all(loaded, NGRAM, requests(loaded, **params))
    assert with_ == without
    assert all(len(tokens) <= params["max_new_tokens"] for tokens, _ in with_)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]


def test_stop_strings_end_the_text_where_they_would(loaded):
    without, _ = run_all(loaded, None, requests(loaded, max_new_tokens=40, ignore_eos=True))
    stop = without[0][0][12][1]  # a token the first answer generates (a run repeats it)
    params = {"max_new_tokens": 40, "ignore_eos": True, "stop_sequences": [stop]}
    without, _ = run_all(loaded, None, requests(loaded, **params))
    with_, stats = run_all(loaded, NGRAM, requests(loaded, **params))
    assert with_ == without and without[0][1] == FinishReason.STOP
    assert stats["spec_decode_num_drafts"] > 0


def test_grammar_rows_follow_their_grammar_position_by_position(loaded):
    """Each verified position is masked by the grammar state the tokens before it leave."""
    grammar = StructuredOutput(kind="regex", spec="(ab ){3,12}c")
    params = {"max_new_tokens": 40, "structured": grammar}
    without, _ = run_all(loaded, None, requests(loaded, **params))
    with_, stats = run_all(loaded, NGRAM, requests(loaded, **params))
    assert with_ == without
    assert stats["spec_decode_num_drafts"] > 0


def test_sampled_rows_reject_and_leave_no_trace(loaded):
    """Seeded sampling rejects many proposals; the cache holds accepted positions only, so the
    answers and what a later prompt sharing the prefix reads are those without speculation."""
    params = {"max_new_tokens": 40, "do_sample": True, "temperature": 0.1, "seed": 7}
    twice = 2 * PROMPTS  # more prompts than slots: the later ones reuse slots and prefixes
    without, _ = run_all(loaded, None, requests(loaded, twice, **params))
    with_, stats = run_all(loaded, NGRAM, requests(loaded, twice, **params))
    assert with_ == without
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
