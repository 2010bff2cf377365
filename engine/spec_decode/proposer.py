"""The proposer protocol: after each step, draft up to k next tokens for requests in decode.

A proposal is a run of draft token ids and, for a proposer that samples its drafts, the distribution q
each was drawn from (the rejection sampler accepts draft d at position j with probability
min(1, p_j(d) / q_j(d))). A proposer that picks drafts deterministically (n-gram lookup) gives no q: it
is then a point mass at the draft, and a draft is accepted with probability p_j(d).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sluice.engine.request import Request

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Proposal:
    token_ids: tuple[int, ...]
    # [len(token_ids), vocab] float32: row j is the distribution token_ids[j] was drawn from; None for a
    # deterministic proposer (a point mass at each draft).
    probs: torch.Tensor | None = None

    def followed_by(self, num_kept: int, forced: tuple[int, ...]) -> Proposal:
        """The first `num_kept` drafts, then `forced` ones, which no distribution drew: their q is a
        point mass (a row of zeros with a one at the draft where the others have q)."""
        token_ids = self.token_ids[:num_kept] + forced
        if self.probs is None or not forced:
            return Proposal(token_ids, None if self.probs is None else self.probs[:num_kept])
        import torch

        from sluice.engine.sample.device_tensor import device_tensor

        probs = self.probs
        point_masses = probs.new_zeros(len(forced), probs.shape[1])
        point_masses.scatter_(1, device_tensor(forced, torch.long, probs.device).unsqueeze(1), 1.0)
        return Proposal(token_ids, torch.cat([probs[:num_kept], point_masses]))


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        """Drafts for requests whose computed tokens end right before their last token. A request may
        get an empty proposal or none."""

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget the state of finished requests."""


def speculation_allowed(request: Request) -> bool:
    """Whether a request may verify drafts: unless it opted out. The processors that follow the output
    tokens see, at each verify row, the drafts before it as if accepted (penalties count them, a grammar
    takes them: `SamplingRow.num_drafts`). Not a constrained request with min_tokens or allowed_token_ids,
    the processors that can leave its grammar no token at all: a draft row, which the request may never
    reach, would fail it. (Also what keeps min_tokens, which reads whether a thinking chat's `</think>` is
    among the outputs, off the draft model's rows, where drafts are placeholders.)"""
    params = request.sampling_params
    return request.use_speculation and (
        params.constraint is None or (params.min_tokens == 0 and params.allowed_token_ids is None)
    )
