"""The waiting queue against a sorted list: random pushes, pops, removals and re-pushes (a preempted
request comes back with its key); and a removal costs no scan of the heap, so cancelling N waiting requests
is O(N), not the O(N^2) that made a mass cancel of 30,000 outlast --engine-timeout in one core step."""

from __future__ import annotations

import heapq
import random

import pytest
from scheduler_driver import make_request

from sluice.engine.scheduler import request_queue
from sluice.engine.scheduler.request_queue import RequestQueue


@pytest.mark.parametrize("seed", range(8))
def test_the_queue_runs_requests_in_key_order_through_removals_and_re_pushes(seed: int) -> None:
    rng = random.Random(seed)
    queue = RequestQueue()
    reference: dict[str, tuple[int, float, int, int]] = {}  # id -> (priority, arrival, seq, num_tokens)
    requests = {}
    for step in range(600):
        action = rng.random()
        if action < 0.45 or not reference:
            request_id = f"r{step}"
            request = make_request(
                request_id, [1], priority=rng.randint(-2, 2), arrival=float(rng.randint(0, 9))
            )
            num_tokens = rng.randint(1, 50)
            queue.push(request, step, num_tokens)
            requests[request_id] = request
            reference[request_id] = (request.priority, request.arrival_time, step, num_tokens)
        elif action < 0.7:
            expected = min(reference, key=lambda r: reference[r][:3])
            assert queue.peek() is requests[expected]
            assert queue.pop() is requests[expected]
            key = reference.pop(expected)
            if rng.random() < 0.5:  # preempted again later: back with its original key
                queue.push(requests[expected], key[2], key[3])
                reference[expected] = key
        else:
            request_id = rng.choice([*reference, "gone"]) if rng.random() < 0.9 else f"r{step}"
            removed = queue.remove(requests[request_id]) if request_id in requests else False
            assert removed == (request_id in reference)
            reference.pop(request_id, None)
        assert len(queue) == len(reference) and bool(queue) == bool(reference)
        assert queue.num_tokens == sum(key[3] for key in reference.values())
        assert [r.request_id for r in queue] == sorted(reference, key=lambda r: reference[r][:3])
    while reference:
        expected = min(reference, key=lambda r: reference[r][:3])
        assert queue.pop() is requests[expected]
        del reference[expected]
    with pytest.raises(IndexError):
        queue.peek()


def test_removing_every_waiting_request_heapifies_only_to_compact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each removal scanned the heap and heapified it again."""
    heapified: list[int] = []
    heapify = heapq.heapify

    def counting_heapify(heap: list) -> None:
        heapified.append(len(heap))
        heapify(heap)

    monkeypatch.setattr(request_queue.heapq, "heapify", counting_heapify)
    queue = RequestQueue()
    waiting = [make_request(f"r{i}", [1], arrival=float(i)) for i in range(10_000)]
    for seq, request in enumerate(waiting):
        queue.push(request, seq, 1)
    for request in waiting[1:]:
        assert queue.remove(request)
    assert len(heapified) <= 20  # compactions, each once dead entries are most of the heap
    assert (len(queue), queue.num_tokens, queue.pop()) == (1, 1, waiting[0])
