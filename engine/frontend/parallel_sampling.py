"""`n` samples of one prompt (`SamplingParams.n` > 1), fanned out by the frontend (vLLM's `ParentRequest`).

The engine core runs one request per `AddRequest` and knows nothing of `n`. A request with n > 1 becomes
n core requests `{id}#0 .. {id}#{n-1}`, sample i with `params.for_sample(i)` (n = 1, seed + i when seeded,
prompt logprobs on sample 0 only). Sample 0 is sent first; the others wait here until sample 0's first
output arrives. By then sample 0 has computed the prompt and the prompt's full blocks are in the prefix
cache (held by sample 0, or free but still cached), so each later sample finds them there and computes
only the prompt's last block: ((P - 1) mod block_size) + 1 of its P prompt tokens (a prefix hit never
covers the last token, which must be computed for its logits):

    add_request(a, n=4)   -> core: a#0                here: a#1 a#2 a#3
    a#0's first output    -> core: a#1 a#2 a#3        each a prefix hit on a#0's full prompt blocks

    prompt tokens computed, P = 37, block_size = 16:  a#0: 37   a#1, a#2, a#3: 5 each   (P = 32: 32, 16)

With prefix caching disabled the later samples compute the whole prompt again (as they do the part of it
evicted from the cache before they were admitted, under memory pressure). If sample 0 ends without a
token, the others end the same way when it never ran or was aborted (its grammar did not compile, the
core refused it, the request was aborted); when it ran and failed (its sampling raised) it ends alone
and the others are sent. Aborting the request drops the samples not sent yet. No torch here.
"""

from __future__ import annotations

import msgspec

from sluice.engine.messages import AddRequest, CoreOutput

SAMPLE_ID_SEPARATOR = "#"


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """Engine ids of the n samples of `request_id`: the id itself when n == 1."""
    if n == 1:
        return [request_id]
    return [f"{request_id}{SAMPLE_ID_SEPARATOR}{i}" for i in range(n)]


class ParallelSampling:
    """The later samples of every n > 1 request whose sample 0 has not answered yet, keyed by sample 0's
    engine id. One thread (the frontend's) owns it."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[AddRequest]] = {}  # sample 0's engine id -> samples 1 .. n - 1

    def add(self, add: AddRequest) -> AddRequest:
        """What to send to the core now: `add` itself when n == 1, else its sample 0 (the others wait)."""
        if add.params.n == 1:
            return add
        first, *rest = (
            msgspec.structs.replace(add, request_id=engine_id, params=add.params.for_sample(i))
            for i, engine_id in enumerate(sample_request_ids(add.request_id, add.params.n))
        )
        self._waiting[first.request_id] = rest
        return first

    @property
    def num_waiting(self) -> int:
        """n-sample requests whose sample 0 has not answered yet (`on_output` has nothing to do when 0)."""
        return len(self._waiting)

    @property
    def unsent(self) -> tuple[int, int]:
        """(samples, their prompt tokens) held here, not sent to the core yet. Safe from any thread (the
        metrics endpoint reads it from its own): it copies the dict at once (one C call under the GIL)
        instead of iterating it while the frontend's thread may add or pop a request."""
        held = [add for rest in list(self._waiting.values()) for add in rest]
        return len(held), sum(len(add.prompt_token_ids) for add in held)

    def on_output(self, output: CoreOutput) -> tuple[list[AddRequest], list[CoreOutput]]:
        """On sample 0's first output: the samples to send now, or, when sample 0 ended without a token
        having never run or been aborted, the last outputs of the others (its finish reason, error and
        invalid field, under their ids)."""
        rest = self._waiting.pop(output.request_id, None)
        if rest is None:
            return [], []
        ran_and_failed = output.finish_reason == "error" and output.first_scheduled is not None
        if output.new_token_ids or ran_and_failed:
            return rest, []
        if output.finish_reason == "abort":
            return [], [CoreOutput.aborted(add.request_id) for add in rest]
        return [], [
            CoreOutput.failed(add.request_id, output.error, output.invalid_field, output.too_long)
            for add in rest
        ]

    def drop(self, request_id: str) -> list[str]:
        """Forgets the request's samples not sent yet (it is aborted); returns their engine ids."""
        first_id = f"{request_id}{SAMPLE_ID_SEPARATOR}0"
        return [add.request_id for add in self._waiting.pop(first_id, [])]
