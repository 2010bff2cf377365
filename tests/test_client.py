"""The Python client (`Client`, `AsyncClient`, `generate_request`) and `sluice generate` against the real
server: what the builder sends, when a stream's call starts and what ends it, and what a caller learns of
how a request ended."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from service_harness import PATIENCE_S, UNENDING, ServerThread, long_engine_config, wait_for

from sluice import AsyncClient, Client, SluiceError, generate_request
from sluice.service import generate_command
from sluice.service.cli import build_parser, load_commands
from sluice.service.generate_command import stats_line
from sluice.service_config import REQUEST_HASH_HEADER_ENV
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SLUICE = str(Path(sys.executable).parent / "sluice")


NUM_GREEDY_TOKENS = 24


def _greedy(**kwargs: object) -> pb.GenerateRequest:
    return generate_request(
        "Hello world", temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True, **kwargs
    )


def test_a_stop_string_given_alone_is_one_stop_string(server: ServerThread) -> None:
    with Client(server.target) as client:
        whole = client.complete(_greedy()).text
        assert len(whole) >= 12, whole
        stop = whole[8:12]
        request = _greedy(stop=stop)
        assert list(request.sampling_params.stop) == [stop]  # not its characters, each a stop string
        completion = client.complete(request)
    assert (completion.text, completion.finish_reason_name) == (whole[: whole.find(stop)], "stop")
    assert (completion.stop_string, completion.stop_token_id) == (stop, None)


def test_more_than_one_prompt_form_is_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"^text and token_ids: give one prompt form, not 2$"):
        generate_request("Hello", token_ids=[5, 6])
    with pytest.raises(ValueError, match=r"^text and token_ids and messages: give one prompt form, not 3$"):
        generate_request("Hello", token_ids=[5], messages=[{"role": "user", "content": "Hi"}])


def test_tools_and_tool_choice_in_either_form_become_the_chats_fields() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    expected = pb.Tool(name="get_weather", description="Weather", parameters=json.dumps(schema))
    forms = [
        {"name": "get_weather", "description": "Weather", "parameters": schema},
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": schema},
        },
        {"name": "get_weather", "description": "Weather", "parameters": json.dumps(schema)},
        expected,
    ]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for form in forms:
        assert list(generate_request(messages=messages, tools=[form]).messages.tools) == [expected]
    choices = {
        None: pb.ToolChoice(),
        "required": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
        "none": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
        "get_weather": pb.ToolChoice(function_name="get_weather"),
    }
    for choice, message in choices.items():
        request = generate_request(messages=messages, tools=forms[:1], tool_choice=choice)
        assert request.messages.tool_choice == message
        assert request.messages.HasField("tool_choice") == (choice is not None)
    # OpenAI's named form names a tool even when the name is spelled like a mode.
    named = {"type": "function", "function": {"name": "none"}}
    request = generate_request(messages=messages, tools=forms[:1], tool_choice=named)
    assert request.messages.tool_choice == pb.ToolChoice(function_name="none")
    with pytest.raises(ValueError, match=r"^tools: needs messages$"):
        generate_request("Hello", tools=forms[:1])
    with pytest.raises(ValueError, match=r"^tool_choice: needs messages$"):
        generate_request("Hello", tool_choice="auto")


def test_a_session_that_is_no_header_value_is_refused_naming_it(server: ServerThread) -> None:
    with Client(server.target) as client:
        for session in ("café", "a\nb"):
            with pytest.raises(ValueError, match=r"^session: .* is not printable ASCII"):
                client.complete(_greedy(), session=session)


def test_a_stream_starts_when_made_and_closing_it_aborts_the_request(server: ServerThread) -> None:
    with Client(server.target) as client:
        stream = client.generate(generate_request("Hello", **UNENDING))
        wait_for(lambda: server.stats().num_running == 1, "the request running before its stream is read")
        assert next(stream).token_ids
        stream.close()
        server.wait_idle()
        assert list(stream) == []


def test_leaving_a_with_block_or_dropping_a_stream_aborts_the_request(server: ServerThread) -> None:
    with Client(server.target) as client:
        with client.generate(generate_request("Hello", **UNENDING)) as stream:
            assert next(stream).token_ids
        server.wait_idle()
        stream = client.generate(generate_request("Hello", **UNENDING))
        assert next(stream).token_ids
        del stream  # grpc cancels a call it garbage-collects
        server.wait_idle()


def test_breaking_out_of_or_dropping_an_async_stream_aborts_the_request(server: ServerThread) -> None:
    """grpc.aio holds a running call itself (its channel's done-callback): a stream left by `break`, or
    dropped unread, kept its request generating, with its KV blocks and its tenant's slot, until
    max_tokens or the client's close."""

    async def run() -> None:
        async with AsyncClient(server.target) as client:
            async for chunk in client.generate(generate_request("Hello", **UNENDING)):
                assert chunk.token_ids
                break
            await asyncio.to_thread(server.wait_idle)
            stream = client.generate(generate_request("Hello", **UNENDING))
            await asyncio.to_thread(wait_for, lambda: server.stats().num_running == 1, "the request running")
            del stream
            await asyncio.to_thread(server.wait_idle)

    asyncio.run(run())


def test_an_async_stream_starts_when_made_and_its_async_with_block_aborts_it(server: ServerThread) -> None:
    async def run() -> list[pb.GenerateResponse]:
        async with AsyncClient(server.target) as client:
            stream = client.generate(generate_request("Hello", **UNENDING))
            await asyncio.to_thread(wait_for, lambda: server.stats().num_running == 1, "the request running")
            async with stream:
                assert (await anext(stream)).token_ids
            await asyncio.to_thread(server.wait_idle)
            return [chunk async for chunk in stream]

    assert asyncio.run(run()) == []


def test_a_completion_keeps_what_stopped_it(server: ServerThread) -> None:
    with Client(server.target) as client:
        token_ids = client.complete(_greedy()).token_ids
        completion = client.complete(_greedy(stop_token_ids=[token_ids[3]]))
    assert completion.token_ids == token_ids[: token_ids.index(token_ids[3]) + 1]
    assert (completion.finish_reason_name, completion.stop_token_id, completion.stop_string) == (
        "stop",
        token_ids[3],
        None,
    )


def test_the_affinity_config_given_as_service_config_works_in_a_fresh_process(server: ServerThread) -> None:
    """grpc honours the config's requestHashHeader only with an environment variable set (see
    sluice.service_config): the client sets it for any config keyed on a header, not only for
    `session_affinity=True`. A fresh process, since one client that set it leaves it set."""
    script = (
        "from sluice import Client, generate_request\n"
        "from sluice.service_config import SESSION_AFFINITY_SERVICE_CONFIG as config\n"
        f"with Client({server.target!r}, service_config=config) as client:\n"
        "    request = generate_request('Hi', max_tokens=2, ignore_eos=True)\n"
        "    print(client.complete(request, timeout=60, session='conversation-1').usage.completion_tokens)\n"
    )
    env = {name: value for name, value in os.environ.items() if name != REQUEST_HASH_HEADER_ENV}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert (result.returncode, result.stdout) == (0, "2\n"), result.stderr


def test_sluice_generate_fails_when_the_server_aborts_its_request(llama_long_dir: str) -> None:
    """One sequence at a time: the command's request waits behind one that runs until the drain's grace
    period ends and aborts both; the command's stream then ends with FINISH_REASON_ABORT."""
    thread = ServerThread(long_engine_config(llama_long_dir, max_num_seqs=1)).start()
    command = [SLUICE, "generate", "--target", thread.target, "--raw", "--max-tokens", "8", "Hello"]
    try:
        with Client(thread.target) as client:
            holder = client.generate(generate_request("Hold", **UNENDING))
            assert next(holder).token_ids
            generate = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            wait_for(lambda: thread.stats().num_waiting == 1, "the command's request waiting")
            thread.call(thread.server.drain(grace_period=1.0))
            _, stderr = generate.communicate(timeout=PATIENCE_S)
            assert list(holder)[-1].finish_reason == pb.FINISH_REASON_ABORT
    finally:
        thread.stop()
    assert generate.returncode == 1, stderr
    assert stderr.endswith("sluice generate: the request ended with finish reason abort\n"), stderr


def test_sluice_generate_reports_a_refused_request_and_fails(server: ServerThread) -> None:
    """The server's status and message on stderr, exit status 1 (docs/API.md: a prompt and max_tokens
    beyond the context are RESOURCE_EXHAUSTED, without a retry trailer)."""
    command = [SLUICE, "generate", "--target", server.target, "--raw", "--max-tokens", "2147483647", "Hello"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE_S)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == (
        "\nsluice generate: RESOURCE_EXHAUSTED: max_tokens: prompt (3 tokens) + max_tokens (2147483647) = "
        "2147483650 exceeds the model's context of 131072 tokens\n"
    )


def test_sluice_generates_rate_counts_the_tokens_after_the_first_chunk() -> None:
    """With --stream-interval 4 the first chunk holds 4 tokens: 12 tokens, the first 4 after 0.5 s, the
    other 8 over the next 1.5 s."""
    assert stats_line(2.0, 0.5, 12, 4) == "12 tokens in 2.00s: 5.3 tokens/s, TTFT 500 ms"
    assert stats_line(0.2, 0.1, 1, 1) == "1 tokens in 0.20s: nan tokens/s, TTFT 100 ms"
    assert stats_line(0.2, None, 0, 0) == "0 tokens in 0.20s: nan tokens/s, TTFT nan ms"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--max-tokens", str(2**64)), f"argument --max-tokens: must be in [1, 2147483647], got {2**64}"),
        (("--seed", str(2**64)), f"argument --seed: must be in [{-(2**63)}, {2**63 - 1}], got {2**64}"),
        (("--max-tokens", "lots"), "argument --max-tokens: invalid int value: 'lots'"),
        (("--temperature", "hot"), "argument --temperature: invalid float value: 'hot'"),
        (("--timeout", "0"), "argument --timeout: must be in [0.001, 1000000000.0], got 0"),
        (("--timeout", "inf"), "argument --timeout: must be in [0.001, 1000000000.0], got inf"),
    ],
)
def test_sluice_generate_refuses_a_value_its_request_cannot_hold_naming_the_flag(
    capsys, flags, message
) -> None:
    """A max_tokens beyond int32 ended in protobuf's traceback; a timeout of 0 as DEADLINE_EXCEEDED."""
    with pytest.raises(SystemExit) as info:
        build_parser(load_commands(["generate"])).parse_args(["generate", *flags, "hi"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith(f"sluice generate: error: {message}\n")


@pytest.mark.parametrize(
    ("api_key", "message"),
    [
        ("k3y\n", "api_key: must be a non-empty string without surrounding whitespace"),
        ("", "api_key: must be a non-empty string without surrounding whitespace"),
        ("clé", "api_key: must be printable ASCII"),
    ],
)
def test_an_api_key_grpc_cannot_send_is_refused_naming_it_never_echoing_it(
    api_key: str, message: str
) -> None:
    """A key read from a file with its newline failed every call with INTERNAL "Invalid metadata", and on
    AsyncClient with grpc's ExecuteBatchError, no SluiceError."""
    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}") as info:
            make("localhost:1", api_key=api_key)
        assert api_key.strip() not in str(info.value) or not api_key.strip()


def test_metadata_grpc_cannot_send_is_refused_naming_the_argument(server: ServerThread) -> None:
    with Client(server.target) as client:
        with pytest.raises(ValueError, match=r"^metadata: must be \(key, value\) pairs, not a dict"):
            client.model_info(metadata={"x-foo": "1"})
        with pytest.raises(ValueError, match=r"^metadata: must be \(key, value\) pairs.*got 'X-Trace'$"):
            client.model_info(metadata=[("X-Trace", "1")])
        assert client.model_info(metadata=[("x-trace", "1")]).vocab_size > 0
    # What else gRPC cannot send as a header: grpc.aio failed it with its own ExecuteBatchError.
    refused = [
        ([("x-a", "caf\u00e9")], "the value of 'x-a' must be printable ASCII"),
        ([("x-a", "a\nb")], "the value of 'x-a' must be printable ASCII"),
        ([("x-a", b"\xff")], "the value of 'x-a' must be printable ASCII"),
        ([("x-a-bin", "text")], "the value of 'x-a-bin' must be bytes"),
        ([("x a", "1")], "key 'x a' may hold only lowercase letters, digits"),
    ]

    async def refused_on_async_client() -> None:
        async with AsyncClient(server.target) as client:
            for metadata, message in refused:
                with pytest.raises(ValueError, match=f"^metadata: {re.escape(message)}"):
                    await client.model_info(metadata=metadata)

    asyncio.run(refused_on_async_client())
    with Client(server.target) as client:
        for metadata, message in refused:
            with pytest.raises(ValueError, match=f"^metadata: {re.escape(message)}"):
                client.model_info(metadata=metadata)
        assert client.model_info(metadata=[("x-a-bin", b"\xff"), ("x-b", b"ascii")]).vocab_size > 0


def test_a_timeout_past_any_deadline_grpc_holds_is_no_deadline(server: ServerThread) -> None:
    """grpc ended a call whose deadline it cannot hold at once, DEADLINE_EXCEEDED before sending it
    (inf, and from ~1e10 s); a timeout that is no number of seconds > 0 is refused naming it."""

    async def on_async_client() -> list[int]:
        async with AsyncClient(server.target) as client:
            return [len((await client.complete(_greedy(), timeout=t)).token_ids) for t in (math.inf, 1e10)]

    assert asyncio.run(on_async_client()) == [NUM_GREEDY_TOKENS] * 2
    with Client(server.target) as client:
        for timeout in (math.inf, 1e10):
            assert len(client.complete(_greedy(), timeout=timeout).token_ids) == NUM_GREEDY_TOKENS
            assert client.model_info(timeout=timeout).vocab_size > 0
        assert client.model_info(timeout=np.float32(60)).vocab_size > 0  # any real number, numpy's too
        for timeout in (0, -1.0, math.nan, "5", True):
            with pytest.raises(ValueError, match=r"^timeout: must be a number of seconds > 0"):
                client.model_info(timeout=timeout)


def test_arguments_grpc_or_protobuf_cannot_take_are_refused_naming_them(server: ServerThread) -> None:
    """Each failed with protobuf's or grpc's own error, naming nothing ("bad argument type for built-in
    operation", "'int' object has no attribute 'isascii'", "too many values to unpack"), or was read as
    true ("false")."""
    with Client(server.target) as client:
        calls = [
            (lambda: client.tokenize(5), "text"),
            (lambda: client.tokenize("\ud800"), "text"),
            (lambda: client.tokenize("hi", add_special_tokens="no"), "add_special_tokens"),
            (lambda: client.abort(5), "request_id"),
            (lambda: client.abort("\ud800"), "request_id"),
            (lambda: client.complete(_greedy(), session=5), "session"),
        ]
        for call, name in calls:
            with pytest.raises(ValueError, match=f"^{name}: "):
                call()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    builders = [
        (lambda: generate_request("hi", trace_context={"traceparent": 1}), "trace_context"),
        (lambda: generate_request("hi", regex=5), "regex"),
        (lambda: generate_request("hi", choice=[1, 2]), "choice"),
        (lambda: generate_request("hi", json_object="false"), "json_object"),
        (lambda: generate_request(**chat, continue_final_message="false"), "continue_final_message"),
        (lambda: generate_request(**chat, add_generation_prompt="yes"), "add_generation_prompt"),
        (lambda: Client(None), "target"),
        (lambda: Client("localhost:1", options={"grpc.x": 1}), "options"),
        (lambda: Client("localhost:1", options=None), "options"),
        (lambda: Client("localhost:1", service_config='{"loadBalancingConfig": []}'), "service_config"),
        (lambda: Client("localhost:1", credentials="x"), "credentials"),
    ]
    for build, name in builders:
        with pytest.raises(ValueError, match=f"^{name}: "):
            build()


def test_a_request_that_never_reached_the_engine_has_no_usage(server: ServerThread) -> None:
    """The proto leaves usage unset there (an earlier Abort of its id); the Completion read it as zeros."""
    with Client(server.target) as client:
        with pytest.raises(SluiceError):  # NOT_FOUND, and remembered
            client.abort("never-ran")
        completion = client.complete(_greedy(request_id="never-ran"))
        assert (completion.finish_reason_name, completion.usage) == ("abort", None)
        assert completion.timings is not None
        assert client.complete(_greedy()).usage.completion_tokens == NUM_GREEDY_TOKENS


def test_sluice_generate_into_a_closed_pipe_exits_without_a_traceback(server: ServerThread) -> None:
    """`sluice generate ... | head -c 5`: a BrokenPipeError traceback, exit 1."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first token is written
    command = [SLUICE, "generate", "--target", server.target, "--raw", "--max-tokens", "8", "Hello"]
    try:
        result = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=PATIENCE_S)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (1, "")


def test_sluice_generate_whose_reader_leaves_after_the_last_text_exits_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`| head -c 5` that has its 5 bytes: the newline owed after the text (and the stats line) raised the
    BrokenPipeError outside the stream's handler."""
    read, write = os.pipe()

    class ReaderLeavesClient:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> ReaderLeavesClient:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
            yield pb.GenerateResponse(text="Hello", token_ids=[5])
            os.close(read)  # the reader has what it wanted
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)

    monkeypatch.setattr(generate_command, "Client", ReaderLeavesClient)
    args = build_parser(load_commands(["generate"])).parse_args(["generate", "--raw", "Hi"])
    with open(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert generate_command.run(args) == 1
