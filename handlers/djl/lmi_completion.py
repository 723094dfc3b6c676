"""An LMI body as the OpenAI completion request DJL LMI's vLLM handler makes of it where a
model.py's output formatter will read the answer (djl_python 0.36,
lmi_vllm/request_response_utils.py: convert_lmi_schema_to_completion_request).

The body is validated as LMI first, so that its errors name LMI's fields. Then `inputs` is the
prompt, `max_new_tokens` (30 unless given) `max_tokens`, `return_full_text` `echo` (not on a
stream), `truncate` `truncate_prompt_tokens`, `top_n_tokens` `n` (DJL's mapping), and
`ignore_eos_token` `ignore_eos`; a stream asks for one log-prob per token and usage, as does
`details` (`decoder_input_details`: `prompt_logprobs`); `do_sample: false` is temperature 0;
every other parameter passes as it is. vLLM's own switches DJL adds
(`return_tokens_as_token_ids`, `continuous_usage_stats`) are not: this server's completions have
none. `adapters` (a name, or a list of one) becomes `model`, the completion's adapter selector;
one completion cannot run several adapters.
"""

from __future__ import annotations

from typing import Any

from handlers.protocols.lmi import LmiError, parse_lmi_request
from handlers.protocols.lmi.dynamic import parse_dynamic_request

LMI_MAX_NEW_TOKENS = 30  # DJL's default, where OpenAI's completions default to 16


def as_completion(body: dict[str, Any], dynamic: bool) -> dict[str, Any]:
    """The completion request for LMI `body` (LmiError, or DynamicError under dynamic
    batching, naming what is wrong with it)."""
    (parse_dynamic_request if dynamic else parse_lmi_request)(body)
    parameters = dict(body.get("parameters") or {})
    stream = bool(body.get("stream", False))
    completion: dict[str, Any] = {
        "prompt": body["inputs"],
        "max_tokens": parameters.pop("max_new_tokens", LMI_MAX_NEW_TOKENS),
        "echo": parameters.pop("return_full_text", False),
        "n": parameters.pop("top_n_tokens", 1),
        "ignore_eos": parameters.pop("ignore_eos_token", False),
        "stream": stream,
    }
    truncate = parameters.pop("truncate", None)
    if truncate is not None:
        completion["truncate_prompt_tokens"] = truncate
    adapter = _adapter(body.get("adapters"))
    if adapter:
        completion["model"] = adapter
    if stream:
        completion["logprobs"] = 1
        completion["stream_options"] = {"include_usage": True}
        del completion["echo"]
    if parameters.pop("details", False):
        completion["logprobs"] = 1
        if parameters.pop("decoder_input_details", False):
            completion["prompt_logprobs"] = 1
    do_sample = parameters.pop("do_sample", None)
    if do_sample is not None and not do_sample:
        parameters["temperature"] = 0.0
    return {**completion, **parameters}


def _adapter(named: str | list[str] | None) -> str | None:
    if not isinstance(named, list):
        return named
    if len(set(named)) > 1:
        raise LmiError("adapters: one per input, but a model.py's output formatter reads one "
                       "completion, which runs one adapter: name one for every input")
    return named[0] if named else None
