"""Media parts read safely (handlers/engine/media/): data: URLs, base64, http(s) URLs from a
local server (size cap, time limit, redirects, allow-list), server paths under
option.allowed_local_media_path only, and every bad file refused naming its part."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
from media_files import (
    b64,
    bomb_png,
    data_url,
    frameless_avi,
    jpeg,
    media_server,
    mp4,
    png,
    truncated_png,
    wav,
)

from handlers.config import values
from handlers.engine.media import MediaError, MediaLimits, MediaReader, sources

READER = MediaReader(frozenset({"image", "audio", "video"}), MediaLimits())


def refused(reader: MediaReader, kind: str, ref: str) -> str:
    with pytest.raises(MediaError) as caught:
        reader.read(kind, ref, "messages[0].content[1]")
    assert caught.value.message.startswith("messages[0].content[1]: ")
    return caught.value.message


def test_data_url_and_base64_give_the_same_image():
    a = READER.read("image", data_url(png(), "image/png"), "p")
    b = READER.read("image", b64(png()), "p")
    assert a.data.size == (32, 24) and a.data.mode == "RGB"
    assert a.digest == b.digest and a.kind == "image"
    assert READER.read("image", b64(png(seed=1)), "p").digest != a.digest
    assert READER.read("image", b64(jpeg()), "p").data.size == (32, 24)


def test_video_and_audio_decode():
    frames = READER.read("video", data_url(mp4(), "video/mp4"), "p").data
    assert frames.shape == (6, 32, 32, 3) and frames.dtype.name == "uint8"
    samples, rate = READER.read("audio", b64(wav()), "p").data
    assert rate == 16000 and samples.shape == (8000,) and 0.3 < abs(samples).max() <= 1


@pytest.mark.parametrize(("kind", "data", "says"), [
    ("image", bomb_png(), "decompression bomb"),
    ("image", truncated_png(), "truncated"),
    ("image", b"GIF87a not really", "not an image"),
    ("image", wav(), "not an image"),
    ("video", frameless_avi(), "no frames"),
    ("video", png(), "not a video container"),
    ("audio", png(), "not audio"),
    ("audio", b"RIFF\x10\x00\x00\x00WAVEfmt ", "WAV"),
])
def test_bad_files_are_refused_naming_the_part(kind, data, says):
    assert says in refused(READER, kind, b64(data))


def test_not_base64_nor_a_url():
    assert "neither a URL" in refused(READER, "image", "not base64 at all!")
    assert "ftp: URL cannot be read" in refused(READER, "image", "ftp://host/x.png")
    assert "must be base64" in refused(READER, "image", "data:image/png,raw")


def test_size_cap():
    small = MediaReader(READER.kinds, MediaLimits(max_bytes={"image": 1000, "audio": 1000,
                                                             "video": 1000}))
    assert "larger than" in refused(small, "image", b64(png(64, 64)))
    with media_server({"/big.png": png(64, 64)}) as base:
        assert "larger than" in refused(small, "image", f"{base}/big.png")


def test_http_url_fetched_and_redirect_rules(tmp_path):
    (tmp_path / "secret.png").write_bytes(png())
    with media_server({"/a.png": png()}, redirects={
            "/hop": "/a.png", "/to-file": f"file://{tmp_path}/secret.png",
            "/loop": "/loop"}) as base:
        assert READER.read("image", f"{base}/a.png", "p").digest == \
            READER.read("image", b64(png()), "p").digest
        assert READER.read("image", f"{base}/hop", "p").data.size == (32, 24)
        assert "only http(s) URLs are followed" in refused(READER, "image", f"{base}/to-file")
        assert "redirects" in refused(READER, "image", f"{base}/loop")
        assert "answered 404" in refused(READER, "image", f"{base}/missing.png")


def test_allowed_media_domains():
    only = MediaReader(READER.kinds, MediaLimits(domains=("example.com",)))
    with media_server({"/a.png": png()}) as base:
        assert "option.allowed_media_domains" in refused(only, "image", f"{base}/a.png")
        local = MediaReader(READER.kinds, MediaLimits(domains=("127.0.0.1",)))
        assert local.read("image", f"{base}/a.png", "p").kind == "image"


def test_a_stalled_url_times_out():
    quick = MediaReader(READER.kinds, MediaLimits(timeout={"image": 0.5, "audio": 0.5,
                                                           "video": 0.5}))
    with media_server({}, stall={"/slow.png"}) as base:
        assert "took longer than 0.5 s" in refused(quick, "image", f"{base}/slow.png")


def test_fetches_are_bounded(monkeypatch):
    """More URLs than MAX_FETCHES at once: the others wait for a turn (the semaphore)."""
    gate = threading.BoundedSemaphore(1)
    monkeypatch.setattr(sources, "_FETCHES", gate)
    with media_server({}, stall={"/slow.png"}) as base:
        quick = MediaReader(READER.kinds, MediaLimits(timeout={"image": 5, "audio": 5,
                                                               "video": 5}))
        holder = threading.Thread(target=lambda: pytest.raises(
            MediaError, quick.read, "image", f"{base}/slow.png", "p"))
        holder.start()
        while gate.acquire(blocking=False):  # until the holder has the one turn
            gate.release()
        assert not gate.acquire(blocking=False)  # a second fetch would wait here
        holder.join()
    assert gate.acquire(blocking=False)


def test_server_paths(tmp_path: Path):
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "a.png").write_bytes(png())
    (tmp_path / "outside.png").write_bytes(png())
    assert "option.allowed_local_media_path" in refused(READER, "image", str(folder / "a.png"))
    local = MediaReader(READER.kinds, MediaLimits(local_path=folder.resolve()))
    assert local.read("image", str(folder / "a.png"), "p").data.size == (32, 24)
    assert local.read("image", f"file://{folder}/a.png", "p").kind == "image"
    assert "not under" in refused(local, "image", str(folder / ".." / "outside.png"))
    assert "no such file" in refused(local, "image", str(folder / "b.png"))


def test_counts():
    limits = MediaLimits(per_prompt=values.modality_counts("image=2,video=1"))
    limits.check_counts(Counter(image=2, video=1), "messages")
    with pytest.raises(MediaError, match="3 image parts; at most 2.*limit_mm_per_prompt"):
        limits.check_counts(Counter(image=3), "messages")
    with pytest.raises(MediaError, match="1 audio parts; at most 0"):
        limits.check_counts(Counter(audio=1), "messages")
    with pytest.raises(MediaError, match="21 media parts; at most 20"):
        MediaLimits().check_counts(Counter(image=21), "messages")


def test_setting_values():
    assert values.modality_counts("image=2,video=1") == {"image": 2, "video": 1}
    assert values.modality_counts('{"image": 4}') == {"image": 4}
    for bad in ("image=two", "pictures=2", "image"):
        with pytest.raises(ValueError, match="modality=count"):
            values.modality_counts(bad)
    assert values.domain_list("Example.com, cdn.example.com") == ("example.com",
                                                                  "cdn.example.com")
    with pytest.raises(ValueError):
        values.domain_list("http://example.com/")


def test_media_settings_reach_the_limits_or_are_refused_for_a_text_model(tmp_path):
    from types import SimpleNamespace

    from handlers.cli import parse_args
    from handlers.config import ConfigError, load_config
    from handlers.engine.torch.build import _media_limits

    folder = tmp_path / "media"
    folder.mkdir()
    config = load_config(parse_args([
        "--model-dir", str(tmp_path), "--option", "option.limit_mm_per_prompt=image=2,video=1",
        "--option", "option.allowed_media_domains=cdn.example.com",
        "--option", f"option.allowed_local_media_path={folder}"]), {})
    limits = _media_limits(config, SimpleNamespace(processor=object(), name="vlm"))
    assert limits == MediaLimits({"image": 2, "video": 1}, ("cdn.example.com",),
                                 folder.resolve())
    with pytest.raises(ConfigError, match="option.limit_mm_per_prompt, .*reads text only"):
        _media_limits(config, SimpleNamespace(processor=None, name="text-model"))
