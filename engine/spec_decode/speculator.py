"""The engine core's speculative decoding state: drafts proposed after a step, kept until the step that
verifies them, and the counts of drafts verified and accepted."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sluice.engine.request import Request
from sluice.engine.scheduler.scheduler_output import SchedulerOutput
from sluice.engine.spec_decode.proposer import Proposal, Proposer, speculation_allowed
from sluice.engine.spec_decode.spec_counters import SpecCounters

# (request id, its grammar, its output token ids, the drafts proposed, k, its constraint's after_token_id)
# -> (how many of those, from the first, the grammar accepts after the outputs; the tokens it forces after
# them, k drafts at most in all): the grammar mask's `constrained_drafts`
ConstrainDrafts = Callable[
    [str, object, Sequence[int], tuple[int, ...], int, int | None], tuple[int, tuple[int, ...]]
]


class Speculator:
    """Proposes drafts for requests in decode (`Request.spec_token_ids`, which the scheduler trims to
    its budget) and hands the rejection sampler the drafts a step verifies. `proposer` None: a no-op.
    A constrained request (`constrain`) keeps the drafts up to the first one its grammar refuses (the
    verification would reject that one and all after it), then drafts what its grammar forces there,
    up to `num_speculative_tokens` in all; also where the proposer had nothing to offer."""

    def __init__(
        self,
        proposer: Proposer | None,
        disable_by_batch_size: int | None = None,
        constrain: ConstrainDrafts | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.proposer = proposer
        self.disable_by_batch_size = disable_by_batch_size
        self.constrain = constrain
        self.num_speculative_tokens = num_speculative_tokens
        self.counters = SpecCounters()
        self._proposals: dict[str, Proposal] = {}  # request id -> its latest drafts, until verified

    def proposal(self, request_id: str, spec_token_ids: tuple[int, ...]) -> Proposal | None:
        """The drafts the scheduler kept for this step (a prefix of those proposed)."""
        if not spec_token_ids:
            return None
        probs = self._proposals[request_id].probs
        return Proposal(spec_token_ids, None if probs is None else probs[: len(spec_token_ids)])

    def count(self, scheduler_output: SchedulerOutput, num_sampled: dict[str, int]) -> None:
        """A verify step's drafts and accepted drafts (all sampled tokens but the last)."""
        for scheduled in scheduler_output.scheduled:
            if scheduled.spec_token_ids and scheduled.request_id in num_sampled:
                num_accepted = num_sampled[scheduled.request_id] - 1
                self.counters.add(len(scheduled.spec_token_ids), num_accepted)

    def drafts_at(self, num_running: int) -> bool:
        """Whether requests get drafts while `num_running` requests are running: with a proposer, below
        `disable_by_batch_size` (vLLM's speculative_disable_by_batch_size: at or above it, no drafts)."""
        if self.proposer is None:
            return False
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def propose(
        self, updated: Iterable[Request], get_request: Callable[[str], Request | None], draft: bool = True
    ) -> None:
        """Drafts for the next step, for the requests just advanced that are in decode and may speculate.
        `draft` False: none (the batch is at `disable_by_batch_size`, or the next step was scheduled before
        these tokens came); only the verified drafts and the finished requests' state are dropped."""
        if self.proposer is None:
            return
        updated = list(updated)
        for request in updated:  # their drafts were verified (or they finished)
            self._proposals.pop(request.request_id, None)
        self.proposer.free([r.request_id for r in updated if r.is_finished])
        if not draft:
            return
        requests = [r for r in updated if not r.is_finished and speculation_allowed(r)]
        if not requests:
            return
        proposals = self.proposer.propose(requests)
        for request in requests:
            if request.grammar is not None and self.constrain is not None:
                proposals[request.request_id] = self._constrained(request, proposals.get(request.request_id))
        for request_id, proposal in proposals.items():
            get_request(request_id).spec_token_ids = list(proposal.token_ids)
        self._proposals.update(proposals)

    def _constrained(self, request: Request, proposal: Proposal | None) -> Proposal:
        """The proposal cut before the first draft the request's grammar refuses, then what it forces."""
        proposal = proposal or Proposal(())
        num_kept, forced = self.constrain(
            request.request_id,
            request.grammar,
            request.output_token_ids,
            proposal.token_ids,
            self.num_speculative_tokens,
            constraint.after_token_id if (constraint := request.sampling_params.constraint) else None,
        )
        return proposal.followed_by(num_kept, forced)

    def free(self, request_ids: Iterable[str]) -> None:
        """Drops the requests' drafts and the proposer's state (a draft model's KV blocks), now."""
        if self.proposer is None:
            return
        request_ids = list(request_ids)
        self.proposer.free(request_ids)
        for request_id in request_ids:
            self._proposals.pop(request_id, None)
