"""TorchAttentionBackend against attention written out directly, one query row at a time."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.engine.worker.input_batch import build_model_inputs

BLOCK_SIZE = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
NUM_BLOCKS = 40
SCALE = 0.3


def _step(pairs: list[tuple[int, int]], generator: torch.Generator) -> SchedulerOutput:
    """(query_len, seq_len) pairs -> a step whose block tables are disjoint random permutation slices."""
    permutation = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    scheduled = []
    for i, (query_len, seq_len) in enumerate(pairs):
        num_blocks = math.ceil(seq_len / BLOCK_SIZE)
        block_ids = tuple(permutation[:num_blocks])
        permutation = permutation[num_blocks:]
        tokens = (0,) * query_len
        scheduled.append(ScheduledRequest(str(i), tokens, seq_len - query_len, block_ids, True))
    return SchedulerOutput(tuple(scheduled), sum(q for q, _ in pairs))


def _reference(q, k_cache, v_cache, out: SchedulerOutput) -> torch.Tensor:
    rows = []
    group = NUM_HEADS // NUM_KV_HEADS
    for req in out.scheduled:
        slots = [req.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(req.seq_len)]
        keys = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]  # [seq_len, kv_heads, head_dim]
        values = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
        for position in range(req.start_position, req.seq_len):
            row = torch.empty(NUM_HEADS, HEAD_DIM, dtype=torch.float64)
            for h in range(NUM_HEADS):
                scores = keys[: position + 1, h // group].double() @ q[len(rows), h].double() * SCALE
                row[h] = torch.softmax(scores, dim=0) @ values[: position + 1, h // group].double()
            rows.append(row)
    return torch.stack(rows).float()


@pytest.mark.parametrize(
    "pairs",
    [
        [(1, 13), (1, 1), (1, 40), (1, 8)],  # pure decode, uneven lengths
        [(7, 7), (1, 20), (5, 37), (1, 1), (9, 17)],  # fresh prefill, decodes, chunks after a prefix
    ],
)
def test_matches_direct_attention_and_writes_cache_slots(pairs) -> None:
    generator = torch.Generator().manual_seed(len(pairs))
    out = _step(pairs, generator)
    metadata = build_model_inputs(out, BLOCK_SIZE, torch.device("cpu")).metadata
    num_tokens = out.num_batched_tokens
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    got = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, metadata, SCALE)
    slots = metadata.slot_mapping
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], k)
    assert torch.equal(v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], v)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, out), rtol=1e-5, atol=1e-5)
