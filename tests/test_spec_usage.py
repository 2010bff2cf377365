"""Usage counts a request's accepted drafts among the tokens it returned: a stop string completed inside a
step's run of accepted drafts drops the rest of the run, and those drafts with it."""

from __future__ import annotations

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.outputs import EngineStats, RequestOutput
from sluice.engine.sampling_params import SamplingParams

PROMPT = [493, 445, 489, 438, 32, 50, 47, 188, 431] * 4  # repetitive: a step accepts two n-gram drafts


def _run(checkpoint: str, stop: str | None = None) -> tuple[list[RequestOutput], EngineStats, LLM]:
    """One greedy request with n-gram speculation: its outputs, step by step, and the engine's stats."""
    llm = LLM(checkpoint, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4), block_size=16)
    engine = llm.engine
    engine.add_request(
        "r", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=stop, ignore_eos=True)
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs, engine.stats(), llm


def test_a_stop_string_inside_accepted_drafts_drops_them_from_usage(llama_dir):
    steps, _, llm = _run(llama_dir)
    tokens = [t for step in steps for t in step.token_ids]
    accepted_before = [0] + [step.usage.accepted_draft_tokens for step in steps]
    # The first step that accepted at least two drafts: its first token is a draft.
    cut = next(
        i for i, step in enumerate(steps) if step.usage.accepted_draft_tokens - accepted_before[i] >= 2
    )
    num_kept = sum(len(step.token_ids) for step in steps[:cut]) + 1
    stop = llm.tokenizer.decode(tokens[:num_kept])  # the whole text up to the cut step's first token
    assert stop != llm.tokenizer.decode(tokens[: num_kept - 1])

    outputs, stats, _ = _run(llama_dir, stop)
    final = outputs[-1]
    assert [t for out in outputs for t in out.token_ids] == tokens[:num_kept]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.usage.completion_tokens == num_kept
    # The core accepted the cut step's drafts (two or more); only the first, the one kept, counts.
    assert (
        stats.num_accepted_draft_tokens == steps[cut].usage.accepted_draft_tokens >= accepted_before[cut] + 2
    )
    assert final.usage.accepted_draft_tokens == accepted_before[cut] + 1 <= final.usage.completion_tokens - 1
    assert final.usage.draft_tokens == stats.num_draft_tokens
