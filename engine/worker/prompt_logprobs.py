"""Prompt logprobs from a step's hidden states: log_softmax of the logits at prompt positions.

    slice rows (hidden):   [ p0  p1  p2  p3 ]            start_position 0, prompt t0 t1 t2 t3 t4 ...
    targets:                 t1  t2  t3  t4             logprob[i] = log_softmax(logits[p_i])[t_{i+1}]

The top N at each position are in decreasing logprob, ties in increasing token id (`top_k_ties_by_id`),
whatever the chunking. Rows are taken in chunks of at most ROWS_PER_CHUNK so a long prefill chunk never
holds a [rows, vocab] float32 tensor larger than that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sluice.engine.outputs import PromptLogprobs
from sluice.engine.sample.top_logprobs import top_k_ties_by_id
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice

ROWS_PER_CHUNK = 256


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    query_lens: Sequence[int],
    slices: Sequence[PromptLogprobsSlice],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PromptLogprobs]:
    """hidden: [num_tokens, hidden_size], the step's rows in scheduled order (query_lens per slice).
    Returns request id -> the logprobs of its slice's target tokens, in position order."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    results: dict[str, PromptLogprobs] = {}
    for piece in slices:
        first = starts[piece.scheduled_index]
        columns = PromptLogprobs([], [], piece.num_top)
        for begin in range(0, len(piece.target_token_ids), ROWS_PER_CHUNK):
            targets = piece.target_token_ids[begin : begin + ROWS_PER_CHUNK]
            rows = hidden[first + begin : first + begin + len(targets)]
            _add_logprobs(columns, compute_logits(rows), targets)
        results[piece.request_id] = columns
    return results


def _add_logprobs(columns: PromptLogprobs, logits: torch.Tensor, targets: Sequence[int]) -> None:
    """Appends one entry per row to `columns`. logits: [rows, vocab]; targets: one token id per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    columns.token_ids.extend(targets)
    columns.logprobs.extend(logprobs.gather(1, index).squeeze(1).tolist())
    if columns.num_top > 0:
        values, ids = top_k_ties_by_id(logprobs, columns.num_top)
        columns.top_token_ids.extend(ids.flatten().tolist())
        columns.top_logprobs.extend(values.flatten().tolist())
