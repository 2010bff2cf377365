"""The grammar mask: a logits processor that allows only the tokens a request's grammar accepts next.

Each constrained request has an xgrammar matcher, synced before every step with the request's accepted
output tokens: new ones are accepted, and a matcher that has seen more tokens than the request holds is
rebuilt from the request's tokens. After a preemption by recompute the outputs are kept, so the matcher
stays valid; anything that shortens them (none today, speculative rejection later) rebuilds it.

The mask runs after the other processors, so a row can be left with no token at all: allowed_token_ids
that share none with what the constraint accepts next, stop_token_ids that min_tokens holds back where the
constraint needs one, or a grammar that compiles but matches no string (`root ::= root`). Such a row
raises `NoTokenLeftError` (an InvalidRequestError naming the field) rather than drawing a token from
nothing, which would break the constraint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluice.engine.errors import InvalidRequestError

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
        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
        for i in picked:
            self._sync(rows[i]).matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=picked)
        # Reading the flags waits for the device, as the blocking copy of the bitmask above already did.
        index = torch.tensor(picked, device=logits.device)
        empty = torch.isneginf(logits.index_select(0, index)).all(dim=1).tolist()
        for i, is_empty in zip(picked, empty, strict=True):
            if is_empty:
                raise NoTokenLeftError(rows[i])

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
