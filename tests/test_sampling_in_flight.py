"""Sampling rows whose penalties and min_tokens count a token in flight (async scheduling: the token the
step still running samples, on the device, not yet in the row's outputs), on the device the tests run on.

They must give the tokens of the same rows with that token on the host, and on CUDA sample without
waiting for the device (torch's sync debug mode set to "error"): a pageable host-to-device copy would wait
for the forward just launched, and the step would no longer overlap. The GPU check runs this file
(`sluice.benchmarks.gpu.kernel_test_files`); on a CPU the mode is CUDA's and only the tokens are checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 64
PROMPT = [4, 5]
STOP = 9


@contextmanager
def no_device_waits() -> Iterator[None]:
    """On CUDA: any call that waits for the device raises."""
    if DEVICE.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _case() -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[int]]:
    """Logits, params, host outputs and the tokens in flight of rows where counting the token in flight
    changes the pick: each row's best raw logit is what its penalty or min_tokens holds back with it."""
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    held = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, stop_token_ids=[STOP])
    rows = [
        # (params, host outputs, token in flight, the raw logits' best)
        (SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=100.0), [1], 7, 7),
        (SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=2.0), [3], 3, 3),
        (held, [2], 4, STOP),  # 2 outputs with the one in flight: the stop token is held back
        (held, [2, 2], 4, STOP),  # 3: it is not
        (SamplingParams(temperature=0.7, seed=11, max_tokens=16, presence_penalty=2.0), [5], 6, 6),
        (greedy, [1], 8, 8),  # nothing counts its outputs: the token in flight changes nothing
        # Nor here, but their processors run in the same step without waiting either.
        (SamplingParams(temperature=0.0, max_tokens=16, logit_bias={10: 30.0}), [1], 8, 8),
        (SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=[20, 21]), [1], 8, 8),
    ]
    for i, (*_, best) in enumerate(rows):
        logits[i, best] = 12.0 if i != 1 else 10.0
    logits[1, 11] = 7.0  # frequency 2 on token 3, twice with the one in flight: 10 - 4 < 7 < 10 - 2
    params = [r[0] for r in rows]
    return logits.to(DEVICE), params, [r[1] for r in rows], [r[2] for r in rows]


def test_penalised_and_min_tokens_rows_count_their_token_in_flight_without_waiting() -> None:
    logits, params, outputs, in_flight = _case()
    token_in_flight = torch.tensor(in_flight, device=DEVICE)
    rows = [
        SamplingRow(f"r{i}", p, PROMPT, out, token_in_flight=token_in_flight[i : i + 1])
        for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]
    sampler = Sampler()
    with no_device_waits():
        got = sampler.sample_no_sync(logits, rows)
        # A second step: the kept counts took nothing from the token in flight.
        again = sampler.sample_no_sync(logits, rows)
    on_host = [
        SamplingRow(f"r{i}", p, PROMPT, [*out, token])
        for i, (p, out, token) in enumerate(zip(params, outputs, in_flight, strict=True))
    ]
    expected = Sampler().sample_no_sync(logits, on_host).tolist()
    assert got.tolist() == expected
    assert again.tolist()[:4] == expected[:4]  # the greedy rows (the seeded one draws afresh)
    stale = [
        SamplingRow(f"r{i}", p, PROMPT, out) for i, (p, out) in enumerate(zip(params, outputs, strict=True))
    ]
    without = Sampler().sample_no_sync(logits, stale).tolist()
    assert [g != w for g, w in zip(expected, without, strict=True)][:4] == [True, True, False, True]
    assert expected[0] != 7 and expected[1] == 11 and expected[2] != STOP and expected[3] == STOP
    assert expected[5:] == without[5:] == [8, 10, 20 + int(logits[7, 21] > logits[7, 20])]
