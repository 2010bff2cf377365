"""Turns requests that advanced this step into `RequestOutput` deltas: text, stop strings, usage."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus
from engine.outputs import Logprobs, RequestOutput, Timings, Usage
from engine.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

FinishRequest = Callable[[str, RequestStatus], object]


class OutputProcessor:
    """Owns one incremental detokenizer per live request.

    Token-level stops (eos, stop token ids, max_tokens) are decided by the scheduler; stop strings are
    found here, and such a request is finished through `finish_request` before its output is built.
    """

    def __init__(self, tokenizer: Tokenizer | None, finish_request: FinishRequest) -> None:
        self._tokenizer = tokenizer
        self._finish_request = finish_request
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, request: Request) -> None:
        if self._tokenizer is not None:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self._tokenizer, request.sampling_params
            )

    def process(
        self, requests: Iterable[Request], logprobs: Mapping[str, Logprobs | None]
    ) -> list[RequestOutput]:
        """One output per request that received a token this step (its last output token)."""
        outputs = []
        for request in requests:
            token_id = request.output_token_ids[-1]
            text = self._detokenize(request, token_id)
            lp = logprobs.get(request.request_id)
            outputs.append(self._build(request, (token_id,), text, () if lp is None else (lp,)))
        return outputs

    def finish_aborted(self, request: Request, error: str | None = None) -> RequestOutput:
        """The last output of a request that was aborted or failed (no new tokens)."""
        return self._build(request, (), "", (), error=error)

    def _detokenize(self, request: Request, token_id: int) -> str:
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return ""
        text = detokenizer.add_tokens([token_id])
        if detokenizer.stop_string is not None:
            request.stop_reason = detokenizer.stop_string
            if request.is_finished:
                # Finished by length in the same step: the stop string still decides the reason.
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self._finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.is_finished:
            text += detokenizer.flush()
        return text

    def _build(
        self,
        request: Request,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[Logprobs, ...],
        error: str | None = None,
    ) -> RequestOutput:
        finished = request.is_finished
        if finished:
            self._detokenizers.pop(request.request_id, None)
        times = request.times
        return RequestOutput(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason if finished else None,
            error=error,
            usage=Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens),
            timings=Timings(times.arrival, times.first_scheduled, times.first_token, times.finished),
            num_preemptions=request.num_preemptions,
        )
