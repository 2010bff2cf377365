"""Tokenizer directories in the Hugging Face layout, built offline for tokenizer and detokenizer tests.

- `build_byte_level_bpe(dir)`: a byte-level BPE trained here with `tokenizers`, saved by transformers.
- `build_sentencepiece_llama(dir)`: the real SentencePiece model mistral-common ships (Mistral 7B v0.1,
  32000 pieces, byte fallback), converted by transformers' LlamaTokenizer (needs `sentencepiece`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mistral_common
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sluice.engine.text.tokenizer import Tokenizer as SluiceTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Streaming tokens one at a time.",
    "Café, naïve, résumé, façade, jalapeño, Straße.",
    "你好，世界。今天天气很好。",
    "Emoji: 😀 🚀 👍🏽 ❤️ and 🇫🇷 flags.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 12345 and symbols #$%&*() [] {}.",
] * 20

CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The Llama 2 / Mistral style template: roles must alternate user/assistant after an optional system message.
LLAMA_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}
{% else %}
    {% set system = none %}{% set loop_messages = messages %}
{% endif %}
{{ bos_token }}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if loop.first and system is not none %}
            {{ '[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' }}
        {% else %}
            {{ '[INST] ' + message['content'] + ' [/INST]' }}
        {% endif %}
    {% else %}
        {{ ' ' + message['content'] + eos_token }}
    {% endif %}
{% endfor %}"""

BPE_SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def build_byte_level_bpe(directory: Path) -> Path:
    """Byte-level BPE (GPT-2 / Qwen2 style) whose post-processor prepends <|bos|>; ChatML template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = backend.token_to_id("<|bos|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHATML_TEMPLATE,
    )
    wrapped.save_pretrained(directory)
    im_end = backend.token_to_id("<|im_end|>")
    _write_json(
        directory / "generation_config.json", {"eos_token_id": [im_end, backend.token_to_id("<|eos|>")]}
    )
    return directory


def build_sentencepiece_llama(directory: Path) -> Path:
    """Mistral 7B v0.1's SentencePiece tokenizer as transformers converts it; Llama 2 chat template."""
    source = directory / "source"
    source.mkdir(parents=True)
    model = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    shutil.copy(model, source / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
    }
    _write_json(source / "tokenizer_config.json", config)
    converted = AutoTokenizer.from_pretrained(source)
    converted.chat_template = LLAMA_TEMPLATE
    out = directory / "llama"
    converted.save_pretrained(out)
    _write_json(out / "generation_config.json", {"eos_token_id": 2})
    return out


def tokenizers_of_both_kinds(root: Path) -> dict[str, SluiceTokenizer]:
    """Sluice tokenizers of the two decoding kinds, by name: "bpe" (byte-level, the table path) and
    "sentencepiece" (Llama 2 style, the window path), built under `root`."""
    return {
        "bpe": SluiceTokenizer.from_pretrained(build_byte_level_bpe(root / "bpe")),
        "sentencepiece": SluiceTokenizer.from_pretrained(build_sentencepiece_llama(root / "sp")),
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
