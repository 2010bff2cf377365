"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from engine.loading.model_arch import SUPPORTED_ARCHITECTURES
from engine.worker.models.llama import LlamaForCausalLM

# Every supported architecture runs on LlamaForCausalLM: Mistral and Qwen2 are Llama with a sliding
# window / q,k,v biases, both read from ModelArchConfig.
MODEL_CLASSES: dict[str, type[nn.Module]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM)


def get_model_class(architecture: str) -> type[nn.Module]:
    """Raises ValueError naming the supported architectures when `architecture` is not one."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"architectures: {architecture!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        ) from None
