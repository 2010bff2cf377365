"""sluice.v1.InferenceService: thin async handlers over the engine; errors map in sluice.service.status."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping

import grpc
from opentelemetry import trace

from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.async_engine import AsyncEngine, prompt_chars, tokenize_when_long
from sluice.engine.text.prompt import resolve_prompt
from sluice.service import convert
from sluice.service.auth import authenticate
from sluice.service.caller import Call, Caller
from sluice.service.generation import GenerationRunner, operation_of
from sluice.service.malformed_messages import MalformedMessageError
from sluice.service.metrics import ServerMetrics
from sluice.service.request_cancel import ABORT
from sluice.service.request_ids import RequestIds, engine_id_of
from sluice.service.status import ServiceUnavailableError, UnauthenticatedError, rpc_errors
from sluice.service.stream_refusal import drain_request_stream
from sluice.service.stream_session import StreamSession
from sluice.service.tenant_limits import TenantLimiter
from sluice.service.tenants import TenantDirectory
from sluice.service.tracing import RequestTracer
from sluice.v1 import sluice_pb2 as pb
from sluice.v1 import sluice_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
# The generation methods: each records a span even for a call refused on arrival (RequestTracer.refusals),
# so each checks the API key itself, inside its refusals (the API key interceptor lets them through).
TRACED_METHODS = (f"/{SERVICE_NAME}/Generate", f"/{SERVICE_NAME}/StreamGenerate")
# The methods that answer a request message that does not parse themselves: StreamGenerate, in-band like
# any bad request, and its stream goes on (sluice.service.malformed_messages ends other calls at one).
MALFORMED_IN_BAND_METHODS = (f"/{SERVICE_NAME}/StreamGenerate",)


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """Serves requests once an engine is attached; until then, and while draining, answers UNAVAILABLE."""

    def __init__(
        self,
        metrics: ServerMetrics,
        tracer_provider: trace.TracerProvider | None = None,
        tenants: TenantDirectory | None = None,
    ) -> None:
        self._metrics = metrics
        self._tracer_provider = tracer_provider
        self._tenants = tenants or TenantDirectory.open()
        self._limiter = TenantLimiter()
        self._request_ids = RequestIds()
        self._tracer = RequestTracer(tracer_provider, None)  # its model named once attached
        self._runner: GenerationRunner | None = None
        self._num_generate_calls = 0
        self._sessions: set[StreamSession] = set()
        self.draining = False

    @property
    def num_active_requests(self) -> int:
        """Generate calls and StreamGenerate requests not yet ended (their last chunk written)."""
        return self._num_generate_calls + sum(s.num_live_requests for s in self._sessions)

    def attach(self, engine: AsyncEngine) -> None:
        self._tracer = RequestTracer(self._tracer_provider, engine.model_info.name)
        self._runner = GenerationRunner(engine, self._metrics, self._tracer, self._limiter)

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

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The tenant of a call that starts no generation request (the interceptor has already refused
        unknown keys)."""
        return self.authenticate(Call.of(context, SERVICE_NAME, ""))

    def authenticate(self, call: Call) -> Caller:
        """The tenant whose API key `call` carries; UnauthenticatedError naming the header if none. Every
        handler of TRACED_METHODS calls it first, inside its refusals: the interceptor lets them through."""
        tenant = authenticate(call.metadata, self._tenants)
        if isinstance(tenant, str):
            raise UnauthenticatedError(tenant)
        return Caller(tenant, call)

    def refusals(
        self, call: Call, operation: str | None, trace_context: Mapping[str, str] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Around a generation call's checks on arrival: one span if they refuse it
        (RequestTracer.refusals)."""
        return self._tracer.refusals(call, operation, trace_context)

    def accepting_runner(self) -> GenerationRunner:
        self.check_accepting()
        assert self._runner is not None
        return self._runner

    @rpc_errors
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = Call.of(context, SERVICE_NAME, "Generate")
        with self.refusals(call, operation_of(request), dict(request.trace_context)):
            caller = self.authenticate(call)  # first: an unknown key learns nothing of the server
            runner = self.accepting_runner()
            tenant = caller.tenant.name
            request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
            cancel = self._request_ids.claim(tenant, request_id)
        self._num_generate_calls += 1
        try:
            # Tenant names hold no "/": engine ids of two tenants never collide.
            engine_request_id = engine_id_of(f"gen/{tenant}/", request_id)
            chunks = runner.run(request, engine_request_id, caller, reply_id=request_id, cancel=cancel)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        finally:
            self._num_generate_calls -= 1
            self._request_ids.release(tenant, request_id, cancel)

    @rpc_errors
    async def StreamGenerate(
        self,
        request_iterator: AsyncIterator[pb.StreamGenerateRequest | MalformedMessageError],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """A message that does not parse comes as a MalformedMessageError (MALFORMED_IN_BAND_METHODS),
        which the session refuses in-band."""
        call = Call.of(context, SERVICE_NAME, "StreamGenerate")
        with self.refusals(call, None):  # refused whole: one span for the call, not one per request
            try:
                caller = self.authenticate(call)
                runner = self.accepting_runner()
            except (UnauthenticatedError, ServiceUnavailableError):
                await drain_request_stream(request_iterator)  # else a grpc.aio client may see INTERNAL
                raise
        session = StreamSession(runner, caller, self.check_accepting, self.record_status)
        self._sessions.add(session)
        try:
            async for response in session.run(request_iterator):
                yield response
        finally:
            self._sessions.discard(session)

    @rpc_errors
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Idempotent; NOT_FOUND for an id this tenant never used (remembered: see RequestIds).
        Allowed while draining, so callers can still stop what runs."""
        if self._runner is None:
            self.check_accepting()
        if not request.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        cancel = self._request_ids.abort(self.caller(context).tenant.name, request.request_id)
        if cancel is not None:
            await cancel.cancel(ABORT)
        return pb.AbortResponse()

    @rpc_errors
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        tokenizer = self.accepting_runner().engine.tokenizer
        kind = request.WhichOneof("prompt")
        if tokenizer is None:
            raise InvalidRequestError(kind or "prompt", "this model has no tokenizer")
        if kind == "messages" and request.HasField("add_special_tokens") and request.add_special_tokens:
            raise InvalidRequestError(
                "add_special_tokens", "applies to text prompts: a chat's template writes its special tokens"
            )
        if kind == "messages":  # as Generate renders and checks it, tools included
            messages = list(convert.messages_from_proto(request.messages))
            tool_use = convert.tool_use_from_chat(request.messages)
            tools = None if tool_use is None else tool_use.for_template()
            size = prompt_chars(messages=messages, tools=tools)
            options = convert.chat_options_from_proto(request.messages)
            token_ids = await tokenize_when_long(
                size, resolve_prompt, tokenizer, messages=messages, tools=tools, chat_options=options
            )
        elif request.text:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            token_ids = await tokenize_when_long(
                len(request.text), tokenizer.encode, request.text, add_special_tokens=add_special
            )
        else:
            raise InvalidRequestError("prompt", "is empty: give text or messages")
        return pb.TokenizeResponse(token_ids=token_ids)

    @rpc_errors
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return convert.model_info_to_proto(self.accepting_runner().engine.model_info)
