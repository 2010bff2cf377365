"""The grammar mask: a logits processor that allows only the tokens a request's grammar accepts next.

Each constrained request has an xgrammar matcher, synced before every row with the row's output tokens
(under async scheduling with the token in flight too, which its row carries on the host:
`sluice.engine.core.launched_step.with_tokens_in_flight`; in a speculative verify step with the drafts the
row follows, `SamplingRow.num_drafts`): new ones are accepted, and tokens the matcher took that the row does
not hold (drafts rejected since) are rolled back. The drafts a request verifies were cut before the first
one its grammar refuses (`constrained_drafts`, which the speculator calls as they are proposed, and which
adds the tokens the grammar forces after them); were a refused one verified, it would not be an error:
the rows after it go unmasked, and the row before it masks it out, so the verification stops there.
After a preemption by recompute the outputs are kept, so the matcher stays valid; anything that shortens
them (none today) rebuilds it.

A constraint with `after_token_id` (a thinking chat's `</think>`) applies to the outputs after the first such
token: until one is among the row's outputs the row goes unmasked (its drafts are kept through that token),
and the matcher takes the outputs after it. Where that token was a draft rejected since, the matcher
starts again from where the row's outputs have it.

The mask runs after the other processors, so a row can be left with no token at all: allowed_token_ids
that share none with what the constraint accepts next, stop_token_ids that min_tokens holds back where the
constraint needs one, or a grammar that compiles but matches no string (`root ::= root`). Such a row
raises `NoTokenLeftError` (an InvalidRequestError naming the field) rather than drawing a token from
nothing, which would break the constraint. Whether one is left is read from the bitmask on the host, not
from the masked logits, so that nothing waits for the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    """The request's matcher over its output tokens from index `start` (after its constraint's
    `after_token_id`; 0 without one): it accepted the first `settled` of them and then `tail` (drafts of
    a verify step, not known to be accepted)."""

    matcher: xgr.GrammarMatcher
    start: int = 0
    settled: int = 0
    tail: list[int] = field(default_factory=list)


class GrammarMask:
    """Rows whose `grammar` is set (an xgrammar CompiledGrammar) get -inf on every disallowed token."""

    def __init__(self) -> None:
        self._states: dict[str, _MatcherState] = {}
        # Requests whose constraint waits for its `after_token_id`: how many of their accepted outputs are
        # known not to hold it; once one of those does, the index after it.
        self._scanned: dict[str, int] = {}
        self._starts: dict[str, int] = {}

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
            state = self._sync_row(rows[i])
            # None: the row follows a draft the grammar refuses. Complete (it accepted eos): the request
            # ends with the token it has, so this row is one that async scheduling launched before it knew,
            # or one past an eos draft. Neither row's token is ever used.
            if state is None or state.matcher.is_terminated():
                continue
            matcher = state.matcher
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
            self._scanned.pop(request_id, None)
            self._starts.pop(request_id, None)

    def constrained_drafts(
        self,
        request_id: str,
        grammar: object,
        output_token_ids: Sequence[int],
        drafts: Sequence[int],
        max_drafts: int,
        after_token_id: int | None = None,
    ) -> tuple[int, tuple[int, ...]]:
        """The drafts a constrained request verifies, as (how many of the proposed `drafts` it keeps, the
        tokens its grammar forces after those): the proposed ones up to the first its grammar refuses
        (vLLM's `validate_tokens`: verify rows are not spent on drafts the verification would reject),
        then, up to `max_drafts` in all, the continuation the grammar forces there (xgrammar's jump-forward
        tokens: a JSON key and its quotes, the rest of a `choice`), drafted rather than decoded one step a
        token (SGLang's jump-forward decoding, verified like any draft, so another tokenization of the
        same text is only a rejected draft). The matcher is left as the outputs leave it. Outputs the
        grammar refuses get no drafts: the next step's mask ends the request with that error alone.
        `after_token_id`: the constraint's; before one is among the outputs, the drafts are kept up to and
        including the first one (the grammar's part starts after it, checked from the next step)."""
        if self._start(request_id, output_token_ids, 0, after_token_id) is None:
            kept = list(drafts[:max_drafts])
            return (kept.index(after_token_id) + 1 if after_token_id in kept else len(kept)), ()
        try:
            state = self._sync(request_id, grammar, output_token_ids, 0, after_token_id)
        except GrammarViolationError:
            return 0, ()
        assert state is not None  # no drafts given: nothing refused
        matcher = state.matcher
        num_kept = 0
        for token_id in drafts[:max_drafts]:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_kept += 1
        forced: list[int] = []
        # Jump-forward leaves out stop tokens; drafting the one a complete text must end with would save
        # no step (the verify step's bonus token samples it; measured: the same steps, only more drafts).
        if num_kept < max_drafts and not matcher.is_terminated():
            for token_id in matcher.find_jump_forward_tokens()[: max_drafts - num_kept]:
                if not matcher.accept_token(token_id):
                    break
                forced.append(token_id)
        if num_kept + len(forced):
            matcher.rollback(num_kept + len(forced))
        return num_kept, tuple(forced)

    def _sync_row(self, row: SamplingRow) -> _MatcherState | None:
        constraint = row.params.constraint
        after_token_id = None if constraint is None else constraint.after_token_id
        return self._sync(row.request_id, row.grammar, row.output_token_ids, row.num_drafts, after_token_id)

    def _sync(
        self,
        request_id: str,
        grammar: object,
        outputs: Sequence[int],
        num_drafts: int,
        after_token_id: int | None = None,
    ) -> _MatcherState | None:
        """The request's matcher after its output tokens, the last `num_drafts` of them a verify row's
        drafts; None where one of those drafts is a token the grammar refuses (then the matcher stops
        before it), or where the outputs do not hold the constraint's `after_token_id` yet."""
        start = self._start(request_id, outputs, num_drafts, after_token_id)
        if start is None:
            return None
        num_outputs = len(outputs) - start  # the grammar's part of the outputs
        state = self._states.get(request_id)
        if state is None or state.start != start or state.settled > num_outputs:
            import xgrammar as xgr  # imported by now: the grammar's compiler imported it

            state = _MatcherState(xgr.GrammarMatcher(grammar), start)
            self._states[request_id] = state
        # Keep the part of the tail the row holds; roll back the drafts it does not (rejected since).
        first = state.settled
        kept = 0
        for taken, held in zip(state.tail, outputs[start + first :], strict=False):
            if taken != held:
                break
            kept += 1
        if kept < len(state.tail):
            state.matcher.rollback(len(state.tail) - kept)
            del state.tail[kept:]
        num_accepted = num_outputs - min(num_drafts, num_outputs)
        refused = False
        for position in range(first + kept, num_outputs):
            token_id = outputs[start + position]
            # A complete matcher takes no token (xgrammar would log a warning for each: drafts past eos).
            if state.matcher.is_terminated() or not state.matcher.accept_token(token_id):
                if position < num_accepted:
                    raise GrammarViolationError(f"token {token_id} does not match the request's constraint")
                refused = True
                break
            state.tail.append(token_id)
        # The row's accepted outputs are the request's own: they never roll back.
        settle = num_accepted - state.settled
        if settle > 0:
            del state.tail[:settle]
            state.settled = num_accepted
        return None if refused else state

    def _start(
        self, request_id: str, outputs: Sequence[int], num_drafts: int, after_token_id: int | None
    ) -> int | None:
        """Where the constraint's part of `outputs` starts: 0 without an `after_token_id`, else the index
        after the first one; None while the outputs hold none. Each accepted output is searched once."""
        if after_token_id is None:
            return 0
        start = self._starts.get(request_id)
        if start is not None and start <= len(outputs):
            return start
        scanned = self._scanned.get(request_id, 0)
        num_accepted = len(outputs) - num_drafts
        try:
            index = outputs.index(after_token_id, min(scanned, num_accepted))
        except ValueError:
            self._scanned[request_id] = num_accepted
            return None
        if index < num_accepted:  # accepted: it stays the first
            self._starts[request_id] = index + 1
            self._scanned.pop(request_id, None)
        else:
            self._scanned[request_id] = num_accepted
        return index + 1


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
        held_back = params.held_back_by_min_tokens(row.eos_token_ids, under_constraint=True)  # masked here
        allowed[[t for t in held_back if t < vocab]] = False
    return not bool(allowed.any())
