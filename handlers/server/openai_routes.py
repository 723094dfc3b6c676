"""OpenAI routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, and the
body-based routing `/invocations` uses (`messages` -> chat, `prompt` -> completions).

Bad input never reaches the engine: it is a 400 (404 for another model) in OpenAI's error shape.
Streams answer 200 only once the first output arrived, so a failure before it gets a status;
a client that disconnects aborts its requests (their batch slots are freed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from handlers.engine.base import Engine
from handlers.engine.types import GenerationRequest, RequestOutput, RequestValidationError
from handlers.protocols.lmi.formatters import JSON_MEDIA_TYPE
from handlers.protocols.openai import (
    DONE,
    ChatStream,
    Collected,
    CompletionStream,
    OpenAIError,
    engine_refusal,
    failure,
    fit_to_context,
    not_a_text_model,
    prepare_chat,
    prepare_completion,
    render_chat_completion,
    render_completion,
    sse_event,
    stream_error,
)
from handlers.protocols.openai.requests import GenerationFields
from handlers.protocols.openai.sse import MEDIA_TYPE
from handlers.server.body import BodyError, read_json, request_id
from handlers.server.responses import GONE, json_response
from handlers.server.streaming import (
    ClientDisconnected,
    ClosingStreamingResponse,
    cancel_generation,
    until_disconnect,
)

if TYPE_CHECKING:
    from handlers.server.app import ServerSettings

log = logging.getLogger(__name__)

BodyHandler = Callable[[Request, Any, str], Awaitable[Response]]
BodyRouter = Callable[[Any], BodyHandler | None]
Feed = Callable[[int, RequestOutput], list[dict[str, Any]]]


class GenerationFailed(Exception):
    pass


def error_response(error: OpenAIError) -> Response:
    return Response(error.body(), error.status, media_type=JSON_MEDIA_TYPE)


def add_openai_routes(app: FastAPI, engine: Engine, settings: ServerSettings) -> OpenAIRoutes:
    routes = OpenAIRoutes(engine, settings)
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    return routes


class OpenAIRoutes:
    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.created = int(time.time())
        self.models = [settings.model_name]  # what /v1/models lists (an embedding model joins)
        # The body key that selects each OpenAI task in /invocations; embeddings add "input".
        self.body_routes: dict[str, BodyHandler] = {
            "messages": self.chat_body, "prompt": self.completion_body}

    def route_for(self, body: Any) -> BodyHandler | None:
        """The OpenAI handler an /invocations body asks for, or None (the LMI schema)."""
        if isinstance(body, dict):
            return next((h for key, h in self.body_routes.items() if key in body), None)
        return None

    async def list_models(self) -> Response:
        """OpenAI's list and KServe V1's `models` in one object (CONTRACT.md)."""
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "lmi-serve"}
                for name in self.models]
        return json_response({"object": "list", "data": data, "models": list(self.models)})

    async def chat(self, request: Request) -> Response:
        return await self._from_body(request, self.chat_body)

    async def completions(self, request: Request) -> Response:
        return await self._from_body(request, self.completion_body)

    async def _from_body(self, request: Request, handler: BodyHandler) -> Response:
        rid = request_id(request)
        try:
            body = await read_json(request, self.settings.max_request_size, 400)
        except BodyError as exc:
            log.info("[RequestId=%s] bad body: %s", rid, exc.message)
            return error_response(OpenAIError(exc.message, status=exc.status))
        return await handler(request, body, rid)

    async def chat_body(self, request: Request, body: Any, rid: str) -> Response:
        async def answer() -> Response:
            job = prepare_chat(body, self.engine.tokenizer, self.settings.model_name,
                               self.settings.full_text_enabled)
            self._admit(job.gen, job.request, "messages", rid)
            if job.request.stream:
                stream = ChatStream(job.context, job.options)
                return await self._stream(request, [job.gen], lambda _, o: stream.feed(o), rid)
            results = await self._collect(request, [job.gen])
            return json_response(render_chat_completion(job.context, job.options, results[0]))

        return await self._guarded(answer, rid)

    async def completion_body(self, request: Request, body: Any, rid: str) -> Response:
        async def answer() -> Response:
            job = prepare_completion(body, self.engine.tokenizer, self.settings.model_name)
            for i, gen in enumerate(job.gens):
                where = "prompt" if len(job.gens) == 1 else f"prompt[{i}]"
                self._admit(gen, job.request, where, rid)
            if job.request.stream:
                stream = CompletionStream(job.context, job.options)
                return await self._stream(request, job.gens, stream.feed, rid)
            results = await self._collect(request, job.gens)
            return json_response(render_completion(job.context, job.options, results))

        return await self._guarded(answer, rid)

    async def _guarded(self, answer: Callable[[], Awaitable[Response]], rid: str) -> Response:
        """Run `answer`, turning refusals, disconnects and failures into responses."""
        if self.settings.embeddings_only:
            return error_response(not_a_text_model(self.settings.model_name))
        if not self.engine.is_ready():
            return error_response(OpenAIError("the model is still loading", status=503))
        try:
            return await answer()
        except OpenAIError as exc:
            log.info("[RequestId=%s] invalid OpenAI request: %s", rid, exc.message)
            return error_response(exc)
        except ClientDisconnected:
            log.info("[RequestId=%s] client disconnected; request aborted", rid)
            return Response(status_code=GONE)
        except GenerationFailed as exc:
            log.warning("[RequestId=%s] generation failed: %s", rid, exc)
            return error_response(OpenAIError(f"generation failed: {exc}", status=500))
        except Exception:
            log.exception("[RequestId=%s] unexpected error", rid)
            return error_response(OpenAIError("internal server error", status=500))

    def _admit(self, gen: GenerationRequest, request: GenerationFields, prompt_field: str,
               rid: str) -> None:
        """Tokenize and check with the engine, then fit the output length to the context."""
        if ignored := request.ignored_fields:
            log.warning("[RequestId=%s] ignoring unknown fields %s", rid, ignored)
        try:
            self._validate(gen, request)
        except RequestValidationError as exc:
            raise engine_refusal(exc, prompt_field) from None
        fit_to_context(gen, request, self.engine.max_model_len)

    def _validate(self, gen: GenerationRequest, request: GenerationFields) -> None:
        try:
            self.engine.validate(gen)
        except RequestValidationError as exc:
            if exc.field != "inputs" or not request.truncates:
                raise
            # A prompt the context cannot hold: keep its end, leaving the output its room.
            _, limit = request.max_output_tokens
            gen.params.truncate = max(1, self.engine.max_model_len - (limit or 1))
            self.engine.validate(gen)

    async def _collect(self, request: Request, gens: list[GenerationRequest]) -> list[Collected]:
        async def work() -> list[Collected]:
            results = [Collected() for _ in gens]
            async for i, output in self._outputs(gens):
                results[i].add(output, time.monotonic())
            return results

        return await until_disconnect(request, work)

    async def _stream(self, request: Request, gens: list[GenerationRequest], feed: Feed,
                      rid: str) -> Response:
        outputs = self._outputs(gens)
        try:
            first = await until_disconnect(request, lambda: anext(outputs, None))
        except BaseException:
            await outputs.aclose()
            raise
        if first is None:
            raise GenerationFailed("the engine ended the request without output")
        return ClosingStreamingResponse(self._events(first, outputs, feed, rid),
                                        media_type=MEDIA_TYPE)

    async def _events(self, first: tuple[int, RequestOutput],
                      outputs: AsyncIterator[tuple[int, RequestOutput]], feed: Feed, rid: str
                      ) -> AsyncIterator[bytes]:
        try:
            for chunk in feed(*first):
                yield sse_event(chunk)
            async for i, output in outputs:
                for chunk in feed(i, output):
                    yield sse_event(chunk)
        except Exception as exc:
            log.warning("[RequestId=%s] generation failed mid-stream: %s", rid, exc)
            yield stream_error(f"generation failed: {exc}")
        finally:
            await outputs.aclose()  # aborts whatever is still running
        yield DONE

    async def _outputs(self, gens: list[GenerationRequest]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's outputs as (prompt index, output); a failed sequence raises
        GenerationFailed; closing early aborts the unfinished requests."""
        streams = [self.engine.generate(gen) for gen in gens]
        merged = _merge(streams)
        finished: set[int] = set()
        try:
            async for i, output in merged:
                if (why := failure(output)) is not None:
                    raise GenerationFailed(why)
                if output.finished:
                    finished.add(i)
                yield i, output
        finally:
            with anyio.CancelScope(shield=True):  # runs when a disconnect cancelled the caller
                await merged.aclose()
                for i, (gen, stream) in enumerate(zip(gens, streams, strict=True)):
                    if i not in finished:
                        await cancel_generation(self.engine, stream, gen.request_id)


async def _merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as their outputs arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
