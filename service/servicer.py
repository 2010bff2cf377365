"""sluice.v1.InferenceService: thin async handlers over the engine; errors map in service.status."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from engine.errors import InvalidRequestError, UnknownRequestError
from engine.frontend.async_engine import AsyncEngine
from service import convert
from service.generation import GenerationRunner
from service.metrics import ServerMetrics
from service.status import ServiceUnavailableError, rpc_errors
from service.stream_refusal import drain_request_stream
from service.stream_session import StreamSession
from service.stubs import sluice_pb2 as pb
from service.stubs import sluice_pb2_grpc as pb_grpc
from service.tracing import RequestTracer


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """Serves requests once an engine is attached; until then, and while draining, answers UNAVAILABLE."""

    def __init__(self, metrics: ServerMetrics, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._metrics = metrics
        self._tracer_provider = tracer_provider
        self._runner: GenerationRunner | None = None
        self.draining = False

    def attach(self, engine: AsyncEngine) -> None:
        tracer = RequestTracer(self._tracer_provider, engine.model_info.name)
        self._runner = GenerationRunner(engine, self._metrics, tracer)

    @property
    def runner(self) -> GenerationRunner | None:
        return self._runner

    def record_status(self, method: str, code: grpc.StatusCode) -> None:
        self._metrics.record_status(method, code)

    def check_accepting(self) -> None:
        """Raises ServiceUnavailableError unless new requests may start now."""
        if self._runner is not None and self._runner.engine.error is not None:
            raise ServiceUnavailableError(f"the engine failed: {self._runner.engine.error}")
        if self.draining:
            raise ServiceUnavailableError("the server is draining and accepts no new requests")
        if self._runner is None:
            raise ServiceUnavailableError("the server is still loading the model")

    def _accepting_runner(self) -> GenerationRunner:
        self.check_accepting()
        assert self._runner is not None
        return self._runner

    @rpc_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        runner = self._accepting_runner()
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        async for chunk in runner.run(request, request_id, context.invocation_metadata() or ()):
            yield chunk

    @rpc_errors
    async def StreamGenerate(
        self, request_iterator: AsyncIterator[pb.StreamGenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        try:
            runner = self._accepting_runner()
        except ServiceUnavailableError:
            await drain_request_stream(request_iterator)  # else a grpc.aio client may see INTERNAL
            raise
        session = StreamSession(
            runner,
            context.invocation_metadata() or (),
            self.check_accepting,
            self.record_status,
        )
        async for response in session.run(request_iterator):
            yield response

    @rpc_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        runner = self._accepting_runner()
        if not request.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if not runner.engine.has_request(request.request_id):
            raise UnknownRequestError(request.request_id)
        await runner.engine.abort(request.request_id)
        return pb.AbortResponse()

    @rpc_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        tokenizer = self._accepting_runner().engine.tokenizer
        kind = request.WhichOneof("prompt")
        if tokenizer is None:
            raise InvalidRequestError(kind or "prompt", "this model has no tokenizer")
        if kind == "messages":
            token_ids = tokenizer.encode_chat(list(convert.messages_from_proto(request.messages)))
        elif request.text:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
        else:
            raise InvalidRequestError("prompt", "is empty: give text or messages")
        return pb.TokenizeResponse(token_ids=token_ids)

    @rpc_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return convert.model_info_to_proto(self._accepting_runner().engine.model_info)
