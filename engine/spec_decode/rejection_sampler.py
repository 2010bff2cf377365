"""Verifies draft tokens against the target model's logits, keeping exactly the target's distribution.

For a request with drafts d_0 .. d_{k-1} the target gives k + 1 rows of logits: row j is the
distribution p_j of the token after the request's tokens and d_0 .. d_{j-1}. Each row goes through the
logits processors as if d_0 .. d_{j-1} had been accepted (the row's output tokens include them), then
temperature / top-k / top-p / min-p.

    greedy:   accept d_j while d_j == argmax p_j; the first mismatch yields argmax p_j instead; when all
              k are accepted, argmax p_k is the bonus token.
    random:   accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (q: the proposal's distribution,
              a point mass at d_j when the proposer gives none); on rejection draw from
              norm(max(0, p_j - q_j)) and stop; when all k are accepted, draw the bonus from p_k.

A random request takes k + 1 uniform numbers a step, whatever is accepted: one a draft, then one for the
token drawn at its first rejection (or the bonus), so that every request's verification runs at once, on
the device, and the step waits for it once (not once a draft). Every number comes from the request's own
generator when it is seeded, so a seed reproduces a request's tokens in the same schedule, not whatever
the batch: how many drafts a step verifies depends on the other requests (the step's token budget left,
free blocks, preemption), and each verified draft takes a draw. Nor does it give the tokens of a run
without speculation (the draws differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate

import torch

from sluice.engine.sample.logits_processors import any_applies
from sluice.engine.sample.sampler import (
    SampledToken,
    Sampler,
    SamplingRow,
    apply_filters,
    argmax_rows,
    device_tensor,
    draw_at,
    logprobs_no_sync,
)
from sluice.engine.spec_decode.proposer import Proposal


class RejectionSampler:
    """Wraps the engine's `Sampler` (its processors and generators)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], proposals: Sequence[Proposal | None]
    ) -> list[list[SampledToken]]:
        """logits: [sum(1 + k_i), vocab]: request i's k_i + 1 rows in order (k_i = its number of drafts).
        Returns, per request, its accepted drafts then one target token."""
        drafts = [() if p is None else p.token_ids for p in proposals]
        if not any(drafts):
            return [[token] for token in self.sampler.sample(logits, rows)]
        starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
        if logits.dim() != 2 or logits.shape[0] != starts[-1]:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {starts[-1]} verified rows")
        logits = logits.float()
        # Whether a logits processor concerns the request (then also each place after a draft, or not).
        concerned = [any_applies(self.sampler.processors, row) for row in rows]
        expanded = [
            place
            for row, draft, read in zip(rows, drafts, concerned, strict=True)
            for place in _verify_rows(row, draft, read)
        ]
        processed = self.sampler.apply_processors(logits, expanded) if any(concerned) else logits
        token_ids: list[list[int]] = [[] for _ in rows]
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            argmax = argmax_rows(processed).tolist()
            for i in greedy:
                token_ids[i] = _verify_greedy(drafts[i], argmax[starts[i] : starts[i + 1]])
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            launched = self._launch_random(processed, expanded, starts, random, drafts, proposals)
            accepted_and_token = launched.tolist()  # the one wait
            accepted, tokens = accepted_and_token[: len(random)], accepted_and_token[len(random) :]
            for i, a, t in zip(random, accepted, tokens, strict=True):
                token_ids[i] = [*drafts[i][:a], t]
        return self._sampled_tokens(logits, expanded, starts, token_ids)

    def acceptance_fractions(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """The uniform numbers that accept drafts, one a draft (`rows`: each draft's request's row)."""
        return self.sampler.fractions(rows, device)

    def _launch_random(
        self,
        processed: torch.Tensor,
        expanded: Sequence[SamplingRow],
        starts: Sequence[int],
        random: Sequence[int],
        drafts: Sequence[Sequence[int]],
        proposals: Sequence[Proposal | None],
    ) -> torch.Tensor:
        """The random requests (`random`: their indices) verified together, queued on the device without
        waiting for it: [each request's count accepted..., each request's token...]. Request m's draft j
        is accepted when u_j * q_j(d_j) < p_j(d_j), i.e. with probability min(1, p_j(d_j) / q_j(d_j)); at
        its first rejection r a token is drawn from max(0, p_r - q_r) (p_r less d_r where q is a point
        mass; p_r itself where that leaves nothing), and after k_m acceptances from p_k."""
        device = processed.device

        def on_device(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return device_tensor(values, dtype, device)

        # The requests' rows, compacted: request m's k_m + 1 rows start at row_start[m].
        rows = [r for i in random for r in range(starts[i], starts[i + 1])]
        selected = processed if len(rows) == processed.shape[0] else processed[on_device(rows)]
        filtered = apply_filters(selected, [expanded[r] for r in rows])
        p = torch.softmax(filtered, dim=-1)
        num_drafts = [len(drafts[i]) for i in random]
        row_start = list(accumulate((k + 1 for k in num_drafts), initial=0))[:-1]
        # One entry a draft, request by request: its request m, its place j, its row of p, its token.
        owner = [m for m, k in enumerate(num_drafts) for _ in range(k)]
        place = [j for k in num_drafts for j in range(k)]
        draft_row = [row_start[m] + j for m, j in zip(owner, place, strict=True)]
        draft_token = on_device([t for i in random for t in drafts[i]])
        # q's rows where the proposer gave q (a draft model), then one of zeros: the q of a point mass
        # (n-gram drafts) in the residual, where the rejected draft is taken out of p instead.
        q_rows, q_start, num_q = [], [], 0  # q_start[m]: request m's first row in q_all; -1: a point mass
        for i, k in zip(random, num_drafts, strict=True):
            q = proposals[i].probs if k else None
            q_start.append(-1 if q is None else num_q)
            if q is not None:
                q_rows.append(q[:k].to(device, p.dtype))
                num_q += k
        q_all = torch.cat([*q_rows, p.new_zeros(1, p.shape[1])])
        zeros = q_all.shape[0] - 1
        q_index = [zeros if q_start[m] < 0 else q_start[m] + j for m, j in zip(owner, place, strict=True)]
        q_draft = q_all[on_device(q_index), draft_token]
        point_mass = on_device([q_start[m] < 0 for m in owner], torch.bool)
        q_draft = torch.where(point_mass, 1.0, q_draft)
        p_draft = p[on_device(draft_row), draft_token]

        request_rows = [expanded[starts[i]] for i in random]
        u = self.acceptance_fractions([request_rows[m] for m in owner], device)
        k_t, owner_t = on_device(num_drafts), on_device(owner)
        # r: each request's first rejected place, k where every draft is accepted.
        rejected_place = torch.where(u * q_draft < p_draft, k_t[owner_t], on_device(place))
        r = k_t.clone().scatter_reduce_(0, owner_t, rejected_place, "amin")
        rejected = r < k_t
        base = p[on_device(row_start) + r]
        q_start_t = on_device(q_start)
        if q_rows:
            q_rejected = q_all[torch.where(rejected & (q_start_t >= 0), q_start_t + r, zeros)]
            residual = (base - q_rejected).clamp_(min=0.0)
        else:  # point masses only (n-gram drafts)
            residual = base.clone()
        if any(q < 0 < k for q, k in zip(q_start, num_drafts, strict=True)):  # point masses: d_r out
            draft_start = on_device(list(accumulate(num_drafts, initial=0))[:-1])
            rejected_token = draft_token[(draft_start + r).clamp(max=len(owner) - 1)].unsqueeze(1)
            take_out = (rejected & (q_start_t < 0)).unsqueeze(1)
            kept = residual.gather(1, rejected_token)
            residual.scatter_(1, rejected_token, torch.where(take_out, 0.0, kept))
        nothing_left = residual.sum(dim=-1, keepdim=True) <= 0.0
        token = draw_at(
            torch.where(nothing_left, base, residual), self.sampler.fractions(request_rows, device)
        )
        return torch.cat([r, token])

    def _sampled_tokens(
        self,
        logits: torch.Tensor,
        expanded: Sequence[SamplingRow],
        starts: Sequence[int],
        token_ids: Sequence[Sequence[int]],
    ) -> list[list[SampledToken]]:
        """Each request's tokens, with their logprobs where it asks for them (from the raw logits of the
        rows that sampled them): one batch for the whole step."""
        used = [starts[i] + j for i, tokens in enumerate(token_ids) for j in range(len(tokens))]
        flat = [t for tokens in token_ids for t in tokens]
        rows = [expanded[u] for u in used]
        device = logits.device
        pending = (
            logprobs_no_sync(
                logits[device_tensor(used, torch.long, device)], rows, device_tensor(flat, torch.long, device)
            )
            if any(row.params.logprobs is not None for row in rows)
            else None
        )
        sampled = (
            [SampledToken(t, None) for t in flat]
            if pending is None
            else pending.sampled_tokens(flat, pending.tensors)
        )
        out, at = [], 0
        for tokens in token_ids:
            out.append(sampled[at : at + len(tokens)])
            at += len(tokens)
        return out


def _verify_rows(row: SamplingRow, draft: Sequence[int], concerned: bool) -> Sequence[SamplingRow]:
    """The request's len(draft) + 1 rows: place j follows the first j drafts, outputs of that place only
    (`SamplingRow.num_drafts`). Only the logits processors read a row's outputs: where none concerns the
    request, `row` serves every place rather than a copy of its outputs a place."""
    if not concerned:
        return (row,) * (len(draft) + 1)
    followed = [
        replace(row, output_token_ids=[*row.output_token_ids, *draft[:j]], num_drafts=j)
        for j in range(1, len(draft) + 1)
    ]
    return (row, *followed)


def _verify_greedy(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """argmax: the target's choice at each of the len(draft) + 1 rows."""
    for j, token_id in enumerate(draft):
        if argmax[j] != token_id:
            return [*draft[:j], argmax[j]]
    return [*draft, argmax[len(draft)]]
