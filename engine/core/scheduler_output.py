"""The scheduler's decision for one step: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's slice of this step.

    The request computes `token_ids` at positions `start_position .. start_position + len(token_ids) - 1`.
    `block_ids` is its whole block table (logical block i -> physical block `block_ids[i]`).
    `sample` is true when this slice reaches the request's last token, so a new token is produced.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached/computed tokens plus the new ones."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """`block_copies`: (src, dst) physical blocks whose K/V (every layer) the runner copies before this
    step's forward pass: the partial last prompt block of each sample forked since the last step."""

    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
