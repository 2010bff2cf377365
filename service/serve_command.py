"""`sluice serve`: load a model and serve sluice.v1.InferenceService until SIGTERM / SIGINT drains it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from sluice.engine.config import EngineConfig
from sluice.engine.errors import EngineDeadError
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.service.engine_args import add_engine_arguments, engine_config_from_args
from sluice.service.listen_address import ListenError
from sluice.service.server import ServerConfig, SluiceServer, TlsConfig
from sluice.service.tenants import TenantDirectory
from sluice.service.tracing import tracer_provider_from_env

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger("sluice.serve")

# Seconds between an engine failure and the exit: clients get their UNAVAILABLE, probes see NOT_SERVING.
ENGINE_FAILURE_GRACE = 1.0


def configure(parser: argparse.ArgumentParser) -> None:
    """The server's own flags here; the engine's come from the config dataclasses (`engine_args`)."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    server.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="bound on waiting sequences (a request of n samples is n; an empty queue takes any request)",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="one shared key, tenant 'default' (or SLUICE_API_KEY)",
    )
    server.add_argument(
        "--api-keys",
        metavar="FILE",
        help="TOML file of tenants: keys, max_priority, limits, prefix_cache_scope (docs/OPERATIONS.md)",
    )
    server.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM (NOT_SERVING at once, new calls refused with "
        "UNAVAILABLE, GOAWAY once they stop coming)",
    )
    server.add_argument(
        "--max-connection-age",
        type=float,
        default=300.0,
        help="seconds before a client connection gets a GOAWAY, so clients re-resolve and new "
        "replicas get traffic (0 disables)",
    )
    server.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=3600.0,
        help="seconds the calls of an aged connection may still run before it closes (then cut: "
        "UNAVAILABLE mid-stream; keep it above the longest generation)",
    )
    server.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    server.add_argument(
        "--profile-dir",
        default=os.environ.get("SLUICE_PROFILE_DIR"),
        help="allow the StartProfile / StopProfile RPCs (VllmEngine service), writing torch.profiler "
        "traces and summaries of the engine's steps under this directory (or SLUICE_PROFILE_DIR)",
    )
    server.add_argument("--tls-cert", help="PEM server certificate")
    server.add_argument("--tls-key", help="PEM server private key")
    server.add_argument("--tls-client-ca", help="PEM CA bundle; clients must present a certificate (mTLS)")
    server.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk (a request's stream_interval overrides it); slow readers get "
        "merged chunks whatever this is",
    )
    server.add_argument(
        "--engine-timeout",
        type=float,
        default=30.0,
        help="seconds without a word from the engine core before it counts as failed (a CPU step that "
        "keeps the core busy says so meanwhile)",
    )
    server.add_argument(
        "--kv-events",
        action="store_true",
        help="stream the prefix cache's stored and evicted blocks (VllmEngine.SubscribeKvEvents) to SMG's "
        "cache-aware routing; the stream carries every request's token ids",
    )
    add_engine_arguments(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config_from_args(args)


def server_config(args: argparse.Namespace) -> ServerConfig:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("tls-cert: --tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("tls-client-ca: needs --tls-cert and --tls-key")
    tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if args.api_keys and args.api_key:
        raise ValueError("api-keys: give --api-key (or SLUICE_API_KEY) or --api-keys, not both")
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tenants=TenantDirectory.load(args.api_keys) if args.api_keys else None,
        grace_period=args.grace_period,
        metrics_port=args.metrics_port,
        profile_dir=args.profile_dir or None,
        tls=tls,
        max_connection_age=args.max_connection_age or None,
        max_connection_age_grace=args.max_connection_age_grace,
    )


async def serve(
    config: EngineConfig,
    serving: ServerConfig,
    engine: AsyncEngine,
    tracer_provider: TracerProvider | None = None,
) -> int:
    """Health NOT_SERVING while the model loads, SERVING once ready; SIGTERM/SIGINT drain and exit 0
    (a second SIGINT aborts what still runs instead of waiting out the grace period).

    If the engine core dies, health goes NOT_SERVING, calls end UNAVAILABLE, and after
    ENGINE_FAILURE_GRACE seconds the process exits 1, so the orchestrator restarts it. A core that
    dies during the drain fails the requests still running: the drain goes on and the exit is 1.
    """
    server = SluiceServer(serving, tracer_provider=tracer_provider)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_stop_signal, sig, stop, server)
    try:
        port = await server.start()
    except ListenError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        await engine.shutdown()  # never started: its sockets and directory
        return 2
    try:
        started = await _start_unless_stopped(engine, stop)
    except EngineDeadError as exc:
        logger.error("the engine could not start: %s", exc)
        started = False
    if not started:
        await server.stop(0)
        await engine.shutdown()
        return 0 if stop.is_set() else 1
    await server.attach_engine(engine)
    metrics = f" metrics_port={server.metrics_port}" if server.metrics_port is not None else ""
    _announce(f"sluice ready: model={engine.model_info.name} port={port}{metrics} core_pid={engine.core_pid}")
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(server.engine_failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if server.engine_failed.is_set():
        logger.error("exiting in %.1fs: the engine failed (%s)", ENGINE_FAILURE_GRACE, engine.error)
        await asyncio.sleep(ENGINE_FAILURE_GRACE)
        await server.stop(grace=0.5)
        await engine.shutdown()
        return 1
    logger.info("draining: NOT_SERVING, new calls refused; grace period %.1fs", server.config.grace_period)
    await server.drain()
    await engine.shutdown()
    if server.engine_failed.is_set():
        logger.error("drained, but the engine failed during the drain (%s)", engine.error)
        return 1
    return 0


def _announce(line: str) -> None:
    """The ready line on stdout. A stdout whose reader is gone (a pipe to a log shipper that died) must not
    stop a server that is ready: the line goes to the log instead, and stdout to /dev/null, so that the
    interpreter's last flush cannot fail either."""
    try:
        print(line, flush=True)
    except OSError as exc:
        logger.warning("stdout cannot be written (%s); %s", exc.strerror or exc, line)
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def _on_stop_signal(sig: signal.Signals, stop: asyncio.Event, server: SluiceServer) -> None:
    """The first SIGTERM or SIGINT stops the server (the drain, or the load cancelled); a SIGINT after it
    (Ctrl-C again, as uvicorn takes it) ends the drain's grace period at once. A repeated SIGTERM changes
    nothing: a supervisor may deliver it twice (to every process of a cgroup, and again through a
    wrapper script that forwards it), and a pod's in-flight requests keep their grace period."""
    if not stop.is_set():
        stop.set()
    elif sig == signal.SIGINT:
        logger.warning("SIGINT again: the grace period ends now; requests still running are aborted")
        server.end_grace_period()
    else:
        logger.info("SIGTERM again: the drain goes on (SIGINT ends its grace period now)")


async def _start_unless_stopped(engine: AsyncEngine, stop: asyncio.Event) -> bool:
    """Starts the engine (loads the model); False if SIGTERM / SIGINT came first, which cancels the load
    (its core is killed). Raises EngineDeadError if the model fails to load."""
    loading = asyncio.create_task(engine.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((loading, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if loading.done():
        loading.result()
        return True
    loading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loading
    logger.info("stopped while the model loaded")
    return False


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        if args.kv_events and not config.cache.enable_prefix_caching:
            raise ValueError("kv-events: the events are the prefix cache's; drop --no-prefix-caching")
        engine = AsyncEngine(
            config,
            args.max_queue,
            stream_interval=args.stream_interval,
            engine_timeout=args.engine_timeout,
            kv_events=args.kv_events,
        )
        main = serve(config, server_config(args), engine, tracer_provider_from_env())
    except ValueError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
