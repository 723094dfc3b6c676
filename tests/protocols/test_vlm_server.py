"""A tiny random-weight LLaVA served by `lmi-serve` (the torch engine), asked by the official
openai and anthropic clients: images from a URL a local HTTP server in the test serves, from a
server path under option.allowed_local_media_path (MindIE's plain string), and as base64. The
answers equal transformers' own generate() on the same inputs; media tokens count in
usage.prompt_tokens; bad images and too many of them are refused (400) while another client's
stream runs on to its end."""

from __future__ import annotations

import base64

import anthropic
import httpx
import openai
import pytest
from media_files import b64, bomb_png, media_server, png, truncated_png
from server_process import running_server
from tiny_vlm import TEMPLATE, make_tiny_vlm_dir, transformers_vlm_greedy
from transformers import AutoProcessor

from handlers.engine.media import MediaLimits, MediaReader
from handlers.engine.torch.media_prompts import MediaPrompts

TOKENS = 6
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_vlm_dir("llava", tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "local.png").write_bytes(png(seed=7))
    return media


@pytest.fixture(scope="module")
def files():
    with media_server({"/a.png": png(seed=1)}) as base:
        yield base


@pytest.fixture(scope="module")
def url(model, folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(f"option.model_id={model}", "option.rolling_batch=torch",
                        "option.model_name=llava", "option.dtype=fp32",
                        "option.embedding_model_id=none",
                        "option.max_model_len=512", f"option.allowed_local_media_path={folder}",
                        "option.limit_mm_per_prompt=image=2",
                        "option.allowed_media_domains=127.0.0.1", log_path=log) as base:
        yield base


def expected(model, seed: int) -> tuple[str, int]:
    """transformers' greedy answer to QUESTION about png(seed), and the prompt's tokens."""
    processor = AutoProcessor.from_pretrained(model)
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}],
        chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    item = MediaReader(frozenset({"image"}), MediaLimits()).read("image", b64(png(seed=seed)),
                                                                 "p")
    inputs = MediaPrompts(processor).inputs(prompt, (item,))
    ids = transformers_vlm_greedy(model, inputs, TOKENS)
    count = inputs["input_ids"].shape[1]
    assert count > len(processor.tokenizer.encode(prompt)) + 2  # the image's tokens expanded
    return processor.tokenizer.decode(ids, skip_special_tokens=True), count


def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def ask(url, image: object):
    return oai(url).chat.completions.create(
        model="llava", max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": TOKENS},
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                               {"type": "image_url", "image_url": image}]}])


def test_openai_url_path_and_base64(url, model, folder, files):
    for image, seed in [({"url": f"{files}/a.png"}, 1), (str(folder / "local.png"), 7),
                        ({"url": f"data:image/png;base64,{b64(png(seed=2))}"}, 2)]:
        answer = ask(url, image)
        text, prompt_tokens = expected(model, seed)
        assert answer.choices[0].message.content == text
        assert answer.usage.prompt_tokens == prompt_tokens  # the image's tokens count


def test_anthropic_base64_image(url, model):
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    message = client.messages.create(
        model="llava", max_tokens=TOKENS,
        extra_body={"temperature": 0, "ignore_eos": True, "min_tokens": TOKENS},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(seed=3)).decode()}}]}])
    text, prompt_tokens = expected(model, 3)
    assert message.content[0].text == text
    assert message.usage.input_tokens == prompt_tokens


def test_bad_images_refused_while_a_stream_runs(url, folder, files):
    client = oai(url)
    stream = client.chat.completions.create(
        model="llava", max_tokens=64, stream=True, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Tell me a long story."}])
    first = next(iter(stream))
    bad = [({"url": f"data:image/png;base64,{b64(bomb_png())}"}, "decompression bomb"),
           ({"url": f"data:image/png;base64,{b64(truncated_png())}"}, "truncated"),
           (str(folder / ".." / "elsewhere.png"), "not under option.allowed_local_media_path"),
           ({"url": files.replace("127.0.0.1", "localhost") + "/a.png"},
            "option.allowed_media_domains")]
    for image, says in bad:
        with pytest.raises(openai.BadRequestError, match=says):
            ask(url, image)
    with pytest.raises(openai.BadRequestError, match="3 image parts; at most 2"):
        client.chat.completions.create(model="llava", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": b64(png())}] * 3}])
    with pytest.raises(openai.BadRequestError, match="takes image content, not audio"):
        client.chat.completions.create(model="llava", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "audio_url", "audio_url": f"{files}/a.wav"}]}])
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 60


def test_tokenize_and_count_tokens_count_the_media(url, model):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png(seed=5))}"}}]}]
    _, prompt_tokens = expected(model, 5)
    counted = httpx.post(f"{url}/tokenize", timeout=60,
                         json={"model": "llava", "messages": messages}).json()
    assert counted["count"] == prompt_tokens == len(counted["tokens"])
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    tokens = client.messages.count_tokens(model="llava", messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": b64(png(seed=5))}}]}])
    assert tokens.input_tokens == prompt_tokens
