"""The rejection sampler alone, on made-up logits and drafts: tens of thousands of requests verified in
one call, whose tokens must follow the target's distributions exactly (chi-square, fixed seeds).

Each request verifies k = 2 drafts over a 16-token vocabulary against the same three target rows p_0,
p_1, p_2. Its drafts are drawn from q_0, q_1 (one per place, each half p_j and half a skewed
distribution), handed over with q (a draft model's proposal) for half of the requests and as point
masses (no q, n-gram drafts) for the other half, in the same batch; in another batch all are point
masses, as in an n-gram proposer's step. Whatever the drafts, the first token must follow p_0; among the
requests whose first token is their first draft (accepted), the second must follow p_1; after both
accepted, the bonus p_2. A residual built from the wrong place's q, or a point mass's draft left in p at
a rejection, fails."""

from __future__ import annotations

import pytest
import torch
from test_speculative_sampling import ALPHA, VOCAB, chi_square_p_value

from sluice.engine.sample.logits_processors import any_applies
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.spec_decode.rejection_sampler import RejectionSampler, _verify_rows

NUM_REQUESTS = 20_000
K = 2


def _distributions() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(K + 1, VOCAB, generator=generator) * 1.5, dim=-1)
    skewed = torch.softmax(torch.randn(K, VOCAB, generator=generator) * 2.5, dim=-1)
    return p, (p[:K] + skewed) / 2


def _verify(with_q: list[bool]) -> tuple[list[list[int]], list[tuple[int, ...]], list[bool]]:
    p, q = _distributions()
    generator = torch.Generator().manual_seed(6)
    drafts = torch.stack(
        [torch.multinomial(q[j], NUM_REQUESTS, True, generator=generator) for j in range(K)], 1
    )
    params = SamplingParams(temperature=1.0, max_tokens=8)
    rows = [SamplingRow(f"r{n}", params, [3], []) for n in range(NUM_REQUESTS)]
    proposals = [
        Proposal(tuple(d), q.clone() if has_q else None)
        for d, has_q in zip(drafts.tolist(), with_q, strict=True)
    ]
    logits = torch.log(p).repeat(NUM_REQUESTS, 1)  # each request's k + 1 rows: p_0, p_1, p_2
    sampled = RejectionSampler(Sampler(seed=7)).sample(logits, rows, proposals)
    return [[t.token_id for t in tokens] for tokens in sampled], [x.token_ids for x in proposals], with_q


@pytest.fixture(scope="module")
def mixed():
    return _verify([n % 2 == 0 for n in range(NUM_REQUESTS)])


@pytest.fixture(scope="module")
def point_masses_only():
    return _verify([False] * NUM_REQUESTS)


@pytest.mark.parametrize(
    "batch, kind", [("mixed", "q"), ("mixed", "point mass"), ("point_masses_only", "point mass")]
)
def test_each_place_follows_the_target_whatever_the_drafts(request, batch, kind):
    p, _ = _distributions()
    tokens, drafts, with_q = request.getfixturevalue(batch)
    mine = [(t, d) for t, d, has_q in zip(tokens, drafts, with_q, strict=True) if has_q == (kind == "q")]
    assert all(1 <= len(t) <= K + 1 and t[:-1] == list(d[: len(t) - 1]) for t, d in mine)
    first = [t[0] for t, _ in mine]
    second = [t[1] for t, d in mine if t[0] == d[0]]
    bonus = [t[2] for t, _ in mine if len(t) == K + 1]
    assert len(second) > 1000 and len(bonus) > 100  # every place and the bonus ran often
    assert len(second) < len(mine) * 0.8  # and rejections too
    for observed, expected in ((first, p[0]), (second, p[1]), (bonus, p[2])):
        assert chi_square_p_value(observed, expected.double()) > ALPHA


def test_a_request_no_processor_reads_shares_one_row_for_all_its_places():
    """Place j of a verify follows the first j drafts, as outputs of that place only; only the logits
    processors read them. A request none concerns gets its one row at every place (no copy of its
    outputs a place: 64 requests' k = 3 copies cost ~1 ms a step on the host), a penalised one the drafts
    in each place's outputs."""
    sampler = RejectionSampler(Sampler())
    plain = SamplingRow("plain", SamplingParams(temperature=0.0), [3], [5, 6])
    assert not any_applies(sampler.sampler.processors, plain)
    assert all(row is plain for row in _verify_rows(plain, (7, 8), concerned=False))
    penalised = SamplingRow("penalised", SamplingParams(temperature=0.0, repetition_penalty=1.2), [3], [5, 6])
    assert any_applies(sampler.sampler.processors, penalised)
    rows = _verify_rows(penalised, (7, 8), concerned=True)
    assert [(list(row.output_token_ids), row.num_drafts) for row in rows] == [
        ([5, 6], 0),
        ([5, 6, 7], 1),
        ([5, 6, 7, 8], 2),
    ]
    assert _verify_rows(penalised, (), concerned=True) == (penalised,)
