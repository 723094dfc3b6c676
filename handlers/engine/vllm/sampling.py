"""Our SamplingParams -> vLLM's SamplingParams keyword arguments (free of vLLM, so the mapping
is tested without it). What vLLM cannot do is refused by name before admission."""

from __future__ import annotations

from typing import Any

from handlers.engine.schema_enforcement import enforced_text
from handlers.engine.types import RequestValidationError, SamplingParams, StructuredOutput


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """vllm.SamplingParams(**this, output_kind=DELTA, structured_outputs=...) for `params`."""
    _refuse_unsupported(params)
    kwargs: dict[str, Any] = {
        # vLLM's own best_of is gone: every sequence is generated and streamed, and the
        # protocols keep the best n by cumulative log-probability, as with the torch engine.
        "n": params.num_sequences // greedy_copies(params),
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": params.temperature if params.do_sample else 0.0,
        "top_p": params.top_p if params.do_sample else 1.0,
        "top_k": max(params.top_k, 0) if params.do_sample else 0,
        "min_p": params.min_p if params.do_sample else 0.0,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "seed": params.seed,
        "stop": list(params.stop_sequences),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "skip_special_tokens": params.skip_special_tokens,
        # Every token's log-probability (LMI's details, best_of's ranking), and the top ones.
        "logprobs": params.top_logprobs,
        "prompt_logprobs": params.top_logprobs if params.prompt_logprobs else None,
    }
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    if params.max_thinking_tokens is not None:  # the thinking's end is vLLM's reasoning parser's
        kwargs["thinking_token_budget"] = params.max_thinking_tokens
    return kwargs


def greedy_copies(params: SamplingParams) -> int:
    """vLLM refuses n > 1 without sampling: such a request runs one sequence, and its outputs
    are copied to every index (greedy sequences are the same sequence)."""
    return 1 if params.do_sample else params.num_sequences


def structured_kwargs(structured: StructuredOutput) -> dict[str, Any]:
    """vllm.sampling_params.StructuredOutputsParams(**this) for our constraint."""
    if structured.kind == "json_object":
        return {"json_object": True}
    if structured.kind == "json_schema":  # what the torch engine enforces too
        return {"json": enforced_text(structured.spec, structured.param)}
    if structured.kind in ("regex", "grammar"):
        return {structured.kind: structured.spec}
    raise RequestValidationError(structured.param, f"unknown structured output {structured.kind}")


def _refuse_unsupported(params: SamplingParams) -> None:
    if params.do_sample and params.typical_p != 1.0:
        raise RequestValidationError(
            "typical_p", "typical_p is not supported by the vllm engine (vLLM has no typical "
            "sampling); use top_p or min_p, or the torch engine")
    if params.watermark:
        raise RequestValidationError(
            "watermark", "watermark is not supported by the vllm engine (TGI's watermark needs "
            "the torch engine)")
