"""Tiny random-weight vision-language checkpoints built from transformers' configs, with the
SmolLM2 tokenizer (plus each family's media tokens) and PIL image processors (torchvision is
not installed): LLaVA, LLaVA-NeXT and Idefics3 (SmolVLM). Weights are drawn wider than the
default init so that an image changes the greedy answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, CLIPVisionConfig, LlamaConfig

from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.model_source import default_model_path

# The chat template every tiny VLM gets: media parts as the processor's placeholder.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for p in m.content %}"
            "{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
FAMILIES = ("llava", "llava_next", "idefics3")


def _tokenizer(extra: list[str]) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(cached_gguf_dir(default_model_path()),
                                              local_files_only=True)
    tokenizer.add_tokens(extra, special_tokens=True)
    return tokenizer


def _text(tokenizer: Any, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=head_dim,
                       max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=False, initializer_range=0.2)


def _clip(image_size: int) -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, image_size=image_size, patch_size=14,
                            projection_dim=32, initializer_range=0.2, initializer_factor=5.0)


def _llava(tokenizer: Any, head_dim: int = 16) -> tuple[Any, Any]:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    config = LlavaConfig(vision_config=_clip(28), text_config=_text(tokenizer, head_dim),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    images = LlavaImageProcessorPil(size={"shortest_edge": 28},
                                    crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                               num_additional_image_tokens=1, chat_template=TEMPLATE,
                               vision_feature_select_strategy="default")
    return LlavaForConditionalGeneration(config), processor


def _llava_next(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    grid = [[28, 28], [28, 56], [56, 28]]
    config = LlavaNextConfig(vision_config=_clip(28), text_config=_text(tokenizer),
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=grid, vision_feature_layer=-2,
                             vision_feature_select_strategy="default")
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28},
                                        crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=grid)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                   num_additional_image_tokens=1, chat_template=TEMPLATE,
                                   vision_feature_select_strategy="default")
    return LlavaNextForConditionalGeneration(config), processor


def _idefics3(tokenizer: Any, head_dim: int = 16) -> tuple[Any, Any]:
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=28, patch_size=14,
                                  initializer_range=0.2)
    config = Idefics3Config(vision_config=vision, text_config=_text(tokenizer, head_dim),
                            scale_factor=2,
                            pad_token_id=tokenizer.pad_token_id,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56},
                                       max_image_size={"longest_edge": 28})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=1,
                                  chat_template=TEMPLATE)
    return Idefics3ForConditionalGeneration(config), processor


BUILDERS = {"llava": (_llava, ["<image>"]), "llava_next": (_llava_next, ["<image>"]),
            "idefics3": (_idefics3, ["<image>", "<fake_token_around_image>", "<global-img>",
                                     "<end_of_utterance>"])}


def make_tiny_vlm_dir(family: str, path: Path, seed: int = 11, **shape: Any) -> Path:
    """`shape`: head_dim=64 for vLLM's CPU attention (LLaVA, Idefics3)."""
    build, tokens = BUILDERS[family]
    tokenizer = _tokenizer(tokens)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = build(tokenizer, **shape)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def transformers_vlm_greedy(folder: Path, inputs: dict[str, Any], tokens: int) -> list[int]:
    """transformers' own generate() on the processor's `inputs`, greedy, `tokens` new ids."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
