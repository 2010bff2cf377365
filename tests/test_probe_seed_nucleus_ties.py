"""A seeded row's top_p nucleus, where tied logits straddle its edge, keeps the same tokens whatever the
batch. On the host the nucleus is looked for among each row's `topk` candidates, as many as the batch's
largest top_k (or NUCLEUS_CANDIDATES), and `topk` orders a tie one way for one count and another way for
another: which of the tied tokens made the nucleus (and so the seeded draw) changed with the other rows'
top_k. Ties are common where logits are rounded (bf16). Now a tie is taken in increasing token id on every
path (as the top logprobs and argmax take it), so a seed reproduces whatever the batch, as
docs/ARCHITECTURE.md promises."""

from __future__ import annotations

import torch

from sluice.engine.sample import sampler as sampler_module
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams

VOCAB = 4096  # past NUCLEUS_CANDIDATES: the host looks for the nucleus among the candidates first
NUM_TIED = 40


def _tied_row(seed: int) -> tuple[torch.Tensor, list[int]]:
    """Logits with NUM_TIED tokens at 2.0 (at random ids), the rest spread below 0: a top_p of 0.5 ends
    inside the tie. Returns the row and the tied ids."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.rand(VOCAB, generator=generator) * -8.0 - 1.0
    tied = torch.randperm(VOCAB, generator=generator)[:NUM_TIED]
    logits[tied] = 2.0
    return logits, sorted(tied.tolist())


def _row(params: SamplingParams, request_id: str) -> SamplingRow:
    return SamplingRow(request_id, params, [], [])


NEIGHBOURS = [
    SamplingParams(top_k=2000),  # candidates: 2,001
    SamplingParams(top_k=1100, top_p=0.9),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.2),
    SamplingParams(top_k=4095),  # the whole vocabulary
]


def test_a_tie_at_the_nucleus_edge_keeps_its_lowest_ids_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    for seed in range(4):
        logits, tied = _tied_row(seed)
        alone = sampler_module.apply_filters(logits.unsqueeze(0), [_row(params, "a")])[0]
        kept = alone.isfinite().nonzero().flatten().tolist()
        assert 0 < len(kept) < NUM_TIED and set(kept) <= set(tied)
        assert kept == tied[: len(kept)]  # a tie in increasing id, as argmax and the top logprobs take it
        for neighbour in NEIGHBOURS:
            other, _ = _tied_row(seed + 100)
            batch = torch.stack([other, logits, other])
            rows = [_row(neighbour, "x"), _row(params, "a"), _row(neighbour, "y")]
            cut = sampler_module.apply_filters(batch, rows)
            assert cut[1].isfinite().nonzero().flatten().tolist() == kept, (seed, neighbour)


def test_a_seeded_top_p_request_draws_the_same_tokens_alone_and_beside_a_top_k_request():
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=11)
    logits, _ = _tied_row(7)
    other, _ = _tied_row(8)
    alone, batched = Sampler(), Sampler()
    drawn_alone, drawn_batched = [], []
    for _ in range(64):
        drawn_alone.append(alone.sample(logits.unsqueeze(0), [_row(params, "a")])[0].token_id)
        rows = [_row(SamplingParams(top_k=2000, seed=1), "x"), _row(params, "a")]
        drawn_batched.append(batched.sample(torch.stack([other, logits]), rows)[1].token_id)
    assert drawn_batched == drawn_alone


def test_a_top_k_row_tied_at_its_top_cuts_the_same_nucleus_sorted_whole_or_among_the_candidates():
    """top_k 1 keeps every token tied with the most likely. Alone (2 candidates) the tie runs past the
    candidates and the row is sorted whole; beside a top_k 2000 row it is cut among the candidates. Where
    the tie's mass reaches top_p exactly (3 of 6 tied tokens at 0.5), a softmax on one path and
    exp(x - logsumexp) on the other rounded it to either side of top_p: one token more or fewer."""
    generator = torch.Generator().manual_seed(0)
    differ = []
    for num_tied in range(2, 64):
        logits = torch.rand(VOCAB, generator=generator) * -8.0 - 1.0
        logits[torch.randperm(VOCAB, generator=generator)[:num_tied]] = 3.0
        for top_p in (0.1, 0.25, 0.3, 0.5, 0.75, 0.9):
            row = _row(SamplingParams(top_k=1, top_p=top_p), "a")
            alone = sampler_module.apply_filters(logits.unsqueeze(0), [row])[0]
            rows = [_row(SamplingParams(top_k=2000), "x"), row]
            beside = sampler_module.apply_filters(torch.stack([logits, logits]), rows)[1]
            if not torch.equal(alone.isfinite(), beside.isfinite()):
                differ.append((num_tied, top_p))
    assert differ == []


def test_the_whole_sort_ends_a_nucleus_where_the_candidates_end_it() -> None:
    """A top_p-only row goes to the whole sort or stays among the candidates depending on the batch's
    largest top_k (a nucleus past 1,025 candidates fits in 2,001). At a top_p equal to the exact mass of a
    row's first j tokens (as the candidates' path sums it), both paths end its nucleus at token j: the
    sort normalised over the row in sorted order, whose sum can differ in its last bit (about 6% of rows),
    and kept one token more or fewer there."""
    rows = 300
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    values, _ = logits.sort(dim=-1, descending=True, stable=True)
    mass = torch.exp(values - torch.logsumexp(logits, dim=-1, keepdim=True)).cumsum(dim=-1)
    ends = torch.randint(1, 400, (rows,), generator=generator)  # inside the first 1,025 candidates
    top_p = mass.gather(1, ends.unsqueeze(1)).squeeze(1)
    among_candidates = sampler_module._top_k_top_p(logits, [VOCAB] * rows, top_p.tolist())
    sorted_whole = sampler_module._cut_sorted(logits, torch.full((rows,), VOCAB), top_p)
    kept = torch.isfinite(among_candidates)
    assert torch.equal(kept, torch.isfinite(sorted_whole))
    assert ((kept.sum(dim=-1) - (ends + 1)).abs() <= 1).all()  # each ends at its boundary (the test's)


def test_a_top_k_and_top_p_row_ends_its_nucleus_alike_beside_a_larger_top_k() -> None:
    """Its normaliser sums its top_k tokens over as many candidates as the batch's largest top_k asks for
    (-inf past its own k): in float32 the sum's last bit depended on that count, and at a top_p equal to
    the exact mass of its first j tokens 5 of 400 rows kept a token more or fewer beside a top_k=2000 row."""
    rows, k = 400, 300
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, VOCAB, generator=generator) * 3
    top = logits.sort(dim=-1, descending=True, stable=True).values[:, :k]
    mass = torch.exp(top - torch.logsumexp(top, dim=-1, keepdim=True)).cumsum(dim=-1)
    ends = torch.randint(1, k - 20, (rows,), generator=generator)
    top_p = mass.gather(1, ends.unsqueeze(1)).squeeze(1).tolist()
    alone = sampler_module._top_k_top_p(logits, [k] * rows, top_p)
    neighbour = torch.randn(1, VOCAB, generator=generator)
    beside = sampler_module._top_k_top_p(torch.cat([logits, neighbour]), [k] * rows + [2000], [*top_p, 1.0])
    assert torch.equal(torch.isfinite(alone), torch.isfinite(beside[:rows]))
