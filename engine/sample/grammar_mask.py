"""The grammar mask: a logits processor that allows only the tokens a request's grammar accepts next.

Each constrained request has an xgrammar matcher, synced before every step with the request's accepted
output tokens (under async scheduling with the token in flight too, which its row carries on the host:
`sluice.engine.core.launched_step.with_tokens_in_flight`): new ones are accepted, and a matcher that has
seen more tokens than the request holds is rebuilt from the request's tokens. After a preemption by
recompute the outputs are kept, so the matcher stays valid; anything that shortens them (none today,
speculative rejection later) rebuilds it.

The mask runs after the other processors, so a row can be left with no token at all: allowed_token_ids
that share none with what the constraint accepts next, stop_token_ids that min_tokens holds back where the
constraint needs one, or a grammar that compiles but matches no string (`root ::= root`). Such a row
raises `NoTokenLeftError` (an InvalidRequestError naming the field) rather than drawing a token from
nothing, which would break the constraint. Whether one is left is read from the bitmask on the host, not
from the masked logits, so that nothing waits for the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluice.engine.errors import InvalidRequestError
from sluice.engine.sample.device_tensor import device_tensor, to_device_no_wait

if TYPE_CHECKING:
    import xgrammar as xgr

    from sluice.engine.sample.sampler import SamplingRow


class GrammarViolationError(ValueError):
    """A request holds a token its grammar does not accept (it can only come from outside the mask)."""


class NoTokenLeftError(InvalidRequestError):
    """The request's other sampling parameters leave none of the tokens its constraint accepts next."""

    def __init__(self, row: SamplingRow) -> None:
        params = row.params
        position = len(row.output_token_ids)
        where = f"at output token {position}"
        if params.allowed_token_ids is not None:
            field, message = "allowed_token_ids", f"none is a token the constraint accepts {where}"
        elif position < params.min_tokens and params.stop_token_ids:
            field = "min_tokens"
            message = f"holds back stop_token_ids, the only tokens the constraint accepts {where}"
        else:
            field, message = params.constraint.field, f"accepts no token {where}"
        super().__init__(field, message)


@dataclass
class _MatcherState:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0


class GrammarMask:
    """Rows whose `grammar` is set (an xgrammar CompiledGrammar) get -inf on every disallowed token."""

    def __init__(self) -> None:
        self._states: dict[str, _MatcherState] = {}

    def applies_to(self, row: SamplingRow) -> bool:
        return row.grammar is not None

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        picked = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not picked:
            return
        # A row's grammar was compiled by xgrammar, so it is imported by now (by the grammar compiler,
        # on the first constraint: an engine that never sees one never imports it).
        import xgrammar as xgr

        # bitmask: [num_rows, ceil(vocab / 32)] int32, bit j of row i set = token j allowed.
        vocab = logits.shape[1]
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
        masked = []
        for i in picked:
            matcher = self._sync(rows[i]).matcher
            # Complete (it accepted eos): the request ends with the token it has, so this row is one that
            # async scheduling launched before it knew; its token is never used.
            if matcher.is_terminated():
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            if _no_token_left(bitmask[i], rows[i], vocab):
                raise NoTokenLeftError(rows[i])
            masked.append(i)
        if masked:
            # Tensors on the logits' device: given a list, xgrammar's CUDA launch copies it from pageable
            # memory, which waits for the device (the step's forward, under async scheduling).
            device = logits.device
            indices = device_tensor(masked, torch.int32, device)
            xgr.apply_token_bitmask_inplace(logits, to_device_no_wait(bitmask, device), indices=indices)

    def free(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def _sync(self, row: SamplingRow) -> _MatcherState:
        state = self._states.get(row.request_id)
        outputs = row.output_token_ids
        if state is None or state.num_accepted > len(outputs):
            import xgrammar as xgr  # imported by now: `apply`

            state = _MatcherState(xgr.GrammarMatcher(row.grammar))
            self._states[row.request_id] = state
        for token_id in outputs[state.num_accepted :]:
            if not state.matcher.accept_token(token_id):
                raise GrammarViolationError(f"token {token_id} does not match the request's constraint")
            state.num_accepted += 1
        return state


def _no_token_left(words: torch.Tensor, row: SamplingRow, vocab: int) -> bool:
    """Whether nothing is left to sample in the row once the mask (its bitmask row, `words`) is applied
    after the other processors: allowed_token_ids and min_tokens are the ones that ban tokens (a bias and
    the penalties move logits, never to -inf). Read on the host, so that no one waits for the logits."""
    params = row.params
    holds_back = row.num_output_tokens < params.min_tokens
    if params.allowed_token_ids is None and not holds_back:  # the mask alone: any bit below vocab
        full, rest = divmod(vocab, 32)
        return not (bool(words[:full].any()) or (rest > 0 and bool(words[full] & ((1 << rest) - 1))))
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words.unsqueeze(1) >> shifts) & 1).flatten()[:vocab].bool()
    if params.allowed_token_ids is not None:
        listed = torch.zeros(vocab, dtype=torch.bool)
        listed[[t for t in params.allowed_token_ids if t < vocab]] = True
        allowed &= listed
    if holds_back:
        allowed[[t for t in params.held_back_by_min_tokens(row.eos_token_ids) if t < vocab]] = False
    return not bool(allowed.any())
