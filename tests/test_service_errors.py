"""Status codes and messages for bad requests, and that every way a request can end early (cancel,
deadline, in-band cancel, Abort, dropped stream) frees its KV blocks at once."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import pytest
from checkpoints import LONG_CONTEXT
from service_harness import UNENDING, ServerThread, long_engine_config, tiny_engine_config, wait_for

from sluice import generate_request
from sluice.service.status import DEADLINE_SLACK_S, cancelled_status
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)  # a hang's bound: one wait alone may take PATIENCE_S (60 s)


class Outbox:
    """A request iterator for a bidi call that the test feeds while reading responses."""

    def __init__(self) -> None:
        self._queue: queue.Queue[pb.StreamGenerateRequest | None] = queue.Queue()

    def generate(self, request: pb.GenerateRequest) -> None:
        self._queue.put(pb.StreamGenerateRequest(generate=request))

    def cancel(self, request_id: str) -> None:
        self._queue.put(pb.StreamGenerateRequest(cancel=pb.StreamCancel(request_id=request_id)))

    def half_close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[pb.StreamGenerateRequest]:
        while (message := self._queue.get()) is not None:
            yield message


def _status(call_result: Iterator[object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(call_result)
    return info.value.code(), info.value.details()


def _rpc_count(server: ServerThread, method: str, code: str) -> float:
    labels = {"method": method, "code": code}
    return server.server.metrics.registry.get_sample_value("sluice_rpc_requests_total", labels) or 0.0


INVALID = grpc.StatusCode.INVALID_ARGUMENT
MALFORMED = [
    ("empty text", generate_request(""), INVALID, "prompt: is empty: give text, token_ids or messages"),
    ("no prompt", pb.GenerateRequest(), INVALID, "prompt: is empty: give text, token_ids or messages"),
    ("negative max_tokens", generate_request("hi", max_tokens=-1), INVALID, "max_tokens: must be >= 1"),
    ("top_p 0", generate_request("hi", top_p=0.0), INVALID, "top_p: must be in (0, 1]"),
    ("logprobs 21", generate_request("hi", logprobs=21), INVALID, "logprobs: must be in [0, 20]"),
    ("temperature -1", generate_request("hi", temperature=-1.0), INVALID, "temperature: must be >= 0"),
    (
        "request_id over 512 bytes",
        generate_request("hi", request_id="é" * 257),
        INVALID,
        "request_id: must be at most 512 bytes (UTF-8), got 514",
    ),
    (
        "cache_salt over 256 bytes",
        generate_request("hi", cache_salt="s" * 257),
        INVALID,
        "cache_salt: must be at most 256 bytes (UTF-8), got 257",
    ),
    (
        "temperature inf",
        generate_request("hi", temperature=float("inf")),
        INVALID,
        "temperature: must be a finite number, got inf",
    ),
    (
        "repetition_penalty nan",
        generate_request("hi", repetition_penalty=float("nan")),
        INVALID,
        "repetition_penalty: must be a finite number, got nan",
    ),
    (
        "min_tokens > max_tokens",
        generate_request("hi", max_tokens=2, min_tokens=3),
        INVALID,
        "min_tokens: must be in [0, max_tokens]",
    ),
    ("empty stop string", generate_request("hi", stop=[""]), INVALID, "stop: must not contain empty strings"),
    (
        "33 stop strings",
        generate_request("hi", stop=[f"s{i}" for i in range(33)]),
        INVALID,
        "stop: at most 32 strings, got 33",
    ),
    (
        "1025 stop token ids",
        generate_request("hi", stop_token_ids=range(1025)),
        INVALID,
        "stop_token_ids: at most 1024 ids, got 1025",
    ),
    (
        "token id >= vocab",
        generate_request(token_ids=[5, 512]),
        INVALID,
        "token_ids: token id 512 is outside the vocabulary [0, 512)",
    ),
    (
        "negative token id",
        generate_request(token_ids=[-3]),
        INVALID,
        "token_ids: token id -3 is outside the vocabulary [0, 512)",
    ),
    (
        "empty chat role",
        generate_request(messages=[{"role": "", "content": "x"}]),
        INVALID,
        "messages[0].role: must not be empty",
    ),
    (
        "prompt + max_tokens > context",
        generate_request(token_ids=[7] * 250, max_tokens=LONG_CONTEXT - 249),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"max_tokens: prompt (250 tokens) + max_tokens ({LONG_CONTEXT - 249}) = {LONG_CONTEXT + 1} exceeds "
        f"the model's context of {LONG_CONTEXT} tokens",
    ),
    (  # no max_tokens (>= 1) could fit: it named max_tokens, which the caller cannot lower below 1
        "prompt fills the context",
        generate_request(token_ids=[7] * LONG_CONTEXT, max_tokens=1),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"prompt: {LONG_CONTEXT} tokens leave no room for an output token in the model's context of "
        f"{LONG_CONTEXT} tokens (shorten it, or set truncate_prompt_tokens)",
    ),
]


@pytest.mark.parametrize(("case", "request_", "code", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_generate_request(stub, server, case, request_, code, message) -> None:
    assert _status(stub.Generate(request_)) == (code, message)
    server.wait_idle()


def test_malformed_unary_requests(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(pb.AbortRequest(request_id="nope"))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        "request_id: no request with id 'nope'",
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(pb.AbortRequest())
    assert (info.value.code(), info.value.details()) == (INVALID, "request_id: must not be empty")
    # Quoted in NOT_FOUND, a 100 kB id made trailers the client refused (RESOURCE_EXHAUSTED); 512 bytes pass.
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(pb.AbortRequest(request_id="x" * 100_000))
    assert (info.value.code(), info.value.details()) == (
        INVALID,
        "request_id: must be at most 512 bytes (UTF-8), got 100000",
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(pb.AbortRequest(request_id="é" * 256))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.NOT_FOUND,
        f"request_id: no request with id '{'é' * 256}'",
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(text=""))
    assert (info.value.code(), info.value.details()) == (INVALID, "prompt: is empty: give text or messages")


def test_cancel_mid_stream_frees_blocks(stub, server: ServerThread) -> None:
    call = stub.Generate(generate_request("Hello world", **UNENDING))
    chunks = [next(call) for _ in range(3)]
    stats = server.stats()
    assert (stats.num_running, len(chunks)) == (1, 3) and stats.num_kv_blocks_used > 0
    before = _rpc_count(server, "Generate", "CANCELLED")
    call.cancel()
    server.wait_idle()
    # Counted when the handler unwinds, which may come after the engine reports idle.
    wait_for(lambda: _rpc_count(server, "Generate", "CANCELLED") == before + 1, "the CANCELLED count")


def test_the_requests_of_a_cancelled_stream_are_counted_cancelled(stub, server: ServerThread) -> None:
    """The call's CANCELLED was counted, its requests' (an in-band cancel's OK, an error's code) not."""
    before = _rpc_count(server, "StreamGenerate.request", "CANCELLED")
    outbox = Outbox()
    call = stub.StreamGenerate(iter(outbox))
    for request_id in ("a", "b"):
        outbox.generate(generate_request("Hello world", request_id=request_id, **UNENDING))
    wait_for(lambda: server.stats().num_running == 2, "both requests running")
    call.cancel()
    outbox.half_close()
    server.wait_idle()
    # Counted when the pumps unwind, which may come after the engine reports idle.
    wait_for(lambda: _rpc_count(server, "StreamGenerate.request", "CANCELLED") == before + 2, "the count")


def test_deadline_aborts_the_request(stub, server: ServerThread) -> None:
    before = _rpc_count(server, "Generate", "DEADLINE_EXCEEDED")
    # The request runs until something ends it: only the deadline can. 5 s is far more than any machine
    # needs to start it, so the deadline passes mid-generation, with the handler running (a deadline that
    # passes before the server hands the call to the handler is never counted).
    chunks = []
    with pytest.raises(grpc.RpcError) as info:
        for chunk in stub.Generate(generate_request("Hello world", **UNENDING), timeout=5.0):
            chunks.append(chunk)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert chunks, "the request streamed nothing before its 5 s deadline"
    server.wait_idle()
    # Counted when the handler unwinds, which may come after the engine reports idle.
    wait_for(lambda: _rpc_count(server, "Generate", "DEADLINE_EXCEEDED") == before + 1, "the count")


def test_the_requests_of_a_stream_past_its_deadline_count_as_deadline_exceeded(
    stub, server: ServerThread
) -> None:
    """As the call and each request's span: the call's deadline ended the request, not its caller."""
    before = _rpc_count(server, "StreamGenerate.request", "DEADLINE_EXCEEDED")
    outbox = Outbox()
    call = stub.StreamGenerate(iter(outbox), timeout=5.0)  # as test_deadline_aborts_the_request
    outbox.generate(generate_request("Hello world", request_id="a", **UNENDING))
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    outbox.half_close()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()
    wait_for(
        lambda: _rpc_count(server, "StreamGenerate.request", "DEADLINE_EXCEEDED") == before + 1, "the count"
    )


class _Context:
    def __init__(self, remaining: float | None) -> None:
        self._remaining = remaining

    def time_remaining(self) -> float | None:
        return self._remaining


def test_a_cancel_at_the_deadline_counts_as_deadline_exceeded() -> None:
    """The caller's own deadline timer may fire first: its cancel then reaches the server with a little of
    the server's deadline left (test_deadline_aborts_the_request met this on a busy machine)."""
    assert cancelled_status(_Context(-0.1)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled_status(_Context(DEADLINE_SLACK_S / 2)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cancelled_status(_Context(DEADLINE_SLACK_S + 5.0)) == grpc.StatusCode.CANCELLED
    assert cancelled_status(_Context(None)) == grpc.StatusCode.CANCELLED  # no deadline


def test_abort_rpc_ends_the_stream_with_abort(stub, server: ServerThread) -> None:
    call = stub.Generate(generate_request("Hello world", request_id="to-abort", **UNENDING))
    first = next(call)
    assert first.request_id == "to-abort"
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")) == pb.AbortResponse()
    rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    num_tokens = len([t for c in [first, *rest] for t in c.token_ids])
    assert rest[-1].usage.completion_tokens == num_tokens < UNENDING["max_tokens"]
    server.wait_idle()


def test_in_band_cancel_and_errors_keep_the_stream_open(stub, server: ServerThread) -> None:
    outbox = Outbox()
    responses = stub.StreamGenerate(iter(outbox))
    outbox.generate(generate_request("Hello world", request_id="long", **UNENDING))
    assert next(responses).request_id == "long"
    outbox.generate(generate_request("again", request_id="long", **UNENDING))
    outbox.generate(generate_request("no id", max_tokens=2))
    errors = [(r.request_id, r.error) for r in _drain_until_errors(responses, 2)]
    assert errors == [
        (
            "long",
            pb.RequestError(
                code=grpc.StatusCode.ALREADY_EXISTS.value[0],
                message="request_id: 'long' is already in use by a live request",
            ),
        ),
        (
            "",
            pb.RequestError(code=INVALID.value[0], message="request_id: must not be empty on StreamGenerate"),
        ),
    ]
    outbox.cancel("long")
    last = next(r for r in responses if r.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED)
    assert (last.request_id, last.chunk.finish_reason) == ("long", pb.FINISH_REASON_ABORT)
    assert last.chunk.usage.completion_tokens < UNENDING["max_tokens"]
    server.wait_idle()
    outbox.half_close()
    assert list(responses) == []


def test_a_stream_refuses_a_request_id_over_512_bytes_in_band(stub, server: ServerThread) -> None:
    outbox = Outbox()
    responses = stub.StreamGenerate(iter(outbox))
    outbox.generate(generate_request("hi", request_id="x" * 513, max_tokens=2, ignore_eos=True))
    refused = next(responses)
    message = "request_id: must be at most 512 bytes (UTF-8), got 513"
    assert (refused.request_id, refused.error) == (
        "x" * 513,
        pb.RequestError(code=INVALID.value[0], message=message),
    )
    outbox.generate(generate_request("hi", request_id="x" * 512, max_tokens=2, ignore_eos=True))
    outbox.half_close()
    finished = [r for r in responses if r.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert [(r.request_id, r.chunk.finish_reason) for r in finished] == [("x" * 512, pb.FINISH_REASON_LENGTH)]
    server.wait_idle()


def _drain_until_errors(
    responses: Iterator[pb.StreamGenerateResponse], count: int
) -> list[pb.StreamGenerateResponse]:
    errors = []
    while len(errors) < count:
        response = next(responses)
        if response.WhichOneof("event") == "error":
            errors.append(response)
    return errors


def test_cancelling_the_bidi_call_aborts_every_request(stub, server: ServerThread) -> None:
    outbox = Outbox()
    responses = stub.StreamGenerate(iter(outbox))
    for i in range(3):
        outbox.generate(generate_request(f"prompt {i}", request_id=str(i), **UNENDING))
    seen = set()
    while len(seen) < 3:
        seen.add(next(responses).request_id)
    assert server.stats().num_running == 3
    responses.cancel()
    server.wait_idle()
    outbox.half_close()  # ends the request iterator, which gRPC's sending thread still waits on


@pytest.mark.parametrize("n", [1, 4])
def test_full_queue_is_resource_exhausted(llama_long_dir: str, n: int) -> None:
    """A request of n samples runs (n sequences, all that may run), one more waits: the queue (max_queue 1)
    is full. With n = 4 it counted requests against running sequences, and 4 more could wait."""
    thread = ServerThread(long_engine_config(llama_long_dir, max_num_seqs=n), max_queue=1).start()
    try:
        channel = thread.channel()
        stub = thread.stub(channel)
        running = stub.Generate(generate_request("first", n=n, **UNENDING))
        wait_for(lambda: thread.stats().num_running == n, "the first request's samples running")
        waiting = stub.Generate(generate_request("second", **UNENDING))
        wait_for(lambda: thread.stats().num_waiting == 1, "the second request waiting")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_request("third", **UNENDING)))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the waiting queue is full (1 sequences waiting, max_queue 1); retry in 1000 ms",
        )
        assert dict(info.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
        running.cancel()
        waiting.cancel()
        thread.wait_idle()
        channel.close()
    finally:
        thread.stop()


def test_a_request_the_kv_cache_cannot_hold_is_resource_exhausted_naming_max_tokens(llama_long_dir) -> None:
    """prompt + max_tokens inside the model's context (which the frontend checks) but over the whole KV
    cache (which only the engine core knows): refused as the context check refuses, RESOURCE_EXHAUSTED
    naming max_tokens, alone, as n samples and behind a constraint (refused once its grammar compiled),
    never INTERNAL (it was: the core's refusal reached the frontend as a failed run); nothing is held and
    a request that fits runs after them."""
    thread = ServerThread(tiny_engine_config(llama_long_dir, num_blocks=8)).start()  # 128 tokens
    too_long = {"token_ids": [7] * 100, "max_tokens": 100}  # 13 blocks of 16
    constrained = generate_request(**too_long)
    constrained.sampling_params.choice.choices.extend(["red", "green"])
    expected = (grpc.StatusCode.RESOURCE_EXHAUSTED, "max_tokens: needs 13 KV blocks but the cache has 8")
    try:
        with thread.channel() as channel:
            stub = thread.stub(channel)
            requests = [generate_request(**too_long), generate_request(**too_long, n=3), constrained]
            assert [_status(stub.Generate(request)) for request in requests] == [expected] * 3
            assert _rpc_count(thread, "Generate", "RESOURCE_EXHAUSTED") == 3
            assert _rpc_count(thread, "Generate", "INTERNAL") == 0
            assert thread.wait_idle().num_kv_blocks_used == 0
            fits = generate_request(token_ids=[7] * 100, max_tokens=28, ignore_eos=True)  # all 8 blocks
            assert sum(len(chunk.token_ids) for chunk in stub.Generate(fits)) == 28
    finally:
        thread.stop()
