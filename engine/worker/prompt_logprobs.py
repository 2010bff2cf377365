"""Prompt logprobs from a step's hidden states: log_softmax of the logits at prompt positions.

    slice rows (hidden):   [ p0  p1  p2  p3 ]            start_position 0, prompt t0 t1 t2 t3 t4 ...
    targets:                 t1  t2  t3  t4             logprob[i] = log_softmax(logits[p_i])[t_{i+1}]

Rows are taken in chunks of at most ROWS_PER_CHUNK so a long prefill chunk never holds a
[rows, vocab] float32 tensor larger than that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sluice.engine.outputs import Logprobs, TokenLogprob
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice

ROWS_PER_CHUNK = 256


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    query_lens: Sequence[int],
    slices: Sequence[PromptLogprobsSlice],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, list[Logprobs]]:
    """hidden: [num_tokens, hidden_size], the step's rows in scheduled order (query_lens per slice).
    Returns request id -> one Logprobs per target token, in position order."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    results: dict[str, list[Logprobs]] = {}
    for piece in slices:
        first = starts[piece.scheduled_index]
        entries: list[Logprobs] = []
        for begin in range(0, len(piece.target_token_ids), ROWS_PER_CHUNK):
            targets = piece.target_token_ids[begin : begin + ROWS_PER_CHUNK]
            rows = hidden[first + begin : first + begin + len(targets)]
            entries.extend(_logprobs(compute_logits(rows), targets, piece.num_top))
        results[piece.request_id] = entries
    return results


def _logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: int) -> list[Logprobs]:
    # logits: [rows, vocab] float32; targets: one token id per row.
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    sampled = logprobs.gather(1, index).squeeze(1).tolist()
    top_values: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if num_top > 0:
        top = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        Logprobs(
            sampled=TokenLogprob(token_id, value),
            top=tuple(TokenLogprob(t, v) for t, v in zip(ids, values, strict=True)),
        )
        for token_id, value, ids, values in zip(targets, sampled, top_ids, top_values, strict=True)
    ]
