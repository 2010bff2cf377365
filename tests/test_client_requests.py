"""What the Python client's request builders send and what a failed call raises, against the real server:
a request's stream_interval, `stop=None`, one prompt form for tokenize, and a SluiceError that survives
pickling (a process pool sends a worker's exception back pickled)."""

from __future__ import annotations

import json
import pickle

import grpc
import pytest
from service_harness import ServerThread

from sluice import Client, SluiceError, generate_request

pytestmark = pytest.mark.timeout(180)

NUM_TOKENS = 17


def test_generate_request_sets_the_requests_stream_interval(server: ServerThread) -> None:
    """Chunks of at least 4 tokens but the last (a reader slower than the tokens gets merged chunks)."""
    request = generate_request(
        "Hello", temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stream_interval=4
    )
    assert request.stream_interval == 4
    assert generate_request("Hello").stream_interval == 0  # the server's --stream-interval
    with Client(server.target) as client:
        sizes = [len(chunk.token_ids) for chunk in client.generate(request, timeout=60)]
    assert sum(sizes) == NUM_TOKENS
    assert all(size >= 4 for size in sizes[:-1]), sizes


def test_stop_none_is_no_stop(server: ServerThread) -> None:
    """As a sampling argument left None: protobuf's TypeError "must assign iterable" before."""
    request = generate_request("Hello", max_tokens=3, ignore_eos=True, stop=None, stop_token_ids=None)
    assert (list(request.sampling_params.stop), list(request.sampling_params.stop_token_ids)) == ([], [])
    with Client(server.target) as client:
        completion = client.complete(request, timeout=60)
    assert (len(completion.token_ids), completion.finish_reason_name) == (3, "length")


def test_tokenize_refuses_text_and_messages_together(server: ServerThread) -> None:
    """As generate_request does; tokenize sent the messages and dropped the text without a word."""
    messages = [{"role": "user", "content": "Hi"}]
    with Client(server.target) as client:
        text_ids, chat_ids = client.tokenize("Hi"), client.tokenize(messages=messages)
        assert text_ids and chat_ids and text_ids != chat_ids
        with pytest.raises(ValueError, match=r"^text and messages: give one prompt form, not 2$"):
            client.tokenize("Hi", messages=messages)


def test_a_sluice_error_survives_pickling(server: ServerThread) -> None:
    with Client(server.target) as client, pytest.raises(SluiceError) as info:
        client.complete(generate_request("Hello", max_tokens=-1), timeout=60)
    pushback = SluiceError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota", {"grpc-retry-pushback-ms": "250"}
    )
    for error in (info.value, pushback):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), copy.code, copy.message, copy.trailing_metadata, str(copy)) == (
            SluiceError,
            error.code,
            error.message,
            error.trailing_metadata,
            str(error),
        )
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in info.value.message
    assert pickle.loads(pickle.dumps(pushback)).retry_pushback_ms == 250


def test_generate_request_sets_constraints_bias_and_allowed_ids(server: ServerThread) -> None:
    """Structured output, logit_bias and allowed_token_ids could not be set through the builder (a
    TypeError for each keyword): callers edited request.sampling_params by hand."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    with Client(server.target) as client:
        chosen = client.complete(generate_request("Pick", choice=["yes", "no"], max_tokens=8), timeout=60)
        assert chosen.text in ("yes", "no")
        answer = client.complete(generate_request("JSON", json_schema=schema, max_tokens=24), timeout=60)
        assert json.loads(answer.text)["ok"] in (True, False)
        only = client.complete(
            generate_request("Hi", allowed_token_ids=[5, 6], max_tokens=4, ignore_eos=True), timeout=60
        )
        assert set(only.token_ids) <= {5, 6}
        biased = client.complete(
            generate_request("Hi", logit_bias={9: 100.0}, temperature=0.0, max_tokens=3, ignore_eos=True),
            timeout=60,
        )
        assert list(biased.token_ids) == [9, 9, 9]
    assert generate_request("x", json_object=True).sampling_params.HasField("json_object")
    assert generate_request("x", regex="a+").sampling_params.regex == "a+"
    with pytest.raises(ValueError, match="^regex and choice: give one constraint, not 2$"):
        generate_request("x", regex="a", choice=["a"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 3.5}, r"^max_tokens: 3\.5 cannot be sent"),
        ({"stop": ["a", 1]}, r"^stop: \['a', 1\] cannot be sent"),
        ({"stop": b"ab"}, r"^stop: b'ab' cannot be sent"),
        ({"stream_interval": -1}, r"^stream_interval: -1 cannot be sent"),
        ({"seed": 2**70}, r"^seed: \d+ cannot be sent"),
        ({"text": None, "token_ids": [1.5]}, r"^token_ids: \[1\.5\] cannot be sent"),
        ({"text": b"bytes"}, r"^text: b'bytes' cannot be sent"),
        ({"text": None, "messages": [{"content": "hi"}]}, r"^messages: each must be a mapping with a role"),
        (
            {"text": None, "messages": [{"role": "user", "content": "a\udc80"}]},
            r"^messages: cannot be sent \('utf-8' codec can't encode character '\\udc80'",
        ),
        (
            {"text": None, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"name": "f"}},
            r"^tool_choice: as a dict",
        ),
        (
            {
                "text": None,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"parameters": {}}}],
            },
            r"^tools: each must be a mapping",
        ),
        (
            {
                "text": None,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"description": "no name"}],
            },
            r"^tools: each must be a mapping with a string name",
        ),
        (
            {"text": None, "messages": [{"role": "user", "content": "hi"}], "tools": ["get_weather"]},
            r"^tools: each must be a mapping",
        ),
        (
            {
                "text": None,
                "messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            },
            r"^tool_calls: each must be a mapping with a string name",
        ),
    ],
)
def test_arguments_protobuf_cannot_take_are_refused_naming_them(kwargs: dict, message: str) -> None:
    """protobuf's own errors named no field ("bad argument type for built-in operation", KeyError 'role'),
    and bytes text went through."""
    with pytest.raises(ValueError, match=message):
        generate_request(**{"text": "Hello", **kwargs})


def test_content_parts_are_sent_as_their_text() -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    request = generate_request(messages=[{"role": "user", "content": parts}])
    assert request.messages.messages[0].content == "Hi\nthere"
