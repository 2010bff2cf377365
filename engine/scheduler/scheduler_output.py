"""The scheduler's decision for one step: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass

# Async scheduling: the token a step still running on the device will sample for the request. The model
# runner fills it in on the device from that step's sampled token ids; it never reaches the model as -1.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's slice of this step.

    The request computes `token_ids` at positions `start_position .. start_position + len(token_ids) - 1`.
    `block_ids` is its whole block table (logical block i -> physical block `block_ids[i]`).
    Under async scheduling the last of `token_ids` may be `PLACEHOLDER_TOKEN_ID`: a token the step before
    this one samples.
    `sample` is true when this slice reaches the request's last token, so a new token is produced.
    `spec_token_ids` (only with `sample`) are draft tokens computed after `token_ids`, at the next
    positions; the step then yields logits for the last token and every draft, and the request advances
    by the drafts it accepts plus one token. They count in `num_tokens` and have KV slots:

        position:   start ...        seq_len - k - 1 | seq_len - k ... seq_len - 1
        tokens:     token_ids (last one is sampled)  | spec_token_ids (k drafts)
        logits:                      row 0           | rows 1 .. k
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, drafts included."""
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached/computed tokens plus the new ones (drafts included)."""
        return self.start_position + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the scheduled slices, and the requests preempted or finished since the last step."""

    scheduled: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """Rows of one scheduled slice whose logits give prompt logprobs.

    The first `len(target_token_ids)` rows of the slice scheduled[scheduled_index] (prompt positions
    `start_position ..`); row i's logprob is taken at target_token_ids[i] (the next prompt token), with
    the `num_top` most likely tokens.
    """

    request_id: str
    scheduled_index: int
    start_position: int
    target_token_ids: tuple[int, ...]
    num_top: int
