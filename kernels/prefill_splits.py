"""How many slices the prefill kernel cuts each q tile's context into (split-KV, `prefill_attention`).

A launch splits only when its q tiles x KV heads are too few to fill the GPU's SMs and its contexts are
longer than a partition: a speculative verify, a short turn after a long cached conversation, a chunk
after a long prefix. The count depends only on the batch's shape and the context bound `max_seq_len`,
never on the contexts themselves, so a CUDA graph captured with the largest context replays shorter ones;
and it is bounded, so a graph's partial buffers are too (`split_partials_bound_bytes`).
"""

from __future__ import annotations

import torch

from sluice.kernels.paged_decode_attention import DEFAULT_NUM_SMS, device_sm_count, pick_num_splits

# Split a launch's contexts until its q tiles x KV heads fill every SM once: FlashAttention-2's bar (its
# num_splits heuristic splits only a grid under one wave); a 128-row tile holds one or two programs an SM.
# Untimed: the GPU check's `split_prefill` section times the pick against twice as many splits.
PREFILL_PROGRAMS_PER_SM = 1


def split_partials_bound_bytes(head_dim: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """The most bytes of partials a launch with a picked split count allocates, whatever its batch: it
    splits only while its q tiles with rows x KV heads < PREFILL_PROGRAMS_PER_SM x num_sms, and then splits
    x those < 2 x PREFILL_PROGRAMS_PER_SM x num_sms, each (split, tile, KV head) holding at most 128
    (token, head) rows (`prefill_config`'s tallest tile) of head_dim + 1 floats."""
    return 4 * 2 * PREFILL_PROGRAMS_PER_SM * num_sms * 128 * (head_dim + 1)


def pick_prefill_splits(
    num_tokens: int,
    num_seqs: int,
    max_query_len: int,
    num_kv_heads: int,
    block_q: int,
    block_n: int,
    max_seq_len: int | None,
    sliding_window: int | None,
    partition_size: int,
    device: torch.device,
) -> int:
    """Slices per tile (1 without `max_seq_len`): `pick_num_splits` with PREFILL_PROGRAMS_PER_SM, the q tiles
    that can hold rows as the units of work (at most cdiv(max_query_len, block_q) a sequence: a verify's
    one, not the grid's two) and, as context, the most positions one tile attends to (a window's W plus the
    tile's own rows)."""
    if max_seq_len is None:
        return 1
    num_q_tiles = min(num_tokens // block_q + num_seqs, num_seqs * -(-max_query_len // block_q))
    context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_q + block_n)
    return pick_num_splits(
        num_q_tiles, num_kv_heads, context, device_sm_count(device), partition_size,
        programs_per_sm=PREFILL_PROGRAMS_PER_SM,
    )  # fmt: skip
