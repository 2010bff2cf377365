"""How a layer's heads, rows and vocabulary split over the ranks of a tensor-parallel group (sizes only).

Query heads split evenly. KV heads split evenly when there are at least as many as ranks; with fewer, each
is replicated on size / num_kv_heads consecutive ranks (vLLM's `num_kv_head_replicas`), so a rank's query
heads always find their KV head on the same rank:

    8 query heads, 2 KV heads, 4 ranks:   rank      0     1     2     3
                                          q heads   0-1   2-3   4-5   6-7
                                          kv head   0     0     1     1     (replicated twice)

The vocabulary splits in contiguous ranges of ceil(vocab / size) rows; the last rank's range is padded with
zero rows past the vocabulary (their logits are dropped after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass


def divide(total: int, size: int, what: str) -> int:
    """total / size; ValueError naming `tensor_parallel_size` when it does not divide `what`."""
    if total % size:
        raise ValueError(f"tensor_parallel_size: {size} does not divide the {total} {what}")
    return total // size


@dataclass(frozen=True)
class HeadPartition:
    """One rank's heads: query heads q_start .. q_start + num_heads - 1, KV heads from kv_start."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def partition_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadPartition:
    """Rank `rank`'s heads of `size`; ValueError naming `tensor_parallel_size` when they do not split."""
    per_rank = divide(num_heads, size, "query heads")
    if num_kv_heads >= size:
        kv_per_rank = divide(num_kv_heads, size, "KV heads")
        return HeadPartition(per_rank, kv_per_rank, rank * per_rank, rank * kv_per_rank)
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {size} ranks cannot share {num_kv_heads} KV heads evenly "
            f"(with fewer KV heads than ranks, it must be a multiple of them)"
        )
    replicas = size // num_kv_heads
    return HeadPartition(per_rank, 1, rank * per_rank, rank // replicas)


@dataclass(frozen=True)
class VocabPartition:
    """Rows start .. end - 1 of the vocabulary on this rank, held in `num_rows` rows (zero padding after)."""

    start: int
    end: int
    num_rows: int

    @classmethod
    def of(cls, vocab_size: int, rank: int, size: int) -> VocabPartition:
        num_rows = -(-vocab_size // size)
        start = min(rank * num_rows, vocab_size)
        return cls(start, min(start + num_rows, vocab_size), num_rows)
