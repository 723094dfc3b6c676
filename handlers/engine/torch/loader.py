"""Model loading from local files (model_source.py fetched remote ones already): every
transformers call reads local files only (`local_files_only`), so loading never reaches a hub.

A source is a Hugging Face layout directory (config.json + *.safetensors) or a single .gguf file:
a GGUF whose linears run on quantized blocks, of an architecture gguf_model.py builds (llama,
qwen2, qwen3, phi3), is served from its own blocks, any other from its dequantized copy in the
GGUF cache (handlers/engine/gguf/), the log saying why.

On the CPU a Llama checkpoint is built by llama_model.py and its tokenizer loaded by its class,
without importing transformers' modeling code (~6 s of a start); anything else goes through
transformers' Auto classes, imported only then.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from handlers.engine import plain_tokenizer
from handlers.engine.gguf.cache import convert_gguf, gguf_cache_entry, tokenizer_dir
from handlers.engine.machine import resolve_device
from handlers.engine.plain_tokenizer import PlainTokenizer
from handlers.engine.torch import gguf_model, llama_model, quantization
from handlers.engine.torch.dtype_probe import choose_cpu_dtype
from handlers.engine.torch.quant_linear import QuantLinear
from handlers.model_source import derive_model_name

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class LoadedModel:
    model: nn.Module  # a causal LM in eval mode on `device` (transformers' or llama_model's)
    tokenizer: PreTrainedTokenizerBase  # with the model's chat template
    name: str  # e.g. "smollm2-135m-instruct"
    source: str  # the path it came from (the .gguf file, not its cache copy)
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: set[int]
    quantize: str = "none"  # the linears' weights: none (float), int8 or int4 (the narrowest)
    quantize_mode: str = "none"  # what option.quantize resolved to (quantization.py's Plan)
    processor: Any = None  # a multimodal model's AutoProcessor (its media); None: text only

    @property
    def quantization(self) -> str:
        """The mode, and the narrowest width where the mode does not say it (a GGUF's blocks)."""
        if self.quantize_mode in ("none", self.quantize):
            return self.quantize_mode
        return f"{self.quantize_mode} ({self.quantize})"


def check_dtype(dtype: str) -> None:
    if dtype.lower() != "auto" and dtype.lower() not in _DTYPES:
        raise ValueError(f"option.dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}.")


def resolve_dtype(dtype: str, device: torch.device, checkpoint: torch.dtype | None) -> torch.dtype:
    """The torch dtype for option.dtype. "auto" on the CPU: bfloat16 where this machine
    multiplies it clearly faster than float32 (measured, dtype_probe.py), else float32. On a
    GPU: the checkpoint's 16-bit dtype, else bfloat16 (float16 where bf16 is unsupported)."""
    check_dtype(dtype)
    name = dtype.lower()
    if name in _DTYPES:
        return _DTYPES[name]
    if device.type == "cpu":
        chosen, why = choose_cpu_dtype()
        logger.info("option.dtype=auto: %s on this CPU: %s", str(chosen).removeprefix("torch."),
                    why)
        return chosen
    if checkpoint in (torch.float16, torch.bfloat16):
        return checkpoint
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_model(
    source: Path,
    *,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    trust_remote_code: bool = False,
    cache_dir: Path | None = None,
    name: str | None = None,
    quantize: str | None = None,
) -> LoadedModel:
    """Load `source` (from `model_source.resolve_model_source`) as an eval-mode causal LM on
    `device`; `name` is the served name (else derived from the file's); `quantize`:
    option.quantize (quantization.py)."""
    started = time.perf_counter()
    target = resolve_device(device)
    check_dtype(dtype)  # reject a bad option.dtype or option.quantize before any slow work
    plan = quantization.plan(quantize, source, target, dtype)
    if plan.mode != "none" and dtype.lower() == "auto":
        dtype = "fp32"  # the quantized linears take float32 in; the rest follows
    elif plan.float_dtype is not None and dtype.lower() == "auto":
        dtype = "bf16" if plan.float_dtype == torch.bfloat16 else "fp32"  # measured already
        logger.info("option.dtype=auto: %s, as the quantization probe measured", dtype)
    logger.info("option.quantize=%s: %s (%s)", quantize or "auto", plan.mode, plan.why)
    blocks = _gguf_blocks(source, plan.mode, dtype, target, cache_dir)
    processor = None
    if blocks is not None:
        model, tokenizer, origin, quantized = blocks
    else:
        model, tokenizer, origin = _load_weights(source, dtype, target, trust_remote_code,
                                                 cache_dir, plan.mode)
        quantized = quantization.linear_widths(model)
        if not isinstance(tokenizer, (str, bytes)) and hasattr(tokenizer, "tokenizer") \
                and hasattr(tokenizer, "image_processor"):  # a multimodal model's processor
            processor, tokenizer = tokenizer, tokenizer.tokenizer
            if processor.chat_template and not getattr(tokenizer, "chat_template", None):
                tokenizer.chat_template = processor.chat_template
    if blocks is None and plan.mode != "none" and quantized == "none":
        quantized = quantization.quantize_model(model, plan.mode, source, cache_dir)
        origin += f"; linear layers {quantized}"
    model.to(target).eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or derive_model_name(source.name),
        source=str(source),
        max_model_len=_max_model_len(_text_config(model.config), max_model_len),
        device=target,
        dtype=model.dtype,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        quantize=quantized,
        quantize_mode=plan.mode,
        processor=processor,
    )
    logger.info(
        "Loaded %s from %s (%s): dtype=%s device=%s max_model_len=%d eos=%s in %.1f s",
        loaded.name, source, origin, loaded.dtype, target, loaded.max_model_len,
        sorted(loaded.eos_token_ids), time.perf_counter() - started,
    )  # fmt: skip
    logger.info("Weights of %s: %s", loaded.name, _weights_summary(model))
    return loaded


def _weights_summary(model: nn.Module) -> str:
    """What the linears, the token embedding and the output head are held in (the log's)."""
    def held(module: nn.Module | None) -> str:
        bits = getattr(module, "bits", None)
        if bits is not None:
            return f"int{bits} blocks"
        weight = getattr(module, "weight", None)
        return "-" if weight is None else str(weight.dtype).removeprefix("torch.")

    linears = quantization.linear_widths(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else model.get_decoder().embed_tokens
    head = model.get_output_embeddings()
    tied = any(isinstance(getattr(head, field, None), torch.Tensor)
               and isinstance(getattr(embedding, field, None), torch.Tensor)
               and getattr(head, field).data_ptr() == getattr(embedding, field).data_ptr()
               for field in ("weight", "weights"))
    return (f"linear layers {linears if linears != 'none' else 'float'}, token embedding "
            f"{held(embedding)}, output head {held(head)}{' (tied: the same)' if tied else ''}")


def _gguf_blocks(source: Path, mode: str, dtype: str, target: torch.device,
                 cache_dir: Path | None) -> tuple[nn.Module, Any, str, str] | None:
    """A GGUF served from its own blocks (gguf_model.py): the model, its tokenizer, where the
    weights came from and what its linears are; None where that module does not serve it (the
    GGUF is then dequantized, logged)."""
    if source.suffix.lower() != ".gguf" or mode not in gguf_model.MODES:
        return None
    try:
        model = gguf_model.load(source, mode, resolve_dtype(dtype, target, None), cache_dir)
    except gguf_model.Unsupported as why:
        logger.info("%s is dequantized to float, its linears quantized after: %s", source.name,
                    why)
        return None
    widths = {module.bits for module in model.modules() if isinstance(module, QuantLinear)}
    quantized = f"int{min(widths)}"
    origin = f"GGUF, served from its blocks (linear layers {quantized}, the token embedding " \
             f"int{model.model.embed_tokens.bits}; no float copy)"
    return model, _llama_tokenizer(tokenizer_dir(source, cache_dir)), origin, quantized


def _load_weights(
    source: Path, dtype: str, target: torch.device, trust_remote_code: bool,
    cache_dir: Path | None, mode: str,
) -> tuple[nn.Module, PreTrainedTokenizerBase, str]:
    """The model (in its final dtype, still on CPU or `target`; a Llama checkpoint's linears
    quantized for `mode` as they are read), its tokenizer, and a note on where the weights were
    read from."""
    origin = "safetensors checkpoint"
    if source.suffix.lower() == ".gguf":
        entry = gguf_cache_entry(source, cache_dir)
        if not entry.is_dir():
            model, tokenizer = convert_gguf(source, entry)
            model.to(resolve_dtype(dtype, target, model.dtype))
            return model, tokenizer, f"GGUF, converted and cached in {entry}"
        source, origin = entry, f"GGUF, cached conversion in {entry}"
    why_not = "not on the CPU" if target.type != "cpu" else llama_model.unsupported(source)
    if why_not is None:
        model = llama_model.load(source, resolve_dtype(dtype, target, None),
                                 quantization.load_widths(mode))
        return model, _llama_tokenizer(source), origin
    logger.info("Loading %s with transformers' classes (%s)", source, why_not)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(source, **kwargs)
    torch_dtype = resolve_dtype(dtype, target, _checkpoint_dtype(config))
    if is_multimodal(config):
        if config.model_type not in VISION_FAMILIES:
            raise ValueError(
                f"{source}: the torch engine serves the vision-language families "
                f"{', '.join(VISION_FAMILIES)}, not {config.model_type} (others place their "
                "media tokens by positions or attention of their own); the vllm engine serves it")
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(source, config=config,
                                                            dtype=torch_dtype, **kwargs)
        # The processor stands in for the tokenizer until load_model splits them.
        return model, AutoProcessor.from_pretrained(source, **kwargs), origin + ", multimodal"
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch_dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    return model, tokenizer, origin


# The vision-language families whose media are input embeddings in place of their placeholder
# tokens, under the language model's own positions and causal attention: what the runner's
# passes compute (tested on each).
VISION_FAMILIES = ("llava", "llava_next", "idefics3")


def is_multimodal(config: Any) -> bool:
    """A vision-language model: a text model with a vision encoder beside it."""
    return getattr(config, "vision_config", None) is not None \
        and getattr(config, "text_config", None) is not None


def _llama_tokenizer(source: Path) -> PreTrainedTokenizerBase | PlainTokenizer:
    """The tokenizer AutoTokenizer would give a Llama checkpoint, without AutoTokenizer's import
    of the modeling code: a generic tokenizers-backed one (no remote code) is read without
    transformers where transformers would take it as it is, else by transformers' class; anything
    else goes through AutoTokenizer."""
    if (plain := plain_tokenizer.load(source)) is not None:
        return plain
    config_file = source / "tokenizer_config.json"
    named: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if named.get("tokenizer_class") in plain_tokenizer.GENERIC_CLASSES and "auto_map" not in named:
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def _text_config(config: Any) -> Any:
    """A multimodal model's language model's config (the context length is its)."""
    text = getattr(config, "get_text_config", None)
    return text() if text is not None else config


def _checkpoint_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _max_model_len(config: Any, option: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        if option is None:
            raise ValueError("The model's config names no context length: set option.max_model_len")
        return option
    if option is not None and option > limit:
        logger.warning("option.max_model_len %d exceeds the model's %d; using that", option, limit)
    return min(option or limit, limit)


def _eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    generation = getattr(model, "generation_config", None)
    sources = (getattr(generation, "eos_token_id", None),
               getattr(_text_config(model.config), "eos_token_id", None),
               tokenizer.eos_token_id)  # fmt: skip
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
