"""Sampled tokens' logprobs as columns (`OutputLogprobs`): read as a sequence of `Logprobs`, built by the
sampler from the tensors, carried in the core's message (several tokens for a step that accepted drafts),
merged for a slow reader and over a completion, and turned into both APIs' protos from the columns."""

from __future__ import annotations

import asyncio

import pytest
import torch
from smg_grpc_proto import vllm_engine_pb2 as smg

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.frontend.request_stream import OutputCollector
from sluice.engine.messages import CoreOutput, CoreOutputs, decode_core_message, encode
from sluice.engine.outputs import (
    NO_OUTPUT_LOGPROBS,
    EngineStats,
    Logprobs,
    OutputLogprobs,
    RequestOutput,
    TokenLogprob,
)
from sluice.engine.sample.sampler import Sampler, SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.service import convert, smg_convert
from sluice.v1 import sluice_pb2 as pb

# A step that accepted two drafts: three tokens, two top each.
THREE_TOKENS = OutputLogprobs(
    [7, 8, 9], [-1.0, -2.0, -3.0], 2, [7, 1, 2, 8, 9, 3], [-1.0, -1.5, -0.5, -2.0, -0.25, -4.0]
)
THREE_ENTRIES = [
    Logprobs(TokenLogprob(7, -1.0), (TokenLogprob(7, -1.0), TokenLogprob(1, -1.5))),
    Logprobs(TokenLogprob(8, -2.0), (TokenLogprob(2, -0.5), TokenLogprob(8, -2.0))),
    Logprobs(TokenLogprob(9, -3.0), (TokenLogprob(9, -0.25), TokenLogprob(3, -4.0))),
]


def _one(token_id: int, logprob: float, *top: tuple[int, float]) -> OutputLogprobs:
    return OutputLogprobs([token_id], [logprob], len(top), [t for t, _ in top], [v for _, v in top])


def test_columns_read_as_one_logprobs_per_token() -> None:
    assert list(THREE_TOKENS) == THREE_ENTRIES and len(THREE_TOKENS) == 3 and THREE_TOKENS
    assert THREE_TOKENS[-1] == THREE_ENTRIES[2] and THREE_TOKENS[-3] == THREE_ENTRIES[0]
    with pytest.raises(IndexError):
        THREE_TOKENS[3]
    with pytest.raises(IndexError):
        THREE_TOKENS[-4]
    assert list(OutputLogprobs([5, 6], [-0.5, -0.25])) == [
        Logprobs(TokenLogprob(5, -0.5), ()),
        Logprobs(TokenLogprob(6, -0.25), ()),
    ]
    assert not NO_OUTPUT_LOGPROBS and list(NO_OUTPUT_LOGPROBS) == []
    # Sliced as the tuple of Logprobs it replaced is.
    assert THREE_TOKENS[1:] == tuple(THREE_ENTRIES[1:]) and THREE_TOKENS[::-2] == tuple(THREE_ENTRIES[::-2])
    assert THREE_TOKENS[5:] == () and NO_OUTPUT_LOGPROBS[:1] == ()


def test_a_multi_token_step_crosses_the_cores_message_intact() -> None:
    outputs = [
        CoreOutput("spec", [7, 8, 9], THREE_TOKENS, 0, 0, 1.0, 2.0),
        CoreOutput("plain", [4], None, 0, 0, 1.0, 2.0),
        CoreOutput("no-top", [5], OutputLogprobs([5], [-0.5]), 0, 0, 1.0, 2.0),
    ]
    message = CoreOutputs(outputs, EngineStats(3, 0, 8, 2, 0, 0, 5))
    decoded = decode_core_message(encode(message))
    assert decoded == message
    spec, plain, no_top = decoded.outputs
    assert list(spec.new_logprobs) == THREE_ENTRIES and plain.new_logprobs is None
    assert list(no_top.new_logprobs) == [Logprobs(TokenLogprob(5, -0.5), ())]


def test_joined_keeps_order_skips_empty_parts_and_copies_nothing_for_one() -> None:
    first, rest = THREE_TOKENS.first(1), _one(8, -2.0, (2, -0.5), (8, -2.0))
    last = _one(9, -3.0, (9, -0.25), (3, -4.0))
    assert OutputLogprobs.joined([first, NO_OUTPUT_LOGPROBS, rest, last]) == THREE_TOKENS
    assert OutputLogprobs.joined([NO_OUTPUT_LOGPROBS, THREE_TOKENS]) is THREE_TOKENS
    assert OutputLogprobs.joined([]) is NO_OUTPUT_LOGPROBS
    assert list(THREE_TOKENS.first(2)) == THREE_ENTRIES[:2] and THREE_TOKENS.first(3) == THREE_TOKENS


def test_a_slow_readers_outputs_are_merged_with_their_logprobs_in_order() -> None:
    async def run() -> RequestOutput:
        collector = OutputCollector()
        collector.put(RequestOutput("r", (7,), "a", logprobs=THREE_TOKENS.first(1)))
        collector.put(RequestOutput("r", (), "", logprobs=NO_OUTPUT_LOGPROBS))
        two = OutputLogprobs([8, 9], [-2.0, -3.0], 2, [2, 8, 9, 3], [-0.5, -2.0, -0.25, -4.0])
        collector.put(RequestOutput("r", (8, 9), "bc", logprobs=two))  # a step that accepted a draft
        return await asyncio.wait_for(collector.get(), 60.0)

    merged = asyncio.run(run())
    assert merged.token_ids == (7, 8, 9) and merged.text == "abc"
    assert merged.logprobs == THREE_TOKENS and list(merged.logprobs) == THREE_ENTRIES


def test_the_sampler_builds_each_rows_columns_from_the_tensors() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    rows = [
        SamplingRow("a", SamplingParams(temperature=0.0, logprobs=3), [1], []),
        SamplingRow("b", SamplingParams(temperature=0.0), [1], []),
        SamplingRow("c", SamplingParams(temperature=0.0, logprobs=0), [1], []),
    ]
    a, b, c = Sampler().sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    top = expected[0].topk(3)
    assert a.logprobs.num_top == 3 and a.logprobs.token_ids == [a.token_id]
    assert a.logprobs.logprobs == pytest.approx([expected[0, a.token_id].item()], abs=1e-6)
    assert a.logprobs.top_token_ids == top.indices.tolist()
    assert a.logprobs.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert b.logprobs is None
    assert list(c.logprobs) == [Logprobs(TokenLogprob(c.token_id, c.logprobs.logprobs[0]), ())]


def test_both_apis_build_the_protos_from_the_columns() -> None:
    response = convert.generate_response_from_output(RequestOutput("e", (7, 8, 9), "", THREE_TOKENS), "c")
    assert list(response.logprobs) == [
        pb.Logprobs(
            sampled=pb.TokenLogprob(token_id=e.sampled.token_id, logprob=e.sampled.logprob),
            top=[pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in e.top],
        )
        for e in THREE_ENTRIES
    ]
    message = smg.OutputLogProbs()
    smg_convert.add_output_logprobs(message, THREE_TOKENS)
    assert list(message.token_ids) == [7, 8, 9]
    assert list(message.token_logprobs) == [-1.0, -2.0, -3.0]
    assert [(list(t.token_ids), list(t.values)) for t in message.top_logprobs] == [
        ([7, 1], [-1.0, -1.5]),
        ([2, 8], [-0.5, -2.0]),
        ([9, 3], [-0.25, -4.0]),
    ]
    without_top = smg.OutputLogProbs()
    smg_convert.add_output_logprobs(without_top, OutputLogprobs([5], [-0.5]))
    assert list(without_top.token_ids) == [5] and not without_top.top_logprobs


def _hf_logprobs(directory: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax at the positions that predicted `output`: [len(output), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def test_speculative_steps_logprobs_equal_transformers(llama_dir) -> None:
    """Greedy with n-gram drafts: steps that accept drafts carry several tokens' columns; joined over the
    steps, one entry per token, equal to transformers' log_softmax at each position."""
    phrase = [17, 91, 250, 33, 402, 8, 77, 140]
    prompt = [5, 9, *phrase, 12, *phrase, 61, *phrase[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    llm = LLM(llama_dir, speculative=SpeculativeConfig("ngram", num_speculative_tokens=4), block_size=16)
    (completion,) = llm.generate(prompt, params)
    assert completion.accepted_draft_tokens > 0  # some steps carried several tokens
    got = completion.logprobs
    assert len(got) == len(completion.token_ids) == 24
    assert [e.sampled.token_id for e in got] == completion.token_ids
    expected = _hf_logprobs(llama_dir, prompt, completion.token_ids)
    want = expected.gather(1, torch.tensor(completion.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([e.sampled.logprob for e in got]), want, atol=1e-4, rtol=0)
    top = expected.topk(3, dim=-1)
    assert [[t.token_id for t in e.top] for e in got] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[t.logprob for t in e.top] for e in got]), top.values, atol=1e-4, rtol=0
    )
