"""A request refused for its size names the field that is at fault, at every boundary: the prompt where it
leaves no room for one generated token (in the model's context, the KV cache, or the step budget with
chunked prefill off), max_tokens only where a smaller one would fit. A prompt exactly as long as the step
budget with chunked prefill off was refused naming max_tokens (`max_tokens: prompt (32 tokens) +
max_tokens (1) exceed max_num_batched_tokens 32`), and, where max_tokens also overfilled the KV cache, so
was a longer one: on SMG's VllmEngine, whose unset max_tokens is the rest of the context, the caller was
told to lower a max_tokens it never sent."""

from __future__ import annotations

import itertools

import pytest
from scheduler_driver import PagedFakeModel, make_request, run_until_done, tokens

from sluice import LLM, SamplingParams
from sluice.engine.config import CacheConfig, SchedulerConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.scheduler.scheduler import Scheduler

BS = 8


def _scheduler(budget: int, chunked: bool, num_blocks: int, max_model_len: int, window: int | None = None):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=1, enable_chunked_prefill=chunked),
        CacheConfig(block_size=BS),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        sliding_window=window,
    )


def _refusal(scheduler: Scheduler, num_prompt: int, max_tokens: int) -> tuple[str, str] | None:
    try:
        scheduler.add_request(make_request("r", tokens(num_prompt, 10), max_tokens))
    except ContextLengthError as error:
        return error.field, str(error)
    return None


def test_a_prompt_as_long_as_the_step_budget_is_named_with_chunked_prefill_off() -> None:
    scheduler = _scheduler(budget=32, chunked=False, num_blocks=64, max_model_len=64)
    assert scheduler.max_request_tokens == 32
    assert _refusal(scheduler, 32, 1) == (
        "prompt",
        "prompt: 32 tokens leave no room for an output token in max_num_batched_tokens 32 with chunked "
        "prefill off",
    )
    assert _refusal(scheduler, 31, 2) == (
        "max_tokens",
        "max_tokens: prompt (31 tokens) + max_tokens (2) exceed max_num_batched_tokens 32 with chunked "
        "prefill off",
    )
    assert _refusal(scheduler, 31, 1) is None


def test_the_prompt_is_named_before_a_max_tokens_that_overfills_the_kv_cache() -> None:
    """48 tokens of cache, a 32-token budget: a 32-token prompt fits no output token whatever max_tokens
    says, so a max_tokens of 32 (SMG's unset one: the rest of the 64-token context) is not what to lower."""
    scheduler = _scheduler(budget=32, chunked=False, num_blocks=6, max_model_len=64)
    assert _refusal(scheduler, 32, 32) == (
        "prompt",
        "prompt: 32 tokens leave no room for an output token in max_num_batched_tokens 32 with chunked "
        "prefill off",
    )


@pytest.mark.parametrize(
    ("window", "budget", "chunked", "num_blocks", "max_model_len"),
    [
        (window, budget, chunked, num_blocks, 40)
        for window, budget, chunked, num_blocks in itertools.product(
            (None, 12), (1, 7, 8, 9, 40), (True, False), (3, 4, 6)
        )
    ],
)
def test_refusals_follow_max_request_tokens_at_every_boundary(
    window: int | None, budget: int, chunked: bool, num_blocks: int, max_model_len: int
) -> None:
    """Every prompt and max_tokens inside the context: taken exactly when they fit `max_request_tokens`
    (what SMG's unset max_tokens is held to); refused naming the prompt exactly when no max_tokens fits."""
    most = _scheduler(budget, chunked, num_blocks, max_model_len, window).max_request_tokens
    for num_prompt in range(1, max_model_len):
        for max_tokens in range(1, max_model_len - num_prompt + 1):
            scheduler = _scheduler(budget, chunked, num_blocks, max_model_len, window)
            refusal = _refusal(scheduler, num_prompt, max_tokens)
            case = (num_prompt, max_tokens, most, refusal)
            if num_prompt + max_tokens <= most:
                assert refusal is None, case
            else:
                assert refusal is not None, case
                assert refusal[0] == ("prompt" if num_prompt + 1 > most else "max_tokens"), case


def test_a_request_at_the_step_budget_runs_to_its_end() -> None:
    """The largest request taken with chunked prefill off (prompt + max_tokens = the budget) runs, alone
    and beside others that preempt it."""
    scheduler = _scheduler(budget=32, chunked=False, num_blocks=64, max_model_len=64)
    requests = [make_request(f"r{i}", tokens(31 - i, 10 * i), 1 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    run_until_done(scheduler, PagedFakeModel(BS))
    assert [len(r.output_token_ids) for r in requests] == [1, 2, 3]
    assert scheduler.num_blocks_used == 0


def test_the_offline_engine_names_the_prompt(llama_dir: str) -> None:
    llm = LLM(
        llama_dir,
        max_model_len=64,
        enable_chunked_prefill=False,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=BS,
        attention_backend="torch",
    )
    with pytest.raises(ContextLengthError) as refused:
        llm.generate([list(range(20, 52))], SamplingParams(max_tokens=1, temperature=0.0))
    assert refused.value.field == "prompt"
    (completion,) = llm.generate([list(range(20, 51))], SamplingParams(max_tokens=1, temperature=0.0))
    assert (len(completion.token_ids), completion.finish_reason) == (1, "length")
    assert llm.engine.stats().num_kv_blocks_used == 0
