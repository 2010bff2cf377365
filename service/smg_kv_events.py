"""KV cache event batches as SMG's `KvEventBatch` (smg.grpc.common), for `VllmEngine.SubscribeKvEvents`.

SMG's gateway subscribes to every gRPC worker at registration: with the events its cache-aware policy
routes a request to the worker whose prefix cache holds the longest run of the request's blocks (it
hashes each stored block's token ids itself), instead of guessing from the requests it sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from smg_grpc_proto.generated import common_pb2

from sluice.engine.frontend.kv_event_log import KVEventBatch, KVEventSubscription
from sluice.engine.kv_cache.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent
from sluice.service.tenants import request_salt_of

_DEVICE = common_pb2.KV_CACHE_TIER_DEVICE
_LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL


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


async def smg_batches(subscription: KVEventSubscription) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The subscription's batches as SMG's, events numbered 1, 2, ... over the stream; a snapshot's
    events, made up from the cache rather than recorded, are numbered 0 (as SMG's KvSnapshotChunk says)."""
    next_event_id = 1
    async for batch in subscription:
        if batch.snapshot is not None:
            yield batch_to_smg(batch, None)
            continue
        yield batch_to_smg(batch, next_event_id)
        next_event_id += len(batch.events)
