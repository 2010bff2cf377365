"""FP8 linears that take a one-row step's input before the kernel that would make it, in whole models:
`fuse_norm_fp8` (qkv_proj and gate_up_proj normalize the row, after the residual add, and quantize it in
their own loads: `fp8_normed_gemv` / `fp8_normed_skinny_mm`) and `fuse_silu_fp8` (down_proj activates the
[gate | up] row and quantizes it: `fp8_gated_gemv` / `fp8_gated_skinny_mm`). FP8 checkpoints on the
Triton kernels (interpreted on CPU) with the FP8 layers on their CUDA path (`scaled_mm_on_cpu`), on both
one-row launches (`one_row_launch`): the final hidden states bit for bit those with the fold off, the
launches counted, steps of more rows unfolded, greedy tokens equal transformers' on the checkpoint with
both folds on; the options refused where they cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from test_fp8_checkpoint import MAX_TOKENS, prompts
from test_fp8_fused_quant_model import _final_hidden

from sluice.engine.frontend.llm import LLM
from sluice.engine.worker.layers import fp8_linear
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.kernels import fp8_gemv, fp8_skinny_mm

BLOCK = 16
NUM_LAYERS, HIDDEN, INTERMEDIATE = 2, 64, 128  # checkpoints.py's tiny models
FOLDS = {  # the option -> (the launches it makes, the op that hands its input over, one-row x's shape)
    "fuse_norm_fp8": (("fp8_normed_gemv", "fp8_normed_skinny_mm"), RMSNorm, (1, HIDDEN)),
    "fuse_silu_fp8": (("fp8_gated_gemv", "fp8_gated_skinny_mm"), SiluAndMul, (1, 2 * INTERMEDIATE)),
}


@pytest.fixture(params=["gemv", "skinny"])
def one_row_launch(request, monkeypatch) -> str:
    """The launch one-row steps run: `fp8_gemv` on every layer (the tiny models' weights are all below
    GEMV_MAX_WEIGHT, as llama-3.2-1b's qkv_proj and down_proj are), or `fp8_skinny_mm` on every layer (as
    llama-3-8b's qkv_proj, gate_up_proj and down_proj take it)."""
    if request.param == "skinny":
        monkeypatch.setattr(fp8_linear, "GEMV_MAX_WEIGHT", 0)
    return request.param


@pytest.fixture
def row_launches(monkeypatch) -> list[tuple[str, tuple[int, int]]]:
    """(launch's name, x's shape) of every launch that folds its input's kernel in, in order."""
    calls: list[tuple[str, tuple[int, int]]] = []

    def counted(name: str, launch):
        return lambda x, *args: calls.append((name, tuple(x.shape))) or launch(x, *args)

    for module in (fp8_gemv, fp8_skinny_mm):
        for name in ("fp8_normed_gemv", "fp8_normed_skinny_mm", "fp8_gated_gemv", "fp8_gated_skinny_mm"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


def _folded_llm(directory: str, dtype: str, **folds: bool) -> LLM:
    return LLM(directory, dtype=dtype, attention_backend="triton", block_size=BLOCK, num_blocks=32, **folds)


def _launch_name(fold: str, one_row_launch: str) -> str:
    gemv, skinny = FOLDS[fold][0]
    return gemv if one_row_launch == "gemv" else skinny


@pytest.mark.parametrize(
    ("fold", "source", "activations"),
    [
        ("fuse_norm_fp8", "llama_dir", "token"),
        ("fuse_norm_fp8", "llama_dir", "static"),
        ("fuse_norm_fp8", "qwen2_dir", "token"),  # qkv_proj's bias
        ("fuse_silu_fp8", "llama_dir", "token"),
        ("fuse_silu_fp8", "llama_dir", "static"),
    ],
)
def test_a_fold_in_the_one_row_products_gives_the_same_hidden_states(
    fold,
    source,
    activations,
    request,
    tmp_path,
    scaled_mm_on_cpu,
    one_row_launch,
    row_launches,
    quant_launches,
):
    """With the fold on, a one-row step runs the folded launch where the norms (two a layer) or SiLU-and-mul
    (one) ran, bit for bit (under the interpreter) the two launches it replaces; o_proj still quantizes in
    a launch of its own on the skinny path (on the gemv's, inside the gemv), and the other inputs' codes
    still come from the kernels before them. Steps of more rows keep the kernels' own launches."""
    directory = write_fp8_checkpoint(
        request.getfixturevalue(source), str(tmp_path / "fp8"), weights="channel", activations=activations
    )
    llm = _folded_llm(directory, "bfloat16", **{fold: True})
    layers = llm.engine.model_runner.model.model.layers
    if fold == "fuse_norm_fp8":
        assert all(layer.input_layernorm.fuses_into_linear for layer in layers)
        assert all(layer.self_attn.qkv_proj.method.fuse_norm for layer in layers)
    else:
        assert all(layer.mlp.act.fuses_into_linear for layer in layers)
        assert all(layer.mlp.down_proj.method.fuse_silu for layer in layers)
    per_layer = 2 if fold == "fuse_norm_fp8" else 1
    q_size = layers[0].self_attn.o_proj.input_size
    fused = _final_hidden(llm, (1,))
    assert row_launches == [(_launch_name(fold, one_row_launch), FOLDS[fold][2])] * per_layer * NUM_LAYERS
    assert quant_launches == ([(1, q_size)] * NUM_LAYERS if one_row_launch == "skinny" else [])
    row_launches.clear()
    assert _final_hidden(llm, (2, 3)).isfinite().all() and row_launches == []  # 5 rows: unfolded
    op = FOLDS[fold][1]
    unfolded_kernels = dataclasses.replace(llm.engine.model_runner.kernels, **{fold: False})
    for module in llm.engine.model_runner.model.modules():
        if isinstance(module, op):
            module.select(unfolded_kernels)
    unfused = _final_hidden(llm, (1,))
    assert row_launches == []
    assert fused.shape == (1, HIDDEN) and fused.isfinite().all() and torch.equal(fused, unfused)


def test_both_folds_keep_greedy_tokens_equal_transformers(
    llama_dir, tmp_path, scaled_mm_on_cpu, one_row_launch, row_launches
):
    """One prompt at a time in float32 (`tensorwise`), so that every decode step is one row and folds its
    norms and its SiLU-and-mul (three folded launches a layer); greedy tokens as transformers' on the FP8
    checkpoint."""
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="channel", activations="token")
    llm = _folded_llm(directory, "float32", fuse_norm_fp8=True, fuse_silu_fp8=True)
    for prompt in prompts():
        agrees_with_transformers(llm, directory, [prompt], MAX_TOKENS)
    names = [name for name, _ in row_launches]
    decode_steps = (MAX_TOKENS - 1) * len(prompts())
    normed, gated = (_launch_name(fold, one_row_launch) for fold in FOLDS)
    assert names.count(normed) >= 2 * NUM_LAYERS * decode_steps
    assert names.count(gated) >= NUM_LAYERS * decode_steps
    assert set(names) == {normed, gated}


@pytest.mark.parametrize("fold", list(FOLDS))
def test_a_fold_needs_fp8_linears_on_the_triton_kernels(llama_dir, fold):
    with pytest.raises(ValueError, match=f"^{fold}: needs FP8 linears .* got quantization None"):
        LLM(llama_dir, dtype="float32", attention_backend="triton", num_blocks=32, **{fold: True})
