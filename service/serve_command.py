"""`sluice serve`: load a model and serve sluice.v1.InferenceService until SIGTERM / SIGINT drains it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from sluice.engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sluice.engine.errors import EngineDeadError
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.service.server import ServerConfig, SluiceServer, TlsConfig
from sluice.service.tenants import TenantDirectory
from sluice.service.tracing import tracer_provider_from_env

_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}

logger = logging.getLogger("sluice.serve")

# Seconds between an engine failure and the exit: clients get their UNAVAILABLE, probes see NOT_SERVING.
ENGINE_FAILURE_GRACE = 1.0


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"kv-cache-memory: cannot read size {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def configure(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        help="Hugging Face directory, .gguf file or packaged model name such as gemma3-270m "
        "(default: the embedded SmolLM2)",
    )
    source.add_argument("--preset", help="random weights in a named shape (sluice.engine.loading.presets)")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: random weights shaped by --preset or by --model's config.json",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--max-queue", type=int, default=None, help="bound on waiting requests")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="one shared key, tenant 'default' (or SLUICE_API_KEY)",
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="TOML file of tenants: keys, max_priority, limits, prefix_cache_scope (see README)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM (NOT_SERVING at once, new calls refused with "
        "UNAVAILABLE, GOAWAY once they stop coming)",
    )
    parser.add_argument(
        "--max-connection-age",
        type=float,
        default=300.0,
        help="seconds before a client connection gets a GOAWAY, so clients re-resolve and new "
        "replicas get traffic (0 disables)",
    )
    parser.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=120.0,
        help="seconds the calls of an aged connection may still run before it closes",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    parser.add_argument("--tls-cert", help="PEM server certificate")
    parser.add_argument("--tls-key", help="PEM server private key")
    parser.add_argument("--tls-client-ca", help="PEM CA bundle; clients must present a certificate (mTLS)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-memory", type=parse_size, default=None, help="KV cache size on CPU, e.g. 2GiB"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory Sluice may use"
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default=None, help="weight-only, CPU (default: off)"
    )
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--max-seq-len-to-capture",
        type=int,
        default=8192,
        help="decode batches with a longer context run without CUDA graphs",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of random (preset) weights")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads of the engine core process (default: its physical cores)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk (a request's stream_interval overrides it); slow readers get "
        "merged chunks whatever this is",
    )
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="speculative decoding: ngram (prompt lookup) or draft (a smaller model, --draft-model)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=3, help="draft tokens verified per step"
    )
    parser.add_argument("--draft-model", default=None, help="draft model directory (--speculative draft)")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest suffix n-gram looked up")
    parser.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram looked up")
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=30.0,
        help="seconds without a word from the engine core before it counts as failed",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    cache_kwargs = {} if args.kv_cache_memory is None else {"kv_cache_memory_bytes": args.kv_cache_memory}
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            load_format="dummy" if args.preset else args.load_format,
            preset=args.preset,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len,
            quantization=args.quantization,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            **cache_kwargs,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=not args.no_chunked_prefill,
        ),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_seq_len_to_capture=args.max_seq_len_to_capture,
        num_threads=args.num_threads,
        speculative=speculative_config(args),
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative is None:
        if args.draft_model is not None:
            raise ValueError("draft-model: needs --speculative draft")
        return None
    return SpeculativeConfig(
        method=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
    )


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
        api_key=args.api_key or None,
        tenants=TenantDirectory.load(args.api_keys) if args.api_keys else None,
        grace_period=args.grace_period,
        metrics_port=args.metrics_port,
        tls=tls,
        max_connection_age=args.max_connection_age or None,
        max_connection_age_grace=args.max_connection_age_grace,
    )


async def serve(config: EngineConfig, serving: ServerConfig, engine: AsyncEngine) -> int:
    """Health NOT_SERVING while the model loads, SERVING once ready; SIGTERM/SIGINT drain and exit 0.

    If the engine core dies, health goes NOT_SERVING, calls end UNAVAILABLE, and after
    ENGINE_FAILURE_GRACE seconds the process exits 1, so the orchestrator restarts it.
    """
    server = SluiceServer(serving, tracer_provider=tracer_provider_from_env())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = await server.start()
    try:
        await engine.start()
    except EngineDeadError as exc:
        logger.error("the engine could not start: %s", exc)
        await server.stop(0)
        await engine.shutdown()
        return 1
    await server.attach_engine(engine)
    metrics = f" metrics_port={server.metrics_port}" if server.metrics_port is not None else ""
    print(
        f"sluice ready: model={engine.model_info.name} port={port}{metrics} core_pid={engine.core_pid}",
        flush=True,
    )
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
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        engine = AsyncEngine(
            config,
            args.max_queue,
            stream_interval=args.stream_interval,
            engine_timeout=args.engine_timeout,
        )
        main = serve(config, server_config(args), engine)
    except ValueError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
