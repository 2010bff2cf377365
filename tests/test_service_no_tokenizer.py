"""A model without a tokenizer (a checkpoint without tokenizer.json; `--preset` serves random weights so)
over Sluice's own API: a token_ids prompt runs and answers transformers' greedy tokens with no text, and
what needs a tokenizer (a text or chat prompt, stop strings, constrained output, Tokenize) is refused
INVALID_ARGUMENT naming its field, leaving nothing in the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from fp8_checkpoints import transformers_greedy
from service_harness import ServerThread, tiny_engine_config

from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 5, 9, 14]
NO_TOKENIZER = "this model has no tokenizer; send token_ids"
NONE_FOR = "needs a tokenizer; this model has none"


@pytest.fixture(scope="module")
def server(llama_without_tokenizer_dir: str) -> Iterator[ServerThread]:
    thread = ServerThread(tiny_engine_config(llama_without_tokenizer_dir)).start()
    try:
        yield thread
    finally:
        thread.stop()


def _by_ids(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(token_ids=PROMPT), sampling_params=pb.SamplingParams(**params)
    )


def test_a_token_ids_prompt_answers_transformers_greedy_tokens_without_text(
    server, llama_without_tokenizer_dir
) -> None:
    with server.channel() as channel:
        chunks = list(server.stub(channel).Generate(_by_ids(temperature=0.0, max_tokens=6, ignore_eos=True)))
    assert [t for chunk in chunks for t in chunk.token_ids] == transformers_greedy(
        llama_without_tokenizer_dir, [PROMPT], 6
    )[0]
    assert "".join(chunk.text for chunk in chunks) == ""
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("request_", "details"),
    [
        (pb.GenerateRequest(text="hi"), f"text: {NO_TOKENIZER}"),
        (
            pb.GenerateRequest(
                messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
            ),
            f"messages: {NO_TOKENIZER}",
        ),
        (_by_ids(stop=["x"]), "stop: stop strings need a tokenizer; this model has none"),
        (_by_ids(json_schema=json.dumps({"type": "object"})), f"json_schema: constrained output {NONE_FOR}"),
    ],
    ids=["text", "messages", "stop", "json_schema"],
)
def test_what_needs_a_tokenizer_is_refused_naming_its_field(server, request_, details) -> None:
    with server.channel() as channel, pytest.raises(grpc.RpcError) as info:
        list(server.stub(channel).Generate(request_, timeout=60))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_tokenize_is_refused_naming_the_prompts_field(server) -> None:
    with server.channel() as channel, pytest.raises(grpc.RpcError) as info:
        server.stub(channel).Tokenize(pb.TokenizeRequest(text="hi"), timeout=60)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "text: this model has no tokenizer",
    )
