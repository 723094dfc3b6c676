"""DJL LMI's generation parameters (the `parameters` of its input schema) and their mapping to
the engine's `SamplingParams`: LMI's own, which KServe's V1 and V2 bodies carry too and through
which Triton's generate extension maps its parameters.

The fields follow DJL LMI's GenerationParameters, its vLLM / lmi-dist extras and TGI's names.
Unknown parameter keys are ignored, as LMI passes them through to engines that may not use them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from handlers.engine.types import SamplingParams

MAX_TOP_TOKENS = 20  # vLLM's default max_logprobs


class LmiParameters(BaseModel):
    """`parameters`; None means "not given" where that changes a default."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int = Field(30, ge=1)
    min_new_tokens: int = Field(
        0, ge=0, validation_alias=AliasChoices("min_new_tokens", "min_tokens", "min_length")
    )
    do_sample: bool | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0, le=1)
    typical_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop_sequences: list[str] | str | None = None
    stop: list[str] | str | bool | None = None  # TGI's name; TensorRT-LLM's boolean is ignored
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = Field(False, validation_alias=AliasChoices("ignore_eos_token", "ignore_eos"))
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1)
    num_beams: int = Field(1, ge=1)
    top_logprobs: int = Field(
        0, ge=0, le=MAX_TOP_TOKENS, validation_alias=AliasChoices("top_n_tokens", "logprobs")
    )
    decoder_input_details: bool = False
    prompt_logprobs: int | None = Field(None, ge=0)
    details: bool | None = None  # None: on under tgi_compat, as in DJL
    # None: rolling batch answers the generation alone; dynamic batching, as DJL's handler
    # (which decodes the whole sequence), the prompt and the generation.
    return_full_text: bool | None = None

    @property
    def wants_prefill(self) -> bool:
        return self.decoder_input_details or bool(self.prompt_logprobs)

    @property
    def returned_sequences(self) -> int:
        # As in DJL: best_of alone returns every sequence it generates (TGI's best_of_sequences).
        return self.n or self.best_of or 1

    @property
    def num_sequences(self) -> int:
        return max(self.returned_sequences, self.best_of or 1)


def wants_sampling(p: LmiParameters) -> bool:
    """`do_sample` decides when given; otherwise a sampling parameter must ask for it.

    As in TGI (whose schema LMI's is), values equal to their neutral default (temperature 1.0,
    top_k 0 or -1, top_p / typical_p 1.0, min_p 0) ask for nothing. Temperature 0 is greedy.
    """
    if p.temperature == 0:
        return False
    if p.do_sample is not None:
        return p.do_sample
    return (
        p.temperature not in (None, 1.0)
        or (p.top_k or 0) > 0
        or (p.top_p or 1.0) < 1.0
        or (p.typical_p or 1.0) < 1.0
        or (p.min_p or 0.0) > 0.0
    )


def _stop_strings(p: LmiParameters) -> list[str]:
    found: list[str] = []
    for value in (p.stop_sequences, p.stop):
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            found.extend(value)
    return list(dict.fromkeys(s for s in found if s))  # drop "" and duplicates, keep order


def to_sampling_params(p: LmiParameters) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        do_sample=wants_sampling(p),
        # Temperature 0 means greedy; 1.0 keeps engines from dividing by it.
        temperature=p.temperature or 1.0,
        top_k=max(p.top_k or 0, 0),
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        min_p=p.min_p or 0.0,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed,
        stop_sequences=_stop_strings(p),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        truncate=p.truncate,
        top_logprobs=p.top_logprobs,
        prompt_logprobs=p.wants_prefill,
        n=p.returned_sequences,
        best_of=p.best_of,
    )
