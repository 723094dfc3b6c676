"""A local stand-in of the Hugging Face Hub's HTTP endpoints: what huggingface_hub 2.4.0's
`snapshot_download` and `hf_hub_download` call, serving repos from local directories.

The client asks, in order: the repo info at a revision (`/api/models/{id}/revision/{rev}`, for
the commit `sha`; skipped when the revision is a commit sha), the recursive tree listing at that
commit (`/api/models/{id}/tree/{sha}`), then HEAD and GET of each file's resolve URL, reading
X-Repo-Commit, ETag and Content-Length from the HEAD. Files are served here as plain git blobs:
no LFS redirect to a CDN and no X-Xet-* header, so the client downloads over plain HTTP from
this server. Errors carry the X-Error-Code that `hf_raise_for_status` turns into
RepositoryNotFoundError, RevisionNotFoundError or RemoteEntryNotFoundError. The client's
best-effort lookup of `/api/agent-harnesses` gets a 404, which it ignores (an answer would be
cached in the real HF_HOME).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from huggingface_hub import constants
from server_process import serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class FakeRepo:
    """A model repo whose files are those under `folder`, all at one commit, and `extra` ones
    under names no folder could hold (`../x`), each with the content of a local file."""

    repo_id: str
    folder: Path
    extra: dict[str, Path] = field(default_factory=dict)

    @property
    def sha(self) -> str:
        """The commit "main" names: fixed per repo, 40 hex digits like a git sha."""
        return hashlib.sha1(self.repo_id.encode()).hexdigest()

    def files(self) -> dict[str, Path]:
        return {p.relative_to(self.folder).as_posix(): p
                for p in sorted(self.folder.rglob("*")) if p.is_file()} | self.extra


class HubError(Exception):
    """An error answer, with the X-Error-Code huggingface_hub maps to its exception."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.headers = {"X-Error-Code": code, "X-Error-Message": message}


def blob_id(data: bytes) -> str:
    """Git's object id of a file: the oid and ETag the Hub gives a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubStandIn:
    """The Hub for `repos` (by id), counting the file downloads it serves and every call."""

    repos: dict[str, FakeRepo]
    url: str = ""
    downloads: list[str] = field(default_factory=list)  # "repo_id/filename" per file GET
    asked: list[str] = field(default_factory=list)  # "METHOD path" per call about a repo

    def app(self) -> Starlette:
        repo = "/{org}/{name}"
        return Starlette(routes=[
            Route(f"/api/models{repo}", self.repo_info),  # model_info with no revision
            Route(f"/api/models{repo}/revision/{{revision}}", self.repo_info),
            Route(f"/api/models{repo}/tree/{{revision}}", self.tree),
            Route(f"{repo}/resolve/{{revision}}/{{filename:path}}", self.file,
                  methods=["GET", "HEAD"]),
        ], exception_handlers={HubError: _error_response})

    def _find(self, request: Request) -> tuple[FakeRepo, str]:
        """The repo and the commit a request names: "main" (also when none is named) or the
        repo's sha."""
        self.asked.append(f"{request.method} {request.url.path}")
        params = request.path_params
        repo = self.repos.get(f"{params['org']}/{params['name']}")
        if repo is None:
            raise HubError("RepoNotFound", "Repository not found")
        revision = params.get("revision", "main")
        if revision not in ("main", repo.sha):
            raise HubError("RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, repo.sha

    async def repo_info(self, request: Request) -> Response:
        repo, sha = self._find(request)
        return JSONResponse({"id": repo.repo_id, "sha": sha, "private": False})

    async def tree(self, request: Request) -> Response:
        repo, _ = self._find(request)  # always the whole tree: the client asks recursively
        return JSONResponse([
            {"type": "file", "path": name, "size": path.stat().st_size,
             "oid": blob_id(path.read_bytes())}
            for name, path in repo.files().items()
        ])

    async def file(self, request: Request) -> Response:
        repo, sha = self._find(request)
        filename = request.path_params["filename"]
        path = repo.files().get(filename)
        if path is None:
            raise HubError("EntryNotFound", f"{filename} does not exist")
        data = path.read_bytes()
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob_id(data)}"',
                   "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return Response(headers=headers)
        self.downloads.append(f"{repo.repo_id}/{filename}")
        return Response(data, headers=headers, media_type="application/octet-stream")


async def _error_response(request: Request, exc: HubError) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=404, headers=exc.headers)


@contextlib.contextmanager
def serving_hub(*repos: FakeRepo) -> Iterator[HubStandIn]:
    """The stand-in for `repos`, served on a free loopback port (its `url`)."""
    hub = HubStandIn({repo.repo_id: repo for repo in repos})
    with serving(hub.app()) as url:
        hub.url = url
        yield hub


def point_hub_client_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """Send this process's (and its children's) Hub calls to `url`. huggingface_hub reads
    HF_ENDPOINT once, at import, into `constants.ENDPOINT` and the resolve URL template, and it
    is imported already: those constants are patched too."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Cache Hub downloads under `home` (HF_HOME), online. The cache path and offline mode are
    constants read at import as well."""
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
