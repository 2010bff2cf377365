"""Tiny random-weight checkpoints in the Hugging Face layout, built with transformers itself.

Every builder writes config.json, safetensors weights (float32), generation_config.json and a
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with a ChatML chat template) trained
here with the `tokenizers` library. Same arguments, same bytes: all randomness is seeded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(4)
MISTRAL_WINDOW = 12
# The long-context tiny Llama's context: a request may run this long, minutes of decoding on any machine.
LONG_CONTEXT = 131_072
GEMMA3_WINDOW = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tiny checkpoints' shared shape: 2 layers, 4 query heads sharing 2 kv heads (GQA), head_dim 16.
SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def build_llama_checkpoint(
    directory: str,
    *,
    max_shard_size: str | None = None,
    seed: int = 0,
    max_position_embeddings: int = SHAPE["max_position_embeddings"],
) -> str:
    """Llama 3.1-style: rope_scaling "llama3" (active at these positions) and tied embeddings. The context
    adds no weights: with `max_position_embeddings=LONG_CONTEXT` it is the same model, same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    shape = {**SHAPE, "max_position_embeddings": max_position_embeddings}
    config = LlamaConfig(**shape, rope_scaling=rope, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return _save(LlamaForCausalLM(config), directory, max_shard_size, seed)


def build_mistral_checkpoint(directory: str, *, max_shard_size: str | None = None, seed: int = 1) -> str:
    """Mistral: untied lm_head, rope_theta 1e6, sliding window wider than the context."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHAPE, rope_theta=1e6, sliding_window=4096, tie_word_embeddings=False)
    return _save(MistralForCausalLM(config), directory, max_shard_size, seed)


def build_qwen2_checkpoint(directory: str, *, max_shard_size: str | None = "100KB", seed: int = 2) -> str:
    """Qwen2: q/k/v biases, rms_norm_eps 1e-6; sharded over several safetensors files by default."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    return _save(Qwen2ForCausalLM(config), directory, max_shard_size, seed)


def build_mistral_windowed_checkpoint(directory: str, *, seed: int = 3) -> str:
    """Mistral whose sliding window (12) is shorter than most test prompts, so windowing shows."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SHAPE, rope_theta=1e4, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False)
    return _save(MistralForCausalLM(config), directory, None, seed)


def build_qwen3_checkpoint(directory: str, *, seed: int = 4) -> str:
    """Qwen3: q/k RMSNorm per head, no biases, head_dim 32 (wider than hidden / heads), tied."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**SHAPE, "head_dim": 32}
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    return _save(Qwen3ForCausalLM(config), directory, None, seed)


THINK_TOKENS = ("<think>", "</think>")  # the thinking Qwen3's tokens of their own: ids 512, 513


def build_qwen3_thinking_checkpoint(directory: str, *, seed: int = 7) -> str:
    """Qwen3 with `<think>` and `</think>` as tokens of their own (not special: they are in the text), as
    the hub's Qwen3 and DeepSeek-R1 tokenizers have them; the vocabulary two tokens larger."""
    from tokenizers import AddedToken
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**SHAPE, "head_dim": 32, "vocab_size": VOCAB_SIZE + len(THINK_TOKENS)}
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)
    _save(Qwen3ForCausalLM(config), directory, None, seed)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer.save(path)
    return directory


def build_llama_kv4_checkpoint(directory: str, *, seed: int = 6) -> str:
    """Llama with 8 query heads sharing 4 KV heads (head_dim 16), hidden 128, untied: 4 tensor-parallel ranks
    each hold one KV head (the other checkpoints' 2 KV heads are replicated over 4 ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {**SHAPE, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8}
    config = LlamaConfig(**{**shape, "num_key_value_heads": 4}, rope_theta=1e4, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), directory, None, seed)


def build_gemma3_checkpoint(
    directory: str, *, seed: int = 5, layer_types: tuple[str, ...] | None = None
) -> str:
    """Gemma 3 text: 3 layers, local (window 8, shorter than the prompts) then global by default;
    query_pre_attn_scalar differs from head_dim; separate local and global RoPE bases."""
    from transformers import Gemma3ForCausalLM

    return _save(Gemma3ForCausalLM(_gemma3_text_config(layer_types)), directory, None, seed)


def build_gemma3_multimodal_checkpoint(directory: str, *, seed: int = 5) -> str:
    """Gemma 3 as the hub's 4B/12B/27B ship it, `Gemma3ForConditionalGeneration`: the language model of
    `build_gemma3_checkpoint` (its text_config) beside a one-layer SigLIP vision tower and its projector."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14,
    )  # fmt: skip
    text = _gemma3_text_config(None).to_dict()
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return _save(Gemma3ForConditionalGeneration(config), directory, None, seed)


def build_mistral3_multimodal_checkpoint(directory: str, *, tied: bool, seed: int = 4) -> str:
    """Mistral Small 3.x's layout, `Mistral3ForConditionalGeneration`: a Mistral language model without a
    window (as the hub's) beside a one-layer Pixtral vision tower and its projector. Untied: its own
    lm_head, and no top-level tie_word_embeddings in config.json (the hub's); tied: transformers 5's
    default (true at the top, whatever the text_config says), no lm_head saved."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {**SHAPE, "model_type": "mistral", "head_dim": 32, "sliding_window": None, "rope_theta": 1e6}
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, image_size=28, patch_size=14, head_dim=16,
    )  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=IM_START_ID)
    config.tie_word_embeddings = tied
    _save(Mistral3ForConditionalGeneration(config), directory, None, seed)
    if not tied:
        path = Path(directory) / "config.json"
        path.write_text(
            json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "tie_word_embeddings"})
        )
    return directory


def _gemma3_text_config(layer_types: tuple[str, ...] | None) -> Any:
    from transformers import Gemma3TextConfig

    layer_types = layer_types or ("sliding_attention", "sliding_attention", "full_attention")
    return Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": len(layer_types)},
        head_dim=16,
        sliding_window=GEMMA3_WINDOW,
        layer_types=list(layer_types),
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        pad_token_id=0,
    )


# A tool_use template as Hermes-style models ship it: a macro, a leading newline, indentation at the end.
TOOL_USE_CHAT_TEMPLATE = (
    "\n# tools\n{%- macro names(tools) -%}"
    "{% for t in tools %}{{ t.function.name }};{% endfor %}"
    "{%- endmacro -%}\n"
    "TOOLS: {{ names(tools) }}\n"
    "{% for message in messages %}{{ message.role }}> {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant>{% endif %}\n  "
)


def copy_with_tool_use_template(directory: str, destination: Path) -> Path:
    """A copy of a checkpoint with TOOL_USE_CHAT_TEMPLATE as its named "tool_use" template (transformers 5's
    `additional_chat_templates/`), which renders the tools' names: a prompt rendered by it is longer."""
    shutil.copytree(directory, destination)
    (destination / "additional_chat_templates").mkdir()
    (destination / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_CHAT_TEMPLATE)
    return destination


def _save(model: torch.nn.Module, directory: str, max_shard_size: str | None, seed: int) -> str:
    randomize_weights(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}, f)
    save_tokenizer(directory)
    return directory


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (so RoPE and masking errors show),
    norm weights around 1 and non-zero biases (so a dropped bias or norm shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE with exactly VOCAB_SIZE tokens; encoding prepends <|begin_of_text|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    return tokenizer


def save_tokenizer(directory: str) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inline), loadable by AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _corpus() -> list[str]:
    text = (
        "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches; "
        "sluice serves tokens fast with paged attention, continuous batching and chunked prefill. "
        "Hello world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1999. "
        "Émile ate crème brûlée in Zürich; naïve café façade — “quotes” and ‘apostrophes’ 日本語 中文 😀"
    )
    words = text.split()
    generator = torch.Generator().manual_seed(1234)
    lines = []
    for _ in range(400):
        picks = torch.randint(len(words), (12,), generator=generator).tolist()
        lines.append(" ".join(words[i] for i in picks))
    return lines
