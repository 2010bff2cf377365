"""The grpc.aio server: InferenceService, health, reflection, auth, TLS, metrics endpoint, and drain.

Life of a server:
    start()          port bound, health NOT_SERVING, InferenceService answers UNAVAILABLE
    attach_engine()  health SERVING
    drain()          health NOT_SERVING and every new call refused with UNAVAILABLE (retryable) by the
                     servicers, while the server still takes calls; once clients have moved away (no
                     call for QUIET_S, at least HEALTH_NOTICE_S after the start, at most the grace
                     period) grpc's stop(grace): GOAWAY to every connection, the listener closes;
                     in-flight requests get `grace_period` seconds (from the start), the rest are
                     aborted (FINISH_REASON_ABORT); then it stops
    end_grace_period()  during the drain (a second SIGINT): the grace period ends now
    every connection lives `max_connection_age` seconds (grpc adds +-10% jitter), then gets a GOAWAY
                     so clients re-resolve and new replicas get their share; its calls in flight get
                     `max_connection_age_grace` more seconds before the connection closes
    engine dies      health NOT_SERVING at once, every call UNAVAILABLE; `engine_failed` is set so
                     `sluice serve` exits non-zero and the orchestrator restarts the pod
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import ssl
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from smg_grpc_proto import vllm_engine_pb2_grpc

from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.service.auth import HEALTH_SERVICE, ApiKeyInterceptor
from sluice.service.call_arrivals import CallArrivals
from sluice.service.health import HealthServicer
from sluice.service.listen_address import ListenError, bind_failure, listen_address
from sluice.service.malformed_messages import MalformedMessageInterceptor
from sluice.service.metrics import ServerMetrics
from sluice.service.reflection import enable_reflection
from sluice.service.servicer import MALFORMED_IN_BAND_METHODS, InferenceServicer
from sluice.service.servicer import TRACED_METHODS as TRACED_INFERENCE_METHODS
from sluice.service.smg_servicer import SERVICE_NAME as SMG_SERVICE
from sluice.service.smg_servicer import TRACED_METHODS as TRACED_SMG_METHODS
from sluice.service.smg_servicer import SmgEngineServicer
from sluice.service.tenants import TenantDirectory, check_key
from sluice.v1 import sluice_pb2, sluice_pb2_grpc

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

INFERENCE_SERVICE = sluice_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
# grpc.health.v1 answers for the server ("") and for each generation service it serves, all one status.
HEALTH_SERVICES = ("", INFERENCE_SERVICE, SMG_SERVICE)
# After the drain's grace period, leftover requests are aborted; their last chunks go out within this.
ABORT_MARGIN_S = 1.0
# Why the GOAWAY waits: from grpc's stop() on, grpc's core cancels (CANCELLED, which no client retries)
# every call it has accepted but not yet handed to a handler (the aio server takes one at a time, so
# under load they queue) and every call that reaches a connection before its client has read the
# GOAWAY. Until then the servicers refuse calls with UNAVAILABLE (retried elsewhere), so the GOAWAY
# waits until calls have stopped coming: at least HEALTH_NOTICE_S (clients watching health move away)
# and then until no call has arrived for QUIET_S (nothing queued, nothing on the way), counted only over
# time the event loop kept its schedule (a loop that wakes late may have calls queued it has not seen).
HEALTH_NOTICE_S = 0.5
QUIET_S = 0.25
# After the GOAWAY, before the calls still open are cancelled (health watches, idle streams; grpc's
# stop(0)): at least this long, so that what is already under way ends as it would have (a refusal's
# UNAVAILABLE still being written, a call sent before its client read the GOAWAY, the two-step GOAWAY's
# ping round trip) instead of as CANCELLED. Without it, when no request was left, stop(0) ran before the
# graceful stop had even started (nothing awaited between them), and a CI run (2026-11-30) saw 2 of 1,340
# storm calls end CANCELLED, the cancel 5 ms after the GOAWAY's log line (docs/FLEET.md, "Drain").
GOAWAY_SETTLE_S = 0.25


# grpc takes these durations as int32 milliseconds: at most this, about 24.8 days (its own default).
GRPC_MAX_MS = 2**31 - 1
# Calls grpc holds for the event loop before it drops them (ServerConfig.grpc_options): admission control
# (--max-queue, tenants' limits) refuses the excess, not the transport.
MAX_PENDING_CALLS = 20_000


def grpc_millis(seconds: float) -> int:
    """`seconds` as grpc's int32 milliseconds, held to GRPC_MAX_MS: a longer time (or inf) is as good as
    never, where grpc itself would refuse it (OverflowError at server creation)."""
    return GRPC_MAX_MS if seconds * 1000 >= GRPC_MAX_MS else round(seconds * 1000)


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate and key (PEM files); `client_ca` set means clients must present a cert (mTLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        """Each file is read now, and the key matched to the certificate, so that a missing, malformed or
        mismatched one is refused naming its flag (grpc would only fail to bind, as if the port were
        taken)."""
        for name, flag in (("cert", "cert"), ("key", "key"), ("client_ca", "client-ca")):
            path = getattr(self, name)
            if path is None:
                continue
            try:
                pem = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"tls-{flag}: cannot read {path}: {exc.strerror or exc}") from None
            if b"-----BEGIN " not in pem:
                raise ValueError(f"tls-{flag}: {path} is not a PEM file")
            if name == "key" and b"ENCRYPTED" in pem:  # OpenSSL would prompt for it on the terminal
                raise ValueError(f"tls-key: {path} is passphrase-protected; grpc needs an unencrypted key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # No password: never OpenSSL's prompt on the terminal, which a server would wait at forever.
            context.load_cert_chain(self.cert, self.key, password=b"")
        except (ssl.SSLError, OSError) as exc:  # swapped files, or a key of another certificate
            raise ValueError(
                f"tls-key: {self.key} is not the private key of the certificate in {self.cert} "
                f"({getattr(exc, 'reason', None) or exc})"
            ) from None
        if self.client_ca is not None:
            try:
                context.load_verify_locations(cafile=self.client_ca)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"tls-client-ca: {self.client_ca} holds no CA certificate ({exc.reason or exc})"
                ) from None

    def credentials(self) -> grpc.ServerCredentials:
        key_pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            key_pair, root_certificates=client_ca, require_client_auth=client_ca is not None
        )


@dataclass(frozen=True)
class ServerConfig:
    """`api_key` (one key, tenant "default") and `tenants` (--api-keys) are exclusive; neither: no auth.
    `max_connection_age` None disables it."""

    host: str = "0.0.0.0"
    port: int = 50051  # 0 picks a free port
    api_key: str | None = field(default=None, repr=False)  # never in a repr, as tenants keep theirs
    tenants: TenantDirectory | None = None
    grace_period: float = 30.0
    metrics_port: int | None = None  # None: no /metrics endpoint; 0 picks a free port
    profile_dir: str | None = None  # None: StartProfile / StopProfile answer FAILED_PRECONDITION
    tls: TlsConfig | None = None
    max_message_bytes: int = 64 << 20
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    max_connection_age: float | None = 300.0
    max_connection_age_grace: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port: must be in [0, 65535]")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port: must be in [0, 65535]")
        if not self.grace_period >= 0:  # NaN too
            raise ValueError("grace_period: must be >= 0")
        if self.api_key is not None and self.tenants is not None:
            raise ValueError("api_keys: give an API key or an API keys file, not both")
        if self.api_key is not None:  # "" too: an empty SLUICE_API_KEY must not turn keys off
            check_key(self.api_key, "api_key")
        # grpc counts whole milliseconds, where 0 would age every connection out at once (NaN too).
        if self.max_connection_age is not None and not self.max_connection_age >= 0.001:
            raise ValueError(
                "max_connection_age: must be >= 0.001 seconds (0 on the command line, None here, disables it)"
            )
        if not self.max_connection_age_grace >= 0:
            raise ValueError("max_connection_age_grace: must be >= 0 seconds")
        if self.profile_dir is not None:
            self._make_profile_dir(self.profile_dir)

    @staticmethod
    def _make_profile_dir(path: str) -> None:
        """Made now, so that a path no profile can be written to is refused at start: else taken, and
        StartProfile and StopProfile answered success while the core only logged that it wrote nothing."""
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"profile_dir: {path!r} is not a directory")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"profile_dir: {path!r} cannot be made a directory ({e.strerror})") from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"profile_dir: {path!r} is not writable")

    def tenant_directory(self) -> TenantDirectory:
        if self.tenants is not None:
            return self.tenants
        if self.api_key is None:
            return TenantDirectory.open()
        return TenantDirectory.single_key(self.api_key)

    def grpc_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
            # grpc sets SO_REUSEPORT by default: a second server on a port in use would start as well and
            # silently take a share of its connections. Off, it is refused (ListenError, naming the port).
            ("grpc.so_reuseport", 0),
            # Calls arrived but not yet taken by the event loop (one at a time): past grpc's defaults of
            # 1,000 (dropped at random) and 3,000 (all), a burst's calls ended CANCELLED, which no client
            # retries, uncounted and before --max-queue or a tenant's limit could refuse them with
            # RESOURCE_EXHAUSTED (3,000 Generate calls at once: 667 CANCELLED on a 2-core machine).
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
        ]
        if self.max_connection_age is not None:
            options += [
                ("grpc.max_connection_age_ms", grpc_millis(self.max_connection_age)),
                ("grpc.max_connection_age_grace_ms", grpc_millis(self.max_connection_age_grace)),
            ]
        return options


class SluiceServer:
    """One gRPC server with its own metrics registry; the engine is attached once loaded."""

    def __init__(self, config: ServerConfig, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self.tenants = config.tenant_directory()
        self.servicer = InferenceServicer(self.metrics, tracer_provider, self.tenants)
        self.smg_servicer = SmgEngineServicer(self.servicer, self.metrics, config.profile_dir)
        self.arrivals = CallArrivals()
        self.health = HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._grace_over = asyncio.Event()  # set by `end_grace_period`: the drain aborts what still runs
        self.engine_failed = asyncio.Event()
        self._health_tasks: set[asyncio.Task[None]] = set()

    def _count_refusal(self, code: grpc.StatusCode, method: str) -> None:
        """A call refused before any handler ran (for its API key, or a request message that did not
        parse): counted as the handlers count theirs (sluice_rpc_requests_total, by method name), for the
        services whose calls are counted."""
        service, _, name = method.lstrip("/").partition("/")
        if service == INFERENCE_SERVICE:
            self.metrics.record_status(name, code)
        elif service == SMG_SERVICE:  # as "VllmEngine.<method>", apart from sluice.v1's of one name
            self.smg_servicer.record_status(name, code)

    async def start(self) -> int:
        """Binds and starts serving (health NOT_SERVING until `attach_engine`); returns the bound port."""
        interceptors: list[grpc.aio.ServerInterceptor] = [self.arrivals]
        if self.tenants.requires_key:
            # The generation methods check the key in their handlers, to record a refused call's span.
            traced = TRACED_INFERENCE_METHODS + TRACED_SMG_METHODS
            interceptors.append(
                ApiKeyInterceptor(
                    self.tenants,
                    authenticated_by_handler=traced,
                    on_refused=functools.partial(self._count_refusal, grpc.StatusCode.UNAUTHENTICATED),
                )
            )
        # Last: a call the API key interceptor refuses is refused for its key, whatever its message (the
        # Generate methods check the key in their handlers: a message that does not parse is refused first).
        interceptors.append(
            MalformedMessageInterceptor(
                refused_by_handler=MALFORMED_IN_BAND_METHODS,
                on_refused=functools.partial(self._count_refusal, grpc.StatusCode.INVALID_ARGUMENT),
            )
        )
        server = grpc.aio.server(interceptors=interceptors, options=self.config.grpc_options())
        sluice_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.smg_servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection((INFERENCE_SERVICE, SMG_SERVICE, HEALTH_SERVICE), server)
        host = self.config.host.strip("[]")
        address = listen_address(host, self.config.port)
        try:
            if self.config.tls is not None:
                self.port = server.add_secure_port(address, self.config.tls.credentials())
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc: "Failed to bind to address ...", without the reason
            raise ListenError(bind_failure(host, self.config.port)) from None
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        if self.config.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(self.config.metrics_port, host)
            except OSError as exc:
                await self.stop(0)
                where = f"{host}:{self.config.metrics_port}"
                raise ListenError(f"metrics_port: cannot listen on {where}: {exc.strerror or exc}") from None
        return self.port

    async def attach_engine(self, engine: AsyncEngine) -> None:
        """Starts serving requests on a started engine. Its death is listened for once SERVING is set,
        with no await between: a core that died before (since the load, or while health was set) fails
        the server at once, and NOT_SERVING is the last write either way."""
        self.engine = engine
        self.servicer.attach(engine)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        engine.on_dead(self._on_engine_dead)

    def _on_engine_dead(self, reason: str) -> None:
        logger.error("engine failed, no longer serving: %s", reason)
        self.engine_failed.set()
        # Kept until done: the loop holds only a weak reference to a task.
        task = asyncio.get_running_loop().create_task(
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def begin_drain(self) -> None:
        """Health NOT_SERVING and new calls UNAVAILABLE; in-flight requests go on."""
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain(self, grace_period: float | None = None) -> None:
        """Health NOT_SERVING and new calls UNAVAILABLE; once calls have stopped coming (see QUIET_S)
        grpc's stop(grace): GOAWAY, no new connections; in-flight requests get the grace period (or until
        `end_grace_period`), then the rest are aborted and their streams end. Then, at least
        GOAWAY_SETTLE_S after the GOAWAY, the calls that never end by themselves (health Watch streams,
        idle StreamGenerate calls) are cancelled and the server stops."""
        grace = self.config.grace_period if grace_period is None else grace_period
        start = time.monotonic()
        await self.begin_drain()
        quiet = self.arrivals.wait_for_quiet(QUIET_S, start + min(HEALTH_NOTICE_S, grace), start + grace)
        self._log_goaway(await self._unless_grace_over(quiet), grace, time.monotonic() - start)
        server, self._server = self._server, None
        goaway_at = time.monotonic()
        remaining = 0.0 if self._grace_over.is_set() else max(0.0, start + grace - goaway_at)
        stopping = None if server is None else asyncio.ensure_future(server.stop(remaining + ABORT_MARGIN_S))
        await self._unless_grace_over(self._wait_for_requests(start + grace))
        runner = self.servicer.runner
        if runner is not None and (num_aborted := await runner.abort_all()):
            logger.warning("grace period over: aborted %d in-flight requests", num_aborted)
            await self._wait_for_requests(time.monotonic() + ABORT_MARGIN_S)
        if server is not None:
            settled = goaway_at + GOAWAY_SETTLE_S - time.monotonic()
            if settled > 0:
                await asyncio.wait({stopping}, timeout=settled)  # ends early once no call is left open
            await server.stop(0)
            await stopping
        await self.stop()

    def _log_goaway(self, quiet: bool | None, grace: float, elapsed: float) -> None:
        """Says why the drain's GOAWAY goes out now: calls stopped coming (`quiet`), the grace period is
        too short to wait for that, it was ended early (None), or it passed with calls still coming."""
        if quiet:
            logger.info("draining: no new call for %.2f s, %.2f s into the drain: GOAWAY", QUIET_S, elapsed)
        elif grace <= HEALTH_NOTICE_S:
            logger.info("draining: grace period %.2f s, no time to wait for calls to stop: GOAWAY", grace)
        elif quiet is not None:
            logger.warning(
                "calls still arriving (or the event loop too busy to tell) at the end of the grace period; "
                "sending GOAWAY anyway"
            )

    def end_grace_period(self) -> None:
        """Ends the drain's grace period now (`sluice serve`: a second SIGINT): the GOAWAY goes out without
        waiting for calls to stop coming, and the requests still running are aborted."""
        self._grace_over.set()

    async def _unless_grace_over(self, waiting: Coroutine[Any, Any, _T]) -> _T | None:
        """`waiting`'s result, or None (`waiting` cancelled) once `end_grace_period` is called."""
        task = asyncio.ensure_future(waiting)
        grace_over = asyncio.ensure_future(self._grace_over.wait())
        await asyncio.wait((task, grace_over), return_when=asyncio.FIRST_COMPLETED)
        grace_over.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    @property
    def num_active_requests(self) -> int:
        """Generation requests of every API not yet ended."""
        return self.servicer.num_active_requests + self.smg_servicer.num_active_requests

    async def _wait_for_requests(self, deadline: float) -> None:
        while self.num_active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self, grace: float | None = None) -> None:
        """Stops the gRPC server (cancelling calls still open after `grace`) and the metrics endpoint."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        self.metrics.close()
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)
