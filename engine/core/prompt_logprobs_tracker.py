"""Prompt logprobs: which prompt positions of a step need logits, and each request's results so far.

Position p of the prompt predicts prompt token p + 1, so a prompt of P tokens has P - 1 prompt logprobs
(positions 0 .. P - 2); position P - 1 predicts the first output token and is the sampler's. A step that
computes the slice [start, end) of a request's tokens yields the entries of positions
start .. min(end, P - 1) - 1. Chunked prefill yields them chunk by chunk; preemption recomputes from 0
and overwrites. Requests that want prompt logprobs take no prefix-cache hit (cached positions have no
logits), so every position is computed. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sluice.engine.outputs import PromptLogprobs
from sluice.engine.request import Request
from sluice.engine.scheduler.scheduler_output import PromptLogprobsSlice, SchedulerOutput


class PromptLogprobsTracker:
    """Collects each request's prompt logprobs until its first output token carries them."""

    def __init__(self) -> None:
        self._entries: dict[str, PromptLogprobs] = {}
        self._delivered: set[str] = set()

    def slices(
        self, out: SchedulerOutput, get_request: Callable[[str], Request | None]
    ) -> list[PromptLogprobsSlice]:
        """The slices of this step that compute prompt positions of requests wanting prompt logprobs."""
        slices = []
        for index, scheduled in enumerate(out.scheduled):
            request = get_request(scheduled.request_id)
            if request is None or request.sampling_params.prompt_logprobs is None:
                continue
            if scheduled.request_id in self._delivered:
                continue  # recomputed after a preemption: already sent
            end = min(scheduled.seq_len, request.num_prompt_tokens - 1)
            start = scheduled.start_position
            if end <= start:
                continue
            targets = tuple(request.prompt_token_ids[start + 1 : end + 1])
            slices.append(
                PromptLogprobsSlice(
                    scheduled.request_id, index, start, targets, request.sampling_params.prompt_logprobs
                )
            )
        return slices

    def add(self, slices: Iterable[PromptLogprobsSlice], results: dict[str, PromptLogprobs]) -> None:
        """Record a step's results (request id -> the logprobs of its slice's targets, in order)."""
        for piece in slices:
            result = results[piece.request_id]
            entries = self._entries.setdefault(piece.request_id, PromptLogprobs([], [], result.num_top))
            start, top_start = piece.start_position, piece.start_position * result.num_top
            del entries.token_ids[start:], entries.logprobs[start:]  # a recompute after preemption overwrites
            del entries.top_token_ids[top_start:], entries.top_logprobs[top_start:]
            entries.token_ids.extend(result.token_ids)
            entries.logprobs.extend(result.logprobs)
            entries.top_token_ids.extend(result.top_token_ids)
            entries.top_logprobs.extend(result.top_logprobs)

    def take(self, request: Request) -> PromptLogprobs | None:
        """The request's prompt logprobs, once, on its first output; None for requests not wanting them."""
        num_top = request.sampling_params.prompt_logprobs
        if num_top is None or request.request_id in self._delivered:
            return None
        self._delivered.add(request.request_id)
        return self._entries.pop(request.request_id, None) or PromptLogprobs([], [], num_top)

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._entries.pop(request_id, None)
            self._delivered.discard(request_id)
