"""Media made in the tests: images (PIL), video (PyAV), WAV (the standard library), the bad
files the media checks must refuse, and a local HTTP server to fetch them from."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import struct
import threading
import wave
import zlib
from collections.abc import Iterator

import numpy as np
from PIL import Image


def png(width: int = 32, height: int = 24, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def jpeg(seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(png(seed=seed))).save(out, format="JPEG")
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(
        ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(side: int = 50_000) -> bytes:
    """A PNG header saying side x side pixels (gray, 1 bit), with a few bytes of data: small on
    the wire, gigabytes once decoded."""
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 1024)) + _chunk(b"IEND", b""))


def truncated_png() -> bytes:
    whole = png(64, 64)
    return whole[: len(whole) // 2]


def wav(seconds: float = 0.5, rate: int = 16000, freq: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (np.sin(2 * np.pi * freq * t) * 12000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


def mp4(frames: int = 6, width: int = 32, height: int = 32, fmt: str = "mp4") -> bytes:
    """A short MPEG-4 video (frames of random colours) in container `fmt`."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        container.start_encoding()  # the header, even with no frame to follow
        rng = np.random.default_rng(1)
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def frameless_avi() -> bytes:
    """An AVI file with a video stream and not one frame."""
    return mp4(0, fmt="avi")


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@contextlib.contextmanager
def media_server(files: dict[str, bytes], redirects: dict[str, str] | None = None,
                 stall: set[str] | None = None, stalled: threading.Semaphore | None = None,
                 release: threading.Event | None = None) -> Iterator[str]:
    """Serve `files` by path on a free loopback port; `redirects`: path -> Location; a path in
    `stall` sends its headers and then nothing until `release` is set or the server closes
    (`stalled` is released once per such request). Yields the base URL."""
    release = release or threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            if self.path in (redirects or {}):
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.end_headers()
                return
            if self.path in (stall or set()):
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.flush()
                if stalled is not None:
                    stalled.release()
                release.wait(30)
                return
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
