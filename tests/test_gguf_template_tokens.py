"""A GGUF's unknown and padding tokens (`tokenizer.ggml.unknown_token_id`, `padding_token_id`) are the chat
template's `unk_token` and `pad_token`, as transformers' GGUF tokenizer names them: the embedded SmolLM2's
file carries both, and a template reading every named token renders as transformers renders it."""

from __future__ import annotations

import dataclasses
import os

from transformers import AutoTokenizer

from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.text.tokenizer import Tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "[unk={{ unk_token }}][pad={{ pad_token }}]"
)


def test_unk_and_pad_tokens_are_the_templates_as_transformers_names_them():
    path = default_model_path()
    ours = gguf_tokenizer(GGUFFile(path))
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    assert {n: ours.special_tokens.get(n) for n in names} == {n: hf.special_tokens_map.get(n) for n in names}
    ours = Tokenizer.from_spec(dataclasses.replace(ours.spec(), chat_template=TEMPLATE))
    messages = [{"role": "user", "content": "hi"}]
    expected = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False)
    assert "[unk=<|endoftext|>][pad=<|im_end|>]" in expected
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected
