"""Serving the page: `index.html`, `app.js` and `style.css` beside this module, read from the
installed package when the app is built (no network, no framework). The files hold nothing of
the server's, so they are served without the API key (a browser's navigation cannot send one);
everything the page shows it fetches from routes behind the key, asking for it. Its content
security policy lets it reach this server only. `option.enable_ui=false`: none of it is served,
and `GET /` is TGI's health alone."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from handlers.server.context import ServerContext
from handlers.server.framing import Reply
from handlers.server.http.answers import json_response
from handlers.server.http.descriptor import Protocol

PAGE = "/ui"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}  # under /ui/
HEADERS = {
    # The page and its fetches reach this server only: no CDN, nothing inline, no framing.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated, so an upgraded server's page is the one shown
}


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    if not ctx.settings.enable_ui:
        return routes
    folder = files(__package__)
    page = _answer(folder.joinpath("index.html").read_bytes(), "text/html; charset=utf-8")
    assets = {name: _answer(folder.joinpath(name).read_bytes(), kind)
              for name, kind in ASSETS.items()}

    @routes.get(PAGE, include_in_schema=False)
    async def index() -> Response:
        return page

    @routes.get(PAGE + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            return json_response(Reply(404, {"error": f"the page has no file {name!r}"}))
        return assets[name]

    return routes


def _answer(body: bytes, media_type: str) -> Response:
    return Response(body, media_type=media_type, headers=HEADERS)


def is_page(method: str, path: str) -> bool:
    """Whether the request is for the page's own files (open: they hold nothing of the server's)."""
    return method == "GET" and (path == PAGE or path.startswith(PAGE + "/"))


def wants_html(accept: str | None) -> bool:
    """Whether an Accept header names HTML (with q > 0), as a browser's navigation does; `*/*`
    alone, what curl and the HTTP clients send, does not."""
    for item in (accept or "").split(","):
        media, *params = item.split(";")
        if media.strip().lower() != "text/html":
            continue
        weights = [p.strip()[2:] for p in params if p.strip().lower().startswith("q=")]
        try:
            return not weights or float(weights[0]) > 0
        except ValueError:
            return False
    return False


class PageAtRoot:
    """`GET /` asked for HTML is the page: routed as `GET /ui` (so it is answered, and counted
    in /metrics, as the page); any other request to `/` is TGI's, as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/" and scope["method"] == "GET" \
                and wants_html(Headers(scope=scope).get("accept")):
            scope["path"], scope["raw_path"] = PAGE, PAGE.encode()  # the outer middlewares too
        await self.app(scope, receive, send)


PROTOCOL = Protocol(router)
