"""How many slices the prefill kernel cuts each q tile's context into (split-KV, `prefill_attention`).

A launch splits only when its q tiles x KV heads are too few to fill the GPU's SMs and its contexts are
longer than a partition: a speculative verify, a short turn after a long cached conversation, a chunk
after a long prefix. The count depends only on the batch's shape and the context bound `max_seq_len`,
never on the contexts themselves, so a CUDA graph captured with the largest context replays shorter ones;
and it is bounded, so a graph's partial buffers are too (`split_partials_bound_bytes`).
"""

from __future__ import annotations

import torch

from sluice.kernels.compile_target import DEFAULT_NUM_SMS, device_sm_count
from sluice.kernels.paged_decode_attention import pick_num_splits

# The shortest context slice a split prefill program takes. Not the decode kernel's DEFAULT_PARTITION_SIZE
# (128 since run 15): 512 is what run 15 timed split-KV prefill and mixed steps with.
PREFILL_PARTITION_SIZE = 512
# A launch whose q tiles with rows x KV heads fill at least this share of the SMs is not split:
# FlashAttention-2's num_splits heuristic (0.8 of a wave). Run 15 (H200, docs/perf/README.md): 512 tokens
# after 32k, 128 such units for 132 SMs, took 1.06x / 1.08x one split's time in 2 / 4 splits.
NO_SPLIT_WAVE_SHARE = 0.8
# Under that, split until those units x splits fill every SM this many times. Run 15 timed twice the
# splits of one program an SM 1.20-1.34x faster at three shapes (4 tokens after 32k at batch 1 and after
# 8k at batch 4, 128 after 16k), so two.
PREFILL_PROGRAMS_PER_SM = 2


def split_partials_bound_bytes(head_dim: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """The most bytes of partials a launch with a picked split count allocates, whatever its batch: it
    splits only while its q tiles with rows x KV heads < NO_SPLIT_WAVE_SHARE x num_sms (< the programs
    wanted, PREFILL_PROGRAMS_PER_SM x num_sms), and then splits x those < 2 x PREFILL_PROGRAMS_PER_SM x
    num_sms, each (split, tile, KV head) holding at most 128 (token, head) rows (`prefill_config`'s
    tallest tile) of head_dim + 1 floats."""
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
    """Slices per tile: 1 without `max_seq_len`, or where the q tiles that can hold rows (at most
    cdiv(max_query_len, block_q) a sequence: a verify's one, not the grid's two) x KV heads fill
    NO_SPLIT_WAVE_SHARE of the SMs; else `pick_num_splits` with PREFILL_PROGRAMS_PER_SM over those units
    and, as context, the most positions one tile attends to (a window's W plus the tile's own rows)."""
    if max_seq_len is None:
        return 1
    num_q_tiles = min(num_tokens // block_q + num_seqs, num_seqs * -(-max_query_len // block_q))
    num_sms = device_sm_count(device)
    if num_q_tiles * num_kv_heads >= NO_SPLIT_WAVE_SHARE * num_sms:
        return 1
    context = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_q + block_n)
    return pick_num_splits(
        num_q_tiles, num_kv_heads, context, num_sms, partition_size,
        programs_per_sm=PREFILL_PROGRAMS_PER_SM,
    )  # fmt: skip
