"""Architecture name (config.json `architectures[0]`, or a GGUF's `general.architecture`) -> model class.

Model classes are imported on first use, so reading the supported names costs no torch import.
Adding an architecture: a model file in `sluice.engine.worker.models`, one line here, and its tests.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# architecture -> (module in sluice.engine.worker.models, class)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}
# Multimodal architectures served text-only (`sluice.engine.loading.language_model`): architecture -> its
# language model's.
TEXT_ONLY_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
}
SUPPORTED_ARCHITECTURES = (*_MODELS, *TEXT_ONLY_ARCHITECTURES)

# config.json model_type -> architecture, for a config without `architectures`
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}

# GGUF general.architecture -> architecture
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def get_model_class(architecture: str) -> Any:
    """The nn.Module class running `architecture`. Raises ValueError naming the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(f"architectures: {architecture!r} is not supported; supported: {', '.join(_MODELS)}")
    module, name = _MODELS[architecture]
    return getattr(import_module(f"sluice.engine.worker.models.{module}"), name)
