"""Request options of vLLM's that Sluice takes too. `truncate_prompt_tokens`: a request keeps only its
prompt's last k tokens (-1: as many as one request holds); the kept tokens give transformers' greedy
continuation of them, usage and prompt logprobs count them, and a bad value is INVALID_ARGUMENT naming the
field. `include_stop_str_in_output`: the text ends with the stop string that ended it."""

from __future__ import annotations

import grpc
import pytest
import torch

from sluice import generate_request
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.v1 import sluice_pb2 as pb

PROMPT = [(7 * i + 5) % 500 + 4 for i in range(40)]
KEEP = 11
NUM_NEW = 8


def _hf_greedy(directory: str, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_the_offline_engine_continues_the_last_k_prompt_tokens_as_transformers(llama_dir: str) -> None:
    llm = LLM(llama_dir, attention_backend="torch")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, truncate_prompt_tokens=KEEP)
    (completion,) = llm.generate(PROMPT, params)
    assert completion.token_ids == _hf_greedy(llama_dir, PROMPT[-KEEP:])
    assert completion.prompt_token_ids == PROMPT[-KEEP:]
    # -1: the model's context (256 tokens) holds the whole prompt: nothing is cut.
    whole = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, truncate_prompt_tokens=-1)
    (completion,) = llm.generate(PROMPT, whole)
    assert completion.prompt_token_ids == PROMPT
    # A prompt longer than the context: -1 keeps what fits beside max_tokens (it kept all 256 tokens of
    # the context, a prompt no max_tokens could follow: refused every time).
    long_prompt = [(7 * i) % 500 + 1 for i in range(300)]
    (completion,) = llm.generate(long_prompt, whole)
    assert completion.prompt_token_ids == long_prompt[-(256 - NUM_NEW) :]
    assert completion.token_ids == _hf_greedy(llama_dir, long_prompt[-(256 - NUM_NEW) :])


def test_minus_one_keeps_what_a_kv_cache_smaller_than_the_context_holds(llama_dir: str) -> None:
    """-1 kept the context's 256 - max_tokens tokens where the KV cache holds 96: the request was then
    refused for the cache. It keeps what one request can hold (`max_request_tokens`) beside max_tokens."""
    llm = LLM(llama_dir, attention_backend="torch", block_size=16, num_blocks=6)
    assert llm.engine.model_info.max_request_tokens == 96
    whole = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, truncate_prompt_tokens=-1)
    long_prompt = [(7 * i) % 500 + 1 for i in range(300)]
    (completion,) = llm.generate(long_prompt, whole)
    assert completion.prompt_token_ids == long_prompt[-(96 - NUM_NEW) :]
    assert completion.token_ids == _hf_greedy(llama_dir, long_prompt[-(96 - NUM_NEW) :])


def test_a_server_request_keeps_the_last_k_tokens_in_usage_and_prompt_logprobs(stub) -> None:
    def run(**kwargs):
        request = generate_request(
            token_ids=PROMPT,
            temperature=0.0,
            max_tokens=NUM_NEW,
            ignore_eos=True,
            prompt_logprobs=0,
            **kwargs,
        )
        return list(stub.Generate(request, timeout=60))

    truncated, alone = run(truncate_prompt_tokens=KEEP), None
    request = generate_request(
        token_ids=PROMPT[-KEEP:], temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0
    )
    alone = list(stub.Generate(request, timeout=60))
    assert [t for c in truncated for t in c.token_ids] == [t for c in alone for t in c.token_ids]
    assert truncated[-1].usage.prompt_tokens == KEEP
    prompt_logprobs = [lp.sampled.token_id for c in truncated for lp in c.prompt_logprobs]
    assert prompt_logprobs == PROMPT[-KEEP + 1 :]  # every kept token after the first
    assert run()[-1].usage.prompt_tokens == len(PROMPT)


@pytest.mark.parametrize("value", [0, -2])
def test_a_bad_value_is_invalid_argument_naming_the_field(stub, value: int) -> None:
    request = generate_request(token_ids=PROMPT, max_tokens=1, truncate_prompt_tokens=value)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("truncate_prompt_tokens: must be -1")


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(stub) -> None:
    def text(**kwargs) -> tuple[str, list]:
        request = generate_request(
            token_ids=PROMPT, temperature=0.0, max_tokens=24, ignore_eos=True, **kwargs
        )
        chunks = list(stub.Generate(request, timeout=60))
        return "".join(c.text for c in chunks), chunks

    whole, _ = text()
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    at = whole.find(stop)
    included, chunks = text(stop=[stop], include_stop_str_in_output=True)
    assert included == whole[: at + len(stop)]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP and chunks[-1].stop_string == stop
    assert text(stop=[stop])[0] == whole[:at]
