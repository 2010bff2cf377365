"""`SpeculativeConfig.disable_by_batch_size` (`--speculative-disable-by-batch-size`, vLLM's
speculative_disable_by_batch_size): no drafts are proposed while that many requests or more are running;
speculation resumes once the batch is smaller. Greedy tokens stay those of the engine without speculation,
and with async scheduling the steps without drafts overlap, where a speculating engine's never do. A draft
model catches up over the tokens it skipped: as its own target's draft it then has every draft accepted.

On the tiny Llama, prompts that repeat themselves (the n-gram proposer finds drafts): two requests run
alone (batch 2, drafts), two more join (batch 4, at the limit of 3: none), end first (batch 2 again: the
first two speculate again, a draft model from 30-odd tokens behind).
"""

from __future__ import annotations

import random

import pytest

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.async_scheduler import AsyncScheduler
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput

LIMIT = 3
FIRST, LATER = (44, 40), (30, 24)  # max_tokens of the two requests that start, and of the two that join
STEPS_ALONE = 6  # engine steps the first two run before the others join


def _run(llm: LLM) -> dict[str, list[int]]:
    """The staged workload through `llm`'s engine: each request's greedy tokens."""
    rng = random.Random(8)
    prompts = [[rng.randrange(4, 500) for _ in range(9)] * 4 for _ in range(4)]
    engine, tokens = llm.engine, {}

    def add(index: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"r{index}", prompts[index], params)
        tokens[f"r{index}"] = []

    def step() -> None:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids

    for index, max_tokens in enumerate(FIRST):
        add(index, max_tokens)
    for _ in range(STEPS_ALONE):
        step()
    for index, max_tokens in enumerate(LATER, start=len(FIRST)):
        add(index, max_tokens)
    while engine.has_work():
        step()
    return tokens


class Watch:
    """Wraps an engine core: the batch size at each proposal (and the steps in flight of the requests it
    drafts for), and the steps it scheduled."""

    def __init__(self, llm: LLM) -> None:
        core = llm.engine.core
        scheduler, proposer = core.scheduler, core.speculator.proposer
        self.proposed_at: list[int] = []  # requests running at each call of the proposer
        self.in_flight: list[int] = []  # async: tokens steps in flight will sample, per request drafted for
        self.steps: list[SchedulerOutput] = []
        propose, schedule = proposer.propose, scheduler.schedule

        def watched_propose(requests):
            self.proposed_at.append(scheduler.num_running)
            if isinstance(scheduler, AsyncScheduler):
                self.in_flight += [scheduler.num_in_flight(r) for r in requests]
            return propose(requests)

        def watched_schedule() -> SchedulerOutput:
            out = schedule()
            self.steps.append(out)
            return out

        proposer.propose, scheduler.schedule = watched_propose, watched_schedule

    def overlapped(self) -> int:
        """Steps scheduled before the step before them was finished (a placeholder in their tokens)."""
        return sum(any(s.token_ids[-1] == PLACEHOLDER_TOKEN_ID for s in out.scheduled) for out in self.steps)

    def verified_at(self) -> list[int]:
        """For each step that verified drafts, in order: the requests it continued (those it admitted,
        at position 0, joined after the drafts were proposed and do not withdraw them)."""
        verify_steps = [out for out in self.steps if any(s.spec_token_ids for s in out.scheduled)]
        return [sum(s.start_position > 0 for s in out.scheduled) for out in verify_steps]


@pytest.fixture(scope="module")
def plain_tokens(llama_dir: str) -> dict[str, list[int]]:
    return _run(LLM(llama_dir, async_scheduling=False))


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_drafts_while_the_batch_is_at_the_limit_and_the_same_greedy_tokens(
    llama_dir, plain_tokens, async_scheduling, method
) -> None:
    draft_model = llama_dir if method == "draft" else None
    unlimited_spec = SpeculativeConfig(method, draft_model=draft_model)
    unlimited = LLM(llama_dir, speculative=unlimited_spec, async_scheduling=async_scheduling)
    watch_unlimited = Watch(unlimited)
    assert _run(unlimited) == plain_tokens
    assert max(watch_unlimited.proposed_at) == 4  # the workload speculates at batch 4 without a limit
    assert max(watch_unlimited.verified_at()) == 4
    assert watch_unlimited.overlapped() == 0  # speculating requests never overlap

    spec = SpeculativeConfig(method, draft_model=draft_model, disable_by_batch_size=LIMIT)
    llm = LLM(llama_dir, speculative=spec, async_scheduling=async_scheduling)
    watch = Watch(llm)
    assert _run(llm) == plain_tokens
    assert max(watch.proposed_at) < LIMIT
    verified_at = watch.verified_at()
    assert verified_at and max(verified_at) < LIMIT
    # Drafts before the others joined, and again after they ended (the first two still running).
    verifies = [any(s.spec_token_ids for s in out.scheduled) for out in watch.steps]
    joined = next(i for i, out in enumerate(watch.steps) if len(out.scheduled) == 4)
    assert any(verifies[:joined]) and any(verifies[joined + 1 :])
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_used == 0
    if method == "draft":
        assert stats.num_accepted_draft_tokens == stats.num_draft_tokens
    if async_scheduling:
        # At the limit the steps overlap; drafts come only from tokens no step in flight follows.
        assert watch.overlapped() > 0
        assert set(watch.in_flight) == {0}
