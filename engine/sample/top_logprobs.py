"""The k most likely tokens of each row, ties broken by token id: a row's answer depends on its values
alone, not on k, the batch or the device.

`torch.topk` returns tied values in no set order, and which of a tie group that straddles the k-th place
it keeps depends on k and on the row's place in the batch. A request's top logprobs, computed with the
batch's largest k and then cut to its own, would then change with the other requests' `logprobs`, and the
greedy token (`argmax`: the lowest id among the most likely) need not come first. Ties are common where
logits are rounded (bf16 on a GPU: 8 significant bits). Here, as `sorted(range(vocab), key=lambda t:
(-logprobs[t], t))[:k]`:

    candidates = topk(k), sorted by (value desc, id asc)
    t          = the k-th value; the candidates above t are exactly every token above t
    the rest   = the lowest ids among all tokens equal to t, found by a running count of them
                 (cumsum over the vocab) and a binary search for its 1st, 2nd, ... step

On the host only the rows with a tie across the k-th place make that search (`_top_k_on_host`).
"""

from __future__ import annotations

import torch


def top_k_ties_by_id(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs: [rows, vocab] float; returns values [rows, k] and ids [rows, k] int64: each row's k
    largest values, ties in increasing token id. On a GPU it queues its work without waiting for it; on
    the host it searches the vocabulary only in rows whose k-th value is tied past the k-th place
    (`_top_k_on_host`)."""
    if logprobs.device.type == "cpu" and 0 < k < logprobs.shape[-1]:
        return _top_k_on_host(logprobs, k)
    return _top_k_queued(logprobs, k)


def _top_k_on_host(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk(k + 1): where a row's (k+1)-th value is below its k-th, its first k are exactly its top k and
    only need the (value desc, id asc) order; the rows where the two are equal (a tie across the k-th
    place: rare unless logits are rounded) take `_top_k_queued`'s search. It reads which rows those are
    (a wait, free on the host), and saves the search's passes over every row's vocabulary: 64 x 49,152 at
    k = 20, ~16 -> ~3.5 ms (2-core Zen 4)."""
    top = logprobs.topk(k + 1, dim=-1)
    values, ids = by_value_then_id(top.values[:, :k], top.indices[:, :k])
    tied = (top.values[:, k] == top.values[:, k - 1]).nonzero().squeeze(1)
    if tied.numel():
        values[tied], ids[tied] = _top_k_queued(logprobs[tied], k)
    return values, ids


def by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of each row in decreasing value, equal values in increasing id."""
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def _top_k_queued(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_ties_by_id` for every row alike, without waiting for the device."""
    top = logprobs.topk(k, dim=-1)
    if k == 0:
        return top.values, top.indices
    values, ids = by_value_then_id(top.values, top.indices)
    threshold = values[:, -1:]  # [rows, 1]: the k-th value
    num_above = (values > threshold).sum(dim=-1, keepdim=True)
    # ties[r, j]: how many tokens <= j equal the threshold; the n-th of them is the first j where it is n.
    ties = torch.cumsum(logprobs == threshold, dim=-1, dtype=torch.int32)
    place = torch.arange(k, device=logprobs.device).unsqueeze(0)
    nth = (place - num_above + 1).clamp_(min=1).to(torch.int32)
    tie_ids = torch.searchsorted(ties, nth)
    # A NaN threshold equals nothing: such a row keeps topk's ids (tie_ids would be `vocab`).
    keep = (place < num_above) | (tie_ids >= logprobs.shape[-1])
    return torch.where(keep, values, threshold), torch.where(keep, ids, tie_ids)
