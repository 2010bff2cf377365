"""vllm.grpc.engine.VllmEngine (PyPI smg-grpc-proto): the engine API that SMG, the Shepherd Model Gateway,
routes OpenAI-compatible requests to over gRPC. Served on the same port as sluice.v1.InferenceService,
over the same engine, tenants, metrics, tracing and drain; errors map in sluice.service.status.

Why this service of SMG's protos: SMG registers a gRPC worker by calling each runtime's HealthCheck in
turn (sglang, vllm, trtllm, tokenspeed, mlx) and speaks the first that answers. vLLM's is the one
whose Generate takes plain token ids and sampling parameters with vLLM's structured-output oneof (json
schema, regex, grammar, choice), streams token-id deltas, and has out-of-band Abort, GetLoads and
GetTokenizer: what Sluice's engine does, with nothing left over. (SGLang's carries SGLang's scheduler
options, TensorRT-LLM's its executor's, MLX's and TokenSpeed's their engines'.)

    SMG                                   this servicer                       engine
    HealthCheck  -> healthy unless loading, draining or the engine failed
    GetModelInfo / GetServerInfo / GetTokenizer (zip of tokenizer.json, configs) at registration
    GetLoads     -> running / waiting requests, KV usage (polled)
    Generate     -> token ids in  ---- GenerationRunner.outputs ---->   add_request
                 <- chunks (token-id deltas), one Complete per sample
    Abort        -> ends the live requests named (unknown ids are ignored: SMG aborts what it drops)
    SubscribeKvEvents -> the prefix cache's stored / removed blocks, a batch per step, and the engine's
                 load with each and between them (--kv-events)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from sluice.engine.errors import InvalidRequestError, UnknownRequestError
from sluice.engine.frontend.async_engine import tokenize_when_long
from sluice.engine.outputs import EngineStats
from sluice.service import smg_convert, smg_kv_events
from sluice.service.caller import Call, Caller
from sluice.service.generation import GenerationRunner
from sluice.service.metrics import ServerMetrics
from sluice.service.request_cancel import ABORT, RequestCancel
from sluice.service.request_ids import RequestIds, check_request_id, engine_id_of
from sluice.service.servicer import InferenceServicer
from sluice.service.status import (
    FailedPreconditionError,
    PermissionDeniedError,
    ServiceUnavailableError,
    UnimplementedError,
    rpc_errors,
)
from sluice.service.tenants import scope_of
from sluice.service.tracing import RequestSpan

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
# As sluice.service.servicer.TRACED_METHODS: Generate checks the API key itself, inside its refusals.
TRACED_METHODS = (f"/{SERVICE_NAME}/Generate",)
# GetTokenizer's chunk size (SMG's client reassembles up to 200 MB).
TOKENIZER_CHUNK_BYTES = 64 << 10
_METHOD_PREFIX = "VllmEngine."
# gen_ai.operation.name of every Generate: SMG renders chats itself and sends the prompt's tokens.
_OPERATION = "text_completion"


class SmgEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Shares `inference`'s engine, admission (loading, draining, a failed engine) and tenants.
    Embed and FlushCache answer UNIMPLEMENTED. SubscribeKvEvents streams the prefix cache's changes to
    SMG's cache-aware routing when the engine records them (`sluice serve --kv-events`), else answers
    UNIMPLEMENTED: SMG then keeps its own prefix tree of the requests it routed. StartProfile /
    StopProfile need `profile_dir` (`sluice serve --profile-dir`), else FAILED_PRECONDITION."""

    def __init__(
        self, inference: InferenceServicer, metrics: ServerMetrics, profile_dir: str | None = None
    ) -> None:
        self._inference = inference
        self._profile_dir = None if profile_dir is None else Path(profile_dir).resolve()
        self._metrics = metrics
        self._request_ids = RequestIds()
        self._num_generate_calls = 0
        self._started = time.time()
        self._last_receive = 0.0
        self._version = version("sluice")
        self._generation_rate = smg_convert.GenerationRate()

    @property
    def num_active_requests(self) -> int:
        return self._num_generate_calls

    def record_status(self, method: str, code: grpc.StatusCode) -> None:
        self._metrics.record_status(_METHOD_PREFIX + method, code)

    @rpc_errors
    async def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        call = Call.of(context, SERVICE_NAME, "Generate")
        with self._inference.refusals(call, _OPERATION):
            caller = self._inference.authenticate(call)  # first, as the API key interceptor would
            runner = self._inference.accepting_runner()
            self._last_receive = time.time()
            tenant = caller.tenant.name
            request_id = request.request_id or f"smg-{uuid.uuid4().hex}"
            cancel = self._request_ids.claim(tenant, request_id)
        self._num_generate_calls += 1
        try:
            with runner.trace(caller, _OPERATION) as span:
                # Tenant names hold no "/": engine ids of two tenants never collide.
                engine_request_id = engine_id_of(f"smg/{tenant}/", request_id)
                responses = _responses(request, runner, engine_request_id, caller, span, cancel)
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
        finally:
            self._num_generate_calls -= 1
            self._request_ids.release(tenant, request_id, cancel)

    @rpc_errors
    async def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        """Idempotent, and allowed while draining; an id never seen is remembered (a Generate with it
        arriving later ends at once), not an error."""
        tenant = self._inference.caller(context).tenant.name
        for request_id in request.request_ids:  # all checked first: a refused Abort aborts none of them
            if not request_id:
                raise InvalidRequestError("request_ids", "must not contain empty ids")
            check_request_id(request_id, "request_ids")
        for request_id in request.request_ids:
            with contextlib.suppress(UnknownRequestError):
                cancel = self._request_ids.abort(tenant, request_id)
                if cancel is not None:
                    await cancel.cancel(ABORT)
        return vllm_engine_pb2.AbortResponse()

    @rpc_errors
    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The batches after `start_sequence_number` (0: a snapshot of the cache, then the live ones),
        each with the engine's load, and load_only records between them, until the engine stops or the
        server drains; OUT_OF_RANGE when they are no longer all at hand (the subscriber starts over from
        0), DATA_LOSS when the subscriber falls SUBSCRIBER_QUEUE_BATCHES behind. The stream shows the
        cached token ids of every tenant of the subscriber's prefix-cache scope (the stored blocks of
        other scopes are left out): PERMISSION_DENIED to a tenant without `kv_events = true`."""
        tenant = self._inference.caller(context).tenant
        if not tenant.kv_events:
            raise PermissionDeniedError(
                f"SubscribeKvEvents: tenant {tenant.name!r} may not read KV events (kv_events = true "
                "in its [[tenant]] table)"
            )
        engine = self._inference.accepting_runner().engine
        log = engine.kv_event_log
        if log is None:
            raise UnimplementedError(
                "SubscribeKvEvents: the server records no KV events (sluice serve --kv-events)"
            )
        # Only the blocks the tenant's requests can hit (its scope's): another tenant's cached prompt
        # spelled as the gateway's would have it route requests to a worker that recomputes them.
        scope = tenant.cache_scope
        subscription = log.subscribe(request.start_sequence_number, lambda salt: scope_of(salt) == scope)
        batches = smg_kv_events.smg_batches(
            subscription,
            request.start_sequence_number,
            engine.stats,
            engine.model_info,
            self._gen_throughput,
            request.load_records_before_first_batch,
            engine.liveness,
        )
        try:
            await context.send_initial_metadata(())  # the subscriber's call resolves before any event
            async for batch in batches:
                yield batch
        finally:
            subscription.close()

    @rpc_errors
    async def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        """Unhealthy while loading, draining or after the engine failed: SMG stops routing here."""
        try:
            self._inference.check_accepting()
        except ServiceUnavailableError as exc:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message=str(exc))
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    @rpc_errors
    async def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        engine = self._inference.accepting_runner().engine
        return smg_convert.model_info_to_smg(engine.model_info, engine.tokenizer)

    @rpc_errors
    async def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        engine = self._inference.accepting_runner().engine
        return smg_convert.server_info_to_smg(
            num_active_requests=engine.num_live_requests,
            uptime_seconds=time.time() - self._started,
            last_receive_timestamp=self._last_receive,
            info=engine.model_info,
        )

    @rpc_errors
    async def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        engine = self._inference.accepting_runner().engine
        timestamp = datetime.now(UTC).isoformat()
        stats = engine.stats()
        return smg_convert.loads_to_smg(
            stats, engine.model_info, timestamp, self._version, self._gen_throughput(stats)
        )

    def _gen_throughput(self, stats: EngineStats) -> float:
        """Tokens generated per second lately (GetLoads and the load records share the measure)."""
        return self._generation_rate(stats.num_generation_tokens, time.monotonic())

    @rpc_errors
    async def StartProfile(
        self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        """torch.profiler over the engine core's next `num_steps` forward steps (until StopProfile if
        unset), written under the server's --profile-dir (`sluice.engine.core.step_profiler`)."""
        self._inference.caller(context)
        root = self._profile_root()
        engine = self._inference.accepting_runner().engine
        profile = profile_request(request, root)
        engine.start_profile(**profile)
        steps = f"the next {profile['num_steps']}" if profile["num_steps"] else "the"
        return common_pb2.ProfileResponse(
            success=True, message=f"profiling {steps} forward steps into {profile['output_dir']}"
        )

    @rpc_errors
    async def StopProfile(
        self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.ProfileResponse:
        """Ends the running profile (if any) and has it written. The stop goes to the engine core without
        an answer, so the message cannot say whether a profile was running (one of num_steps may have
        ended and been written already)."""
        self._inference.caller(context)
        root = self._profile_root()
        self._inference.accepting_runner().engine.stop_profile()
        return common_pb2.ProfileResponse(
            success=True,
            message=f"profiling stopped: a profile still running is written to its output_dir under {root}",
        )

    def _profile_root(self) -> Path:
        if self._profile_dir is None:
            raise FailedPreconditionError(
                "profiling is off: start the server with --profile-dir DIR (or SLUICE_PROFILE_DIR)"
            )
        return self._profile_dir

    @rpc_errors
    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """A zip of tokenizer.json, tokenizer_config.json (chat template), config.json and
        generation_config.json, in chunks; the last carries the archive's SHA-256."""
        engine = self._inference.accepting_runner().engine
        if engine.tokenizer is None:  # the server's state, not the (empty) request's fault
            raise FailedPreconditionError(
                "GetTokenizer: this model has no tokenizer (no tokenizer.json): send tokenized.input_ids"
            )
        archive = _zip(smg_convert.bundle_files(engine.tokenizer, engine.model_info))
        digest = hashlib.sha256(archive).hexdigest()
        for offset in range(0, len(archive), TOKENIZER_CHUNK_BYTES):
            end = offset + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(
                data=archive[offset:end], sha256=digest if end >= len(archive) else ""
            )


async def _responses(
    request: vllm_engine_pb2.GenerateRequest,
    runner: GenerationRunner,
    engine_request_id: str,
    caller: Caller,
    span: RequestSpan,
    cancel: RequestCancel,
) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
    """Converts the request and streams its responses; a refusal (ValueError: SamplingParams', the prompt
    checks', the engine's, e.g. more KV blocks than it has) names SMG's fields."""
    engine = runner.engine
    to_spec = smg_convert.generation_spec_from_smg
    try:
        spec = await tokenize_when_long(
            len(request.text), to_spec, request, engine.model_info, engine.tokenizer
        )
        outputs = runner.outputs(spec, engine_request_id, caller, span, cancel)
        responses = smg_convert.SmgResponses(spec, request.stream)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                async for response in responses.responses(output):
                    yield response
    except ValueError as exc:
        raise smg_convert.smg_refusal(exc, smg_convert.smg_prompt_field(request)) from exc


async def _unimplemented(self: SmgEngineServicer, request: object, context: grpc.aio.ServicerContext) -> None:
    """UNIMPLEMENTED with a message, without the traceback grpc logs for the generated base methods."""
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not supported by Sluice")


for _name in ("Embed", "FlushCache"):
    setattr(SmgEngineServicer, _name, _unimplemented)


PROFILE_ACTIVITIES = {"CPU": "CPU", "GPU": "GPU", "CUDA": "GPU"}


def profile_request(request: common_pb2.StartProfileRequest, root: Path) -> dict[str, Any]:
    """StartProfile's fields checked, as `AsyncEngine.start_profile`'s arguments; InvalidRequestError names
    the field. output_dir: relative to `root`, or absolute inside it (default: root itself)."""
    if request.HasField("start_step") and request.start_step != 0:
        raise InvalidRequestError("start_step", "not supported: a profile starts at the next step (give 0)")
    if request.HasField("num_steps") and request.num_steps < 1:
        raise InvalidRequestError("num_steps", f"must be >= 1, got {request.num_steps}")
    if request.profile_by_stage:
        raise InvalidRequestError("profile_by_stage", "not supported")
    activities = []
    for name in request.activities:
        if name.upper() not in PROFILE_ACTIVITIES:
            raise InvalidRequestError("activities", f"{name!r} is not one of CPU, GPU (or CUDA)")
        activities.append(PROFILE_ACTIVITIES[name.upper()])
    output_dir = (root / request.output_dir).resolve() if request.output_dir else root
    if not output_dir.is_relative_to(root):
        raise InvalidRequestError("output_dir", f"must be inside the server's --profile-dir {root}")
    return {
        "output_dir": str(output_dir),
        "num_steps": request.num_steps if request.HasField("num_steps") else 0,
        "activities": sorted(set(activities)),
        "record_shapes": request.record_shapes,
        "with_stack": request.with_stack,
    }


def _zip(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()
