"""Token embeddings split by vocabulary rows over the ranks of a tensor-parallel group (vLLM's
`VocabParallelEmbedding`).

Rank r holds the rows `VocabPartition.of(vocab, r, N)` (zero rows pad the last range). A lookup reads the
ids in its range, writes zeros for the others, and one all-reduce sums the ranks' rows: each id is found
on exactly one rank, so the sum is that row, exactly. With one rank it is `F.embedding`, as `nn.Embedding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.distributed.partition import VocabPartition
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.parallel_linear import check_shape


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> [T, embedding_dim]. weight [rows of this rank, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.group = TensorParallelGroup.single()
        self.vocab = VocabPartition.of(num_embeddings, 0, 1)
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def select(self, kernels: KernelConfig, prefix: str) -> None:
        """At load, on meta (`CausalLM.materialize`): hold this rank's rows, in `kernels.dtype`."""
        self.group = kernels.tensor_parallel
        self.vocab = VocabPartition.of(self.num_embeddings, self.group.rank, self.group.size)
        shape = (self.vocab.num_rows, self.embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, dtype=kernels.dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        rows = loaded[self.vocab.start : self.vocab.end]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.end - self.vocab.start)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))
