"""Speculative decoding against the budgets a step promises: the draft model's forwards stay within the
step's token budget (a long prompt, or one the target found in its prefix cache, is caught up in chunks),
and drafts take only blocks and budget that the step's other running requests do not need."""

from __future__ import annotations

import random

from scheduler_driver import check_invariants, make_request, reference_output, tokens
from test_scheduler_spec import make_scheduler, step

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.draft_block_tables import DraftBlockTables

BLOCK = 16
BUDGET = 32
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _long_prompts() -> list[list[int]]:
    """A 160-token system prompt shared by four requests (prefix-cache hits for three of them), and one
    200-token prompt of its own: each far longer than the step budget."""
    rng = random.Random(1)
    tokens = lambda n: [rng.randrange(4, 512) for _ in range(n)]  # noqa: E731
    system = tokens(10 * BLOCK)
    return [system + tokens(5) for _ in range(4)] + [tokens(200)]


def test_the_draft_model_catches_up_long_prompts_within_the_step_budget(llama_dir):
    prompts = _long_prompts()
    config = dict(block_size=BLOCK, num_blocks=96, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    expected = [c.token_ids for c in LLM(llama_dir, **config).generate(prompts, PARAMS)]
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec, **config)
    proposer = llm.engine.core.speculator.proposer
    forwards: list[int] = []  # tokens computed by each draft forward
    execute_model = proposer.runner.execute_model

    def recorded(out, *args):
        forwards.append(sum(s.num_tokens for s in out.scheduled))
        return execute_model(out, *args)

    proposer.runner.execute_model = recorded
    assert [c.token_ids for c in llm.generate(prompts, PARAMS)] == expected
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert 0 < stats.num_accepted_draft_tokens == stats.num_draft_tokens  # the draft's KV is the target's
    assert max(forwards) == BUDGET  # the catch-up's forwards fill the budget, none exceeds it
    assert sum(forwards) >= sum(len(p) for p in prompts)  # the draft computed every prompt token itself
    assert stats.num_kv_blocks_used == 0 and proposer.tables.num_used_blocks == 0


def test_a_decoding_request_drafts_in_k_forwards_a_step(llama_dir):
    """The catch-up runs only where step 0 would exceed the budget: a short prompt's first proposal and
    every one after (the accepted tokens and the last one) are one forward each, k in all; fewer where
    max_tokens leaves room for fewer drafts (the scheduler would not verify the others)."""
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    config = dict(block_size=BLOCK, num_blocks=96, max_num_batched_tokens=BUDGET, max_num_seqs=8)
    llm = LLM(llama_dir, speculative=spec, **config)
    proposer = llm.engine.core.speculator.proposer
    forwards: list[int] = []  # draft forwards of each proposal
    propose, execute_model = proposer.propose, proposer.runner.execute_model

    def counted_propose(requests):
        forwards.append(0)
        return propose(requests)

    def counted_forward(out, *args):
        forwards[-1] += 1
        return execute_model(out, *args)

    proposer.propose, proposer.runner.execute_model = counted_propose, counted_forward
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    completion = llm.generate([list(range(5, 25))], params)[0]
    assert len(completion.token_ids) == 24 and llm.engine.stats().num_accepted_draft_tokens > 0
    # Every draft accepted (the draft is the target): 1 + 4 + 4 + 4 + 4 + 4 outputs, then 3 left: 2 drafts.
    assert forwards == [3, 3, 3, 3, 3, 2]


def _decoding(scheduler, model, requests):
    """Runs the requests' prefills until each has its first output token."""
    for request in requests:
        scheduler.add_request(request)
    while not all(request.output_token_ids for request in requests):
        step(scheduler, model)


def test_drafts_never_take_the_block_another_running_request_needs():
    # a (14-token prompt) decodes at position 14, in its one block; its drafts at 15..17 need a second.
    # b (32-token prompt) decodes at position 32: its third block. One block is free: b's.
    scheduler, model = make_scheduler(num_blocks=4)
    a = make_request("a", tokens(14, 10), max_tokens=20)
    b = make_request("b", tokens(32, 100), max_tokens=20)
    _decoding(scheduler, model, [a, b])
    assert scheduler.kv.pool.num_free_blocks == 1
    a.spec_token_ids = reference_output(a.prompt_token_ids, 4)[1:4]
    out = scheduler.schedule()
    assert out.preempted_request_ids == ()
    assert [(s.request_id, s.num_tokens, s.spec_token_ids) for s in out.scheduled] == [
        ("a", 1, ()),
        ("b", 1, ()),
    ]
    scheduler.update_from_output(out, model.verify(out))
    assert scheduler.num_preemptions == 0
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 2)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)
    check_invariants(scheduler)


def test_drafts_take_only_the_budget_left_after_every_running_request_advanced():
    scheduler, model = make_scheduler(budget=8)
    requests = [make_request(f"r{i}", tokens(10, 50 * i), max_tokens=40) for i in range(6)]
    _decoding(scheduler, model, requests)
    before = [r.num_output_tokens for r in requests]
    for request, n in zip(requests, before, strict=True):
        request.spec_token_ids = reference_output(request.prompt_token_ids, n + 3)[n:]
    out = scheduler.schedule()
    # Six decodes first, then the 2 tokens left of the budget go to the first request's drafts.
    scheduled = [(s.request_id, s.num_tokens) for s in out.scheduled]
    assert scheduled == [("r0", 3)] + [(f"r{i}", 1) for i in range(1, 6)]
    assert out.num_batched_tokens == 8
    scheduler.update_from_output(out, model.verify(out))
    advanced = [3] + [1] * 5  # r0's two drafts accepted, then its target token
    for request, n, k in zip(requests, before, advanced, strict=True):
        assert request.output_token_ids == reference_output(request.prompt_token_ids, n + k)
    check_invariants(scheduler)


def _run_to_completion(engine, first, second, params) -> dict[str, list]:
    """`first` (priority 1) decodes a few steps, then `second` (priority 0) preempts it (one sequence at a
    time) and runs alone to its end; then `first` recomputes and ends. Returns each one's outputs."""
    outputs: dict[str, list] = {"first": [], "second": []}
    engine.add_request("first", first, params, priority=1)
    while len([t for o in outputs["first"] for t in o.token_ids]) < 8:
        for output in engine.step():
            outputs[output.request_id].append(output)
    engine.add_request("second", second, params, priority=0)
    while engine.has_work():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def test_a_preempted_request_gives_up_its_draft_blocks_to_the_running_one(llama_dir):
    # 12 blocks: the preempted request's draft KV (8 blocks of 16) and the running one's (6 and more)
    # cannot both fit the draft's cache, which has as many blocks as the target's.
    rng = random.Random(2)
    first, second = [rng.randrange(4, 512) for _ in range(100)], [rng.randrange(4, 512) for _ in range(80)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    config = dict(
        block_size=BLOCK,
        num_blocks=12,
        max_num_batched_tokens=128,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    expected = _run_to_completion(LLM(llama_dir, **config).engine, first, second, params)
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=llama_dir)
    llm = LLM(llama_dir, speculative=spec, **config)
    outputs = _run_to_completion(llm.engine, first, second, params)
    for request_id in ("first", "second"):
        assert [t for o in outputs[request_id] for t in o.token_ids] == [
            t for o in expected[request_id] for t in o.token_ids
        ]
    first_end, second_end = outputs["first"][-1], outputs["second"][-1]
    assert first_end.num_preemptions == 1 and second_end.num_preemptions == 0
    # Every verify step of the running request had drafts, all accepted (the draft is the target).
    assert 0 < second_end.usage.accepted_draft_tokens == second_end.usage.draft_tokens
    assert second_end.usage.draft_tokens >= 3 * (len(outputs["second"]) - 2)
    assert 0 < first_end.usage.accepted_draft_tokens == first_end.usage.draft_tokens
    assert llm.engine.core.speculator.proposer.tables.num_used_blocks == 0


def test_a_draft_block_table_grows_by_whole_blocks_and_a_freed_one_starts_afresh():
    """`DraftBlockTables` keeps each request's block ids (a proposal asks for every table every step):
    growing within its blocks gives the same table, past them the table extended; once freed, a request
    of that id gets new blocks, not the table it had."""
    tables = DraftBlockTables(block_size=4, num_blocks=6)
    first = tables.grow("a", 5)
    assert len(first) == 2 and tables.grow("a", 8) == first
    grown = tables.grow("a", 9)
    assert grown[:2] == first and len(grown) == 3
    tables.free(["a"])
    other = tables.grow("b", 12)
    again = tables.grow("a", 1)
    assert len(again) == 1 and not set(again) & set(other) and tables.num_used_blocks == 4
    assert tables.grow("c", 12) is None  # 2 blocks left: the pool is short
