"""Tensor-parallel linear layers (Megatron-LM's split, as vLLM's `layers/linear.py`): each rank holds a part
of the weight, sized by `partition` at load (from the `KernelConfig`'s group) before the `LinearMethod`
creates it, and filled by `weight_loader`, which takes the rank's rows or columns of each checkpoint
tensor. With one rank they are the plain layers of `sluice.engine.worker.layers.linear`, computing the
same.

    column parallel   y_r = x W_r^T          W_r: rank r's rows of each shard      (qkv_proj, gate_up_proj)
                      no communication: the output stays split (rank r's heads, rank r's MLP columns)
    row parallel      y = sum_r x_r W_r^T    W_r: rank r's columns               (o_proj, down_proj)
                      one all-reduce; the bias is added once, after it
    lm_head           logits_r = x E_r^T     E_r: rank r's vocabulary rows       then an all-gather

    gate_up_proj [2I, H] on 2 ranks:        rank 0: [gate rows 0..I/2-1;  up rows 0..I/2-1]
                                            rank 1: [gate rows I/2..I-1;  up rows I/2..I-1]
    qkv_proj: rank r's query heads and its KV heads (`sluice.engine.distributed.partition`).

A rank's memory is ~1/N of the weights (norms and, when KV heads are fewer than ranks, k/v rows are
replicated).
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.distributed.partition import HeadPartition, VocabPartition, divide, partition_heads
from sluice.engine.worker.layers.linear import MergedLinear, QKVLinear, ReplicatedLinear


class MergedColumnParallelLinear(MergedLinear):
    """Each shard's rows split evenly: rank r holds rows r * n / N .. (r + 1) * n / N - 1 of every shard n."""

    def partition(self, group: TensorParallelGroup) -> None:
        self.group = group
        sizes = [
            divide(n, group.size, "rows of a column-parallel projection")
            for n in self.checkpoint_output_sizes
        ]
        self._set_sizes(self.checkpoint_input_size, sizes)

    def rank_rows(self, shard: int) -> slice:
        """This rank's rows of checkpoint shard `shard` (`checkpoint_output_sizes[shard]` rows)."""
        rows = self.output_sizes[shard]
        return slice(self.group.rank * rows, (self.group.rank + 1) * rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """This rank's rows of a tensor with the shard's rows (weight, bias, per-row scales); any other
        (a per-tensor scale) whole. With one rank, the plain loader."""
        if (
            self.group.size > 1
            and loaded.dim() > 0
            and loaded.shape[0] == self.checkpoint_output_sizes[shard or 0]
        ):
            loaded = loaded[self.rank_rows(shard or 0)]
        super().weight_loader(param, loaded, shard)


class QKVParallelLinear(QKVLinear, MergedColumnParallelLinear):
    """q, k, v with rank r's query heads and its KV heads (replicated when KV heads are fewer than ranks)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads, bias)
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads

    def partition(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.heads: HeadPartition = partition_heads(
            self.total_num_heads, self.total_num_kv_heads, group.rank, group.size
        )
        q_size, kv_size = self.heads.num_heads * self.head_dim, self.heads.num_kv_heads * self.head_dim
        self._set_sizes(self.checkpoint_input_size, (q_size, kv_size, kv_size))

    def rank_rows(self, shard: int) -> slice:
        first_head = self.heads.q_start if shard == 0 else self.heads.kv_start
        start = first_head * self.head_dim
        return slice(start, start + self.output_sizes[shard])


class RowParallelLinear(ReplicatedLinear):
    """The input's columns split evenly: rank r holds columns r * K / N .. (r + 1) * K / N - 1 of the weight
    and takes the matching slice of x (the column-parallel layer before it left x split so); the partial
    products are summed by one all-reduce, then the bias (whole on every rank) is added once."""

    def partition(self, group: TensorParallelGroup) -> None:
        self.group = group
        input_size = divide(
            self.checkpoint_input_size, group.size, "input columns of a row-parallel projection"
        )
        self._set_sizes(input_size, self.checkpoint_output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """This rank's columns of the weight; a bias (or a per-row scale) whole. With one rank, the plain
        loader."""
        if self.group.size > 1 and loaded.dim() == 2 and loaded.shape[1] == self.checkpoint_input_size:
            start = self.group.rank * self.input_size
            loaded = loaded[:, start : start + self.input_size]
        super().weight_loader(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.method.apply(self, x, self.bias)
        y = self.group.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class ParallelLMHead(ReplicatedLinear):
    """Rank r holds the vocabulary rows `VocabPartition.of(vocab, r, N)` (zero rows pad the last range);
    the logits of every rank are all-gathered, so each rank returns [..., vocab_size], padding dropped. Tied,
    it shares the `VocabParallelEmbedding`'s rows, partitioned the same way."""

    def partition(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.vocab = VocabPartition.of(self.checkpoint_output_sizes[0], group.rank, group.size)
        self._set_sizes(self.checkpoint_input_size, (self.vocab.num_rows,))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """This rank's vocabulary rows of a tensor with a row per token (weight, bias, an FP8 per-row
        scale), padded to `vocab.num_rows` (zero weights, unit scales); any other (a per-tensor scale)
        whole. The layer's method loads it, as with one rank."""
        if self.group.size > 1 and loaded.dim() > 0 and loaded.shape[0] == self.checkpoint_output_sizes[0]:
            rows = loaded[self.vocab.start : self.vocab.end]
            fill = 0.0 if param is self.weight or param is self.bias else 1.0
            shape = (self.vocab.num_rows - rows.shape[0], *rows.shape[1:])
            padding = torch.full(shape, fill, device=rows.device)
            loaded = torch.cat([rows, padding.to(rows.dtype)])
        super().weight_loader(param, loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, x, self.bias)
        if self.group.size == 1:
            return logits
        return self.group.all_gather(logits)[..., : self.checkpoint_output_sizes[0]]


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """ValueError unless the checkpoint tensor has the whole layer's shape `expected`."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")
