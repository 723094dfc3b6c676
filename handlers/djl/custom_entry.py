"""A model.py's code (model_code.py) at LMI's entry: `/invocations`, `/predictions/{m}` and the
SageMaker runtime routes, for the server's own model, whatever the engine.

As DJL LMI's vLLM handler applies it (djl_python 0.36, lmi_vllm/vllm_async_service.py):

- The LoRA adapter is the one named outside the body, else a string `adapters` in it (taken out
  of the body, as DJL pops it, and put back in the formatted body's own field); its model.py's
  formatters override the base model's.
- The input formatter gets the decoded JSON body and `tokenizer=` (the model's Hugging Face
  tokenizer where it has one), and returns the body the server then answers. Not the adapter's
  name: DJL's handler passes `adapter_name=`, but its AdapterFormatterMixin, which applies the
  formatters, takes it to choose them and passes only the rest on. SageMaker's `input_fn` gets
  the raw bytes and the Content-Type instead.
- The output formatter gets what DJL hands it: an LMI body turned into the completion request
  DJL makes of it (`lmi_completion.py`), then the completion or chat completion as a pydantic
  object, or, streamed, each chunk as vLLM's `data: {...}` text and its closing `data: [DONE]`.
  What it returns is sent as DJL sends it: a pydantic model as its JSON, a dict as JSON, a str
  as it is, each followed by a newline (application/json; streams application/jsonlines, ending
  with DJL's empty chunk). Other bodies (Anthropic's, Responses, embeddings, sessions) are
  answered unformatted.

Where model.py answers whole predictions (`ModelCodes.predicts`: as DJL's handlers for
scikit-learn and XGBoost, and SageMaker's inference toolkit, run them): the prediction handler
(`predict_fn`) gets the input and the model: what the init handler made, else `ServedModel`,
whose `predict(body)` answers a body whole, as the output formatter would get it (without a
prediction handler the entry calls it itself); the output formatter then gets the prediction,
and SageMaker's `output_fn` the Accept header too (its return is the body, as it is, of that
type; or a (body, content type) pair).

User code runs in worker threads, never on the event loop: formatters one call at a time (as
on DJL's event loop), prediction handlers side by side. A function that raises or returns what
cannot be sent fails its request alone, with LMI's 424 naming it (a stream that began ends with
one `{"error", "code"}` line); an error of the served model keeps its own status and shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request

from handlers.djl.lmi_completion import as_completion
from handlers.djl.model_code import Function, ModelCodes, without
from handlers.protocols.errors import ErrorKind, ProtocolError
from handlers.protocols.lmi import LmiError
from handlers.protocols.outputs import Event
from handlers.protocols.schemas.openai import ChatCompletion, Completion
from handlers.server.context import ServerContext
from handlers.server.framing import (
    JSON_MEDIA_TYPE,
    Answer,
    Framing,
    Reply,
    StreamReply,
    error_reply,
)
from handlers.server.http.body import BodyError, decode_json
from handlers.server.http.guard import guarded
from handlers.server.http.invocations import Invocations, requested_adapter
from handlers.server.http.lmi import LMI, lmi_body
from handlers.server.http.openai import chat_body, completion_body
from handlers.server.status import LMI_HTTP

log = logging.getLogger(__name__)

PREDICTING_THREADS = 64  # prediction handlers running at once (each waits on its generation)


class ModelAnswered(Exception):
    """What `ServedModel.predict` raises when the served model refused or failed a body: its
    answer (status, content), which the request gets unless the handler catches it."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"the model answered {reply.status}: {reply.body.decode()}")
        self.reply = reply
        self.status = reply.status
        self.content = reply.content


class ServedModel:
    """The `model` a prediction handler gets where no init handler made one: the served model.
    `predict(body)` answers a request body whole, as LMI's entry would (a completion or chat
    completion object; another protocol's answer as JSON); call it from the handler's thread."""

    def __init__(self, predict: Callable[[Any], Awaitable[Any]]) -> None:
        self._predict = predict

    def predict(self, body: Any) -> Any:
        return anyio.from_thread.run(self._predict, body)


class CustomEntry:
    """`EntryCode` (handlers/server/http/invocations.py) for the model.py files found."""

    def __init__(self, codes: ModelCodes) -> None:
        self.codes = codes
        self.formatting = anyio.CapacityLimiter(1)
        self.predicting = anyio.CapacityLimiter(PREDICTING_THREADS)

    def forget_adapter(self, name: str) -> None:
        self.codes = without(self.codes, name)

    async def answer(self, ctx: ServerContext, request: Request, raw: bytes,
                     entry: Invocations) -> Answer:
        return await guarded(LMI, lambda: _Request(self, ctx, request, raw, entry).answer())

    def function(self, adapter: str | None, field: str) -> Function | None:
        """The adapter's own function for `field`, else the base model's."""
        own = self.codes.adapters.get(adapter) if adapter else None
        found = getattr(own, field) if own is not None else None
        base = self.codes.base
        return found or (getattr(base, field) if base is not None else None)

    async def call(self, function: Function, *args: Any, predicting: bool = False,
                   **kwargs: Any) -> Any:
        """`function(*args, **kwargs)` in a worker thread; LmiError (424) naming it if it
        raises (a ModelAnswered passes as it is)."""
        limiter = self.predicting if predicting else self.formatting
        try:
            return await anyio.to_thread.run_sync(lambda: function.call(*args, **kwargs),
                                                  limiter=limiter)
        except ModelAnswered:
            raise
        except Exception as exc:
            log.warning("the %s failed", function.said, exc_info=True)
            raise failed(f"the {function.said} failed: {type(exc).__name__}: {exc}") from None


def failed(message: str) -> LmiError:
    return LmiError(message, ErrorKind.FAILED)


class _Request:
    """One request through a model.py's code."""

    def __init__(self, code: CustomEntry, ctx: ServerContext, request: Request, raw: bytes,
                 entry: Invocations) -> None:
        self.code, self.ctx, self.request, self.raw, self.entry = code, ctx, request, raw, entry
        self.adapter = requested_adapter(request)
        self.decoded: Any = None
        self.not_json: BodyError | None = None
        try:
            self.decoded = decode_json(raw)
        except BodyError as exc:
            self.not_json = exc
        self.adapter_in_body = self.adapter is None and isinstance(self.decoded, dict) and \
            isinstance(self.decoded.get("adapters"), str)
        if self.adapter_in_body:
            self.adapter = self.decoded["adapters"]

    async def answer(self) -> Answer:
        engine = self.ctx.text_engine(LmiError, lambda model: LmiError(
            f"model.py's code applies to text generation; '{model}' serves embeddings only"))
        tokenizer = getattr(engine.tokenizer, "hf", engine.tokenizer)
        body = await self._input(tokenizer)
        if self.code.codes.predicts:
            return await self._predicted(body)
        formatter = self.code.function(self.adapter, "input_formatter")
        if formatter is not None and not isinstance(body, dict):
            raise failed(f"the {formatter.said} returned {type(body).__name__}: it must return "
                         "the request body the server answers, a dict")
        return await self._formatted(body)

    # -- in ------------------------------------------------------------------------------------

    async def _input(self, tokenizer: Any) -> Any:
        function = self.code.function(self.adapter, "input_formatter")
        if function is not None and self._sagemaker(function):
            return await self.code.call(function, self.raw,
                                        self.request.headers.get("content-type"))
        if self.not_json is not None:
            raise LmiError(self.not_json.message, self.not_json.kind)
        if function is None:
            return self.decoded
        payload = self.decoded
        if self.adapter_in_body:  # DJL pops it before the formatter sees the body
            payload = {k: v for k, v in payload.items() if k != "adapters"}
        return await self.code.call(function, payload, tokenizer=tokenizer)

    def _sagemaker(self, function: Function) -> bool:
        base = self.code.codes.base
        return base is not None and base.sagemaker and function in (base.input_formatter,
                                                                     base.output_formatter)

    # -- the server's answer, formatted ---------------------------------------------------------

    async def _formatted(self, body: Any) -> Answer:
        function = self.code.function(self.adapter, "output_formatter")
        handler = self.entry.body(self.ctx, body, self.request.headers).handler
        if function is None or handler not in (lmi_body, completion_body, chat_body):
            return await self.entry.answer(self.ctx, self.request, body, self.adapter)
        answer = await self._served(body, handler)
        if isinstance(answer, StreamReply):
            return await self._stream(answer, function)
        if answer.status >= 400:
            return answer
        formatted = await self.code.call(function, response_object(handler, answer.content))
        return Reply(200, (djl_text(formatted, function) + "\n").encode())

    async def _served(self, body: dict[str, Any], handler: Any) -> Answer:
        """The server's answer to `body`; an LMI body, as the completion DJL makes of it (its
        errors in LMI's shape)."""
        if handler is not lmi_body:
            return await self.entry.answer(self.ctx, self.request, body, self.adapter)
        completion = as_completion(body, self.ctx.settings.dynamic_batching)
        answer = await self.entry.answer(self.ctx, self.request, completion, self.adapter)
        return lmi_error(answer) if isinstance(answer, Reply) and answer.status >= 400 \
            else answer

    async def _stream(self, answer: StreamReply, function: Function) -> Answer:
        """The stream, each chunk through the output formatter: one failing on the first
        chunk fails the request (424); later, the stream ends with an error line."""
        chunks = answer.chunks
        try:
            first = await self._lines(function, answer.framing, await anext(chunks, []))
        except LmiError:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()
            raise
        return StreamReply(self._rest(first, chunks, function, answer.framing),
                           Framing.TEXT_LINES)

    async def _rest(self, first: list[Event], chunks: AsyncIterator[list[Event]],
                    function: Function, framing: Framing) -> AsyncIterator[list[Event]]:
        try:
            yield first
            async for events in chunks:
                yield await self._lines(function, framing, events)
            if framing.trailer is not None:
                yield await self._lines(function, framing, [], framing.trailer)
        except LmiError as exc:
            status = LMI_HTTP[exc.kind]
            yield [Event(json.dumps(exc.payload(status), ensure_ascii=False), exc.message)]
        finally:
            with anyio.CancelScope(shield=True):
                await chunks.aclose()

    async def _lines(self, function: Function, framing: Framing, events: list[Event],
                     trailer: bytes | None = None) -> list[Event]:
        """Each event as vLLM's SSE text through the formatter (or the stream's trailer)."""
        texts = [(framing.frame(event.data), event.failure) for event in events]
        if trailer is not None:
            texts.append((trailer, None))
        return [Event(djl_text(await self.code.call(function, text.decode()), function),
                      failure) for text, failure in texts]

    # -- whole predictions ------------------------------------------------------------------------

    async def _predicted(self, body: Any) -> Answer:
        codes = self.code.codes
        handler = codes.base.prediction_handler
        try:
            if handler is not None:
                model = codes.model if codes.model is not None else ServedModel(self._predict)
                prediction = await self.code.call(handler, body, model, predicting=True)
            elif codes.model is not None:  # the init handler's model predicts, as in DJL
                predict = codes.model.predict
                prediction = await self.code.call(
                    Function(predict, f"predict() of {codes.base.init_handler.said}'s model"),
                    body, predicting=True)
            else:
                prediction = await self._predict(body)
        except ModelAnswered as answered:
            return answered.reply
        return await self._output(prediction)

    async def _predict(self, body: Any) -> Any:
        """`ServedModel.predict`: the server's whole answer to `body`, as an output formatter
        would get it; ModelAnswered for an error."""
        if not isinstance(body, dict):
            raise TypeError(f"model.predict takes a request body, a dict; got "
                            f"{type(body).__name__}")
        if body.get("stream"):
            raise ValueError("model.predict answers whole responses; the body asks for a "
                             "stream (\"stream\": true)")
        handler = self.entry.body(self.ctx, body, self.request.headers).handler
        try:
            answer = await self._served(body, handler)
        except ProtocolError as exc:  # an LMI body that is not one
            raise ModelAnswered(error_reply(exc, LMI_HTTP)) from None
        if isinstance(answer, StreamReply):
            with anyio.CancelScope(shield=True):
                await answer.chunks.aclose()
            raise ValueError("model.predict answers whole responses; the server streams this "
                             "body's answer")
        if answer.status >= 400:
            raise ModelAnswered(answer)
        return response_object(handler, answer.content)

    async def _output(self, prediction: Any) -> Reply:
        function = self.code.function(self.adapter, "output_formatter")
        if function is None:
            return Reply(200, default_body(prediction, self.code.codes))
        if not self._sagemaker(function):
            formatted = await self.code.call(function, prediction)
            return Reply(200, (djl_text(formatted, function) + "\n").encode())
        accept = self.request.headers.get("accept")
        if accept in (None, "", "*/*"):
            accept = JSON_MEDIA_TYPE  # SageMaker's default Accept
        formatted = await self.code.call(function, prediction, accept)
        body, media_type = toolkit_body(formatted, accept, function)
        return Reply(200, body, media_type=media_type)


def response_object(handler: Any, content: Any) -> Any:
    """An answer as DJL hands it to an output formatter: a completion or a chat completion as
    a pydantic object (with vLLM's fields); another protocol's as its JSON."""
    if handler is chat_body:
        return ChatCompletion.model_validate(content)
    if handler in (completion_body, lmi_body):
        return Completion.model_validate(content)
    return content


def lmi_error(reply: Reply) -> Reply:
    """An error the completion route answered, in LMI's shape: `{"error", "code"}`, a
    refusal 424, the field named as the LMI body names it."""
    error = reply.content.get("error") if isinstance(reply.content, dict) else None
    message = error.get("message") if isinstance(error, dict) else str(error)
    field, colon, rest = message.partition(":")
    name, bracket, index = field.partition("[")
    if colon and name in _LMI_FIELDS:
        message = f"{_LMI_FIELDS[name]}{bracket}{index}{colon}{rest}"
    status = LMI_HTTP[ErrorKind.VALIDATION] if reply.status == 400 else reply.status
    return Reply(status, {"error": message, "code": status}, reply.headers)


# The completion's fields that an LMI body's become (lmi_completion.py).
_LMI_FIELDS = {"prompt": "inputs", "max_tokens": "parameters.max_new_tokens"}


def djl_text(value: Any, function: Function) -> str:
    """An output formatter's return as DJL LMI sends it (async_utils._create_output)."""
    if hasattr(value, "model_dump_json"):
        value = value.model_dump_json()
    elif hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        return value
    raise failed(f"the {function.said} returned {type(value).__name__}: it must return a dict, "
                 "a str or a pydantic model")


def toolkit_body(value: Any, accept: str, function: Function) -> tuple[bytes, str]:
    """SageMaker's output_fn return: the body as it is, of the Accept type, or (body, type)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        value, accept = value
    if isinstance(value, bytes | bytearray):
        return bytes(value), accept
    if isinstance(value, str):
        return value.encode(), accept
    if hasattr(value, "model_dump_json"):
        return value.model_dump_json().encode(), accept
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False).encode(), accept
    raise failed(f"the {function.said} returned {type(value).__name__}: it must return the "
                 "response body (bytes, a str, or JSON: a dict or a list), or (body, "
                 "content type)")


def default_body(prediction: Any, codes: ModelCodes) -> bytes:
    """A prediction no output formatter formats: text as it is, anything else as JSON."""
    if isinstance(prediction, bytes | bytearray):
        return bytes(prediction)
    if isinstance(prediction, str):
        return prediction.encode()
    if hasattr(prediction, "model_dump_json"):
        return prediction.model_dump_json().encode()
    try:
        return json.dumps(prediction, ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        said = codes.base.prediction_handler.said if codes.base.prediction_handler else \
            "prediction"
        raise failed(f"the {said} returned {type(prediction).__name__}, which is no response "
                     f"body ({exc}): return JSON, text or bytes, or add an output "
                     "formatter") from None
