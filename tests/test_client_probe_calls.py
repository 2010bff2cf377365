"""The Python client where a probe of its surface found it wrong: `complete()` left by an exception, a
`stream_generate` whose requests' iterator raises or yields something else, and a request of the wrong
type. Against the real server; where a call is cut short, the server must abort its requests."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from service_harness import PATIENCE_S, UNENDING, ServerThread, wait_for

from sluice import AsyncClient, Client, SluiceError, generate_request
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)


def _stream_request(request_id: str, **kwargs: object) -> pb.StreamGenerateRequest:
    return pb.StreamGenerateRequest(generate=generate_request("Hello", request_id=request_id, **kwargs))


# The interrupted caller runs in a child process. A SIGINT can land in grpc's channel just after it took
# its lock and before the `with` that releases it began (CPython runs the handler there): the lock stays
# held by the main thread, and the channel's finalizer, run by the garbage collector in whichever thread
# allocates next, waits on it for ever. In this process that thread was the test server's (CI: the
# module's later tests timed out); in the child, the held lock ends with it.
_INTERRUPTED_CALLER = """
import os, signal, sys
from sluice import Client, generate_request
# Python's own handler, as in a REPL: a process started in the background (CI's) has SIGINT ignored, and
# its children inherit that (Python then installs no handler, and the SIGINT did nothing).
signal.signal(signal.SIGINT, signal.default_int_handler)
target, method, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(target) as client:
    print("calling", flush=True)
    try:
        getattr(client, method)(generate_request("Hello", temperature=0.0, max_tokens=max_tokens,
                                                 ignore_eos=True))
    except KeyboardInterrupt as interrupted:
        kept = interrupted  # as a REPL keeps the last exception in sys.last_value
        print("interrupted", flush=True)
        sys.stdin.readline()  # the parent has seen the request end while it lives
        print(type(kept).__name__, flush=True)
        os._exit(0)  # not through the channel's close, which a lock the SIGINT left held could stall
"""


@pytest.mark.parametrize("method", ["complete", "complete_samples"])
def test_a_ctrl_c_in_complete_aborts_the_request_while_the_exception_lives(
    server: ServerThread, method: str, tmp_path: Path
) -> None:
    """`complete()` hands out no stream to close: a KeyboardInterrupt (kept, as a REPL keeps the last one
    in sys.last_value) left its request generating until max_tokens."""
    command = [sys.executable, "-c", _INTERRUPTED_CALLER, server.target, method, str(UNENDING["max_tokens"])]
    log = tmp_path / "stderr"  # a file: read while the child may still run (a pipe's read would wait)
    with (
        log.open("w") as stderr,
        subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
        ) as caller,
    ):
        try:
            assert caller.stdout.readline() == "calling\n", log.read_text()
            wait_for(lambda: server.stats().num_running >= 1, "the request running")
            caller.send_signal(signal.SIGINT)
            assert caller.stdout.readline() == "interrupted\n", log.read_text()
            server.wait_idle()
            stdout, _ = caller.communicate("\n", timeout=PATIENCE_S)
        finally:
            caller.kill()
    assert (caller.returncode, stdout) == (0, "KeyboardInterrupt\n"), log.read_text()


def _raising_requests():
    yield _stream_request("a", **UNENDING)
    raise RuntimeError("the caller's request generator failed")


def test_a_request_iterator_that_raises_fails_the_stream_with_its_exception(server: ServerThread) -> None:
    """Not UNKNOWN "Exception iterating requests!", with the caller's exception lost."""
    message = r"^the caller's request generator failed$"
    with Client(server.target) as client, pytest.raises(RuntimeError, match=message):
        list(client.stream_generate(_raising_requests()))
    server.wait_idle()


def test_an_async_request_iterator_that_raises_fails_the_stream_with_its_exception(
    server: ServerThread,
) -> None:
    """grpc.aio logged the exception at DEBUG only: the reader saw CANCELLED "Locally cancelled by
    application!", which nobody had asked for. A sync iterable on AsyncClient too."""

    async def raising_async_requests():
        for request in _raising_requests():
            yield request

    async def run(requests) -> BaseException:
        async with AsyncClient(server.target) as client:
            try:
                async for _ in client.stream_generate(requests):
                    pass
            except Exception as error:  # noqa: BLE001 - what the reader saw is the assertion
                return error
        raise AssertionError("the stream ended without an error")

    for requests in (raising_async_requests, _raising_requests):
        error = asyncio.run(run(requests()))
        assert (type(error), str(error)) == (RuntimeError, "the caller's request generator failed")
        server.wait_idle()


def test_a_generate_request_sent_on_stream_generate_is_a_type_error_naming_it(server: ServerThread) -> None:
    """It was sent as the StreamGenerateRequest its bytes happened to parse as (here none: the stream
    answered an in-band INVALID_ARGUMENT "did not parse", which says nothing of the cause)."""
    message = (
        r"^requests: each must be a sluice\.v1\.StreamGenerateRequest, got GenerateRequest "
        r"\(send it as StreamGenerateRequest\(generate=request\)\)$"
    )
    with Client(server.target) as client, pytest.raises(TypeError, match=message):
        list(client.stream_generate([generate_request("Hello", request_id="a", max_tokens=2)]))

    async def run() -> None:
        async with AsyncClient(server.target) as client:
            with pytest.raises(TypeError, match=r"StreamGenerateRequest, got str$"):
                async for _ in client.stream_generate([_stream_request("a", **UNENDING), "Hello"]):
                    pass

    asyncio.run(run())
    server.wait_idle()


def test_a_stream_whose_requests_end_well_still_ends_well(server: ServerThread) -> None:
    """The checked feed changes nothing for good requests: both answered, then the stream ends."""
    with Client(server.target) as client:
        requests = [_stream_request(rid, temperature=0.0, max_tokens=3, ignore_eos=True) for rid in "ab"]
        responses = list(client.stream_generate(iter(requests)))
    finished = {r.request_id for r in responses if r.chunk.finish_reason == pb.FINISH_REASON_LENGTH}
    assert finished == {"a", "b"}


@pytest.mark.parametrize("method", ["generate", "complete", "complete_samples"])
def test_a_request_of_another_type_is_a_type_error_naming_it(server: ServerThread, method: str) -> None:
    """The blocking client raised grpc's own INTERNAL "Exception serializing request!" (no SluiceError),
    or AttributeError 'sampling_params' for a StreamGenerateRequest; AsyncClient sent a string as an
    empty request, refused as "prompt: is empty"."""
    for request, name in (("Hello", "str"), (_stream_request("a"), "StreamGenerateRequest")):
        message = (
            rf"^request: must be a sluice\.v1\.GenerateRequest \(see generate_request\(\)\), got {name}$"
        )
        with Client(server.target) as client, pytest.raises(TypeError, match=message):
            getattr(client, method)(request)

        async def run(request: object) -> None:
            async with AsyncClient(server.target) as client:
                call = getattr(client, method)(request)
                if method != "generate":
                    await call

        with pytest.raises(TypeError, match=message):
            asyncio.run(run(request))


def test_an_error_of_the_server_is_still_a_sluice_error_on_stream_generate(server: ServerThread) -> None:
    """A feed without an error of its own leaves the call's status as it was: here the deadline's."""
    with Client(server.target) as client, pytest.raises(SluiceError) as info:
        list(client.stream_generate([_stream_request("a", **UNENDING)], timeout=0.5))
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()
