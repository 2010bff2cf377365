"""Logits processors: the steps between the model's logits and the draw, applied in list order.

Each processor edits the logits of the rows it concerns (`applies_to`), in place, and may keep
per-request state across steps (dropped by `free`). State is synced from the row's `output_token_ids`
(the accepted tokens), never from what the processor saw sampled, so a preempted or re-sampled request
finds its state consistent. Under async scheduling a row's last output may still be on the device
(`SamplingRow.token_in_flight`): the processors that count outputs add it to this step's counts only, as
they do with the drafts a speculative verify row follows (`SamplingRow.num_drafts`).

    MinTokens -> LogitBias -> Penalties -> AllowedTokenIds -> (GrammarMask, sluice.engine.sample.grammar_mask)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from sluice.engine.sample.device_tensor import device_tensor, to_device_no_wait

if TYPE_CHECKING:
    from sluice.engine.sample.sampler import SamplingRow
    from sluice.engine.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    def applies_to(self, row: SamplingRow) -> bool:
        """Whether `apply` would change this row's logits (cheap: the sampler asks for every row, and
        leaves the logits uncopied when no processor concerns any row). False must stay False for the
        row with more output tokens (`any_applies`)."""

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """logits: [num_rows, vocab] float32, row i belongs to rows[i]; edited in place."""

    def free(self, request_ids: Iterable[str]) -> None:
        """Forget the state of finished requests."""


def any_applies(processors: Iterable[LogitsProcessor], row: SamplingRow) -> bool:
    """Whether a processor concerns the row. If none does, none concerns its rows after drafts (the
    drafts counted as outputs: `LogitsProcessor.applies_to`'s rule), so those rows may share it: the
    rejection sampler's verify places and the draft proposer's draft steps ask this once a request."""
    return any(processor.applies_to(row) for processor in processors)


def default_processors() -> list[LogitsProcessor]:
    # logit_bias before the penalties, as vLLM and transformers (sequence_bias) apply them
    return [MinTokens(), LogitBias(), Penalties(), AllowedTokenIds()]


def draft_processors() -> list[LogitsProcessor]:
    """The processors a draft model proposes under: those of `default_processors` that a request may
    speculate with, each a function of the row alone, so a row whose output tokens end in earlier drafts is
    masked as the target's verify row will be. The penalties and a grammar apply to the target's verify rows
    only: a draft they would not pick is rejected there."""
    return [MinTokens(), LogitBias(), AllowedTokenIds()]


class MinTokens:
    """Bans `SamplingParams.held_back_by_min_tokens` (stop_token_ids; eos unless ignore_eos or a
    constraint that applies to the row) in rows with < min_tokens outputs. Stateless."""

    def applies_to(self, row: SamplingRow) -> bool:
        return row.num_output_tokens < row.params.min_tokens

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        vocab = logits.shape[1]
        row_idx, col_idx = [], []
        for i, row in enumerate(rows):
            if row.num_output_tokens >= row.params.min_tokens:
                continue
            # Scans the outputs: fewer than min_tokens here.
            under_constraint = row.params.constraint_applies(row.output_token_ids)
            banned = row.params.held_back_by_min_tokens(row.eos_token_ids, under_constraint)
            cols = [t for t in banned if t < vocab]
            row_idx += [i] * len(cols)
            col_idx += cols
        if row_idx:
            device = logits.device
            at = (device_tensor(row_idx, torch.long, device), device_tensor(col_idx, torch.long, device))
            logits[at] = float("-inf")

    def free(self, request_ids: Iterable[str]) -> None:
        pass


@dataclass
class _TokenCounts:
    seen: torch.Tensor  # [vocab] bool: in the prompt or the outputs (repetition penalty)
    counts: torch.Tensor  # [vocab] float: occurrences in the outputs (frequency / presence)
    num_outputs: int  # output tokens counted so far


class Penalties:
    """Repetition (prompt + output), frequency and presence (output only) penalties.

    Keeps each penalized request's token counts and adds only the tokens accepted since the last step;
    a row's token in flight, and the drafts a verify row follows, are added on the device to this step's
    copy of its counts, not to the state (the state takes them from `output_token_ids` once accepted).
    """

    def __init__(self) -> None:
        self._state: dict[str, _TokenCounts] = {}

    def applies_to(self, row: SamplingRow) -> bool:
        return _penalized(row.params)

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        picked = [i for i, r in enumerate(rows) if _penalized(r.params)]
        if not picked:
            return
        device = logits.device
        states = [self._sync(rows[i], logits.shape[1], device) for i in picked]
        params = [rows[i].params for i in picked]
        seen = torch.stack([s.seen for s in states])
        counts = torch.stack([s.counts for s in states])
        _count_tokens_in_flight([rows[i] for i in picked], seen, counts)
        _count_drafts([rows[i] for i in picked], seen, counts)
        at = device_tensor(picked, torch.long, device)
        sub = logits.index_select(0, at)
        rep = device_tensor([p.repetition_penalty for p in params], torch.float32, device).unsqueeze(1)
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        # An extreme penalty (1e-45, 3e38: both > 0, both allowed) overflows a finite logit to +-inf, and
        # a row of infinities softmaxes to NaN; a masked one (-inf) stays masked.
        finite = torch.finfo(scaled.dtype)
        sub = torch.where(seen, scaled.clamp(finite.min, finite.max).where(sub.isfinite(), scaled), sub)
        f = device_tensor([p.frequency_penalty for p in params], torch.float32, device).unsqueeze(1)
        p = device_tensor([p.presence_penalty for p in params], torch.float32, device).unsqueeze(1)
        logits.index_copy_(0, at, sub - f * counts - p * (counts > 0).float())

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._state.pop(request_id, None)

    def _sync(self, row: SamplingRow, vocab: int, device: torch.device) -> _TokenCounts:
        state = self._state.get(row.request_id)
        num_accepted = len(row.output_token_ids) - row.num_drafts  # a verify row's drafts: this step only
        if state is None or state.num_outputs > num_accepted or state.seen.shape[0] != vocab:
            state = _TokenCounts(
                seen=torch.zeros(vocab, dtype=torch.bool, device=device),
                counts=torch.zeros(vocab, device=device),
                num_outputs=0,
            )
            state.seen[_ids_below(row.prompt_token_ids, vocab, device)] = True
            self._state[row.request_id] = state
        new = _ids_below(row.output_token_ids[state.num_outputs : num_accepted], vocab, device)
        state.seen[new] = True
        state.counts.index_put_((new,), torch.ones_like(new, dtype=state.counts.dtype), accumulate=True)
        state.num_outputs = num_accepted
        return state


class LogitBias:
    """Adds `params.logit_bias` (token id -> bias; an id listed twice counts once); ids outside the logits
    are ignored. Keeps each request's ids and biases as tensors: rebuilt from Python every step, a bias over
    SmolLM2's whole vocabulary cost ~32 ms a step (now ~0.3), 300 ids on 64 rows 14-20 ms (now 0.2-0.3)."""

    def __init__(self) -> None:
        self._biases: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # id -> (vocab, ids, biases)

    def applies_to(self, row: SamplingRow) -> bool:
        return bool(row.params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        picked = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if not picked:
            return
        biases = [self._bias(rows[i], logits) for i in picked]
        sizes = torch.tensor([ids.shape[0] for ids, _ in biases])
        row_idx = to_device_no_wait(torch.repeat_interleave(torch.tensor(picked), sizes), logits.device)
        cols = torch.cat([ids for ids, _ in biases])
        logits.index_put_((row_idx, cols), torch.cat([values for _, values in biases]), accumulate=True)

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._biases.pop(request_id, None)

    def _bias(self, row: SamplingRow, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = logits.shape[1]
        cached = self._biases.get(row.request_id)
        if cached is None or cached[0] != vocab:
            bias = {t: b for t, b in row.params.logit_bias if t < vocab}  # one entry an id: adds once
            ids = device_tensor(list(bias), torch.long, logits.device)
            values = device_tensor(list(bias.values()), logits.dtype, logits.device)
            cached = self._biases[row.request_id] = (vocab, ids, values)
        return cached[1], cached[2]


class AllowedTokenIds:
    """Every token not in `params.allowed_token_ids` gets -inf. Keeps each request's mask."""

    def __init__(self) -> None:
        self._masks: dict[str, torch.Tensor] = {}  # request id -> [vocab] bool, True = banned

    def applies_to(self, row: SamplingRow) -> bool:
        return row.params.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        picked = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        if not picked:
            return
        banned = torch.stack([self._mask(rows[i], logits.shape[1], logits.device) for i in picked])
        at = device_tensor(picked, torch.long, logits.device)
        logits.index_copy_(0, at, logits.index_select(0, at).masked_fill(banned, float("-inf")))

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._masks.pop(request_id, None)

    def _mask(self, row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(row.request_id)
        if mask is None or mask.shape[0] != vocab:
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[_ids_below(row.params.allowed_token_ids, vocab, device)] = False
            self._masks[row.request_id] = mask
        return mask


def _count_tokens_in_flight(rows: Sequence[SamplingRow], seen: torch.Tensor, counts: torch.Tensor) -> None:
    """Adds each row's token in flight to its row of `seen` and `counts` ([len(rows), vocab]), on the
    device: nothing waits for the step that samples them."""
    in_flight = [(i, row.token_in_flight) for i, row in enumerate(rows) if row.token_in_flight is not None]
    if not in_flight:
        return
    at = device_tensor([i for i, _ in in_flight], torch.long, counts.device)
    token_ids = torch.cat([token for _, token in in_flight])
    seen[at, token_ids] = True
    counts.index_put_((at, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)


def _count_drafts(rows: Sequence[SamplingRow], seen: torch.Tensor, counts: torch.Tensor) -> None:
    """Adds the drafts each verify row follows (`SamplingRow.num_drafts`) to its row of `seen` and
    `counts`: they count as outputs for this row only, as if accepted."""
    vocab = counts.shape[1]
    at, token_ids = [], []
    for i, row in enumerate(rows):
        if row.num_drafts:
            drafts = [t for t in row.output_token_ids[-row.num_drafts :] if t < vocab]
            at += [i] * len(drafts)
            token_ids += drafts
    if not at:
        return
    device = counts.device
    index = (device_tensor(at, torch.long, device), device_tensor(token_ids, torch.long, device))
    seen[index] = True
    counts.index_put_(index, torch.ones(len(at), dtype=counts.dtype, device=device), accumulate=True)


def counts_outputs(params: SamplingParams) -> bool:
    """Whether a default processor reads the request's output tokens when it samples: penalties (which
    tokens), min_tokens (how many)."""
    return params.min_tokens > 0 or _penalized(params)


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _ids_below(token_ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    return to_device_no_wait(ids[ids < vocab], device)
