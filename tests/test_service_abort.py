"""Request ids and Abort: NOT_FOUND for an id never seen, an Abort that comes before its Generate still
cancels it, a duplicate live id is ALREADY_EXISTS, Abort is idempotent; and a request's own
timeout_seconds ends it with DEADLINE_EXCEEDED and frees its KV blocks."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import grpc
import pytest
from checkpoints import LONG_CONTEXT
from service_harness import PATIENCE_S, UNENDING, ServerThread

from sluice import generate_request
from sluice.engine.errors import UnknownRequestError
from sluice.engine.frontend.async_engine import TOKENIZE_INLINE_MAX_CHARS
from sluice.service.request_ids import RequestIdInUseError, RequestIds
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)  # a hang's bound: one wait alone may take PATIENCE_S (60 s)


def _error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call() if callable(call) else list(call)
    return info.value.code(), info.value.details()


def test_abort_of_an_unknown_id_is_not_found(stub) -> None:
    assert _error(lambda: stub.Abort(pb.AbortRequest(request_id="never"))) == (
        grpc.StatusCode.NOT_FOUND,
        "request_id: no request with id 'never'",
    )


def test_an_abort_before_its_generate_still_cancels_it(stub, server: ServerThread) -> None:
    code, _ = _error(lambda: stub.Abort(pb.AbortRequest(request_id="early")))
    assert code == grpc.StatusCode.NOT_FOUND  # no such request yet, but the Abort is remembered
    chunks = list(stub.Generate(generate_request("Hello", request_id="early", **UNENDING)))
    assert [(c.request_id, c.finish_reason, c.usage.completion_tokens) for c in chunks] == [
        ("early", pb.FINISH_REASON_ABORT, 0)
    ]
    # It never reached the engine: no usage (the proto's GenerateResponse.usage), the timings.
    assert not chunks[0].HasField("usage") and chunks[0].HasField("timings")
    server.wait_idle()
    # Remembered once: the id may be used again.
    again = list(stub.Generate(generate_request("Hello", request_id="early", temperature=0.0, max_tokens=2)))
    assert again[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_an_abort_before_its_generate_ends_each_of_its_n_samples(stub, server: ServerThread) -> None:
    """Each sample ends with an abort chunk, as when the engine aborts a running n > 1 request (one
    chunk, of sample 0, ended it: a client waiting for n finished samples waited on)."""
    code, _ = _error(lambda: stub.Abort(pb.AbortRequest(request_id="early-n")))
    assert code == grpc.StatusCode.NOT_FOUND
    chunks = list(stub.Generate(generate_request("Hello", request_id="early-n", n=3, **UNENDING)))
    assert [(c.index, c.finish_reason, c.usage.completion_tokens) for c in chunks] == [
        (i, pb.FINISH_REASON_ABORT, 0) for i in range(3)
    ]
    server.wait_idle()


def test_a_duplicate_live_id_is_already_exists_and_abort_is_idempotent(stub, server: ServerThread) -> None:
    running = stub.Generate(generate_request("Hello", request_id="dup", **UNENDING))
    next(running)
    assert _error(stub.Generate(generate_request("Hi", request_id="dup", max_tokens=2))) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "request_id: 'dup' is already in use by a live request",
    )
    assert server.stats().num_running == 1  # the duplicate never reached the engine
    assert stub.Abort(pb.AbortRequest(request_id="dup")) == pb.AbortResponse()
    assert stub.Abort(pb.AbortRequest(request_id="dup")) == pb.AbortResponse()
    assert list(running)[-1].finish_reason == pb.FINISH_REASON_ABORT
    server.wait_idle()
    assert stub.Abort(pb.AbortRequest(request_id="dup")) == pb.AbortResponse()  # ended lately: still OK
    done = list(stub.Generate(generate_request("Hi", request_id="dup", temperature=0.0, max_tokens=2)))
    assert done[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_generate_timeout_is_deadline_exceeded_and_frees_the_blocks(stub, server: ServerThread) -> None:
    start = time.monotonic()
    call = stub.Generate(generate_request("Hello", timeout_seconds=0.1, **UNENDING))
    assert _error(call) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "timeout_seconds: the request's timeout of 0.1 s passed",
    )
    # Not before its timeout; the request itself would run for minutes.
    assert 0.1 <= time.monotonic() - start < PATIENCE_S
    server.wait_idle()


def test_stream_request_timeout_ends_only_that_request(stub, server: ServerThread) -> None:
    requests = [
        pb.StreamGenerateRequest(
            generate=generate_request("a", request_id="slow", timeout_seconds=0.1, **UNENDING)
        ),
        pb.StreamGenerateRequest(
            generate=generate_request("b", request_id="quick", temperature=0.0, max_tokens=3)
        ),
    ]
    responses = list(stub.StreamGenerate(iter(requests)))
    errors = [
        (r.request_id, r.error.code, r.error.message) for r in responses if r.WhichOneof("event") == "error"
    ]
    assert errors == [
        (
            "slow",
            grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
            "timeout_seconds: the request's timeout of 0.1 s passed",
        )
    ]
    quick = [r.chunk for r in responses if r.request_id == "quick"]
    assert quick[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in quick) == 3
    server.wait_idle()


def test_a_stream_cancel_reaches_a_request_whose_long_prompt_is_still_being_tokenized(stub) -> None:
    """A prompt over TOKENIZE_INLINE_MAX_CHARS is tokenized in a thread before the request is in the
    engine: a cancel that came meanwhile was dropped, and the request ran to max_tokens."""
    prompt = "the quick brown fox jumps over the lazy dog " * (TOKENIZE_INLINE_MAX_CHARS // 40)
    num_prompt_tokens = len(stub.Tokenize(pb.TokenizeRequest(text=prompt)).token_ids)
    unending = {**UNENDING, "max_tokens": LONG_CONTEXT - num_prompt_tokens - 8}
    requests = [
        pb.StreamGenerateRequest(generate=generate_request(prompt, request_id="long", **unending)),
        pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id="long")),
    ]
    responses = list(stub.StreamGenerate(iter(requests), timeout=PATIENCE_S))
    assert responses[-1].chunk.finish_reason == pb.FINISH_REASON_ABORT, responses[-1]


@pytest.fixture
def held_tokenization(server: ServerThread):
    """Prompts wait to be tokenized until the test lets them go, as a long one waits for its thread:
    yields (entered: a prompt is being tokenized, release)."""
    entered, release = threading.Event(), threading.Event()
    tokenize = server.engine._tokenize

    async def held(**prompt):
        entered.set()
        await asyncio.to_thread(release.wait, PATIENCE_S)
        return await tokenize(**prompt)

    server.engine._tokenize = held
    yield entered, release
    release.set()
    del server.engine._tokenize


def test_a_timeout_ends_a_request_whose_prompt_is_still_being_tokenized_at_once(
    stub, server: ServerThread, held_tokenization
) -> None:
    """Its call ended only once the tokenizer was done (seconds for a long prompt), and the request went
    to the engine then, to be aborted there; it never reaches it now."""
    entered, release = held_tokenization
    code, message = _error(
        stub.Generate(generate_request("Hello", timeout_seconds=0.1, **UNENDING), timeout=PATIENCE_S)
    )
    assert (code, message) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "timeout_seconds: the request's timeout of 0.1 s passed",
    )
    assert entered.is_set() and not release.is_set()
    release.set()
    server.wait_idle()


def test_an_abort_ends_each_sample_of_a_request_whose_prompt_is_still_being_tokenized_at_once(
    stub, server: ServerThread, held_tokenization
) -> None:
    entered, release = held_tokenization
    call = stub.Generate(
        generate_request("Hello", request_id="tokenizing", n=2, **UNENDING), timeout=PATIENCE_S
    )
    assert entered.wait(PATIENCE_S)
    stub.Abort(pb.AbortRequest(request_id="tokenizing"))
    assert [(c.index, c.finish_reason, c.usage.completion_tokens) for c in call] == [
        (i, pb.FINISH_REASON_ABORT, 0) for i in range(2)
    ]
    assert not release.is_set()
    release.set()
    server.wait_idle()


@pytest.mark.parametrize("seconds", [-1.0, math.inf, math.nan])
def test_bad_timeout_is_invalid_argument(stub, seconds: float) -> None:
    code, message = _error(stub.Generate(generate_request("Hi", timeout_seconds=seconds)))
    assert (code, message) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"timeout_seconds: must be a finite number >= 0, got {seconds}",
    )


def test_request_ids_forget_after_the_window_and_stay_bounded() -> None:
    now = [0.0]
    ids = RequestIds(remember_s=30.0, max_remembered=2, clock=lambda: now[0])
    with pytest.raises(UnknownRequestError):
        ids.abort("t", "x")
    now[0] += 31.0  # the early Abort expired: a Generate now runs
    assert not ids.claim("t", "x").cancelled
    with pytest.raises(RequestIdInUseError):
        ids.claim("t", "x")
    assert not ids.claim("other-tenant", "x").cancelled
    for i in range(5):  # more early Aborts than remembered: the oldest go first
        with pytest.raises(UnknownRequestError):
            ids.abort("t", f"early-{i}")
    assert not ids.claim("t", "early-0").cancelled
    assert ids.claim("t", "early-4").cancelled


def test_one_tenants_flood_of_aborts_drops_only_its_own_remembered_ids() -> None:
    """The remembered early Aborts and ended ids were one set for all tenants: a tenant sending Aborts
    for ids it never used pushed out another tenant's early Abort (whose Generate then ran) and its
    ended ids (whose idempotent Abort then was NOT_FOUND)."""
    ids = RequestIds(remember_s=30.0, max_remembered=2)
    with pytest.raises(UnknownRequestError):
        ids.abort("beta", "job")
    ids.release("beta", "done", ids.claim("beta", "done"))
    for i in range(5):
        with pytest.raises(UnknownRequestError):
            ids.abort("alpha", f"flood-{i}")
    assert ids.claim("beta", "job").cancelled
    assert ids.abort("beta", "done") is None
    assert not ids.claim("alpha", "flood-0").cancelled  # alpha's own oldest were dropped
