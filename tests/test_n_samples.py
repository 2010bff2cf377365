"""`n` samples of one prompt (the prompt computed once, its blocks forked) and prompt logprobs, on the
engine: outputs against transformers, exact block counts, seeds, aborts."""

from __future__ import annotations

import pytest
import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(37)]  # 37 tokens: 2 full blocks of 16 + 5 tokens
NUM_NEW = 10
GREEDY_4 = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, n=4)


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
def test_greedy_n4_gives_transformers_output_four_times_computing_the_prompt_once(
    checkpoint, prompt_len, request
):
    # Windowed Mistral frees the blocks out of its window before the fork; Gemma 3 is hybrid.
    directory = request.getfixturevalue(checkpoint)
    prompt = PROMPT[:prompt_len]
    # Chunked prefill: the prompt takes 3 steps of 16 tokens.
    llm = LLM(directory, block_size=16, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=16)
    completions = llm.generate(prompt, GREEDY_4)
    expected = _hf_greedy(directory, prompt, NUM_NEW)
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert [c.token_ids for c in completions] == [expected] * 4
    assert [c.finish_reason for c in completions] == ["length"] * 4
    assert [c.prompt_tokens_computed for c in completions] == [prompt_len, 0, 0, 0]
    stats = llm.engine.stats()
    assert stats.num_prompt_tokens_computed == prompt_len
    assert stats.num_generation_tokens == 4 * NUM_NEW
    assert stats.num_kv_blocks_used == 0


def test_fork_shares_full_blocks_and_copies_the_partial_one(llama_dir):
    engine = LLM(llama_dir, block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=16).engine
    engine.add_request("a", PROMPT, GREEDY_4)
    outputs = engine.step()  # the whole prompt, then 4 first tokens from its last logits row
    assert sorted((o.request_id, o.index, len(o.token_ids)) for o in outputs) == [
        ("a", i, 1) for i in range(4)
    ]
    # The leader holds 3 blocks; each of the 3 forks shares its 2 full ones and owns a copy of the third.
    assert engine.stats().num_kv_blocks_used == 3 + 3
    kv = engine.core.scheduler.kv
    leader = kv.block_ids("a#0")
    for i in (1, 2, 3):
        table = kv.block_ids(f"a#{i}")
        assert table[:2] == leader[:2] and table[2] != leader[2]
    assert [kv.pool.blocks[b].ref_cnt for b in leader] == [4, 4, 1]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_kv_blocks_used == 0


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


@pytest.mark.parametrize("steps", [1, 5])  # before the fork (samples waiting), after it (all running)
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


def test_forks_that_find_no_free_block_recompute_and_still_match(llama_dir):
    # 4 blocks: the leader takes 3, one fork copies into the last; two wait and recompute the prompt.
    llm = LLM(llama_dir, block_size=16, num_blocks=4, max_num_batched_tokens=64, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=4)
    engine = llm.engine
    engine.add_request("a", PROMPT, params)
    outputs = engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (2, 2, 4)
    completions: dict[int, list[int]] = {}
    while outputs:
        for output in outputs:
            completions.setdefault(output.index, []).extend(output.token_ids)
        outputs = engine.step()
    assert completions == dict.fromkeys(range(4), _hf_greedy(llama_dir, PROMPT, 4))
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
    from sluice.engine.structured.constraint import Constraint

    choices = ("yes", "no", "maybe so", "yes!")
    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=20, n=6, constraint=Constraint(choice=choices)
    )
    completions = llm.generate("the cat sat on", params)
    assert [c.index for c in completions] == list(range(6))
    assert all(c.text in choices and c.finish_reason == "stop" for c in completions), completions
    assert [c.prompt_tokens_computed > 0 for c in completions] == [True] + [False] * 5
    assert llm.engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize("marker", ["bad#0", "bad#2"])  # the leader's sampling fails; one fork's does
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
