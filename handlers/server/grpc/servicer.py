"""KServe V2 over gRPC: `inference.GRPCInferenceService` with the stubs `tritonclient[grpc]`
ships. ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer (typed
contents or `raw_input_contents` in, `raw_output_contents` out) and Triton's bidirectional
ModelStreamInfer, which answers each request with one response per generated token. The other
RPCs of the service answer UNIMPLEMENTED (the stubs' default).

The protocol is protocols/kserve_v2.py's, as over REST; errors are gRPC status codes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from handlers.engine.base import Pair
from handlers.engine.types import RequestOutput
from handlers.protocols import kserve_v2
from handlers.protocols.errors import ErrorKind, GenerationError, KServeError, ProtocolError
from handlers.protocols.kserve_v2 import Tensor
from handlers.protocols.outputs import Event, Renderer, checked_events
from handlers.protocols.parameters import LmiParameters
from handlers.server import driver
from handlers.server.context import Served, ServerContext
from handlers.server.generation import Generation
from handlers.server.grpc.decoding import Undecodable
from handlers.server.status import GRPC

log = logging.getLogger(__name__)

FINAL = "triton_final_response"
ASK_FINAL = "triton_enable_empty_final_response"


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=self.ctx.ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerMetadataResponse(name="lmi-serve", version=self.ctx.settings.server_version,
                                         extensions=kserve_v2.EXTENSIONS)

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        served, _ = await _answer(context,
                                  lambda: self._generator(request.name, request.version))
        return pb.ModelReadyResponse(ready=served.ready)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        await _answer(context, lambda: self._generator(request.name, request.version))
        meta = kserve_v2.model_metadata(request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]])

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            return await self._infer(request, context)
        except (ProtocolError, GenerationError) as exc:
            log.info("gRPC request %r refused or failed: %s", request.id, exc.message)
            await context.abort(GRPC[exc.kind], exc.message)
        except asyncio.CancelledError:  # the client went away: its requests were aborted
            raise
        except Exception:
            log.exception("gRPC request %r failed", request.id)
            await context.abort(GRPC[ErrorKind.INTERNAL], "internal server error")

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: Any
                               ) -> AsyncIterator[Any]:  # noqa: N802
        """Each request streamed as it comes, several at once; responses interleave."""
        responses: asyncio.Queue[Any] = asyncio.Queue()
        streams: set[asyncio.Task] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    streams.add(asyncio.create_task(self._stream(request, responses.put_nowait)))
                await asyncio.gather(*streams)
            finally:
                responses.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await responses.get()) is not None:
                yield response
        finally:
            for task in (reader, *streams):
                task.cancel()
            await asyncio.gather(reader, *streams, return_exceptions=True)

    # -- inference ------------------------------------------------------------------------------

    def _generator(self, model: str, version: str) -> tuple[Served, str | None]:
        """The generation model, and the LoRA adapter `model` names (None: the model)."""
        generator = self.ctx.generation_model(model)
        adapter = kserve_v2.check_model(model, version or None, generator and generator.name,
                                        self.ctx.adapters(generator))
        assert generator is not None  # check_model refuses a server without one
        return generator, adapter

    async def _prepare(self, request: Any, deadline: float | None, stream: bool = False
                       ) -> tuple[kserve_v2.InferRequest, LmiParameters, Generation]:
        if isinstance(request, Undecodable):  # a streamed message that did not parse
            raise KServeError(request.message)
        generator, adapter = self._generator(request.model_name, request.model_version)
        engine = generator.ready_engine(KServeError)
        infer = kserve_v2.infer_request(request.id, _tensors(request), _parameters(request),
                                        _outputs(request))
        if stream and len(infer.prompts) != 1:
            raise KServeError("a streamed request takes one prompt")
        gens, params = kserve_v2.generation_requests(infer, adapter)
        timeouts = [t for t in (kserve_v2.timeout_seconds(infer), deadline) if t is not None]
        generation = await self.ctx.generation(engine, gens, kserve_v2.CHECKS,
                                               min(timeouts, default=None))
        return infer, params, generation

    async def _infer(self, request: Any, context: Any) -> Any:
        infer, params, generation = await self._prepare(request, context.time_remaining())
        folded = await driver.complete(generation)
        texts = [(gen.prompt if params.return_full_text else "") + acc.sequences[0].text
                 for gen, acc in zip(generation.requests, folded, strict=True)]
        return _response(request.model_name, infer.id, texts)

    async def _stream(self, request: Any, send: Any) -> None:
        """One request's responses, one per generated token; its failure as an error message."""
        try:
            infer, _, generation = await self._prepare(request, None, stream=True)
        except (ProtocolError, GenerationError) as exc:
            log.info("streamed request %r refused: %s", request.id, exc.message)
            send(pb.ModelStreamInferResponse(error_message=exc.message))
            return
        ask_final = _parameters(request).get(ASK_FINAL, False)
        responses = StreamResponses(request.model_name, infer.id, ask_final)
        async for chunk in driver.events(generation, responses):
            for event in chunk:
                send(event.data)


class StreamResponses(Renderer):
    """ModelStreamInfer's responses: one per generated token, the request's last one marked
    final where the client asked (an output that ends the request without a token gives an
    empty final one); a failure, one error message."""

    def __init__(self, model: str, request_id: str, ask_final: bool) -> None:
        self._model = model
        self._id = request_id
        self._ask_final = ask_final

    def feed(self, pairs: list[Pair]) -> list[Event]:
        return checked_events(pairs, lambda _, output: [
            Event(self._response(piece, final)) for piece, final in _pieces(output)])

    def failed(self, error: GenerationError) -> list[Event]:
        return [Event(pb.ModelStreamInferResponse(error_message=error.message))]

    def _response(self, piece: str, final: bool) -> Any:
        response = _response(self._model, self._id, [piece])
        if self._ask_final:
            response.parameters[FINAL].bool_param = final
        return pb.ModelStreamInferResponse(infer_response=response)


def _pieces(output: RequestOutput) -> list[tuple[str, bool]]:
    """Each generated token's text, the last one marked final."""
    tokens = [token.text for seq in output.outputs if seq.index == 0 for token in seq.tokens]
    if output.finished and not tokens:
        tokens = [""]
    return [(text, output.finished and i == len(tokens) - 1) for i, text in enumerate(tokens)]


async def _answer(context: Any, call: Any) -> Any:
    try:
        return call()
    except ProtocolError as exc:
        await context.abort(GRPC[exc.kind], exc.message)


def _tensors(request: Any) -> list[Tensor]:
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise KServeError(f"raw_input_contents holds {len(raw)} entries for "
                          f"{len(request.inputs)} inputs")
    return [Tensor(given.name, given.datatype, list(given.shape),
                   None if raw else list(given.contents.bytes_contents),
                   raw[i] if raw else None)
            for i, given in enumerate(request.inputs)]


def _parameters(request: Any) -> dict[str, Any]:
    return {key: getattr(value, value.WhichOneof("parameter_choice"))
            for key, value in request.parameters.items() if value.WhichOneof("parameter_choice")}


def _outputs(request: Any) -> dict[str, bool | None] | None:
    return {output.name: True for output in request.outputs} if request.outputs else None


def _response(model: str, request_id: str, texts: list[str]) -> Any:
    output = pb.ModelInferResponse.InferOutputTensor(name=kserve_v2.TEXT_OUTPUT,
                                                      datatype=kserve_v2.BYTES,
                                                      shape=[len(texts)])
    return pb.ModelInferResponse(model_name=model, model_version=kserve_v2.MODEL_VERSION,
                                 id=request_id, outputs=[output],
                                 raw_output_contents=[kserve_v2.encode_bytes(texts)])
