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

Every draw comes from the request's own generator when it is seeded, so a seed reproduces a request's
tokens in the same schedule, not whatever the batch: how many drafts a step verifies depends on the other
requests (the step's token budget left, free blocks, preemption), and each verified draft takes a draw.
Nor does it give the tokens of a run without speculation (the draws differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from sluice.engine.sample.sampler import SampledToken, Sampler, SamplingRow, apply_filters, argmax_rows
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
        num_rows = sum(len(d) + 1 for d in drafts)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {num_rows} verified rows")
        logits = logits.float()
        expanded = [
            replace(row, output_token_ids=[*row.output_token_ids, *draft[:j]])
            for row, draft in zip(rows, drafts, strict=True)
            for j in range(len(draft) + 1)
        ]
        processed = self.sampler.apply_processors(logits, expanded)
        argmax = argmax_rows(processed).tolist()
        probs = self._target_probs(processed, expanded)
        results = []
        start = 0
        for row, draft, proposal in zip(rows, drafts, proposals, strict=True):
            end = start + len(draft) + 1
            if row.params.greedy:
                token_ids = _verify_greedy(draft, argmax[start:end])
            else:
                q = None if proposal is None else proposal.probs
                token_ids = self._verify_random(row, draft, probs[start:end], q)
            n = len(token_ids)
            ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
            rows_used = slice(start, start + n)
            results.append(self.sampler.attach_logprobs(logits[rows_used], expanded[rows_used], ids))
            start = end
        return results

    @staticmethod
    def _target_probs(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """p of every row of a random (non-greedy) request, after its filters, in one batch; greedy rows
        stay 0 (never read)."""
        probs = torch.zeros_like(processed)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            filtered = apply_filters(processed[random], [rows[i] for i in random])
            probs[random] = torch.softmax(filtered, dim=-1)
        return probs

    def _verify_random(
        self, row: SamplingRow, draft: Sequence[int], probs: torch.Tensor, q: torch.Tensor | None
    ) -> list[int]:
        # probs: [k + 1, vocab] target distributions; q: [>= k, vocab] draft distributions or None.
        for j, token_id in enumerate(draft):
            p = probs[j]
            p_draft = float(p[token_id])
            q_draft = 1.0 if q is None else float(q[j, token_id])
            if self.sampler.uniform(row, probs.device) * q_draft < p_draft:
                continue
            if q is None:
                residual = p.clone()
                residual[token_id] = 0.0
            else:
                residual = (p - q[j].to(p.device, p.dtype)).clamp_(min=0.0)
            total = float(residual.sum())
            residual = p if total <= 0.0 else residual / total
            return [*draft[:j], int(self.sampler.draw(residual.unsqueeze(0), [row])[0])]
        return [*draft, int(self.sampler.draw(probs[len(draft)].unsqueeze(0), [row])[0])]


def _verify_greedy(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """argmax: the target's choice at each of the len(draft) + 1 rows."""
    for j, token_id in enumerate(draft):
        if argmax[j] != token_id:
            return [*draft[:j], argmax[j]]
    return [*draft, argmax[len(draft)]]
