"""Sampler semantics against direct computations on small known logits."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.engine.sample import sampler as sampler_module
from sluice.engine.sample.logits_processors import Penalties
from sluice.engine.sample.sampler import Sampler, SamplingRow, argmax_rows
from sluice.engine.sampling_params import SamplingParams

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
NUM_DRAWS = 20000
# Frequencies of NUM_DRAWS independent draws: std <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 sigma.
TOLERANCE = 0.015


def row(params: SamplingParams, request_id: str = "r", prompt=(), output=(), eos=frozenset()) -> SamplingRow:
    return SamplingRow(request_id, params, list(prompt), list(output), frozenset(eos))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    Penalties().apply(logits, rows)
    return logits


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) if v != -math.inf else 0.0 for v in values]
    return [e / sum(exps) for e in exps]


def frequencies(params: SamplingParams, logits: list[float] = LOGITS) -> list[float]:
    batch = torch.tensor([logits] * NUM_DRAWS)
    tokens = [
        t.token_id for t in Sampler(seed=0).sample(batch, [row(params, f"r{i}") for i in range(NUM_DRAWS)])
    ]
    return [tokens.count(t) / NUM_DRAWS for t in range(len(logits))]


def assert_distribution(observed: list[float], expected: list[float]) -> None:
    for token, (got, want) in enumerate(zip(observed, expected, strict=True)):
        if want == 0.0:
            assert got == 0.0, f"token {token} was filtered out but drawn"
        else:
            assert abs(got - want) < TOLERANCE, (token, got, want)


def test_plain_sampling_follows_softmax() -> None:
    assert_distribution(frequencies(SamplingParams()), softmax(LOGITS))


def test_temperature_scales_logits() -> None:
    expected = softmax([v / 0.5 for v in LOGITS])
    assert_distribution(frequencies(SamplingParams(temperature=0.5)), expected)


def test_top_k_keeps_only_k_best() -> None:
    expected = softmax(LOGITS[:2]) + [0.0] * 4
    assert_distribution(frequencies(SamplingParams(top_k=2)), expected)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = softmax(LOGITS)  # 0.574, 0.211, 0.128, 0.078, ...: the first three hold 0.913 >= 0.85
    assert probs[0] + probs[1] < 0.85 <= probs[0] + probs[1] + probs[2]
    expected = softmax(LOGITS[:3]) + [0.0] * 3
    assert_distribution(frequencies(SamplingParams(top_p=0.85)), expected)


def test_min_p_drops_tokens_below_fraction_of_best() -> None:
    probs = softmax(LOGITS)  # keep p >= 0.2 * p_max = 0.115: tokens 0, 1, 2
    kept = [p >= 0.2 * probs[0] for p in probs]
    assert kept == [True, True, True, False, False, False]
    expected = softmax(LOGITS[:3]) + [0.0] * 3
    assert_distribution(frequencies(SamplingParams(min_p=0.2)), expected)


def test_top_k_then_top_p_then_min_p_combined() -> None:
    # top_k=4 renormalises over 4 tokens: 0.579, 0.213, 0.129, 0.078; top_p=0.7 keeps 2 of them.
    probs = softmax(LOGITS[:4])
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    expected = softmax(LOGITS[:2]) + [0.0] * 4
    assert_distribution(frequencies(SamplingParams(top_k=4, top_p=0.7, min_p=0.01)), expected)


def test_greedy_is_argmax_and_respects_penalties() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 4.0, 1.0, 0.0]])
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0]),
    ]
    assert [t.token_id for t in Sampler().sample(logits, rows)] == [1, 1]


@pytest.mark.parametrize("vocab", [49152, 256, 1000])  # 1000: not whole chunks, torch's argmax
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "-inf", "all -inf"])
def test_argmax_rows_is_torch_argmax(vocab: int, kind: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    if kind == "ties":  # many equal maxima per row, across and within chunks: the first one wins
        x = x.round().clamp(max=1.0)
    elif kind in ("nan", "-inf"):
        x[::2, 3::97] = float(kind)
    elif kind == "all -inf":
        x[:] = float("-inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, : vocab // 2]), x[:, : vocab // 2].argmax(dim=-1))  # not contiguous


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(logits.clone(), [row(params, prompt=[0, 1], output=[1, 3])])
    assert got.tolist() == [[1.0, -2.0, 3.0, -4.0, 0.5]]


def test_frequency_and_presence_penalties_use_output_counts_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits.clone(), [row(params, prompt=[3, 3], output=[0, 0, 0, 1])])
    # token 0: 1 - 0.5 * 3 - 0.25 = -0.75; token 1: 1 - 0.5 - 0.25 = 0.25; prompt-only token 3 untouched.
    assert got.tolist() == [[-0.75, 0.25, 1.0, 1.0]]


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0]] * 3)
    rows = [
        row(SamplingParams(), "a", output=[0]),
        row(SamplingParams(repetition_penalty=4.0), "b", output=[1]),
        row(SamplingParams(presence_penalty=1.0), "c", output=[2, 2]),
    ]
    assert apply_penalties(logits.clone(), rows).tolist() == [
        [2.0, 2.0, 2.0],
        [2.0, 0.5, 2.0],
        [2.0, 2.0, 1.0],
    ]


def test_penalised_sampling_distribution() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    batch = torch.tensor([LOGITS] * NUM_DRAWS)
    rows = [row(params, f"r{i}", prompt=[0], output=[1, 1]) for i in range(NUM_DRAWS)]
    tokens = [t.token_id for t in Sampler(seed=1).sample(batch, rows)]
    penalised = [2.0 / 2, 1.0 / 2 - 0.5 * 2, 0.5, 0.0, -1.0, -3.0]
    assert_distribution([tokens.count(t) / NUM_DRAWS for t in range(6)], softmax(penalised))


def test_seed_reproduces_regardless_of_batch() -> None:
    torch.manual_seed(123)
    logits = torch.randn(4, 50)
    seeded = SamplingParams(seed=42, temperature=1.3, top_p=0.95)

    def run(batch_logits: torch.Tensor, rows: list[SamplingRow], index: int) -> list[int]:
        sampler = Sampler()
        return [sampler.sample(batch_logits, rows)[index].token_id for _ in range(30)]

    alone = run(logits[:1], [row(seeded, "a")], 0)
    others = [
        row(SamplingParams(), "x"),
        row(SamplingParams(seed=7), "y"),
        row(seeded, "a"),
        row(SamplingParams(temperature=0), "z"),
    ]
    in_batch = run(torch.cat([logits[1:3], logits[:1], logits[3:]]), others, 2)
    assert alone == in_batch
    assert len(set(alone)) > 3  # really random, not a constant
    other_seed = run(logits[:1], [row(SamplingParams(seed=43, temperature=1.3, top_p=0.95), "a")], 0)
    assert other_seed != alone


def test_free_restarts_seeded_generator() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    rows = [row(SamplingParams(seed=5), "a")]
    first = [sampler.sample(logits, rows)[0].token_id for _ in range(10)]
    sampler.free(["a"])
    again = [sampler.sample(logits, rows)[0].token_id for _ in range(10)]
    assert first == again


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5), prompt=[1]),
        row(SamplingParams(logprobs=0, temperature=0.7)),
    ]
    out = Sampler(seed=0).sample(logits, rows)
    for i, sampled in enumerate(out):
        values = logits[i].tolist()
        log_z = math.log(sum(math.exp(v) for v in values))
        (entry,) = sampled.logprobs
        assert entry.sampled.token_id == sampled.token_id
        assert entry.sampled.logprob == pytest.approx(values[sampled.token_id] - log_z, abs=1e-5)
    top = out[0].logprobs[0].top
    assert [t.token_id for t in top] == [1, 2]
    assert [t.logprob for t in top] == pytest.approx(
        [
            3.0 - math.log(sum(math.exp(v) for v in [1, 3, 2, 0])),
            2.0 - math.log(sum(math.exp(v) for v in [1, 3, 2, 0])),
        ]
    )
    assert out[1].logprobs[0].top == ()


def test_no_logprobs_unless_asked() -> None:
    out = Sampler().sample(torch.tensor([[0.0, 1.0]]), [row(SamplingParams(temperature=0))])
    assert out[0].logprobs is None and out[0].token_id == 1


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 4)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    rows = [
        row(params, "a", output=[3], eos={1}),  # 1 output < 2: eos 1 and stop id 2 banned
        row(params, "b", output=[3, 3], eos={1}),  # min_tokens reached
        row(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), "c", eos={1}),  # eos allowed
        row(SamplingParams(min_tokens=5, max_tokens=8), "d", eos={1, 2}),  # random: never eos
    ]
    tokens = [t.token_id for t in Sampler(seed=0).sample(logits, rows)]
    assert tokens[:3] == [3, 1, 1]
    assert tokens[3] not in (1, 2)
    draws = Sampler(seed=0).sample(torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 2000), [rows[3]] * 2000)
    assert {t.token_id for t in draws} == {0, 3}


def test_sample_does_not_modify_logits_and_checks_shape() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    before = logits.clone()
    Sampler().sample(logits, [row(SamplingParams(repetition_penalty=2.0, top_k=1), output=[2])])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="does not match 2 rows"):
        Sampler().sample(logits, [row(SamplingParams()), row(SamplingParams())])


def test_processors_copy_logits_only_for_rows_they_concern() -> None:
    """A batch no processor concerns is sampled from the logits as they are (no [rows, vocab] copy);
    one row with a processor gets a copy in which only that row changed."""
    sampler = Sampler()
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    before = logits.clone()
    plain = [row(SamplingParams(temperature=0.0), "a"), row(SamplingParams(), "b", output=[1])]
    assert sampler.apply_processors(logits, plain) is logits
    biased = [row(SamplingParams(temperature=0.0), "a"), row(SamplingParams(logit_bias={2: 5.0}), "b")]
    processed = sampler.apply_processors(logits, biased)
    assert torch.equal(logits, before)
    assert torch.equal(processed, torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 6.0]]))
    mixed = [
        row(SamplingParams(temperature=0.0), "a"),
        row(SamplingParams(temperature=0.0, logit_bias={2: 5.0}), "b"),
    ]
    assert [t.token_id for t in sampler.sample(logits, mixed)] == [2, 2]
    assert [t.token_id for t in sampler.sample(logits, plain[:1] * 2)] == [2, 0]


def test_logit_bias_comes_before_the_repetition_penalty_as_in_transformers() -> None:
    """Token 1 (logit -1, in the prompt) biased by 4.8 under repetition penalty 2: (-1 + 4.8) / 2 = 1.9
    after the bias, as transformers' SequenceBiasLogitsProcessor then RepetitionPenaltyLogitsProcessor
    (and vLLM) compute it; the penalty first gave -2 + 4.8 = 2.8, above token 0's 2 (a greedy flip)."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    logits = torch.tensor([[2.0, -1.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={1: 4.8})
    processed = Sampler().apply_processors(logits, [row(params, prompt=[1, 2])])
    prompt = torch.tensor([[1, 2]])
    want = SequenceBiasLogitsProcessor({(1,): 4.8})(prompt, logits.clone())
    want = RepetitionPenaltyLogitsProcessor(2.0)(prompt, want)
    torch.testing.assert_close(processed, want)
    assert [t.token_id for t in Sampler().sample(logits, [row(params, prompt=[1, 2])])] == [0]


def test_top_k_top_p_and_min_p_cut_what_transformers_warpers_cut(monkeypatch) -> None:
    """A 5,000-token vocabulary, beyond NUCLEUS_CANDIDATES: peaked rows find their nucleus among the
    candidates, the flat one (top_p only) is sorted whole; every row keeps exactly the tokens, with the
    values, that transformers' warpers keep (temperature, top_k, top_p, min_p in that order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    generator = torch.Generator().manual_seed(3)
    scales = [8.0, 8.0, 6.0, 4.0, 0.3, 0.3, 5.0]
    logits = torch.randn(len(scales), 5000, generator=generator) * torch.tensor(scales).unsqueeze(1)
    params = [
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=300, top_p=0.8),
        SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.9),  # flat: its nucleus reaches past the candidates
        SamplingParams(temperature=0.9),  # no cut, beside rows with cuts: kept whole, never sorted
        SamplingParams(temperature=1.0, top_k=1200, top_p=0.99),  # top_k past the candidates' default
    ]
    sorted_whole = []
    cut_sorted = sampler_module._cut_sorted
    monkeypatch.setattr(
        sampler_module,
        "_cut_sorted",
        lambda x, *args: sorted_whole.append(x.shape[0]) or cut_sorted(x, *args),
    )
    cut = sampler_module.apply_filters(logits, [row(p, f"r{i}") for i, p in enumerate(params)])
    assert sorted_whole == [1]  # the flat top_p row alone
    for i, p in enumerate(params):
        want = TemperatureLogitsWarper(p.temperature)(None, logits[i : i + 1])
        if p.top_k:
            want = TopKLogitsWarper(p.top_k)(None, want)
        if p.top_p < 1.0:
            want = TopPLogitsWarper(p.top_p)(None, want)
        if p.min_p:
            want = MinPLogitsWarper(p.min_p)(None, want)
        kept = want[0].isfinite()
        assert torch.equal(cut[i].isfinite(), kept), (i, int(cut[i].isfinite().sum()), int(kept.sum()))
        assert 0 < int(kept.sum()) < (5000 if p.top_k or p.top_p < 1.0 else 5001)
        torch.testing.assert_close(cut[i][kept], want[0][kept])


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_transformers_does() -> None:
    """Rounded logits tie often (bf16 on a GPU): transformers and vLLM cut below the k-th value, so every
    token tied with it stays; by rank Sluice kept k, and the host and the GPU path kept different ones."""
    from transformers.generation.logits_process import TopKLogitsWarper

    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 12, (6, 300), generator=generator).float()
    logits[5, :] = 1.0  # one value everywhere: a tie that runs past every candidate
    top_k = [1, 5, 20, 50, 7, 3]
    host = sampler_module.apply_filters(
        logits, [row(SamplingParams(top_k=k), f"r{i}") for i, k in enumerate(top_k)]
    )
    sorted_ = sampler_module._cut_sorted(logits, torch.tensor(top_k), torch.ones(len(top_k)))
    for i, k in enumerate(top_k):
        kept = TopKLogitsWarper(k)(None, logits[i : i + 1])[0].isfinite()
        assert int(kept.sum()) > k or i == 0  # ties at the k-th place (the top token stands alone in row 0)
        assert torch.equal(host[i].isfinite(), kept), (i, int(host[i].isfinite().sum()), int(kept.sum()))
        assert torch.equal(sorted_[i].isfinite(), kept), i


def test_a_constrained_row_with_fewer_tokens_than_top_k_is_not_sorted_whole(monkeypatch) -> None:
    """Its k-th logit is -inf (the mask's), as is everything past it: no tie to look for past the
    candidates (each such step sorted the whole vocabulary on the host)."""
    logits = torch.full((1, 5000), float("-inf"))
    logits[0, [3, 7]] = torch.tensor([1.0, 0.5])
    sorted_whole = []
    cut_sorted = sampler_module._cut_sorted

    def spy(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        sorted_whole.append(x.shape[0])
        return cut_sorted(x, *args)

    monkeypatch.setattr(sampler_module, "_cut_sorted", spy)
    cut = sampler_module.apply_filters(logits, [row(SamplingParams(top_k=50), "r")])
    assert sorted_whole == [] and cut[0].isfinite().nonzero().flatten().tolist() == [3, 7]


def test_an_extreme_repetition_penalty_keeps_logits_finite_and_draws_inside_the_vocabulary() -> None:
    """repetition_penalty may be anything > 0 (as in vLLM): 1e-45 divided positive logits to +inf and
    3e38 multiplied negative ones to -inf; a row of infinities softmaxed to NaN, the draw returned the id
    one past the vocabulary, and the next step's embedding took the engine down for every caller."""
    logits = torch.tensor([[2.0, -2.0, 3.0, -math.inf]])
    tiny = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=1e-45), output=[0, 1, 3])])
    huge = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=3e38), output=[0, 1, 3])])
    top = torch.finfo(torch.float32).max
    nearly_zero = (torch.tensor(-2.0) * torch.tensor(1e-45)).item()  # float32 rounds 1e-45
    assert tiny.tolist() == [[top, nearly_zero, 3.0, -math.inf]]  # a masked token stays masked
    assert huge.tolist() == [[(torch.tensor(2.0) / torch.tensor(3e38)).item(), -top, 3.0, -math.inf]]
    params = SamplingParams(repetition_penalty=1e-45, temperature=1.0)
    batch = torch.tensor([[2.0, 1.0, 3.0, 0.5]] * 64)
    rows = [row(params, f"r{i}", output=[0, 2]) for i in range(64)]
    assert {t.token_id for t in Sampler(seed=0).sample(batch, rows)} == {0, 2}  # both at the float max


def test_a_temperature_past_float32s_range_draws_uniformly_among_the_allowed_tokens() -> None:
    """temperature has no upper bound (as in vLLM), and 1e39 is a finite float: on the device it was inf,
    a masked logit over it NaN, and every draw the row's last id, outside allowed_token_ids. Now it is
    float32's largest, whose limit is every allowed token alike."""
    params = SamplingParams(temperature=1e39, allowed_token_ids=[1, 2, 4])
    assert_distribution(frequencies(params), [0.0, 1 / 3, 1 / 3, 0.0, 1 / 3, 0.0])


def test_a_logit_at_the_float_max_over_a_temperature_below_one_is_still_the_most_likely() -> None:
    """An extreme repetition penalty (1e-45) puts the repeated positive logits at float32's largest; over a
    temperature of 0.5 they overflowed to inf, the row softmaxed to NaN and drew its last id (3), which
    the penalty had left far below them."""
    params = SamplingParams(repetition_penalty=1e-45, temperature=0.5)
    batch = torch.tensor([[2.0, 1.0, 3.0, 0.5]] * 64)
    rows = [row(params, f"r{i}", output=[0, 2]) for i in range(64)]
    assert {t.token_id for t in Sampler(seed=0).sample(batch, rows)} == {0, 2}


def test_a_row_of_nan_probabilities_draws_an_id_inside_the_vocabulary() -> None:
    """NaN logits (a model overflowing) give a NaN total: no token is found; the last id, not one past it."""
    probs = torch.tensor([[math.nan] * 5, [0.1, 0.2, 0.3, 0.2, 0.2]])
    assert sampler_module.draw_at(probs, torch.tensor([0.5, 0.5])).tolist() == [4, 2]
