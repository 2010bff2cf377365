"""`LLM.generate` from two threads at once on one LLM: each call steps the engine until its own requests
finish, so the two took each other's outputs; one failed (KeyError) and the other returned completions short
of the tokens the first had taken. They run one at a time now, each with its own results.

The interleaving is forced, not raced: thread A, in its first step, lets thread B start its call and waits
until B has either reached a step of its own (the old code: B's requests were queued beside A's) or waits
for A's call to end."""

from __future__ import annotations

import threading

from service_harness import PATIENCE_S

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS_A = [[5, 6, 7], [8, 9, 10, 11]]
PROMPTS_B = [[12, 13], [14, 15, 16]]


class _Gate:
    """The LLM's lock, noting that thread B has come to it."""

    def __init__(self, lock, arrived: threading.Event) -> None:
        self._lock, self._arrived = lock, arrived
        self.thread: threading.Thread | None = None

    def __enter__(self):
        if threading.current_thread() is self.thread:
            self._arrived.set()
        return self._lock.__enter__()

    def __exit__(self, *exc_info):
        return self._lock.__exit__(*exc_info)


def test_two_threads_generating_on_one_llm_each_get_their_own_completions(llama_dir):
    llm = LLM(llama_dir)
    expected_a = [c.token_ids for c in llm.generate(PROMPTS_A, PARAMS)]
    expected_b = [c.token_ids for c in llm.generate(PROMPTS_B, PARAMS)]
    b_arrived, a_stepped = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def generate(name: str, prompts: list[list[int]]) -> None:
        try:
            results[name] = [c.token_ids for c in llm.generate(prompts, PARAMS)]
        except Exception as exc:
            results[name] = exc

    thread_b = threading.Thread(target=generate, args=("b", PROMPTS_B))
    gate = _Gate(getattr(llm, "_running", threading.Lock()), b_arrived)
    gate.thread, llm._running = thread_b, gate
    step = llm.engine.step

    def interleaved_step():
        if threading.current_thread() is thread_b:
            b_arrived.set()
            assert a_stepped.wait(PATIENCE_S)
        elif not thread_b.is_alive() and not a_stepped.is_set():
            thread_b.start()
            assert b_arrived.wait(PATIENCE_S)
            outputs = step()
            a_stepped.set()
            return outputs
        return step()

    llm.engine.step = interleaved_step
    generate("a", PROMPTS_A)
    thread_b.join(PATIENCE_S)
    assert not thread_b.is_alive()
    assert results == {"a": expected_a, "b": expected_b}
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_kv_blocks_used == 0
