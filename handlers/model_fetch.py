"""Models that are not on local disk, fetched at startup as DJL LMI fetches them: a Hugging Face
Hub id through huggingface_hub (into its cache; a cached snapshot serves offline) and an
`s3://bucket/prefix` URI through boto3 (into `$LMI_CACHE_DIR/s3/...`, reused while the objects
are unchanged). A download is logged file by file; it lands complete or not at all, so a later
start never trusts half a model. Every name that becomes a local path (the URI's bucket and
prefix, each object key, each Hub file name) is checked before the first byte is written: one
that would land outside its folder fails the fetch, naming it. Errors name the source, never a
local path. What may be fetched after startup is the management routes' to decide
(handlers/server/adapter_sources.py).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)

# What a model directory needs: configs, weights, tokenizer files, chat templates (sentence-
# transformers' modules too); not the .bin, .h5 or .msgpack copies of the same weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]
MANIFEST = ".lmi-s3-manifest.json"


class FetchError(RuntimeError):
    """A model that could not be fetched; the message names the source and what went wrong,
    never a local path (it may reach a client of the management routes)."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")


def escapes(name: str) -> bool:
    """Whether `name`, a fetched object's path relative to its folder, could land anywhere but
    inside it: empty, absolute, a `..` segment, a NUL byte."""
    path = PurePosixPath(name)
    return "\0" in name or not path.parts or path.is_absolute() or ".." in path.parts


def _outside(names: dict[str, str], source: str, what: str) -> None:
    """FetchError naming (as the source spells it) the first of `names` (local name -> that
    spelling; all checked before any download) that would land outside its folder."""
    bad = sorted(shown for name, shown in names.items() if escapes(name))
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FetchError(source, f"the {what} {bad[0]!r}{more} would be written outside its "
                         "folder in the cache; nothing was fetched")


def default_cache_dir() -> Path:
    return Path(os.environ.get("LMI_CACHE_DIR") or Path.home() / ".cache" / "lmi-serve")


# --- the Hugging Face Hub -------------------------------------------------------------------


def check_hub_id(repo_id: str) -> None:
    """FetchError for an id the Hub could not name (`a/..`, `a--b`), asked of no network."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise FetchError(repo_id, f"not a Hugging Face Hub id ({exc})") from None


def fetch_hub(repo_id: str, revision: str | None) -> Path:
    """The snapshot of `repo_id` at `revision` in huggingface_hub's cache, downloaded if need
    be (HF_TOKEN, HF_ENDPOINT and HF_HOME apply); a cached one when the Hub cannot be reached."""
    import httpx2  # huggingface_hub's HTTP client: its connection errors are not OSErrors
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    check_hub_id(repo_id)
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    started = time.perf_counter()
    log.info("fetching %s from the Hugging Face Hub", where)
    try:
        # snapshot_download would itself fall back to a cached snapshot, silently: asking for
        # the model's files first tells an unreachable Hub (said in the log) from a download.
        _check_hub_files(repo_id, revision, where)
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                 tqdm_class=_logged_progress(where))
    except (httpx2.HTTPError, LocalEntryNotFoundError, OSError) as exc:
        if _is_missing(exc):
            raise FetchError(where, "the Hugging Face Hub has no such model or revision "
                             f"({type(exc).__name__}: {exc})") from None
        path = _cached_snapshot(repo_id, revision, where, exc)
    log.info("fetched %s into %s in %.1f s", where, path, time.perf_counter() - started)
    return Path(path)


def _check_hub_files(repo_id: str, revision: str | None, where: str) -> None:
    """Refuse the repo before any download if a file it would fetch could land outside its
    snapshot, or its commit id could not name a folder. huggingface_hub 2.4 refuses such a
    file name too, but only as it downloads that file, with the others (fetched concurrently)
    written already; and it makes paths of the commit id unchecked."""
    from huggingface_hub import HfApi
    from huggingface_hub.file_download import REGEX_COMMIT_HASH
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    sha = api.model_info(repo_id, revision=revision).sha
    if sha is None or not REGEX_COMMIT_HASH.fullmatch(sha):
        raise FetchError(where, f"the Hugging Face Hub answered {sha!r} for its commit id")
    names = api.list_repo_files(repo_id, revision=sha)
    fetched = filter_repo_objects(names, allow_patterns=HUB_PATTERNS)
    _outside({name: name for name in fetched}, where, "file")


def _is_missing(exc: Exception) -> bool:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    return isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError)


def _cached_snapshot(repo_id: str, revision: str | None, where: str, exc: Exception) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                 local_files_only=True)
    except LocalEntryNotFoundError:
        raise FetchError(where, "cannot download it from the Hugging Face Hub and no copy is "
                         f"cached ({type(exc).__name__}: {exc})") from None
    log.warning("the Hugging Face Hub cannot be reached (%s); serving the cached snapshot of %s",
                exc, where)
    return path


def _logged_progress(what: str) -> Any:
    """A tqdm class for snapshot_download that logs each file fetched instead of drawing bars."""
    from tqdm.auto import tqdm

    class LoggedProgress(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = io.StringIO()  # no bar on the terminal: the log says it
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.unit != "B":  # snapshot_download drives its byte bars with this class too
                log.info("fetching %s: %d of %s files", what, self.n, self.total or "?")
            return shown

    return LoggedProgress


# --- S3 -----------------------------------------------------------------------------------------


def fetch_s3(uri: str, cache_dir: Path | None = None) -> Path:
    """The objects under `uri` as a local directory (AWS credentials, region and
    AWS_ENDPOINT_URL apply), reused while they are unchanged."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix, target = s3_location(uri, cache_dir)
    client = boto3.client("s3")
    try:
        objects = _list(client, bucket, prefix)
    except (BotoCoreError, ClientError) as exc:
        if (target / MANIFEST).is_file():
            log.warning("S3 cannot be reached (%s); serving the cached copy of %s in %s",
                        exc, uri, target)
            return target
        raise FetchError(uri, f"cannot list it ({exc})") from None
    if not objects:
        raise FetchError(uri, "no objects under it")
    _outside({name: f"{prefix}/{name}" if prefix else name for name in objects}, uri,
             "object key")
    if _manifest(target) == objects:
        log.info("%s is cached in %s, unchanged", uri, target)
        return target
    _download(client, bucket, prefix, objects, target, uri)
    return target


def s3_location(uri: str, cache_dir: Path | None = None) -> tuple[str, str, Path]:
    """(bucket, prefix, the local copy's folder) of an s3:// URI; FetchError for one whose
    bucket or prefix could not name a folder inside the cache (`s3://..`, `s3://b/../x`,
    `s3://b//etc`), asked of no network."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/")
    if escapes(bucket) or (prefix and escapes(prefix)):
        raise FetchError(uri, "its bucket and prefix name no folder inside the cache (an "
                         "empty bucket, or a `..` segment or a leading / in either)")
    return bucket, prefix, (cache_dir or default_cache_dir()) / "s3" / bucket / (prefix or "_root")


def _list(client: Any, bucket: str, prefix: str) -> dict[str, list[Any]]:
    """Every object under the prefix: its key relative to the prefix -> [ETag, size]."""
    found: dict[str, list[Any]] = {}
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/" if prefix else "")
    for page in pages:
        for item in page.get("Contents", []):
            relative = item["Key"][len(prefix):].lstrip("/")
            if relative and not relative.endswith("/"):
                found[relative] = [item["ETag"], item["Size"]]
    return found


def _manifest(target: Path) -> dict[str, list[Any]] | None:
    try:
        return json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _download(client: Any, bucket: str, prefix: str, objects: dict[str, list[Any]],
              target: Path, uri: str) -> None:
    """Into a temporary sibling, then renamed: `target` is a whole model or absent."""
    from botocore.exceptions import BotoCoreError, ClientError

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    total = sum(size for _, size in objects.values())
    started, done = time.perf_counter(), 0
    log.info("fetching %s: %d files, %.1f MB, into %s", uri, len(objects), total / 1e6, target)
    try:
        for i, (relative, (_, size)) in enumerate(sorted(objects.items()), 1):
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            key = f"{prefix}/{relative}" if prefix else relative
            client.download_file(bucket, key, str(destination))
            done += size
            log.info("fetching %s: %d of %d files, %.1f of %.1f MB", uri, i, len(objects),
                     done / 1e6, total / 1e6)
        (staging / MANIFEST).write_text(json.dumps(objects))
        _replace(staging, target)
    except (BotoCoreError, ClientError, OSError) as exc:
        log.warning("fetching %s failed: %s", uri, exc)
        # An OSError's text names the file: its reason alone.
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise FetchError(uri, f"the download failed ({reason})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("fetched %s in %.1f s", uri, time.perf_counter() - started)


def _replace(staging: Path, target: Path) -> None:
    """Put `staging` at `target`, an older copy (its objects have changed) out of the way."""
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(staging, target)
