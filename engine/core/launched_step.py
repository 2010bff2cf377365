"""Async scheduling's step in flight: launched on the device (model run, sampling queued), its sampled
tokens on their way to the host while the core schedules and launches the next step.

    EngineCore.step() with async scheduling (N in flight on entry):
        admit ready grammars; if N holds a request that needs N's tokens first: finish N now (below)
        schedule N+1 (placeholders for the tokens N samples: AsyncScheduler)
        launch N+1: inputs (placeholders <- N's token ids, on the device), forward, sample_no_sync,
                    token ids (+ logprobs) copied to pinned host memory, an event recorded
        finish N: wait for N's event (not for N+1), append tokens, check stops, free what finished
        -> N's outputs (a step later than a synchronous engine returns them)

A request "needs its step's tokens first" (`needs_step_tokens`) when scheduling its next step reads them
on the host: speculation (drafts are proposed from the tokens). With such a request in the step in flight
the core finishes that step before scheduling: that step runs synchronously. A step that verifies drafts
is sampled on the host (`LaunchedStep.verifying`), not at its launch but when the next `step()` finishes
it: meanwhile the core returns the outputs of the step before (its process sends them and takes new
requests) while the verify step's forward runs. The processors that read a request's outputs when
sampling see the one in flight too (`with_tokens_in_flight`): a grammar on the host, once the step in
flight's tokens arrived (after the next step's forward is queued); penalties and min_tokens on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, replace

import torch

from sluice.engine.errors import InvalidRequestError
from sluice.engine.request import Request
from sluice.engine.sample.sampler import (
    DeviceLogprobs,
    SampledToken,
    Sampler,
    SamplingRow,
    logprobs_no_sync,
)
from sluice.engine.scheduler.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from sluice.engine.spec_decode.proposer import speculation_allowed
from sluice.engine.worker.input_batch import SampledTokenIds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingFailure:
    """Why a request's sampling failed. `invalid_field` names the request field to blame when its own
    parameters leave nothing to sample (INVALID_ARGUMENT at the edge); None for any other failure."""

    message: str
    invalid_field: str | None = None

    @classmethod
    def of(cls, exc: Exception) -> SamplingFailure:
        if isinstance(exc, InvalidRequestError):
            return cls(str(exc), exc.field)
        return cls(f"sampling failed: {exc}")


# results: request id -> its sampled tokens; request id -> why its sampling failed
StepResults = tuple[dict[str, list[SampledToken]], dict[str, SamplingFailure]]


def needs_step_tokens(request: Request, speculating: bool) -> bool:
    """Whether the request's next step can only be scheduled once the tokens of its step in flight are on
    the host (`speculating`: the engine has a proposer, which proposes drafts from them)."""
    return speculating and speculation_allowed(request)


class HostCopy:
    """Device tensors on their way to the host. On CUDA: non-blocking copies into pinned memory on the
    current stream and an event recorded after them, so `wait()` waits for those copies only, not for
    work queued later (the next step's forward). Elsewhere the tensors themselves: their work is done."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = list(tensors)
            return
        self._host = []
        for tensor in tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.append(host.copy_(tensor, non_blocking=True))
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


@dataclass
class LaunchedStep:
    """A step whose model run and sampling are queued. `requests[i]` is the request sampled in row i
    (`rows[i]`), kept to recognise it when the results arrive (it may have finished, or its id been
    reused, since)."""

    scheduler_output: SchedulerOutput
    requests: list[Request]
    rows: list[SamplingRow]
    errors: dict[str, SamplingFailure]  # request id -> why its sampling failed (verifying: once sampled)
    num_finished: int = 0  # the scheduler's count of finished requests at launch
    token_ids: torch.Tensor | None = None  # [len(rows)] int64 on the device; None: sampled on the host
    copy: HostCopy | None = None  # token_ids, then the logprobs' tensors
    logprobs: DeviceLogprobs | None = None
    sampled: dict[str, list[SampledToken]] | None = None  # results on the host, once taken
    sample_on_host: Callable[[], StepResults] | None = None  # a verify step's sampling, until it runs

    @classmethod
    def verifying(
        cls, scheduler_output: SchedulerOutput, requests: list[Request], sample: Callable[[], StepResults]
    ) -> LaunchedStep:
        """A step that verifies drafts, sampled on the host by `sample` (its rows and drafts taken at the
        launch) when its results are first asked for: its forward runs in the meantime."""
        return cls(scheduler_output, requests, [], {}, sample_on_host=sample)

    def sampled_token_ids(self) -> SampledTokenIds | None:
        """The token ids the next step's placeholders read (None when sampled on the host: no request
        of such a step is scheduled before it finishes)."""
        if self.token_ids is None:
            return None
        return SampledTokenIds(self.token_ids, {row.request_id: i for i, row in enumerate(self.rows)})

    def results(self, is_live: Callable[[Request], bool] | None) -> StepResults:
        """Waits for the tokens; the results of the requests `is_live` still accepts (None: all of them)."""
        if self.sampled is None and self.sample_on_host is not None:
            sample, self.sample_on_host = self.sample_on_host, None
            self.sampled, self.errors = sample()
        elif self.sampled is None:
            host = self.copy.wait()
            token_ids = host[0].tolist()
            if self.logprobs is None:
                tokens = [SampledToken(token_id, None) for token_id in token_ids]
            else:
                tokens = self.logprobs.sampled_tokens(token_ids, host[1:])
            self.sampled = {row.request_id: [token] for row, token in zip(self.rows, tokens, strict=True)}
        if is_live is None and not self.errors:
            return self.sampled, {}
        live = [r.request_id for r in self.requests if is_live is None or is_live(r)]
        errors = {r: self.errors[r] for r in live if r in self.errors}
        return {r: self.sampled[r] for r in live if r not in errors}, errors


def with_tokens_in_flight(
    rows: list[SamplingRow],
    scheduler_output: SchedulerOutput,
    in_flight: LaunchedStep,
    counting: Set[str],
    constrained: Set[str],
) -> list[SamplingRow]:
    """`rows` (one per sampled slice of `scheduler_output`, in its order) with the token that `in_flight`,
    the step before, samples for each request whose slice ends in its placeholder, where this step's
    sampling reads it:
    - a constrained request's grammar must accept it before its next mask: its row gets it on the host
      (the wait is for the step in flight's tokens, not for this step's forward, queued after them). Where
      that step's sampling failed for the request (it ends with that step), its row goes unmasked: the
      token it draws is never used;
    - the processors of a request in `counting` (penalties, min_tokens: `counts_outputs`) count it on the
      device (`SamplingRow.token_in_flight`)."""
    sampled_slices = (s for s in scheduler_output.scheduled if s.sample)
    on_host: StepResults | None = None
    out = []
    for row, scheduled in zip(rows, sampled_slices, strict=True):
        request_id = scheduled.request_id
        has_token_in_flight = scheduled.token_ids[-1] == PLACEHOLDER_TOKEN_ID
        if has_token_in_flight and request_id in constrained:
            on_host = on_host or in_flight.results(None)
            sampled, errors = on_host
            if request_id in errors:
                row = replace(row, grammar=None)
            else:
                row = replace(row, output_token_ids=[*row.output_token_ids, sampled[request_id][0].token_id])
        elif has_token_in_flight and request_id in counting:
            device = in_flight.sampled_token_ids()  # there: the placeholder was filled from it
            i = device.rows[request_id]
            row = replace(row, token_in_flight=device.token_ids[i : i + 1])
        out.append(row)
    return out


def launch_sampling(
    sampler: Sampler,
    logits: torch.Tensor,
    scheduler_output: SchedulerOutput,
    requests: list[Request],
    rows: list[SamplingRow],
    inject_faults: Callable[[str, Iterable[str]], None],
) -> LaunchedStep:
    """Queues the sampling of `rows` (logits row i for rows[i]) and the copy of its tokens to the host.

    A batch that fails is sampled again row by row, as the synchronous path does: a row that fails gets
    token 0 (never used: its request ends with the error when the step finishes).
    """
    try:
        inject_faults("sample", (row.request_id for row in rows))
        token_ids, errors = sampler.sample_no_sync(logits, rows), {}
    except Exception as exc:
        if not isinstance(exc, InvalidRequestError):  # not a request's own parameters (NoTokenLeftError)
            logger.exception("batched sampling failed; sampling each request alone")
        token_ids, errors = _sample_rows_alone(sampler, logits, rows, inject_faults)
    logprobs = logprobs_no_sync(logits, rows, token_ids)
    tensors = [token_ids] if logprobs is None else [token_ids, *logprobs.tensors]
    return LaunchedStep(
        scheduler_output,
        requests,
        rows,
        errors,
        token_ids=token_ids,
        copy=HostCopy(tensors),
        logprobs=logprobs,
    )


def _sample_rows_alone(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    inject_faults: Callable[[str, Iterable[str]], None],
) -> tuple[torch.Tensor, dict[str, SamplingFailure]]:
    token_ids, errors = [], {}
    for i, row in enumerate(rows):
        try:
            inject_faults("sample", [row.request_id])
            token_ids.append(sampler.sample_no_sync(logits[i : i + 1], [row]))
        except Exception as exc:
            errors[row.request_id] = SamplingFailure.of(exc)
            token_ids.append(torch.zeros(1, dtype=torch.long, device=logits.device))
    return torch.cat(token_ids), errors
