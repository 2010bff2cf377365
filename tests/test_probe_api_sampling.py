"""Request parameters held to vLLM's semantics (vllm/sampling_params.py): `seed=-1` is no seed (vLLM's
`__post_init__` turns it into None), and the client refuses an empty `allowed_token_ids`, which the proto
cannot tell from "unset" (vLLM's `_validate_allowed_token_ids` refuses it, as the offline SamplingParams
does)."""

from __future__ import annotations

import pytest
import torch

from sluice import generate_request
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.service import convert
from sluice.v1 import sluice_pb2 as pb

PROMPT = [(7 * i + 5) % 500 + 4 for i in range(12)]


def test_seed_minus_one_is_no_seed_as_in_vllm() -> None:
    assert SamplingParams(seed=-1) == SamplingParams()
    assert SamplingParams(seed=-1, n=3).for_sample(2).seed is None
    assert convert.sampling_params_from_proto(pb.SamplingParams(seed=-1)).seed is None
    assert SamplingParams(seed=-2).seed == -2  # any other seed stays a seed


def test_a_seed_of_minus_one_draws_as_an_unseeded_request() -> None:
    """It drew from a generator seeded -1: the same tokens on every call."""
    logits = torch.zeros(8, 1000)  # flat: every row's draw is its uniform number

    def draw(seed: int | None) -> list[int]:
        rows = [SamplingRow(f"r{i}", SamplingParams(seed=seed), [1], []) for i in range(8)]
        return Sampler(seed=123).sample_no_sync(logits, rows).tolist()

    assert draw(-1) == draw(None)


def test_the_client_refuses_empty_allowed_token_ids() -> None:
    """Sent, an empty list is the proto's "unset": every token allowed, where the caller allowed none."""
    with pytest.raises(ValueError) as info:
        generate_request(token_ids=PROMPT, allowed_token_ids=[])
    assert str(info.value) == "allowed_token_ids: must not be empty (leave it unset to allow every token)"
    with pytest.raises(ValueError, match=r"^allowed_token_ids: must not be empty"):
        SamplingParams(allowed_token_ids=[])  # as the offline params refuse it
    assert not generate_request(token_ids=PROMPT).sampling_params.allowed_token_ids
    assert list(
        generate_request(token_ids=PROMPT, allowed_token_ids=[7]).sampling_params.allowed_token_ids
    ) == [7]


def test_an_id_listed_twice_in_logit_bias_pairs_takes_its_last_bias_as_a_dict_does() -> None:
    """Sorted before the processor kept one bias an id, the larger bias won whatever the order."""
    pairs = [(9, 100.0), (3, 1.0), (9, -100.0)]
    assert SamplingParams(logit_bias=pairs).logit_bias == ((3, 1.0), (9, -100.0))
    assert SamplingParams(logit_bias=pairs) == SamplingParams(logit_bias=dict(pairs))
    logits = torch.zeros(1, 16)
    row = SamplingRow("a", SamplingParams(temperature=0.0, logit_bias=pairs), [1], [])
    assert Sampler().sample_no_sync(logits, [row]).tolist() == [3]  # the biased-up 9 it picked
