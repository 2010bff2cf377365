"""Draft-model proposer: a smaller model with the target's tokenizer runs k steps per verify, each a
batched forward over the requests it drafts for, on its own paged KV cache (`DraftBlockTables`).

For a request of T tokens (the last one sampled, not yet in the target's KV) with draft KV for its
first c tokens, one proposal runs:

    step 0:      feed tokens[c:T] at positions c .. T-1   -> logits at T-1 -> d_0
    step j > 0:  feed d_{j-1} at position T + j - 1      -> logits       -> d_j      (j < k)

after which the draft KV counts as covering tokens[:T] only: the drafts' positions are recomputed by the
next proposal from the tokens the target accepted. Greedy requests take the draft's argmax (q is then
irrelevant to the verification); others draw d_j from q_j = the draft's distribution under the request's
temperature / top-k / top-p / min-p, returned with the proposal for the rejection rule. Both come after
the request's min_tokens, logit_bias and allowed_token_ids (`draft_processors`), with d_0 .. d_{j-1}
counted as outputs, as the target's verify rows are: without them a draft the target can never pick (a
token outside allowed_token_ids) is rejected at once. The penalties and a grammar apply to the target's
verify rows only: a draft the grammar refuses is rejected there.

d_{j-1} reaches step j on the device, as a placeholder that its forward fills from step j - 1's chosen ids
(as async scheduling fills the target's: `fill_placeholders`), so the k forwards queue one after another
and a proposal waits for the device once, for all its drafts: on a GPU the host builds step j's inputs
while step j - 1 runs, where a wait for each draft left the GPU idle meanwhile. The processors above read
how many outputs a row has, so the drafts still on the device count by placeholders; which ones, only
min_tokens over a constrained request (whether a thinking chat's `</think>` came), and such a request does
not speculate (`speculation_allowed`).

Step 0 never feeds more than the step budget (max_num_batched_tokens) in one forward: where the requests'
tokens from c on add up to more (a request's first proposal, after its prompt or a prefix-cache hit, finds
no draft KV), a catch-up first feeds their tokens before the last, without logits, in forwards of at most
the budget, as the target's chunked prefill does, until the rest fits one. In steady decode (c = the
previous proposal's T, a few accepted tokens behind) step 0 alone runs, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from sluice.engine.config import EngineConfig
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sample.logits_processors import any_applies, draft_processors
from sluice.engine.sample.sampler import (
    SamplingRow,
    apply_filters,
    apply_processors,
    argmax_rows,
    device_tensor,
    draw_at,
    uniform_fractions,
)
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from sluice.engine.spec_decode.draft_block_tables import DraftBlockTables
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.worker.input_batch import SampledTokenIds
from sluice.engine.worker.model_runner import ModelRunner

# One draft step's requests and the drafts chosen for them, still on the device.
_DraftStep = tuple[list["_Drafting"], torch.Tensor]


@dataclass
class _Drafting:
    """One request's proposal in progress."""

    request: Request
    block_ids: tuple[int, ...]
    start: int  # tokens with draft KV before step 0 (the catch-up advances it)
    k: int  # drafts to propose
    row: SamplingRow  # the request's row before its first draft (the processors read it)
    masked: bool  # whether any of the proposer's processors concerns the request
    token_ids: list[int] = dataclasses.field(default_factory=list)  # on the host once all are chosen
    probs: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def sampling_row(self, j: int) -> SamplingRow:
        """The row of draft j: the j drafts before it count as outputs (min_tokens counts them), by
        placeholders, since they are still on the device (the draft processors never read the ids)."""
        if not self.masked or j == 0:
            return self.row
        outputs = [*self.row.output_token_ids, *(PLACEHOLDER_TOKEN_ID,) * j]
        return dataclasses.replace(self.row, output_token_ids=outputs)


class DraftProposer:
    """`runner`: the draft model's, which the target's runner loaded and gave as many KV blocks as its own
    (`sluice.engine.worker.draft_model`)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        self.k = config.speculative.num_speculative_tokens
        self.runner = runner
        self.max_model_len = runner.max_model_len  # the target's, or less where the draft's limit is lower
        # The runner's (and the target's) step budget: the most tokens one draft forward computes.
        self.max_num_batched_tokens = runner.config.scheduler.max_num_batched_tokens
        self.tables = DraftBlockTables(config.cache.block_size, runner.num_blocks)
        self._shared_generator = torch.Generator(device=self.runner.device).manual_seed(config.model.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._holders: dict[str, Request] = {}  # request id -> the request, while it has draft blocks
        self.processors = draft_processors()

    def propose(self, requests: Sequence[Request]) -> dict[str, Proposal]:
        drafting = [d for d in (self._start(r) for r in requests) if d is not None]
        self._catch_up(drafting)
        self._take_drafts(self._launch_drafts(drafting))
        proposals = {}
        for d in drafting:
            self.tables.num_computed[d.request.request_id] = d.request.num_tokens
            probs = None if d.request.sampling_params.greedy else torch.stack(d.probs)
            proposals[d.request.request_id] = Proposal(tuple(d.token_ids), probs)
        return proposals

    def free(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.tables.free(request_ids)
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._holders.pop(request_id, None)
        for processor in self.processors:
            processor.free(request_ids)

    def _start(self, request: Request) -> _Drafting | None:
        """Blocks for the tokens this proposal feeds; None when none can be drafted (too long, at its
        last output token, or the draft cache is full even without the blocks of preempted requests: the
        request then decodes without drafts). At most as many drafts as the scheduler can verify: k
        drafts give up to k + 1 tokens, within max_tokens and max_model_len."""
        num_tokens = request.num_tokens
        outputs_left = request.sampling_params.max_tokens - request.num_output_tokens
        k = min(self.k, self.max_model_len - num_tokens, outputs_left - 1)
        if k <= 0:
            return None
        self._holders[request.request_id] = request
        block_ids = self.tables.grow(request.request_id, num_tokens + k - 1)
        while block_ids is None and self._evict_preempted():
            block_ids = self.tables.grow(request.request_id, num_tokens + k - 1)
        if block_ids is None:
            return None
        start = min(self.tables.num_computed.get(request.request_id, 0), num_tokens - 1)
        row = SamplingRow(
            request.request_id,
            request.sampling_params,
            request.prompt_token_ids,
            request.output_token_ids,
            request.eos_token_ids,
        )
        return _Drafting(request, block_ids, start, k, row, any_applies(self.processors, row))

    def _evict_preempted(self) -> bool:
        """Frees the draft blocks of one request the target preempted (it waits to recompute, and its
        draft KV is recomputed with it: `start` falls back to 0); False when none holds any. A preempted
        request's draft KV stays valid, so it is kept until a running request needs the room."""
        for request_id, holder in self._holders.items():
            if holder.status is RequestStatus.PREEMPTED:
                self.tables.free([request_id])
                del self._holders[request_id]
                return True
        return False

    def _catch_up(self, drafting: list[_Drafting]) -> None:
        """While step 0 would feed more than `max_num_batched_tokens` tokens: draft KV, without logits, for
        the requests' tokens before their last ([start, T - 1)), in forwards of at most that many tokens
        (a request's run may span several)."""
        while sum(d.request.num_tokens - d.start for d in drafting) > self.max_num_batched_tokens:
            budget, scheduled = self.max_num_batched_tokens, []
            for d in drafting:
                request = d.request
                end = min(d.start + budget, request.num_tokens - 1)
                if end > d.start:
                    token_ids = request.token_slice(d.start, end)
                    scheduled.append(
                        ScheduledRequest(request.request_id, token_ids, d.start, d.block_ids, False)
                    )
                    budget -= end - d.start
                    d.start = end
            if not scheduled:  # only last tokens left: more requests than the budget (never configured)
                return
            self.runner.execute_model(SchedulerOutput(tuple(scheduled), self.max_num_batched_tokens - budget))

    def _launch_drafts(self, drafting: list[_Drafting]) -> list[_DraftStep]:
        """Queues the draft steps, each fed the drafts of the one before on the device: nothing here waits
        for the device (on a CPU each step has run when it returns)."""
        steps: list[_DraftStep] = []
        chosen = None  # the step before's drafts, by request
        for j in range(max((d.k for d in drafting), default=0)):
            active = [d for d in drafting if d.k > j]
            logits = self.runner.execute_model(self._step(active, j), chosen)
            logits = apply_processors(self.processors, logits, [d.sampling_row(j) for d in active])
            token_ids = self._choose(active, logits)
            steps.append((active, token_ids))
            chosen = SampledTokenIds(token_ids, {d.request.request_id: i for i, d in enumerate(active)})
        return steps

    @staticmethod
    def _take_drafts(steps: list[_DraftStep]) -> None:
        """Each request's drafts, on the host: the proposal's one wait for the device."""
        if not steps:
            return
        token_ids = iter(torch.cat([chosen for _, chosen in steps]).tolist())
        for active, _ in steps:
            for d in active:
                d.token_ids.append(next(token_ids))

    def _step(self, active: list[_Drafting], j: int) -> SchedulerOutput:
        """Step 0: each request's tokens from `start` on (its last one among them); step j > 0: its latest
        draft, at position T - 1 + j, as a placeholder (still on the device)."""
        scheduled = []
        for d in active:
            request = d.request
            if j == 0:
                token_ids = request.token_slice(d.start, request.num_tokens)
                start = d.start
            else:
                token_ids = (PLACEHOLDER_TOKEN_ID,)
                start = request.num_tokens + j - 1
            scheduled.append(ScheduledRequest(request.request_id, token_ids, start, d.block_ids, True))
        return SchedulerOutput(tuple(scheduled), sum(s.num_tokens for s in scheduled))

    def _choose(self, active: list[_Drafting], logits: torch.Tensor) -> torch.Tensor:
        """Each request's next draft from its row of `logits`, on the device: the argmax for greedy
        requests, else a draw from q (kept for the rejection rule), all rows at once. All greedy (the
        common case): the argmax of `logits` as they are, no rows picked out (docs/BENCHMARKS.md, "Figures
        behind the code")."""
        greedy = [i for i, d in enumerate(active) if d.request.sampling_params.greedy]
        random = [i for i, d in enumerate(active) if not d.request.sampling_params.greedy]
        if not random:  # no rows picked out: no copy, and no index copy, gather or scatter launched
            return argmax_rows(logits)
        token_ids = torch.empty(len(active), dtype=torch.long, device=logits.device)
        if greedy:
            index = device_tensor(greedy, torch.long, logits.device)
            token_ids[index] = argmax_rows(logits[index])
        if random:
            index = device_tensor(random, torch.long, logits.device)
            q = torch.softmax(apply_filters(logits[index].float(), [active[i].row for i in random]), dim=-1)
            generators = [self._generator(active[i].request) for i in random]
            token_ids[index] = draw_at(q, uniform_fractions(generators, logits.device))
            for row, i in enumerate(random):
                active[i].probs.append(q[row])
        return token_ids

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared_generator
        generator = self._generators.get(request.request_id)
        if generator is None:
            # Seeded requests draft reproducibly, from a stream apart from the sampler's (modulo 2**64:
            # a seed near the top of the accepted range overflowed manual_seed and failed the step).
            generator = torch.Generator(device=self.runner.device).manual_seed((seed + 0x5EED) % 2**64)
            self._generators[request.request_id] = generator
        return generator
