"""Models that are not on local disk, fetched at startup as DJL LMI fetches them: a Hugging Face
Hub id through huggingface_hub (into its cache; a cached snapshot serves offline) and an
`s3://bucket/prefix` URI through boto3 (into `$LMI_CACHE_DIR/s3/...`, reused while the objects
are unchanged). A download is logged file by file; it lands complete or not at all, so a later
start never trusts half a model. Nothing is fetched after startup.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a model directory needs: configs, weights, tokenizer files, chat templates (sentence-
# transformers' modules too); not the .bin, .h5 or .msgpack copies of the same weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]
MANIFEST = ".lmi-s3-manifest.json"


class FetchError(RuntimeError):
    """A model that could not be fetched; the message names the source."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("LMI_CACHE_DIR") or Path.home() / ".cache" / "lmi-serve")


# --- the Hugging Face Hub -------------------------------------------------------------------


def fetch_hub(repo_id: str, revision: str | None) -> Path:
    """The snapshot of `repo_id` at `revision` in huggingface_hub's cache, downloaded if need
    be (HF_TOKEN, HF_ENDPOINT and HF_HOME apply); a cached one when the Hub cannot be reached."""
    import httpx2  # huggingface_hub's HTTP client: its connection errors are not OSErrors
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    started = time.perf_counter()
    log.info("fetching %s from the Hugging Face Hub", where)
    try:
        # snapshot_download would itself fall back to a cached snapshot, silently: asking for
        # the model's info first tells an unreachable Hub (said in the log) from a download.
        HfApi().model_info(repo_id, revision=revision)
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                 tqdm_class=_logged_progress(where))
    except (httpx2.HTTPError, LocalEntryNotFoundError, OSError) as exc:
        if _is_missing(exc):
            raise FetchError(f"option.model_id {where}: the Hugging Face Hub has no such "
                             f"model or revision ({type(exc).__name__}: {exc})") from None
        path = _cached_snapshot(repo_id, revision, where, exc)
    log.info("fetched %s into %s in %.1f s", where, path, time.perf_counter() - started)
    return Path(path)


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
        raise FetchError(f"option.model_id {where}: cannot download it from the Hugging Face "
                         f"Hub and no copy is cached ({type(exc).__name__}: {exc})") from None
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

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/")
    target = (cache_dir or default_cache_dir()) / "s3" / bucket / (prefix or "_root")
    client = boto3.client("s3")
    try:
        objects = _list(client, bucket, prefix)
    except (BotoCoreError, ClientError) as exc:
        if (target / MANIFEST).is_file():
            log.warning("S3 cannot be reached (%s); serving the cached copy of %s in %s",
                        exc, uri, target)
            return target
        raise FetchError(f"option.model_id {uri}: cannot list it ({exc})") from None
    if not objects:
        raise FetchError(f"option.model_id {uri}: no objects under it")
    if _manifest(target) == objects:
        log.info("%s is cached in %s, unchanged", uri, target)
        return target
    _download(client, bucket, prefix, objects, target, uri)
    return target


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
        raise FetchError(f"option.model_id {uri}: the download failed ({exc})") from None
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
