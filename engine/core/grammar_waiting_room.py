"""Requests whose grammar is still compiling. They are not in the scheduler yet, so the requests that
are keep running; each joins the scheduler at the first step after its grammar is ready, or ends with an
error naming its constraint's field if it does not compile."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from sluice.engine.errors import InvalidRequestError
from sluice.engine.messages import CoreOutput
from sluice.engine.request import Request, RequestStatus
from sluice.engine.structured.grammar_compiler import GrammarCompileError, GrammarCompiler

logger = logging.getLogger(__name__)


class GrammarWaitingRoom:
    """Not thread-safe: the engine thread owns it (the futures complete in the compile thread).
    `compiler` is None for a model without a tokenizer, which takes no constrained request."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self._compiler = compiler
        self._waiting: dict[str, tuple[Request, Future]] = {}  # arrival order

    def add(self, request: Request) -> None:
        """Starts compiling the request's constraint (in the compile thread); the request waits here."""
        constraint = request.sampling_params.constraint
        if self._compiler is None:
            raise InvalidRequestError(
                constraint.field, "constrained output needs a tokenizer; this model has none"
            )
        self._waiting[request.request_id] = (request, self._compiler.submit(constraint))

    def admit_ready(self, admit: Callable[[Request], None]) -> list[CoreOutput]:
        """Hands every request whose grammar is ready to `admit` (the scheduler's `add_request`), in
        arrival order. Returns the last outputs of those that cannot run: the grammar did not compile
        (an error naming the constraint's field), or `admit` refused them."""
        failed = []
        for request_id in [rid for rid, (_, future) in self._waiting.items() if future.done()]:
            request, grammar = self._waiting.pop(request_id)
            # Never grammar.result() on a failed compile: the compiler's cache hands one future to every
            # request of the same source, and each raise of its one exception would chain this frame (and
            # the request it holds) onto that exception's traceback for as long as the cache keeps it.
            try:
                error = grammar.exception()
                if error is None:
                    request.grammar = grammar.result()
                    admit(request)
            except Exception as exc:  # the scheduler's InvalidRequestError, e.g. more KV blocks than it has
                error = exc
            if error is not None:
                failed.append(_refusal(request, error))
        return failed

    def abort(self, request_id: str, status: RequestStatus) -> Request | None:
        """Takes a waiting request out, finished with `status`; None if it is not here. Its grammar's
        compile is cancelled if it has not started and no other request waits for it (as SGLang's abort
        cancels its grammar future): requests that left must not hold up the compiles of those that stay."""
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            return None
        request, grammar = entry
        if all(future is not grammar for _, future in self._waiting.values()):
            self._compiler.cancel(request.sampling_params.constraint, grammar)
        request.status = status
        request.times.finished = time.time()
        return request

    def wait(self, timeout: float) -> None:
        """Block until some grammar is ready or `timeout` seconds pass (returns at once when empty)."""
        if self._waiting:
            wait([future for _, future in self._waiting.values()], timeout, return_when=FIRST_COMPLETED)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def num_tokens(self) -> int:
        """The prompt tokens of the requests waiting here (none computed yet)."""
        return sum(request.num_tokens for request, _ in self._waiting.values())


def _refusal(request: Request, error: Exception) -> CoreOutput:
    """The last output of a request that could not join the scheduler because of `error`."""
    if isinstance(error, GrammarCompileError):
        field = request.sampling_params.constraint.field
        error = InvalidRequestError(field, f"does not compile: {error}")
        return CoreOutput.refused(request.request_id, error)
    if isinstance(error, InvalidRequestError):
        return CoreOutput.refused(request.request_id, error)
    logger.error("compiling the grammar of request %s failed", request.request_id, exc_info=error)
    return CoreOutput.failed(request.request_id, f"grammar compilation failed: {error}")
