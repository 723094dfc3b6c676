"""A media part's bytes, from where its reference says: a `data:` URL, plain base64 (MindIE's
form), an http(s) URL, or a path on the server (a `file://` URL too). URLs are fetched in the
calling thread (a worker: never the event loop), a few at once, within a time limit and a size
cap, following redirects only to http(s) URLs the allow-list admits."""

from __future__ import annotations

import base64
import binascii
import re
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from handlers.engine.media.limits import MAX_FETCHES, MAX_REDIRECTS, MediaError, MediaLimits

_FETCHES = threading.BoundedSemaphore(MAX_FETCHES)
# Base64 may start with "/" as a path does (a JPEG's does: "/9j/"); a path has a dot, a dash
# or is short, base64 of a media file never.
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4}){16,}(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def read_bytes(ref: str, kind: str, limits: MediaLimits, where: str) -> bytes:
    """The bytes `ref` names, at most `limits.max_bytes[kind]`."""
    cap = limits.max_bytes[kind]
    scheme = urlsplit(ref).scheme.lower() if ":" in ref[:10] else ""
    if scheme == "data":
        return _data_url(ref, cap, where)
    if scheme in ("http", "https"):
        return _fetch(ref, kind, limits, where)
    if scheme == "file" or (ref.startswith("/") and not _BASE64.fullmatch(ref)):
        path = unquote(urlsplit(ref).path) if scheme == "file" else ref
        return _local(Path(path), cap, limits, where)
    if scheme:
        raise MediaError(where, f"a {scheme}: URL cannot be read; use http(s), data: or base64")
    return _base64(ref, cap, where)


def _base64(text: str, cap: int, where: str) -> bytes:
    if len(text) * 3 // 4 > cap + 3:
        raise MediaError(where, f"larger than the {cap >> 20} MB allowed")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(where, "neither a URL, a data: URL, a server path nor base64") from None


def _data_url(ref: str, cap: int, where: str) -> bytes:
    header, sep, payload = ref.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(where, "a data: URL must be base64 (data:<type>;base64,<data>)")
    return _base64(payload, cap, where)


def _local(path: Path, cap: int, limits: MediaLimits, where: str) -> bytes:
    if limits.local_path is None:
        raise MediaError(where, "server paths are not allowed: option.allowed_local_media_path "
                         "names the folder they may be read from")
    resolved = path.resolve()
    if not resolved.is_relative_to(limits.local_path):
        raise MediaError(where, f"not under option.allowed_local_media_path "
                         f"({limits.local_path})")
    if not resolved.is_file():
        raise MediaError(where, "no such file")
    if resolved.stat().st_size > cap:
        raise MediaError(where, f"larger than the {cap >> 20} MB allowed")
    return resolved.read_bytes()


def _fetch(url: str, kind: str, limits: MediaLimits, where: str) -> bytes:
    deadline = time.monotonic() + limits.timeout[kind]
    with _FETCHES, httpx.Client(follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_url(url, limits, where)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with client.stream("GET", url, timeout=left) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    return _body(response, limits.max_bytes[kind], deadline, where)
            except httpx.TimeoutException:
                break
            except httpx.HTTPError as exc:
                raise MediaError(where, f"fetching {url} failed: {exc}") from None
        else:
            raise MediaError(where, f"more than {MAX_REDIRECTS} redirects")
    raise MediaError(where, f"fetching {url} took longer than {limits.timeout[kind]:g} s")


def _check_url(url: str, limits: MediaLimits, where: str) -> None:
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(where, f"redirected to a {parts.scheme or 'relative'}: URL; only "
                         "http(s) URLs are followed")
    host = (parts.hostname or "").lower()
    if limits.domains is not None and host not in limits.domains:
        raise MediaError(where, f"host {host!r} is not in option.allowed_media_domains")


def _body(response: httpx.Response, cap: int, deadline: float, where: str) -> bytes:
    if response.status_code != 200:
        raise MediaError(where, f"fetching {response.url} answered {response.status_code}")
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise MediaError(where, f"larger than the {cap >> 20} MB allowed")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > cap:
            raise MediaError(where, f"larger than the {cap >> 20} MB allowed")
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("deadline")
        chunks.append(chunk)
    return b"".join(chunks)
