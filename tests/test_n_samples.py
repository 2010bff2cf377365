"""`n` samples of one prompt (fanned out by the frontend: sample 0 first, the others once its prompt is
computed, sharing its full blocks through the prefix cache) and prompt logprobs, on the engine: outputs
against transformers, exact prompt tokens computed and block counts, seeds, aborts, failures."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from sluice.engine.core.engine_core import EngineCore
from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16
PROMPT = [(7 * i + 11) % 500 + 4 for i in range(37)]  # 37 tokens: 2 full blocks of 16 + 5 tokens
NUM_NEW = 10
GREEDY_4 = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, n=4)


def last_block(num_prompt_tokens: int) -> int:
    """Prompt tokens a later sample computes: those of the prompt's last block (a prefix hit covers whole
    blocks and never the last token), i.e. P mod 16, or 16 when P is a multiple of 16."""
    return (num_prompt_tokens - 1) % BLOCK + 1


def _hf_model(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _hf_greedy(directory: str, prompt: list[int], num_new: int) -> list[int]:
    with torch.inference_mode():
        out = _hf_model(directory).generate(
            torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("checkpoint", "prompt_len"),
    [("llama_dir", 37), ("llama_dir", 32), ("mistral_windowed_dir", 37), ("gemma3_dir", 37)],
)
def test_greedy_n4_gives_transformers_output_four_times_computing_the_prompt_and_then_its_last_block(
    checkpoint, prompt_len, request
):
    # Windowed Mistral frees the blocks out of its window (they stay cached); Gemma 3 is hybrid.
    directory = request.getfixturevalue(checkpoint)
    prompt = PROMPT[:prompt_len]
    # Chunked prefill: the prompt takes 3 steps of 16 tokens.
    llm = LLM(directory, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=16)
    completions = llm.generate(prompt, GREEDY_4)
    expected = _hf_greedy(directory, prompt, NUM_NEW)
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert [c.token_ids for c in completions] == [expected] * 4
    assert [c.finish_reason for c in completions] == ["length"] * 4
    later = last_block(prompt_len)  # 5 of 37; 16 of 32
    assert [c.prompt_tokens_computed for c in completions] == [prompt_len, later, later, later]
    assert [c.cached_tokens for c in completions] == [0] + [prompt_len - later] * 3
    stats = llm.engine.stats()
    assert stats.num_prompt_tokens_computed == prompt_len + 3 * later
    assert stats.num_generation_tokens == 4 * NUM_NEW
    assert stats.num_kv_blocks_used == 0


def test_later_samples_are_sent_after_sample_zeros_first_token_and_share_its_full_blocks(llama_dir):
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=16)
    engine = llm.engine
    engine.add_request("a", PROMPT, GREEDY_4)
    core = engine.core
    assert [core.scheduler.get_request(f"a#{i}") is not None for i in range(4)] == [True] + [False] * 3
    outputs = engine.step()  # sample 0 computes the whole prompt and samples its first token
    assert [(o.request_id, o.index, len(o.token_ids)) for o in outputs] == [("a", 0, 1)]
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (1, 3, 3)
    outputs = engine.step()  # samples 1..3: a prefix hit of 2 blocks, their last 5 prompt tokens computed
    assert sorted((o.index, len(o.token_ids)) for o in outputs) == [(i, 1) for i in range(4)]
    kv = core.scheduler.kv
    first = kv.block_ids("a#0")
    for i in (1, 2, 3):
        table = kv.block_ids(f"a#{i}")
        assert len(table) == 3 and table[:2] == first[:2] and table[2] != first[2]
    assert [kv.pool.blocks[b].ref_cnt for b in first] == [4, 4, 1]
    stats = engine.stats()
    assert stats.num_kv_blocks_used == 3 + 3
    assert stats.num_prompt_tokens_computed == 37 + 3 * 5
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (3 * 32, 4 * 37)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_kv_blocks_used == 0


def test_without_prefix_caching_every_sample_computes_the_prompt(llama_dir):
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=64, enable_prefix_caching=False)
    completions = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=3))
    assert [c.token_ids for c in completions] == [_hf_greedy(llama_dir, PROMPT, 4)] * 3
    assert [c.prompt_tokens_computed for c in completions] == [len(PROMPT)] * 3
    assert llm.engine.stats().num_prompt_tokens_computed == 3 * len(PROMPT)


def test_seeded_n4_gives_four_different_reproducible_samples_seeded_seed_plus_index(llama_dir):
    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=NUM_NEW, ignore_eos=True, seed=1234, n=4)
    first = [c.token_ids for c in llm.generate(PROMPT, params)]
    again = [c.token_ids for c in llm.generate(PROMPT, params)]
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    alone = [
        llm.generate(
            PROMPT, SamplingParams(temperature=1.0, max_tokens=NUM_NEW, ignore_eos=True, seed=1234 + i)
        )
        for i in range(4)
    ]
    assert [c[0].token_ids for c in alone] == first
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_each_sample_finishes_on_its_own(llama_dir):
    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    expected = _hf_greedy(llama_dir, PROMPT, 3)
    params = SamplingParams(temperature=0.0, max_tokens=8, n=3, stop_token_ids=(expected[2],))
    completions = llm.generate(PROMPT, params)
    assert [(c.finish_reason, c.stop_reason, c.token_ids) for c in completions] == [
        ("stop", expected[2], expected)
    ] * 3
    one_token = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, n=4))
    assert [(c.finish_reason, c.token_ids) for c in one_token] == [("length", expected[:1])] * 4
    assert llm.engine.stats().num_kv_blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


# Step 1: sample 0 mid-prompt, samples 1..3 not sent to the core yet; step 5: all four running.
@pytest.mark.parametrize("steps", [1, 5])
def test_abort_of_an_n4_request_frees_everything(llama_dir, steps):
    engine = LLM(llama_dir, block_size=16, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=16).engine
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=4))
    for _ in range(steps):
        engine.step()
    assert engine.stats().num_kv_blocks_used > 0
    outputs = engine.abort(["a"])
    assert sorted((o.index, o.finish_reason) for o in outputs) == [(i, "abort") for i in range(4)]
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_samples_that_find_no_free_block_wait_and_still_match(llama_dir):
    # 4 blocks: sample 0 takes 3; sample 1 shares its 2 full ones and takes the last; 2 and 3 wait.
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=4, max_num_batched_tokens=64, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=4)
    engine = llm.engine
    engine.add_request("a", PROMPT, params)
    outputs = engine.step() + engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (2, 2, 4)
    completions: dict[int, list[int]] = {}
    computed = {}
    while outputs:
        for output in outputs:
            completions.setdefault(output.index, []).extend(output.token_ids)
            computed[output.index] = output.usage.prompt_tokens_computed
        outputs = engine.step()
    assert completions == dict.fromkeys(range(4), _hf_greedy(llama_dir, PROMPT, 4))
    assert computed == {0: 37, 1: 5, 2: 5, 3: 5}  # sample 1 still held the shared blocks
    assert engine.stats().num_kv_blocks_used == 0
    assert not engine.has_unfinished_requests()


def _hf_prompt_logprobs(directory: str, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = _hf_model(directory)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [len(prompt), vocab]


@pytest.mark.parametrize("checkpoint", ["llama_dir", "qwen2_dir"])
def test_prompt_logprobs_equal_transformers_with_chunked_prefill(checkpoint, request):
    directory = request.getfixturevalue(checkpoint)
    # Chunked prefill: 37 prompt tokens in 3 chunks of at most 16.
    llm = LLM(directory, block_size=16, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5)
    expected = _hf_prompt_logprobs(directory, PROMPT)
    for _ in range(2):  # the second run would hit the prefix cache; a prompt-logprobs request does not
        (completion,) = llm.generate(PROMPT, params)
        got = completion.prompt_logprobs
        assert len(got) == len(PROMPT) - 1
        assert [entry.sampled.token_id for entry in got] == PROMPT[1:]
        want = expected[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor([e.sampled.logprob for e in got]), want, atol=1e-4, rtol=0)
        top = expected[:-1].topk(5, dim=-1)
        torch.testing.assert_close(
            torch.tensor([[t.logprob for t in e.top] for e in got]), top.values, atol=1e-4, rtol=0
        )
        assert [[t.token_id for t in e.top] for e in got] == top.indices.tolist()
        assert completion.cached_tokens == 0


def test_prompt_logprobs_come_once_on_sample_zero(llama_dir):
    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0, n=2)
    first, second = llm.generate(PROMPT, params)
    assert len(first.prompt_logprobs) == len(PROMPT) - 1 and first.prompt_logprobs[0].top == ()
    assert second.prompt_logprobs == []
    # Sample 0 takes no prefix hit (it needs every position's logits); sample 1 hits its blocks.
    assert (first.prompt_tokens_computed, second.prompt_tokens_computed) == (37, 5)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    assert plain[0].prompt_logprobs == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n: must be in [1, 16]"),
        ({"n": 17}, "n: must be in [1, 16]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs: must be in [0, 20]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20]"),
    ],
)
def test_bad_n_and_prompt_logprobs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_every_sample_of_a_constrained_request_matches_its_constraint(llama_dir):
    choices = ("yes", "no", "maybe so", "yes!")
    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=20, n=6, constraint=Constraint(choice=choices)
    )
    completions = llm.generate("the cat sat on", params)
    assert [c.index for c in completions] == list(range(6))
    assert all(c.text in choices and c.finish_reason == "stop" for c in completions), completions
    num_prompt = len(completions[0].prompt_token_ids)
    assert [c.prompt_tokens_computed for c in completions] == [num_prompt] + [last_block(num_prompt)] * 5
    assert llm.engine.stats().num_kv_blocks_used == 0


# Sample 0's sampling fails (it ran: the others are sent and run on their own); sample 2's does.
@pytest.mark.parametrize("marker", ["bad#0", "bad#2"])
def test_a_sample_whose_sampling_fails_ends_alone(llama_dir, monkeypatch, marker):
    monkeypatch.setenv("SLUICE_INJECT_FAULT", f"sample:{marker}")
    engine = LLM(llama_dir, block_size=16, num_blocks=64).engine
    engine.add_request("bad", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=3))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.index] = (output.finish_reason, output.usage.completion_tokens)
    failed = int(marker[-1])
    assert finals == {i: ("error", 0) if i == failed else ("length", 4) for i in range(3)}
    assert engine.stats().num_kv_blocks_used == 0


def test_a_grammar_that_does_not_compile_ends_every_sample_with_its_field(llama_dir):
    llm = LLM(llama_dir, block_size=BLOCK, num_blocks=64)
    params = SamplingParams(max_tokens=4, n=3, constraint=Constraint(regex="a(b"))
    engine = llm.engine
    engine.add_request("g", PROMPT, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step()
    assert [(o.index, o.finish_reason, o.invalid_field) for o in finals] == [
        (i, "error", "regex") for i in range(3)
    ]
    assert len({o.error for o in finals}) == 1 and finals[0].error.startswith("regex: does not compile")
    with pytest.raises(InvalidRequestError, match=r"^regex: does not compile") as info:
        llm.generate(PROMPT, params)
    assert info.value.field == "regex"
    assert not engine.has_unfinished_requests() and engine.stats().num_kv_blocks_used == 0


def test_the_engine_core_knows_nothing_of_n():
    # n > 1 lives in the frontend (engine/frontend/parallel_sampling.py); no word of it in the core.
    words = re.compile(r"fork|follower|leader", re.IGNORECASE)
    for path in sorted((REPO / "engine" / "core").glob("*.py")):
        hits = [line for line in path.read_text().splitlines() if words.search(line)]
        assert hits == [], f"{path.relative_to(REPO)}: {hits}"
    gone = ("fork" + "_request", "block" + "_copies", "block" + "_copy", "sample" + "_group")
    roots = ("engine", "service", "kernels", "benchmarks", "clients", "scripts", "tests", "docs")
    files = [REPO / "README.md"] + [p for root in roots for p in sorted((REPO / root).rglob("*.py"))]
    files += sorted((REPO / "docs").rglob("*.md"))
    assert len(files) > 100
    for path in files:
        text = path.read_text(errors="replace")
        assert [g for g in gone if g in text] == [], path.relative_to(REPO)


def test_engine_core_step_reads_as_its_table_of_contents():
    source = inspect.getsource(EngineCore.step)
    body = source.split('"""')[2].strip().splitlines()
    assert len(body) <= 10, body
    for call in ("self.scheduler.schedule()", "self._execute(", "self._sample(", "self._update("):
        assert call in source
