"""Where the management APIs may read an adapter (or a model loaded at runtime) from.

A `src` is a local directory, an `s3://` URI or a Hugging Face Hub id. A remote one is fetched
into the model cache as models are (handlers/model_source.py), and only where
option.allow_runtime_fetch allows it: off, the server downloads nothing after startup. A local
one must lie, once every symlink is resolved, inside one of the configured roots (the model
directory, the model cache, the folders of the adapters configured at startup): the API must
not read arbitrary files. One holding a model.py is refused: a model.py's code is imported at
startup only (handlers/djl/model_code.py), never because a request named it. Refusals name the
`src` as the client sent it, never a server path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from handlers.model_source import ModelSourceError, check_remote, fetch, is_remote

log = logging.getLogger(__name__)

MODEL_PY = "model.py"  # DJL's custom code (its formatters), which a request never loads
ALLOW_FETCH = "option.allow_runtime_fetch"


class SourceRefused(ValueError):
    """A `src` the API does not read; the message says why."""


def resolve_source(src: str, roots: tuple[Path, ...], base: Path, what: str = "adapters",
                   field: str = "src", files: tuple[str, ...] = (), *,
                   fetch_allowed: bool = False) -> Path:
    """The local directory `src` names (relative paths from `base`, the model directory);
    fetched first when remote and `fetch_allowed` (slow: call it off the event loop). `what` is
    read, as the request's `field`; a file ending in one of `files` is read as well as a
    directory."""
    if "\0" in src:
        raise SourceRefused(f"{field}={src!r} is no usable path: it holds a NUL byte")
    try:
        remote = is_remote(src, base)
    except OSError:  # a name the file system refuses: no local adapter either
        remote = False
    if remote:
        return _without_code(_fetched(src, field, fetch_allowed), src, field)
    try:
        path = Path(src).expanduser()
        resolved = (path if path.is_absolute() else base / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a symlink loop, ~nobody
        log.info("%s=%r is no usable path: %s", field, src, exc)  # the texts name server paths
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            "it does not resolve: a symlink loop, or the home of no user"
        raise SourceRefused(f"{field}={src!r} is no usable path ({reason})") from None
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        log.info("%s=%r (%s) is outside the roots %s may be read from: %s", field, src,
                 resolved, what, ", ".join(str(root) for root in roots) or "none configured")
        raise SourceRefused(f"{field}={src!r} is outside the directories {what} may be read "
                            "from")
    if not _is_dir(resolved) and not (resolved.suffix in files and resolved.is_file()):
        raise SourceRefused(f"{field}={src!r} is not a directory" + (
            f" (or a {', '.join(files)} file)" if files else ""))
    return _without_code(resolved, src, field)


def _without_code(path: Path, src: str, field: str) -> Path:
    if path.is_dir() and (path / MODEL_PY).is_file():
        raise SourceRefused(f"{field}={src!r} holds a {MODEL_PY}: code runs only as imported at "
                            "startup, from the model directory or its adapters/ folder")
    return path


def _fetched(src: str, field: str, fetch_allowed: bool) -> Path:
    """The local copy of remote `src`: a malformed one, or any with fetching off, is refused
    before the network is asked."""
    try:
        check_remote(src)
        if not fetch_allowed:
            where = "S3" if src.startswith("s3://") else "the Hugging Face Hub"
            raise SourceRefused(f"{field}={src!r} names no local directory, and fetching from "
                                f"{where} at runtime is off ({ALLOW_FETCH}=false)")
        return fetch(src)
    except ModelSourceError as exc:
        raise SourceRefused(f"{field}: {exc}") from None


def as_sent(message: str, path: Path, src: str) -> str:
    """`message` (an engine's or a loader's, about the source read from `path`) with that path
    said as the client sent it, `src`: answers name what the client sent, never where the
    server keeps it."""
    return message.replace(str(path), src)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long, a permission denied
        return False
