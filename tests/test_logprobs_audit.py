"""Top logprobs under exact ties: in decreasing logprob, ties in increasing token id, whatever k, the batch
and the chunking, so that the greedy token (the lowest id among the most likely) comes first and a request's
top logprobs equal those of the same request run alone (docs/ARCHITECTURE.md, "What a request's output
depends on"). Ties are built into a checkpoint: lm_head rows copied onto other tokens give those tokens
bit-identical logits at every position."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sample.top_logprobs import top_k_ties_by_id
from sluice.engine.sampling_params import SamplingParams

PROMPT = [(7 * i + 11) % 500 + 4 for i in range(20)]
OTHER_PROMPT = [(3 * i + 7) % 500 + 4 for i in range(25)]


def _by_value_then_id(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda token_id: (-row[token_id], token_id))[:k]


@pytest.mark.parametrize("k", [0, 1, 3, 7, 20, 299, 300])
def test_top_k_orders_ties_by_id_as_a_plain_sort_does(k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    # Values from a handful of levels: every row is full of ties, also across the k-th place.
    logprobs = -torch.randint(0, 6, (8, 300), generator=generator).float()
    logprobs[3, :] = float("-inf")  # all tied
    logprobs[4, 40:] = float("-inf")  # fewer finite values than some k
    values, ids = top_k_ties_by_id(logprobs, k)
    for row in range(8):
        want = _by_value_then_id(logprobs[row].tolist(), k)
        assert ids[row].tolist() == want
        assert values[row].tolist() == logprobs[row, want].tolist()


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_of_distinct_values_and_of_a_tie_across_the_k_th_place(k: int) -> None:
    """Odd rows: distinct values (the host takes topk's own); even rows: the k-th value copied to the
    tokens ranked k + 1 and k + 6, so that the tie reaches past the k-th place (the vocabulary search)."""
    generator = torch.Generator().manual_seed(100 + k)
    logprobs = torch.randn(16, 500, generator=generator)
    ranked = logprobs.argsort(dim=-1, descending=True)
    for row in range(0, 16, 2):
        logprobs[row, ranked[row, [k, k + 5]]] = logprobs[row, ranked[row, k - 1]].item()
    values, ids = top_k_ties_by_id(logprobs, k)
    for row in range(16):
        want = _by_value_then_id(logprobs[row].tolist(), k)
        assert ids[row].tolist() == want
        assert values[row].tolist() == logprobs[row, want].tolist()


def test_a_nan_row_keeps_ids_inside_the_vocabulary() -> None:
    logprobs = torch.full((2, 50), float("nan"))
    logprobs[1, :10] = -1.0
    _, ids = top_k_ties_by_id(logprobs, 5)
    assert ((ids >= 0) & (ids < 50)).all()


@pytest.fixture(scope="module")
def tied_dir(mistral_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[int]]]:
    """The untied Mistral with two groups of bit-identical logits at PROMPT's last position: the most likely
    token and 3 copies of its lm_head row (ids on both sides of it), and the third most likely with 6
    copies. Returns the directory and the groups (each sorted by id) and the second most likely token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    values, order = logits.sort(descending=True)
    assert (values[0] - values[1]).item() > 1e-3 and (values[1] - values[2]).item() > 1e-3
    first, second, third = order[:3].tolist()
    free = [t for t in range(4, 500) if t not in order[:40].tolist()]
    top_group = sorted([first, *[t for t in free if t < first][:2], *[t for t in free if t > first][:1]])
    rest = [t for t in free if t not in top_group]
    third_group = sorted([third, *rest[::7][:6]])
    weight = model.lm_head.weight
    with torch.no_grad():
        for token_id in top_group:
            weight[token_id] = weight[first]
        for token_id in third_group:
            weight[token_id] = weight[third]
    directory = str(tmp_path_factory.mktemp("mistral_tied"))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(mistral_dir) / name).exists():
            shutil.copy(Path(mistral_dir) / name, Path(directory) / name)
    return directory, {"top": top_group, "second": [second], "third": third_group}


def test_greedy_token_comes_first_and_ties_are_in_id_order_alone_or_batched(tied_dir) -> None:
    directory, groups = tied_dir
    expected = groups["top"] + groups["second"] + groups["third"]  # 4 + 1 + 7: ranks 6..12 tie
    llm = LLM(directory, block_size=16, num_blocks=64)
    wide = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    for k in (1, 3, 5, 7, 12):
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
        (alone,) = llm.generate(PROMPT, params)
        batched = llm.generate([OTHER_PROMPT, PROMPT], [wide, params])[1]
        assert alone.token_ids == [groups["top"][0]]  # argmax: the lowest id among the most likely
        for completion in (alone, batched):
            (entry,) = completion.logprobs
            assert [t.token_id for t in entry.top] == expected[:k], k
            assert entry.top[0].token_id == entry.sampled.token_id
        assert batched.logprobs[0] == alone.logprobs[0]  # bit for bit, ties included


def test_prompt_logprobs_order_ties_by_id_whatever_the_chunking(tied_dir) -> None:
    directory, groups = tied_dir
    expected = groups["top"] + groups["second"] + groups["third"]
    prompt = [*PROMPT, 9, 10]  # PROMPT's last position is a prompt position here
    tops = []
    for budget in (8, 64):  # the position in a chunk of 8 rows, or in one chunk of the whole prompt
        llm = LLM(directory, block_size=16, num_blocks=64, max_num_batched_tokens=budget, max_num_seqs=8)
        (completion,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=9))
        entry = completion.prompt_logprobs[len(PROMPT) - 1]
        assert entry.sampled.token_id == 9
        assert [t.token_id for t in entry.top] == expected[:9]
        assert all(math.isfinite(t.logprob) for t in entry.top)
        tops.append(entry)
    assert tops[0] == tops[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [[7], [7, 8, 9]])
def test_smg_input_logprobs_hold_the_first_prompt_tokens_empty_entry_as_vllms_do(
    server, stream, prompt
) -> None:
    """vLLM's VllmEngine answers prompt_logprobs with one entry per prompt token, the first without a
    value (and an empty top): also for a one-token prompt, which has no logprob at all."""
    from smg_grpc_proto import vllm_engine_pb2 as smg
    from smg_grpc_proto import vllm_engine_pb2_grpc as smg_grpc

    request = smg.GenerateRequest(
        request_id=f"plp-{len(prompt)}-{stream}",
        tokenized=smg.TokenizedInput(input_ids=prompt),
        sampling_params=smg.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2),
        stream=stream,
    )
    with server.channel() as channel:
        responses = list(smg_grpc.VllmEngineStub(channel).Generate(request, timeout=60))
    carrying = [getattr(r, r.WhichOneof("response")).input_logprobs for r in responses]
    (got,) = [message for message in carrying if message.token_ids]
    assert list(got.token_ids) == prompt
    assert [entry.HasField("value") for entry in got.token_logprobs] == [False] + [True] * (len(prompt) - 1)
    assert [len(top.token_ids) for top in got.top_logprobs] == [0] + [2] * (len(prompt) - 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.5, "top_k": 3, "seed": 1},
        {"temperature": 0.7, "top_p": 0.2, "min_p": 0.1, "seed": 2},
        {"temperature": 0.0, "repetition_penalty": 1.7, "frequency_penalty": 1.0, "presence_penalty": 0.5},
        {"temperature": 0.0, "logit_bias": {5: 100.0, 6: -100.0}},
        {"temperature": 0.0, "allowed_token_ids": [9, 10, 11], "stop": ["'"]},  # "&", "'", "("
    ],
)
def test_logprobs_are_the_raw_models_whatever_samples_and_asking_changes_no_token(llama_dir, fields) -> None:
    """As vLLM's default: log_softmax of transformers' logits at each position, the sampled token's too
    where it is not among the top; one entry per token, also where a stop string ended the output."""
    from transformers import AutoModelForCausalLM

    llm = LLM(llama_dir, block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, **fields)
    (completion,) = llm.generate(PROMPT, params)
    (plain,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, **fields))
    assert plain.token_ids == completion.token_ids
    assert completion.finish_reason == ("stop" if "stop" in fields else "length")
    tokens = completion.token_ids
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    want = torch.log_softmax(logits, dim=-1)
    got = completion.logprobs
    assert [entry.sampled.token_id for entry in got] == tokens
    sampled = want.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([e.sampled.logprob for e in got]), sampled, atol=1e-4, rtol=0)
    # vLLM's cumulative_logprob: their sum; None where no logprobs were asked for.
    assert completion.cumulative_logprob == pytest.approx(sampled.sum().item(), abs=1e-3)
    assert plain.cumulative_logprob is None
    top = want.topk(2, dim=-1)
    assert [[t.token_id for t in e.top] for e in got] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[t.logprob for t in e.top] for e in got]), top.values, atol=1e-4, rtol=0
    )
