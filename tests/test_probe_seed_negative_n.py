"""A seeded request of n samples whose seed + i is -1 for some sample i (seed in [-n, -2]): that sample is
seeded too. vLLM sets each child's seed to seed + i directly (`ParentRequest`), so its -1 seeds torch's
generator; only the request's own `seed: -1` means no seed. Sluice's `for_sample` rebuilt the params, whose
normalisation turned seed + i = -1 into None: that sample drew from the shared generator, different on every
run of the same seeded request."""

from __future__ import annotations

import pytest

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SEED_LIMIT, SamplingParams

PROMPT = [(13 * i + 5) % 500 + 4 for i in range(21)]


@pytest.mark.parametrize("seed", [-2, -3])
def test_each_sample_of_a_negative_seed_is_seeded_seed_plus_index(seed):
    params = SamplingParams(temperature=1.0, seed=seed, n=3)
    # torch seeds -1 as 2**64 - 1: the sample keeps that generator, an n = 1 request can name it.
    assert [params.for_sample(i).seed for i in range(3)] == [
        s if s != -1 else SEED_LIMIT - 1 for s in range(seed, seed + 3)
    ]


def test_a_seeded_request_whose_sample_falls_on_minus_one_reproduces_it(llama_dir):
    llm = LLM(llama_dir, block_size=16, num_blocks=64, max_num_seqs=8, attention_backend="torch")
    params = SamplingParams(temperature=1.5, seed=-2, n=3, max_tokens=12, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate(PROMPT, params)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    alone = SamplingParams(temperature=1.5, seed=SEED_LIMIT - 1, max_tokens=12, ignore_eos=True)
    assert runs[0][1] == llm.generate(PROMPT, alone)[0].token_ids
    assert len({tuple(tokens) for tokens in runs[0]}) == 3
