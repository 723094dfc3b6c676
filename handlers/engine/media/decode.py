"""Bytes to what a model's processor takes: images through PIL, video through PyAV (FFmpeg),
audio through the standard library's wave (PyAV for the other formats). A file that is not what
its part says, truncated or too large once decoded is refused before it is decoded whole."""

from __future__ import annotations

import io
import wave
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from handlers.engine.media.limits import MAX_VIDEO_FRAMES, MediaError

IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"})
VIDEO_FORMATS = ("mp4", "mov", "avi", "asf", "matroska", "webm")  # ASF: WMV's container


def decode(kind: str, data: bytes, where: str) -> Any:
    return {"image": image, "video": video, "audio": audio}[kind](data, where)


def _check_pixels(width: int, height: int, where: str) -> None:
    # PIL's own bound (Image.MAX_IMAGE_PIXELS): a small file that would decode to gigabytes.
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        raise MediaError(where, f"{width}x{height} pixels is more than the {limit} allowed "
                         "(a decompression bomb?)")


def image(data: bytes, where: str) -> Image.Image:
    try:
        opened = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise MediaError(where, f"more pixels than the {Image.MAX_IMAGE_PIXELS} allowed (a "
                         "decompression bomb?)") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError(where, "not an image (JPEG, PNG, WebP, GIF or BMP)") from None
    if opened.format not in IMAGE_FORMATS:
        raise MediaError(where, f"{opened.format} images are not supported (JPEG, PNG, WebP, "
                         "GIF or BMP)")
    _check_pixels(*opened.size, where)
    try:
        opened.load()
        return opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise MediaError(where, "the image is truncated or corrupt") from None


def video(data: bytes, where: str) -> np.ndarray:
    """Up to MAX_VIDEO_FRAMES frames, evenly spaced: uint8 [frames, height, width, 3]."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not any(f in VIDEO_FORMATS for f in container.format.name.split(",")):
                raise MediaError(where, f"{container.format.name} is not a video container "
                                 "(MP4, AVI, WMV, MKV, WebM)")
            if not container.streams.video:
                raise MediaError(where, "the file has no video stream")
            stream = container.streams.video[0]
            _check_pixels(stream.codec_context.width, stream.codec_context.height, where)
            step = max(1, -(-(stream.frames or 0) // MAX_VIDEO_FRAMES))
            frames = [f.to_ndarray(format="rgb24")
                      for i, f in enumerate(container.decode(stream)) if i % step == 0]
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, OSError):
        raise MediaError(where, "not a video that can be decoded (MP4, AVI, WMV, MKV, "
                         "WebM)") from None
    if not frames:
        raise MediaError(where, "the video has no frames")
    if len(frames) > MAX_VIDEO_FRAMES:  # the container did not say how many it holds
        keep = np.linspace(0, len(frames) - 1, MAX_VIDEO_FRAMES).round().astype(int)
        frames = [frames[i] for i in keep]
    return np.stack(frames)


def audio(data: bytes, where: str) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and their sampling rate."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _wav(data, where)
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise MediaError(where, "not audio (WAV, MP3, FLAC)")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=stream.rate)
            pieces = [r.to_ndarray().reshape(-1) for frame in container.decode(stream)
                      for r in resampler.resample(frame)]
            rate = stream.rate
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, OSError):
        raise MediaError(where, "not audio that can be decoded (WAV, MP3, FLAC)") from None
    if not pieces or not rate:
        raise MediaError(where, "the audio has no samples")
    return np.concatenate(pieces).astype(np.float32), rate


def _wav(data: bytes, where: str) -> tuple[np.ndarray, int]:
    try:
        with wave.open(io.BytesIO(data)) as reader:
            width, channels, rate = reader.getsampwidth(), reader.getnchannels(), \
                reader.getframerate()
            frames = reader.getnframes()
            raw = reader.readframes(frames)
    except (wave.Error, EOFError):
        raise MediaError(where, "not a WAV file that can be read") from None
    if width not in (1, 2, 4) or len(raw) < frames * width * channels or not frames:
        raise MediaError(where, "the WAV file is truncated, empty or of an unsupported sample "
                         "width")
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}[width]
    samples = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    if width == 1:
        samples = samples - 128.0
    samples /= float(1 << (8 * width - 1))
    return samples.reshape(-1, channels).mean(axis=1), rate
