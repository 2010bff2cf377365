"""Loads the draft model of `--speculative draft` for the target's runner, which sizes both KV caches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import ModelSource, load_model_source

if TYPE_CHECKING:
    from sluice.engine.worker.model_runner import ModelRunner


def load_draft_runner(
    config: EngineConfig, target_source: ModelSource, max_model_len: int
) -> ModelRunner | None:
    """The draft model's `ModelRunner` (None without `--speculative draft`): its weights loaded on the
    target's device in the target's dtype, its KV cache not yet allocated. The target's runner sizes its
    own cache from the bytes per block of both, then gives the draft as many blocks
    (`ModelRunner.initialize_kv_cache`), so that one budget covers both models' weights and caches.
    Raises ValueError naming `draft_model` when it does not load or its vocabulary is not the target's."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    from sluice.engine.worker.model_runner import ModelRunner  # which imports this module

    model_config = ModelConfig(model=spec.draft_model, dtype=config.model.dtype, device=config.model.device)
    with _named_draft_model():
        source = load_model_source(model_config)
    if source.arch.vocab_size != target_source.arch.vocab_size:
        raise ValueError(
            f"draft_model: vocabulary of {source.arch.vocab_size} tokens differs from the target's "
            f"{target_source.arch.vocab_size}; the draft must share the target's tokenizer"
        )
    max_model_len = min(max_model_len, source.arch.max_position_embeddings)
    # The target's KV cache dtype, as vLLM's drafter shares the engine's cache config: with an FP8 cache
    # the draft's blocks take a byte per value too.
    cache = CacheConfig(
        block_size=config.cache.block_size,
        enable_prefix_caching=False,
        kv_cache_dtype=config.cache.kv_cache_dtype,
    )
    draft_config = EngineConfig(
        model=dataclasses.replace(model_config, max_model_len=max_model_len),
        cache=cache,
        scheduler=config.scheduler,
        attention_backend=config.attention_backend,
        enforce_eager=True,
    )
    with _named_draft_model():  # its weights: a tensor missing or of another shape
        return ModelRunner(draft_config, source, kv_cache=False)


@contextlib.contextmanager
def _named_draft_model() -> Iterator[None]:
    """A load error, which names `model` (the target's flag) or nothing, as one naming `draft_model`."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"draft_model: {str(exc).removeprefix('model: ')}") from None
