"""The language model of a multimodal checkpoint (Gemma 3 4B/12B/27B: `Gemma3ForConditionalGeneration`;
Mistral Small 3.1/3.2: `Mistral3ForConditionalGeneration`), served text-only, as vLLM serves one with
`--limit-mm-per-prompt '{"image": 0}'`: its config.json's `text_config` becomes the text architecture's
config, its language-model tensors take the text model's names, and its vision tower and projector are
never read.

    config.json                              -> the text model's config
      {"architectures": ["Gemma3ForConditionalGeneration"],
       "text_config": {"hidden_size": 2560, ...},   (what it leaves out: the family's defaults)
       "vision_config": {...}, "eos_token_id": [1, 106], "quantization_config": {...}}

    tensor names                             -> the text model's
      language_model.model.layers.0.mlp...      model.layers.0.mlp...   (the hub's, transformers < 4.52
      model.language_model.layers.0.mlp...      model.layers.0.mlp...    and >= 5; transformers 4.52-4.57)
      language_model.lm_head.weight             lm_head.weight
      vision_tower.*, multi_modal_projector.*   (not read)
"""

from __future__ import annotations

from typing import Any

from sluice.engine.model_registry import MODEL_TYPE_ARCHITECTURES, TEXT_ONLY_ARCHITECTURES

# checkpoint name prefix -> the text model's (each ends at a module boundary)
LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# The multimodal config's keys that describe the other parts, or the wrapper itself.
_WRAPPER_KEYS = ("text_config", "vision_config", "architectures", "model_type")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# quantization_config's lists of module names (compressed-tensors, transformers' fp8 and fbgemm, vLLM's,
# ModelOpt's), whose exact names are the checkpoint's.
_MODULE_LISTS = ("ignore", "modules_to_not_convert", "ignored_layers", "exclude_modules")


def language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor (or module) name -> the text model's; None for a vision tower's or
    projector's; any other name unchanged (a text checkpoint's own)."""
    dotted = name + "."  # a module name ("language_model.lm_head") matches as its tensors do
    if dotted.startswith(VISION_PREFIXES):
        return None
    for theirs, ours in LANGUAGE_MODEL_PREFIXES:
        if dotted.startswith(theirs):
            return (ours + dotted.removeprefix(theirs))[:-1]
    return name


def language_model_config(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The text model's config.json: the multimodal config's `text_config` over its top-level keys (those a
    language model reads: quantization_config, eos_token_id, tie_word_embeddings, ...), as the text
    architecture; the quantization_config's module lists renamed (`language_model_name`). Raises
    ValueError when `text_config` is not an object or its model_type is not the text architecture's."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"text_config: must be an object (the language model's config), got {text!r}")
    text_architecture = TEXT_ONLY_ARCHITECTURES[architecture]
    model_type = text.get("model_type")
    if model_type is not None and MODEL_TYPE_ARCHITECTURES.get(model_type) != text_architecture:
        # another language model in the same wrapper (Ministral 3's "ministral3"): not the one Sluice runs
        supported = [t for t, a in MODEL_TYPE_ARCHITECTURES.items() if a == text_architecture]
        raise ValueError(
            f"text_config.model_type: {model_type!r} is not supported in {architecture}; supported: "
            f"{', '.join(map(repr, supported))}"
        )
    shared = {key: value for key, value in config.items() if key not in _WRAPPER_KEYS}
    merged = {**shared, **text, "architectures": [text_architecture]}
    # The wrapper's special token ids win, as transformers builds a composite model's generation config
    # from its top level (text_config only where that leaves one unset): Gemma 3's eos [1, 106].
    merged.update({key: config[key] for key in _TOKEN_ID_KEYS if config.get(key) is not None})
    # The wrapper ties, as transformers >= 5 reads it (its config classes' default: true, whatever the
    # text_config says); a checkpoint with an lm_head of its own (Mistral Small 3.x) uses it, untied.
    merged["tie_word_embeddings"] = config.get("tie_word_embeddings", True)
    merged.pop("model_type", None)  # the text config's ("gemma3_text"): the architecture names the model
    if isinstance(merged.get("quantization_config"), dict):
        merged["quantization_config"] = _renamed_module_lists(merged["quantization_config"])
    return merged


def _renamed_module_lists(quantization: dict[str, Any]) -> dict[str, Any]:
    """The lists of module names renamed to the text model's, the vision tower's dropped (also in ModelOpt's
    nested `quantization` object); patterns ("re:..." regexes, "*" wildcards) are left as written, matched
    against the text model's names."""
    renamed = dict(quantization)
    for key in _MODULE_LISTS:
        names = quantization.get(key)
        if isinstance(names, list):
            renamed[key] = [ours for name in names if (ours := _renamed_module(name)) is not None]
    if isinstance(quantization.get("quantization"), dict):  # ModelOpt's hf_quant_config.json
        renamed["quantization"] = _renamed_module_lists(quantization["quantization"])
    return renamed


def _renamed_module(name: Any) -> Any:
    if not isinstance(name, str) or name.startswith("re:") or "*" in name:
        return name  # a pattern, or not a name (the config's own parser names the field)
    return language_model_name(name)
