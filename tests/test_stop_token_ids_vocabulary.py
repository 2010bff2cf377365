"""A stop token id outside the vocabulary could never be sampled: the request ran to max_tokens where the
caller meant it to stop (a tokenizer's ids sent to another model). Refused naming the field, as vLLM's
SamplingParams refuses it, offline and over gRPC."""

from __future__ import annotations

import grpc
import pytest
from checkpoints import VOCAB_SIZE

from sluice import generate_request
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams


def test_offline_a_stop_token_id_outside_the_vocabulary_is_refused(llama_dir: str) -> None:
    llm = LLM(llama_dir, num_blocks=16)
    message = rf"^stop_token_ids: token id {VOCAB_SIZE} is outside the vocabulary \[0, {VOCAB_SIZE}\)$"
    with pytest.raises(ValueError, match=message):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[5, VOCAB_SIZE]))
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[VOCAB_SIZE - 1]))


def test_over_grpc_it_is_invalid_argument_naming_the_field(stub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate_request(token_ids=[1, 2, 3], max_tokens=4, stop_token_ids=[10**6])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("stop_token_ids: token id 1000000 is outside the vocabulary")
