"""Media parts through every chat-shaped protocol, sent by the official clients to a real
server over the FakeEngine: OpenAI chat's image_url (object and MindIE's string), input_audio,
video_url and audio_url; the Responses API's input_image and input_audio; Anthropic's image
blocks (base64 and url); Databricks chat as OpenAI's. The engine receives each part read and
decoded, in order; every bad part is refused in the protocol's own error shape while another
client's stream runs on to its end; a text-only model refuses media as before."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fakes import FakeEngine, FakeTokenizer, served_app
from media_files import (
    b64,
    bomb_png,
    data_url,
    frameless_avi,
    media_server,
    mp4,
    png,
    truncated_png,
    wav,
)
from server_process import serving

from handlers.engine.media import MediaLimits, MediaReader

# Placeholders as multimodal chat templates write them: one word per media part.
MEDIA_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% for p in m.content %}"
                  "{% if p.type == 'text' %} {{ p.text }}{% else %} <{{ p.type }}>{% endif %}"
                  "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                  "{% endif %}")


class MediaTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        super().__init__(MEDIA_TEMPLATE)
        self.media = MediaReader(frozenset({"image", "audio", "video"}),
                                 MediaLimits(per_prompt={"image": 2, "audio": 1, "video": 1}))


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    with media_server({"/a.png": png(seed=3), "/b.png": png(seed=4), "/clip.mp4": mp4(),
                       "/tone.wav": wav(), "/bomb.png": bomb_png()}) as base:
        yield base


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(tokenizer=MediaTokenizer(), max_model_len=512, token_delay=0.01)


@pytest.fixture(scope="module")
def url(engine: FakeEngine) -> Iterator[str]:
    with serving(served_app(engine)) as base:
        yield base


@pytest.fixture(scope="module")
def text_only_url() -> Iterator[str]:
    with serving(served_app(FakeEngine())) as base:
        yield base


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def digest(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def last(engine: FakeEngine):
    return engine.requests[-1]


def test_openai_chat_parts(url, engine, files):
    answer = oai(url).chat.completions.create(model="fake-model", max_tokens=40, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": f"{files}/a.png", "detail": "low"}},
            {"type": "image_url", "image_url": data_url(png(seed=4), "image/png")},  # MindIE's
            {"type": "input_audio", "input_audio": {"data": b64(wav()), "format": "wav"}},
            {"type": "video_url", "video_url": {"url": f"{files}/clip.mp4"}},
        ]}])
    request = last(engine)
    assert [(m.kind, m.digest) for m in request.media] == [
        ("image", digest(png(seed=3))), ("image", digest(png(seed=4))),
        ("audio", digest(wav())), ("video", digest(mp4()))]
    assert request.media[0].data.size == (32, 24)
    assert request.media[3].data.shape[0] == 6
    assert "Compare <image> <image> <audio> <video>" in request.prompt
    assert answer.usage.prompt_tokens == len(request.prompt.split())


def test_audio_url_and_string_forms(url, engine, files):
    oai(url).chat.completions.create(model="fake-model", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "audio_url", "audio_url": f"{files}/tone.wav"},
                                     {"type": "text", "text": "what is it"}]}])
    assert [m.kind for m in last(engine).media] == ["audio"]


def test_databricks_chat_takes_the_same_parts(url, engine, files):
    reply = httpx.post(f"{url}/serving-endpoints/fake-model/invocations", timeout=30, json={
        "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": {"url": f"{files}/b.png"}}]}]})
    assert reply.status_code == 200, reply.text
    assert [m.digest for m in last(engine).media] == [digest(png(seed=4))]


def test_responses_input_image_and_audio(url, engine, files):
    oai(url).responses.create(model="fake-model", max_output_tokens=16, input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": f"{files}/a.png", "detail": "auto"},
            {"type": "input_audio", "input_audio": {"data": b64(wav()), "format": "wav"}}]}])
    request = last(engine)
    assert [(m.kind, m.digest) for m in request.media] == [
        ("image", digest(png(seed=3))), ("audio", digest(wav()))]
    assert "look <image> <audio>" in request.prompt


def test_anthropic_image_blocks(url, engine, files):
    message = claude(url).messages.create(model="fake-model", max_tokens=16, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(png(seed=4))}},
            {"type": "image", "source": {"type": "url", "url": f"{files}/a.png"}},
            {"type": "text", "text": "same?"}]}])
    request = last(engine)
    assert [m.digest for m in request.media] == [digest(png(seed=4)), digest(png(seed=3))]
    assert "<image> <image> same?" in request.prompt
    assert message.usage.input_tokens == len(request.prompt.split())


def _image(ref: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "x"},
                                         {"type": "image_url", "image_url": {"url": ref}}]}]


BAD_OPENAI = [
    (_image(b64(bomb_png())), "decompression bomb"),
    (_image(b64(truncated_png())), "truncated"),
    (_image(b64(wav())), "not an image"),
    (_image("/etc/passwd"), "option.allowed_local_media_path"),
    (_image("ftp://example.com/a.png"), "ftp: URL"),
    ([{"role": "user", "content": [{"type": "video_url",
                                    "video_url": data_url(frameless_avi(), "video/avi")}]}],
     "no frames"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": b64(png())}] * 3}],
     "3 image parts; at most 2"),
    ([{"role": "user", "content": [{"type": "input_audio",
                                    "input_audio": {"data": b64(wav()), "format": "ogg"}}]}],
     "format"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": b64(png())}]}],
     "user messages"),
]


def test_bad_parts_refused_while_a_stream_runs(url, engine, files):
    client = oai(url)
    bystander = client.chat.completions.create(
        model="fake-model", max_tokens=400, stream=True,
        messages=[{"role": "user", "content": " ".join(f"w{i}" for i in range(30))}])
    first = next(iter(bystander))
    assert first.choices[0].delta.role == "assistant"
    streaming = last(engine)
    for messages, says in [*BAD_OPENAI, (_image(f"{files}/bomb.png"), "decompression bomb")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="fake-model", max_tokens=4, messages=messages)
        error = caught.value.body
        assert says in error["message"] and error["param"].startswith("messages"), error
    with pytest.raises(openai.BadRequestError) as caught:  # Responses names its input
        client.responses.create(model="fake-model", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(truncated_png(), "image/png")}]}])
    assert caught.value.body["param"].startswith("input[0].content[0]")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(url).messages.create(model="fake-model", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": b64(bomb_png())}}]}])
    assert refused.value.body["type"] == "error"
    assert "messages.0.content.0" in refused.value.body["error"]["message"]
    assert streaming.request_id not in engine.finished  # it ran through every refusal
    chunks = list(bystander)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = first.choices[0].delta.content or ""
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 400


def test_text_only_model_refuses_media(text_only_url):
    with pytest.raises(openai.BadRequestError, match="text-only; image_url"):
        oai(text_only_url).chat.completions.create(model="fake-model", max_tokens=4,
                                                   messages=_image(b64(png())))
    with pytest.raises(openai.BadRequestError, match="text-only; input_image"):
        oai(text_only_url).responses.create(model="fake-model", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png(), "image/png")}]}])
    with pytest.raises(anthropic.BadRequestError, match="text-only; image"):
        claude(text_only_url).messages.create(model="fake-model", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": b64(png())}}]}])


def test_slow_media_hold_no_worker_other_requests_need(url, engine):
    """More stalled URLs than the server reads at once: a text request is answered while every
    one of them still waits on its URL (media are read in threads apart from the workers that
    render and validate requests)."""
    import threading

    arrived, release = threading.Semaphore(0), threading.Event()
    results: list[int] = []
    with media_server({}, stall={"/slow.png"}, stalled=arrived, release=release) as base:
        def stalled_request() -> None:
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "fake-model", "max_tokens": 2,
                "messages": _image(f"{base}/slow.png")})
            results.append(reply.status_code)

        threads = [threading.Thread(target=stalled_request) for _ in range(10)]
        for thread in threads:
            thread.start()
        for _ in range(8):  # the server's fetches, all of them held by the stall
            assert arrived.acquire(timeout=30)
        answer = oai(url).chat.completions.create(model="fake-model", max_tokens=3, messages=[
            {"role": "user", "content": "still answered"}])
        assert answer.choices[0].finish_reason == "length"
        assert results == []  # none of the stalled ones has ended
        release.set()
        for thread in threads:
            thread.join(60)
    assert len(results) == 10
