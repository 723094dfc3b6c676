"""Where the management APIs may read an adapter (or a model loaded at runtime) from.

A `src` is a local directory, an `s3://` URI or a Hugging Face Hub id; remote ones are fetched
into the model cache as models are (handlers/model_source.py). A local one must lie, once every
symlink is resolved, inside one of the configured roots (the model directory, the model cache,
the folders of the adapters configured at startup): the API must not read arbitrary files.
"""

from __future__ import annotations

from pathlib import Path

from handlers.model_source import ModelSourceError, fetch, is_remote


class SourceRefused(ValueError):
    """A `src` the API does not read; the message says why."""


def resolve_source(src: str, roots: tuple[Path, ...], base: Path, what: str = "adapters",
                   field: str = "src", files: tuple[str, ...] = ()) -> Path:
    """The local directory `src` names (relative paths from `base`, the model directory);
    fetched first when remote (slow: call it off the event loop). `what` is read, as the
    request's `field`; a file ending in one of `files` is read as well as a directory."""
    if "\0" in src:
        raise SourceRefused(f"{field}={src!r} is no usable path: it holds a NUL byte")
    try:
        remote = is_remote(src, base)
    except OSError:  # a name the file system refuses: no local adapter either
        remote = False
    if remote:
        try:
            return fetch(src)
        except ModelSourceError as exc:
            raise SourceRefused(f"{field}={src!r} cannot be fetched: {exc}") from None
    try:
        path = Path(src).expanduser()
        resolved = (path if path.is_absolute() else base / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop, ~nobody
        raise SourceRefused(f"{field}={src!r} is no usable path: {exc}") from None
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        allowed = ", ".join(str(root) for root in roots) or "none configured"
        raise SourceRefused(f"{field}={src!r} is outside the directories {what} may be read "
                            f"from ({allowed})")
    if not _is_dir(resolved) and not (resolved.suffix in files and resolved.is_file()):
        raise SourceRefused(f"{field}={src!r} is not a directory" + (
            f" (or a {', '.join(files)} file)" if files else ""))
    return resolved


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long, a permission denied
        return False
