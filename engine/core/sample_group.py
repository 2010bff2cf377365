"""The samples of one prompt (`SamplingParams.n`): their engine ids, and those waiting to fork.

A request with n > 1 becomes n engine requests `{id}#0 .. {id}#{n-1}`, each with n=1 and, when seeded,
seed + index (`SamplingParams.for_sample`). Sample 0, the leader, joins the scheduler and computes the
prompt; the others wait here, outside the scheduler. In the step whose slice reaches the end of the
leader's prompt, the engine samples their first tokens from the leader's logits row and forks them
(`Scheduler.fork_request`: the prompt's full blocks shared by ref count, the partial last block
copied), so the prompt is computed once:

    step k:  leader computes prompt[..P)  -> logits row r
             sample leader from r;  sample #1, #2, #3 from r too;  fork #1..#3 from the leader's blocks
    step k+1: runner copies the partial block for #1..#3, then all four decode

If the leader ends before that step (aborted, its grammar failed), the waiting samples join the
scheduler as ordinary requests (or fail with the leader's grammar error). No torch here.
"""

from __future__ import annotations

from sluice.engine.request import Request

SAMPLE_ID_SEPARATOR = "#"


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """Engine ids of the n samples of `request_id`: the id itself when n == 1."""
    if n == 1:
        return [request_id]
    return [f"{request_id}{SAMPLE_ID_SEPARATOR}{i}" for i in range(n)]


class SampleForks:
    """Samples waiting for their leader's prompt, keyed by the leader's id. One thread owns it."""

    def __init__(self) -> None:
        self._followers: dict[str, list[Request]] = {}  # leader id -> waiting samples, index order
        self._leader_of: dict[str, str] = {}  # waiting sample id -> leader id

    def add(self, leader_id: str, followers: list[Request]) -> None:
        self._followers[leader_id] = list(followers)
        self._leader_of.update((f.request_id, leader_id) for f in followers)

    def followers(self, leader_id: str) -> list[Request]:
        """The samples still waiting for `leader_id` (empty if none)."""
        return self._followers.get(leader_id, [])

    def pop(self, leader_id: str) -> list[Request]:
        """Take every sample waiting for `leader_id` (to fork them, or to run them without it)."""
        followers = self._followers.pop(leader_id, [])
        for follower in followers:
            del self._leader_of[follower.request_id]
        return followers

    def remove(self, request_id: str) -> Request | None:
        """Take one waiting sample out (aborted); None if `request_id` is not waiting here."""
        leader_id = self._leader_of.pop(request_id, None)
        if leader_id is None:
            return None
        followers = self._followers[leader_id]
        request = next(f for f in followers if f.request_id == request_id)
        followers.remove(request)
        if not followers:
            del self._followers[leader_id]
        return request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leader_of

    def __len__(self) -> int:
        return len(self._leader_of)
