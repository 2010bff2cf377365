"""Engine-wide counts of verified and accepted draft tokens, in total and per draft position."""

from __future__ import annotations


class SpecCounters:
    def __init__(self) -> None:
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.drafts_per_position: list[int] = []  # [j]: steps that verified a draft at position j
        self.accepted_per_position: list[int] = []  # [j]: of which accepted (so all drafts before it were)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify step: `num_drafts` drafts, the first `num_accepted` accepted."""
        grow = num_drafts - len(self.drafts_per_position)
        if grow > 0:
            self.drafts_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        self.num_draft_tokens += num_drafts
        self.num_accepted += num_accepted
        for j in range(num_drafts):
            self.drafts_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def stats_fields(self) -> dict[str, int | tuple[int, ...]]:
        """The `EngineStats` fields they fill."""
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted,
            "draft_tokens_per_position": tuple(self.drafts_per_position),
            "accepted_draft_tokens_per_position": tuple(self.accepted_per_position),
        }
