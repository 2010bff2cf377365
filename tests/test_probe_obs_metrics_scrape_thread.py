"""The /metrics endpoint reads the engine's stats from its own thread (prometheus_client's WSGI server),
while the server's event loop adds n-sample requests and sends their held samples. Counting the held
samples iterated the dict the loop changes: a scrape that coincided with an n > 1 request's arrival or
its first answer failed with HTTP 500 ("dictionary changed size during iteration"), once in about a
thousand scrapes under a stream of n = 4 requests on a 2-core machine, losing every series of that
scrape. The test puts the loop's change exactly where a thread switch can put it: inside the read."""

from __future__ import annotations

from collections.abc import Callable

from sluice.engine.frontend.parallel_sampling import ParallelSampling
from sluice.engine.messages import AddRequest
from sluice.engine.sampling_params import SamplingParams


def _add(request_id: str, n: int, num_prompt_tokens: int) -> AddRequest:
    params = SamplingParams(n=n, max_tokens=4)
    return AddRequest(request_id, list(range(1, num_prompt_tokens + 1)), params, 0.0, 0, None, True)


class _SwitchedOutWhileRead(list):
    """A request's held samples whose reading lets the loop's thread run first (`loop_runs`), as the
    interpreter may switch threads between any two steps of the scrape's read."""

    def __init__(self, items: list[AddRequest], loop_runs: Callable[[], None]) -> None:
        super().__init__(items)
        self._loop_runs = loop_runs

    def __iter__(self):
        loop_runs, self._loop_runs = self._loop_runs, lambda: None
        loop_runs()
        return super().__iter__()


def test_held_samples_are_counted_while_the_loop_adds_and_sends_requests() -> None:
    sampling = ParallelSampling()
    first = sampling.add(_add("a", n=3, num_prompt_tokens=5))  # holds a#1, a#2
    sampling.add(_add("b", n=2, num_prompt_tokens=7))  # holds b#1
    held_of_a = sampling._waiting[first.request_id]

    def loop_runs() -> None:
        sampling.add(_add("c", n=4, num_prompt_tokens=2))  # a request arrives

    sampling._waiting[first.request_id] = _SwitchedOutWhileRead(held_of_a, loop_runs)
    # The read sees the dict as it was when it began: a's 2 samples of 5 tokens, b's 1 of 7.
    assert sampling.unsent == (3, 17)
    assert sampling.unsent == (6, 23)  # then c's 3 samples of 2 tokens too
