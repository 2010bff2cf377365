"""KV cache event batches as SMG's `KvEventBatch` (smg.grpc.common), for `VllmEngine.SubscribeKvEvents`.

SMG's gateway subscribes to every gRPC worker at registration: with the events its cache-aware policy
routes a request to the worker whose prefix cache holds the longest run of the request's blocks (it
hashes each stored block's token ids itself), instead of guessing from the requests it sent.

Every batch also carries the engine's load (`EngineLoad`: GetLoads' numbers), so the gateway's load-aware
choices see each step instead of its poll; a step that changed the load without a KV event, and a second
without any batch, send a `load_only` batch repeating the stream's last sequence number (0 before the
engine's first batch, for a subscriber that asked for `load_records_before_first_batch`; without it the
first record comes with the first batch). A subscriber that got load records judges the worker stale
after 15 s without one (SMG's `--worker-stale-secs`): LOAD_HEARTBEAT_S stays well below. Each record
also says how long the engine core has been silent while requests are live and how much prefill it
has in hand (`engine_silence_ms`, `prefill_pending_tokens`): a wedged core shows in the heartbeats.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2

from sluice.engine.frontend.async_engine import EngineLiveness
from sluice.engine.frontend.kv_event_log import KVEventBatch, KVEventSubscription
from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from sluice.engine.model_info import ModelInfo
from sluice.engine.outputs import EngineStats
from sluice.service.tenants import request_salt_of

_DEVICE = common_pb2.KV_CACHE_TIER_DEVICE
_LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL
LOAD_HEARTBEAT_S = 1.0  # a load_only batch after this long without any batch on the stream
_UINT32_MAX = 2**32 - 1


def event_to_smg(event: KVEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlocksStored):
        size = event.block_size
        blocks = [
            common_pb2.KvBlock(
                block_hash=block_hash, token_ids=event.token_ids[i * size : (i + 1) * size], block_size=size
            )
            for i, block_hash in enumerate(event.block_hashes)
        ]
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=_DEVICE, locality=_LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        # The request's own salt, as the gateway saw it (never the tenant's scope, which it does not know).
        salt = request_salt_of(event.cache_salt)
        if salt is not None:
            stored.cache_salt = salt
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlocksRemoved):
        removed = common_pb2.KvBlocksRemoved(block_hashes=event.block_hashes, tier=_DEVICE, locality=_LOCAL)
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    assert isinstance(event, AllBlocksCleared), type(event).__name__
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def batch_to_smg(batch: KVEventBatch, first_event_id: int | None) -> common_pb2.KvEventBatch:
    """The batch, its events numbered from `first_event_id` (all 0 for None)."""
    events = [
        event_to_smg(event, 0 if first_event_id is None else first_event_id + i)
        for i, event in enumerate(batch.events)
    ]
    smg_batch = common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events
    )
    if batch.snapshot is not None:  # the log saw every event since the engine started: nothing unknown
        chunk = batch.snapshot
        smg_batch.snapshot.CopyFrom(
            common_pb2.KvSnapshotChunk(index=chunk.index, count=chunk.count, blocks=chunk.num_blocks)
        )
    return smg_batch


def engine_load(
    stats: EngineStats,
    info: ModelInfo,
    sample: int,
    telemetry: bool,
    gen_throughput: float,
    liveness: EngineLiveness | None = None,
) -> common_pb2.EngineLoad:
    """The load record GetLoads' numbers make; `telemetry` adds those beyond the routing core (SMG sends
    them on the heartbeat cadence: load_only batches and a stream's first record). `liveness` adds the
    engine's silence and the prefill in hand, by which the gateway tells a wedged worker from a busy one:
    the core sends a message every step (its stats, tokens or none) and every HEARTBEAT_S when idle, so
    while it serves its silence is one step at most (`engine_reports_steps`)."""
    load = common_pb2.EngineLoad(
        running_requests=stats.num_running,
        waiting_requests=stats.num_waiting,
        # What the waiting requests have yet to compute; the engine looks at the cache only at admission.
        waiting_uncached_tokens=stats.num_waiting_tokens,
        gen_throughput=gen_throughput,
        token_usage=stats.kv_usage,
        # The engine counts only blocks requests hold as used (cached, unreferenced ones are free).
        active_token_usage=stats.kv_usage,
        max_running_requests=info.max_num_seqs,
        sample=sample,
    )
    if telemetry:
        queries = stats.prefix_cache_queries
        load.cache_hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        load.num_used_tokens = stats.num_kv_blocks_used * info.block_size
        load.max_total_num_tokens = info.kv_capacity_tokens
    if liveness is not None:
        load.engine_reports_steps = True
        load.prefill_pending_tokens = min(liveness.prefill_pending_tokens, _UINT32_MAX)
        if liveness.silence_s is not None:
            load.engine_silence_ms = min(int(liveness.silence_s * 1000), _UINT32_MAX)
    return load


def _routing_core(stats: EngineStats) -> tuple[int, int, int, int]:
    return stats.num_running, stats.num_waiting, stats.num_waiting_tokens, stats.num_kv_blocks_used


async def smg_batches(
    subscription: KVEventSubscription,
    cursor: int,
    stats: Callable[[], EngineStats],
    info: ModelInfo,
    gen_throughput: Callable[[EngineStats], float],
    load_records_before_first_batch: bool = False,
    liveness: Callable[[], EngineLiveness] | None = None,
) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The subscription's batches (after `cursor`) as SMG's, each with the engine's load, and load_only
    batches between them (see the module's docstring). Events are numbered 1, 2, ... over the stream; a
    snapshot's, made up from the cache rather than recorded, 0 (as SMG's KvSnapshotChunk says)."""
    next_event_id, sample = 1, 0
    last_sent = cursor or None  # the sequence number a load_only batch repeats (None: none yet)
    last_core: tuple[int, int, int, int] | None = None
    sent_at = time.monotonic()
    while True:
        # No heartbeat before the first batch for a subscriber that did not ask for records before it.
        quiet = last_sent is None and not load_records_before_first_batch
        timeout = None if quiet else max(0.0, sent_at + LOAD_HEARTBEAT_S - time.monotonic())
        batch = await subscription.next(timeout=timeout)
        now_stats = stats()
        if batch is not None:
            if batch.snapshot is not None:
                smg_batch = batch_to_smg(batch, None)
            else:
                smg_batch = batch_to_smg(batch, next_event_id)
                next_event_id += len(batch.events)
            last_sent = batch.sequence_number
        else:
            due = time.monotonic() - sent_at >= LOAD_HEARTBEAT_S
            if quiet or (_routing_core(now_stats) == last_core and not due):
                continue
            smg_batch = common_pb2.KvEventBatch(sequence_number=last_sent or 0, timestamp=time.time())
        sample += 1
        load_only = batch is None
        record = engine_load(
            now_stats,
            info,
            sample,
            load_only or sample == 1,
            gen_throughput(now_stats),
            None if liveness is None else liveness(),
        )
        smg_batch.load.CopyFrom(record)
        smg_batch.load.load_only = load_only
        last_core, sent_at = _routing_core(now_stats), time.monotonic()
        yield smg_batch
