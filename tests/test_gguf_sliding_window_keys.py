"""`<arch>.attention.sliding_window` in a GGUF is read as llama.cpp reads it (src/llama-model.cpp,
`llama_model::load_hparams`): the LLM_ARCH_LLAMA and LLM_ARCH_QWEN2 cases read no sliding-window key, so a
Llama-architecture file (Mistral 7B v0.1's among them) runs full attention whatever the key says; Gemma 3's
case reads it for its local layers (every 6th layer global), and a file without it (or 0) has none."""

from __future__ import annotations

from operator import methodcaller

import pytest
from test_gguf_rope_and_scalars import SHAPE, _metadata_only_gguf

from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_loader import gguf_arch_config

WINDOW = 16


@pytest.mark.parametrize("gguf_arch", ["llama", "qwen2"])
def test_llama_and_qwen2_files_ignore_the_key(tmp_path, gguf_arch: str) -> None:
    config = {**SHAPE, "num_hidden_layers": 2, "sliding_window": WINDOW}
    path = _metadata_only_gguf(str(tmp_path / "model.gguf"), gguf_arch, config)
    assert GGUFFile(path).metadata[f"{gguf_arch}.attention.sliding_window"] == WINDOW
    arch = gguf_arch_config(GGUFFile(path))
    assert arch.sliding_window is None
    assert [arch.layer_sliding_window(i) for i in range(2)] == [None, None]


def test_gemma3_files_window_their_local_layers(tmp_path) -> None:
    config = {**SHAPE, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW}
    path = _metadata_only_gguf(str(tmp_path / "gemma3.gguf"), "gemma3", config)
    arch = gguf_arch_config(GGUFFile(path))
    assert [arch.layer_sliding_window(i) for i in range(6)] == [WINDOW] * 5 + [None]


@pytest.mark.parametrize("window", [None, 0])
def test_a_gemma3_file_without_a_window_has_no_local_layers(tmp_path, window: int | None) -> None:
    """llama.cpp runs such a file (an all-global Gemma 3) with no SWA: every layer global, its RoPE base
    the global one. Its layers were taken as every-6th-global, five in six windowed at 4096 and rotated
    with the local base 10000."""
    config = {**SHAPE, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": window}
    path = _metadata_only_gguf(str(tmp_path / "gemma3.gguf"), "gemma3", config)
    arch = gguf_arch_config(GGUFFile(path))
    assert [arch.layer_sliding_window(i) for i in range(6)] == [None] * 6


def test_a_gemma3_files_final_logit_softcapping_is_read(tmp_path) -> None:
    """llama.cpp applies it, as transformers does; it was dropped, and every logprob was off."""
    config = {**SHAPE, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW}
    softcap = methodcaller("add_final_logit_softcapping", 30.0)
    path = _metadata_only_gguf(str(tmp_path / "gemma3.gguf"), "gemma3", config, softcap)
    assert gguf_arch_config(GGUFFile(path)).extra["final_logit_softcapping"] == 30.0
