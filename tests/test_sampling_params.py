"""`SamplingParams` takes what callers pass (lists, a lone stop string, None for "none", numpy integers)
and turns it into its own types, or raises ValueError naming the field; it never keeps a value that a
later step (the sampler, the core's message decoder, the detokenizer) would fail on."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.engine.sampling_params import MAX_N, MIN_TEMPERATURE, SamplingParams

SEED_NOTE = "(sample i of n draws from seed + i)"


def test_a_lone_stop_string_is_one_stop_string_and_none_is_none() -> None:
    assert SamplingParams(stop="the").stop == ("the",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_integers_of_any_integer_type_become_ints() -> None:
    params = SamplingParams(
        max_tokens=np.int64(4), top_k=np.int32(3), seed=np.uint64(7), stop_token_ids=[np.int64(9)]
    )
    values = (params.max_tokens, params.top_k, params.seed, params.stop_token_ids[0])
    assert values == (4, 3, 7, 9)
    assert all(type(value) is int for value in values)
    assert type(SamplingParams(temperature=np.float32(0.5)).temperature) is float
    assert type(SamplingParams(temperature=1).temperature) is float


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 1.5}, "top_k: must be an integer, got 1.5"),
        ({"max_tokens": 2.5}, "max_tokens: must be an integer, got 2.5"),
        ({"max_tokens": None}, "max_tokens: must be an integer, got None"),
        ({"min_tokens": 1.5}, "min_tokens: must be an integer, got 1.5"),
        ({"n": 2.5}, "n: must be an integer, got 2.5"),
        ({"seed": 1.5}, "seed: must be an integer, got 1.5"),
        ({"seed": "7"}, "seed: must be an integer, got '7'"),
        ({"logprobs": True}, "logprobs: must be an integer, got True"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs: must be an integer, got 1.5"),
        ({"temperature": "0.5"}, "temperature: must be a number, got '0.5'"),
        ({"top_p": None}, "top_p: must be a number, got None"),
        ({"ignore_eos": "no"}, "ignore_eos: must be True or False, got 'no'"),
        ({"skip_special_tokens": 1}, "skip_special_tokens: must be True or False, got 1"),
        ({"stop": [1]}, "stop: must be strings, got [1]"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids: must be an integer, got 1.5"),
        ({"stop_token_ids": 5}, "stop_token_ids: must be a list, got 5"),
        ({"allowed_token_ids": "abc"}, "allowed_token_ids: must be a list, got 'abc'"),
        ({"allowed_token_ids": [5.5]}, "allowed_token_ids: must be an integer, got 5.5"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias: must be an integer, got 1.5"),
        ({"logit_bias": {1: "x"}}, "logit_bias: must be a number, got 'x'"),
        ({"seed": 2**64}, f"seed: must be in [{-(2**63)}, {2**64 - 1}] {SEED_NOTE}"),
        ({"seed": 2**64 - 2, "n": 3}, f"seed: must be in [{-(2**63)}, {2**64 - 3}] {SEED_NOTE}"),
        ({"seed": -(2**63) - 1}, f"seed: must be in [{-(2**63)}, {2**64 - 1}] {SEED_NOTE}"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_every_sample_of_the_largest_seed_has_a_seed_torch_takes() -> None:
    params = SamplingParams(seed=2**64 - MAX_N, n=MAX_N)
    assert params.for_sample(MAX_N - 1).seed == 2**64 - 1  # torch.Generator.manual_seed's largest


def test_a_temperature_below_the_minimum_is_raised_to_it(caplog) -> None:
    """As vLLM does: logits divided by a float32 temperature of 1e-45 are infinite."""
    assert SamplingParams(temperature=1e-45).temperature == MIN_TEMPERATURE
    assert "temperature 1e-45 is below 0.01, raised to it" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0.0  # greedy stays greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_top_k_minus_one_disables_it_as_in_vllm() -> None:
    """vLLM's SamplingParams takes -1 (and 0) for "no top-k"; it was refused here."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    with pytest.raises(ValueError, match=r"^top_k: must be >= 0 \(0 or -1 disables it\)$"):
        SamplingParams(top_k=-2)
