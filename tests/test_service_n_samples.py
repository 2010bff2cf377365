"""`n` samples and prompt logprobs over gRPC, on a real server on loopback: indices, independent
finishes, the prompt computed by sample 0 and only its last block by the others (usage and engine
stats), seeds, aborts, validation."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import grpc
import pytest
import torch
from service_harness import UNENDING_TOKENS

from sluice.v1 import sluice_pb2 as pb

PROMPT = [(5 * i + 9) % 500 + 4 for i in range(41)]  # 2 full blocks of 16 + 9 tokens
LAST_BLOCK = 9  # prompt tokens each of samples 1.. computes: sample 0's 2 full blocks are cached


def _request(request_id: str = "", prompt: list[int] = PROMPT, **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(token_ids=prompt),
        sampling_params=pb.SamplingParams(**sampling),
    )


def _by_index(chunks: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    samples: dict[int, list[pb.GenerateResponse]] = defaultdict(list)
    for chunk in chunks:
        samples[chunk.index].append(chunk)
    return dict(samples)


def _tokens(chunks: list[pb.GenerateResponse]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def test_greedy_n4_streams_four_identical_samples_sharing_the_prompts_full_blocks(stub, server):
    prompt = PROMPT[::-1]  # not cached yet
    before = server.wait_idle().num_prompt_tokens_computed
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    samples = _by_index(list(stub.Generate(_request("four", prompt=prompt, n=4, **greedy))))
    computed = server.wait_idle().num_prompt_tokens_computed - before
    (single,) = _by_index(list(stub.Generate(_request("one", prompt=prompt, **greedy)))).values()
    assert sorted(samples) == [0, 1, 2, 3]
    assert all(c.request_id == "four" for chunks in samples.values() for c in chunks)
    assert [_tokens(chunks) for chunks in samples.values()] == [_tokens(single)] * 4
    finals = [chunks[-1] for chunks in samples.values()]
    assert [f.finish_reason for f in finals] == [pb.FINISH_REASON_LENGTH] * 4
    assert all((f.usage.prompt_tokens, f.usage.completion_tokens) == (len(prompt), 6) for f in finals)
    assert [f.usage.prompt_tokens_computed for f in finals] == [len(prompt)] + [LAST_BLOCK] * 3
    assert [f.usage.cached_tokens for f in finals] == [0] + [len(prompt) - LAST_BLOCK] * 3
    assert computed == len(prompt) + 3 * LAST_BLOCK


def test_seeded_n4_gives_four_different_reproducible_samples(stub, server):
    sampling = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True, "seed": 77, "n": 4}
    runs = []
    for _ in range(2):
        samples = _by_index(list(stub.Generate(_request(**sampling))))
        runs.append([_tokens(samples[i]) for i in range(4)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4
    server.wait_idle()


def test_abort_ends_every_sample_and_frees_every_block(stub, server):
    # Runs until the Abort: every sample ends aborted, however fast the machine.
    call = stub.Generate(
        _request("long-n", n=4, temperature=0.0, max_tokens=UNENDING_TOKENS, ignore_eos=True)
    )
    chunks = [next(call)]
    stub.Abort(pb.AbortRequest(request_id="long-n"))
    chunks += list(call)
    finals = [c for c in chunks if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted((f.index, f.finish_reason) for f in finals) == [
        (i, pb.FINISH_REASON_ABORT) for i in range(4)
    ]
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_cancelling_an_n4_call_frees_every_block(stub, server):
    call = stub.Generate(
        _request("cancelled-n", n=4, temperature=1.0, max_tokens=UNENDING_TOKENS, ignore_eos=True)
    )
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_a_callers_id_that_names_anothers_sample_is_free(stub, server):
    """Sample 1 of "x" (n = 2) is "x#1" in the engine: a caller's own request "x#1" was refused as in use
    by "x" (naming the engine's ids), on Generate and on StreamGenerate."""
    unending = {"temperature": 1.0, "max_tokens": UNENDING_TOKENS, "ignore_eos": True}
    # Greedy, past EOS: a sampled 2-token request ended "stop" now and then (EOS drawn), and the stream
    # below, waiting for a "length" that never came, ran to its deadline beside `s` and `x` (ci197).
    two_tokens = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
    running = stub.Generate(_request("x", n=2, **unending))
    held_open, calls = threading.Event(), [running]
    try:
        next(running)
        chunks = list(stub.Generate(_request("x#1", **two_tokens), timeout=60))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        requests = [_request("s", n=2, **unending), _request("s#1", **two_tokens)]

        def stream():
            yield from (pb.StreamGenerateRequest(generate=request) for request in requests)
            held_open.wait(60)

        call = stub.StreamGenerate(stream(), timeout=60)
        calls.append(call)
        for response in call:
            assert response.WhichOneof("event") == "chunk", response
            if response.request_id == "s#1" and response.chunk.finish_reason:
                assert response.chunk.finish_reason == pb.FINISH_REASON_LENGTH
                break
        else:
            pytest.fail("the stream ended before s#1 finished")
    finally:  # `x` and `s` run until cancelled: a failure above must not leave them to the next tests
        for call in calls:
            call.cancel()
        held_open.set()
    server.wait_idle()


def test_a_grammar_that_does_not_compile_is_invalid_argument_for_an_n_sample_request(stub, server):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request("bad-n", n=3, regex="a(b", max_tokens=4)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("regex: does not compile: "), info.value.details()
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    # Samples 1 and 2 never reached the core and are forgotten: their engine ids are free.
    chunks = list(stub.Generate(_request("bad-n#1", temperature=0.0, max_tokens=2, ignore_eos=True)))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    server.wait_idle()


def test_stream_generate_names_each_sample(stub, server):
    requests = [
        pb.StreamGenerateRequest(generate=_request("s", n=2, temperature=0.0, max_tokens=3, ignore_eos=True))
    ]
    responses = list(stub.StreamGenerate(iter(requests)))
    samples = _by_index([r.chunk for r in responses])
    assert sorted(samples) == [0, 1] and all(r.request_id == "s" for r in responses)
    assert _tokens(samples[0]) == _tokens(samples[1]) and len(_tokens(samples[0])) == 3
    server.wait_idle()


# Past two of the frontend's slices (service.convert.PROMPT_LOGPROBS_PER_SLICE) and two prefill chunks
LONG_PROMPT = [(7 * i + 3) % 500 + 4 for i in range(557)]


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["41 tokens", "557 tokens"])
def test_prompt_logprobs_equal_transformers(stub, server, llama_long_dir, prompt):
    from transformers import AutoModelForCausalLM

    chunks = list(stub.Generate(_request(prompt=prompt, temperature=0.0, max_tokens=2, prompt_logprobs=3)))
    first, *rest = chunks
    assert all(not c.prompt_logprobs for c in rest)
    got = first.prompt_logprobs
    assert [entry.sampled.token_id for entry in got] == prompt[1:]
    model = AutoModelForCausalLM.from_pretrained(llama_long_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    want = expected.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([e.sampled.logprob for e in got]), want, atol=1e-4, rtol=0)
    top = expected.topk(3, dim=-1)
    assert [[t.token_id for t in e.top] for e in got] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[t.logprob for t in e.top] for e in got]), top.values, atol=1e-4, rtol=0
    )
    server.wait_idle()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"n": 0}, "n: must be in [1, 16]"),
        ({"n": 17}, "n: must be in [1, 16]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20]"),
    ],
)
def test_out_of_range_n_and_prompt_logprobs_are_invalid_argument(stub, sampling, message):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request(**sampling)))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_python_client_collects_each_sample_and_refuses_n_in_complete(server):
    from sluice import AsyncClient, Client, generate_request

    request = generate_request(
        token_ids=PROMPT, n=3, seed=11, temperature=1.0, max_tokens=5, ignore_eos=True, prompt_logprobs=2
    )
    with Client(server.target) as client:
        samples = client.complete_samples(request)
        with pytest.raises(ValueError, match=r"sampling_params.n > 1"):
            client.complete(request)

    async def collect_async():
        async with AsyncClient(server.target) as client:
            return await client.complete_samples(request)

    assert [s.index for s in samples] == [0, 1, 2]
    assert all(len(s.token_ids) == 5 and s.finish_reason_name == "length" for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) == 3  # seeds 11, 12, 13
    assert [len(s.prompt_logprobs) for s in samples] == [len(PROMPT) - 1, 0, 0]
    assert all(len(lp.top) == 2 for lp in samples[0].prompt_logprobs)
    assert [s.token_ids for s in asyncio.run(collect_async())] == [s.token_ids for s in samples]


def test_the_python_client_takes_prompt_logprobs_past_grpcs_default_4_mb(server):
    from sluice import Client, generate_request

    prompt = [(11 * i + 5) % 500 + 4 for i in range(22_000)]  # about 4.4 MB of prompt logprobs at 20 top
    request = generate_request(token_ids=prompt, max_tokens=1, ignore_eos=True, prompt_logprobs=20)
    with Client(server.target) as client:  # AsyncClient opens its channel the same way
        (chunk,) = client.generate(request)
    assert chunk.ByteSize() > 4 * 1024 * 1024 and len(chunk.prompt_logprobs) == len(prompt) - 1
    assert [e.sampled.token_id for e in chunk.prompt_logprobs] == prompt[1:]
    assert all(len(e.top) == 20 for e in chunk.prompt_logprobs)
    server.wait_idle()
