"""Logits processors: logit_bias, allowed_token_ids, penalty state kept across steps, and a row's token
in flight (async scheduling)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sluice.engine.sample.logits_processors import AllowedTokenIds, LogitBias, MinTokens, Penalties
from sluice.engine.sample.sampler import Sampler, SamplingRow, apply_processors
from sluice.engine.sampling_params import SamplingParams

INF = float("inf")


def row(params: SamplingParams, request_id: str = "r", prompt=(), output=()) -> SamplingRow:
    return SamplingRow(request_id, params, list(prompt), list(output))


def test_logit_bias_adds_to_the_named_ids_and_skips_ids_past_the_logits() -> None:
    logits = torch.zeros(2, 4)
    LogitBias().apply(
        logits, [row(SamplingParams(logit_bias={1: 2.5, 3: -1.0, 9: 5.0}), "a"), row(SamplingParams(), "b")]
    )
    assert logits.tolist() == [[0.0, 2.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]


def test_logit_bias_keeps_each_requests_tensors_until_freed() -> None:
    bias = LogitBias()
    params = SamplingParams(logit_bias=[(1, 2.0), (3, -1.0), (1, 2.0)])  # an id listed twice counts once
    for _ in range(2):  # the second step adds the kept tensors; "a" twice, as a verify step's positions
        logits = torch.zeros(3, 4)
        bias.apply(logits, [row(params, "a"), row(SamplingParams(), "b"), row(params, "a")])
        assert logits.tolist() == [[0.0, 2.0, 0.0, -1.0], [0.0] * 4, [0.0, 2.0, 0.0, -1.0]]
    assert list(bias._biases) == ["a"]
    bias.free(["a", "b"])
    assert bias._biases == {}


def test_allowed_token_ids_ban_everything_else() -> None:
    logits = torch.arange(8.0).reshape(2, 4)
    AllowedTokenIds().apply(
        logits, [row(SamplingParams(), "a"), row(SamplingParams(allowed_token_ids=[0, 2]), "b")]
    )
    assert logits.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, -INF, 6.0, -INF]]


def test_greedy_picks_the_best_allowed_token_after_bias() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3], logit_bias={3: 4.5})
    assert Sampler().sample(logits, [row(params)])[0].token_id == 3


def test_penalty_state_grows_with_accepted_tokens_and_equals_a_fresh_computation() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    kept = Penalties()
    outputs: list[int] = []
    for token in [0, 3, 3, 1, 3]:
        outputs.append(token)
        logits = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]])
        kept.apply(logits, [row(params, prompt=[2], output=outputs)])
        fresh = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]])
        Penalties().apply(fresh, [row(params, prompt=[2], output=list(outputs))])
        assert logits.tolist() == fresh.tolist()
    # outputs 0, 3, 3, 1, 3; prompt 2. token 3: 1 / 2 - 0.5 * 3 - 0.25 = -1.25
    assert logits.tolist() == [[2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 3.0 / 2, -1.25, 0.5]]


def test_a_token_in_flight_counts_as_the_last_output_without_entering_the_kept_state() -> None:
    """Async scheduling: the row's last output is still on the device. Penalties and min_tokens give
    what they give with it on the host, and the kept counts take it only once it is there."""
    params = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3, stop_token_ids=[4]
    )
    processors = [MinTokens(), Penalties()]
    outputs: list[int] = []
    for token in [0, 3, 3, 1]:  # each step: the outputs so far on the host, `token` in flight
        in_flight = replace(row(params, prompt=[2], output=outputs), token_in_flight=torch.tensor([token]))
        logits = apply_processors(processors, torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]]), [in_flight])
        reference = row(params, prompt=[2], output=[*outputs, token])
        fresh = apply_processors(
            [MinTokens(), Penalties()], torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]]), [reference]
        )
        assert logits.tolist() == fresh.tolist(), (outputs, token)
        assert (logits[0, 4] == -INF) == (len(outputs) + 1 < 3)  # stop token 4 held back below 3 outputs
        assert processors[1]._state["r"].counts.tolist() == [outputs.count(t) for t in range(5)]
        outputs.append(token)


def test_a_verify_rows_drafts_count_as_outputs_for_that_row_only() -> None:
    """Speculative decoding: row j of a verify step follows the request's outputs and j drafts. Each row
    is penalised as if its drafts were accepted, and the kept counts take only the accepted outputs."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    kept = Penalties()
    outputs, drafts = [0, 3], [3, 1, 3]
    rows = [replace(row(params, prompt=[2], output=[*outputs, *drafts[:j]]), num_drafts=j) for j in range(4)]
    logits = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]]).repeat(4, 1)
    kept.apply(logits, rows)
    for j in range(4):
        fresh = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]])
        Penalties().apply(fresh, [row(params, prompt=[2], output=[*outputs, *drafts[:j]])])
        assert logits[j].tolist() == fresh[0].tolist(), j
    assert kept._state["r"].counts.tolist() == [1, 0, 0, 1, 0]
    # Next step: the first draft was accepted, then 4 sampled; the other drafts never count.
    logits = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]])
    kept.apply(logits, [row(params, prompt=[2], output=[0, 3, 3, 4])])
    fresh = torch.tensor([[2.0, -1.0, 3.0, 1.0, 0.5]])
    Penalties().apply(fresh, [row(params, prompt=[2], output=[0, 3, 3, 4])])
    assert logits.tolist() == fresh.tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {3: 101.0}}, "logit_bias: biases must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias: token ids must be >= 0"),
        (
            {"allowed_token_ids": []},
            "allowed_token_ids: must not be empty (leave it unset to allow every token)",
        ),
    ],
)
def test_bad_bias_and_allowed_ids_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
