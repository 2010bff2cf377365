"""FP8 activation quantization fused into RMSNorm and SiLU-and-mul (`layers/fp8_activations.py`) in whole
models: FP8 checkpoints (compressed-tensors, per-token and static activations) on the Triton kernels
(interpreted on CPU) with the FP8 layers on `torch._scaled_mm`, which torch runs on CPU too: the matmul an
sm_89+ GPU takes, chosen here by replacing the device check (`scaled_mm_on_cpu`). With the fusion on, each
decoder layer launches `fp8_quant` once (o_proj) instead of four times; the final hidden states are bit for
bit those with it off (`KernelConfig.fuse_fp8_quant_norm` / `_silu` False) at 28 rows (`fp8_skinny_mm`) and
71 rows (`_scaled_mm`); one-row steps (`fp8_gemv`) launch none either way; and greedy tokens equal
transformers' on the checkpoint (the reference test_fp8_checkpoint ties the emulated path to). Under tensor
parallelism the row-parallel down_proj's fused input is its own launch's on the rank's slice (per-token
amax over the slice). Block FP8 (a scale per weight block, activations per group of block_k columns) on
`block_triton` (interpreted here): the norm and SiLU-and-mul write `quantize_fp8_groups`' codes and group
scales, with the same bit-for-bit checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from test_fp8_checkpoint import MAX_TOKENS, prompts

from sluice.engine.distributed.group import TensorParallelGroup
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import quantize_at_load
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.layers import quantization
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.fp8_activations import Fp8Activations
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.mlp import GatedMLP
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.kernels import fp8_block_mm

BLOCK = 16
NUM_LAYERS, HIDDEN, INTERMEDIATE = 2, 64, 128  # checkpoints.py's tiny models


@pytest.fixture
def block_triton_on_cpu(monkeypatch):
    """Block-FP8 layers run `block_triton` (`quantize_fp8_groups` + `fp8_block_mm`, or `fp8_block_skinny_mm`
    up to 64 rows), the CUDA sm_89+ path, on CPU under the Triton interpreter instead of the emulation."""
    chosen = quantization.fp8_matmul_for

    def on_cpu(scheme, kernels, input_size, output_size):
        matmul = chosen(scheme, kernels, input_size, output_size)
        return "block_triton" if matmul == "block_emulated" else matmul

    monkeypatch.setattr(quantization, "fp8_matmul_for", on_cpu)


@pytest.fixture
def group_launches(monkeypatch) -> list[tuple[tuple[int, int], int]]:
    """(x's shape, group_size) of every `quantize_fp8_groups` launch, in order."""
    calls: list[tuple[tuple[int, int], int]] = []
    launch = fp8_block_mm.quantize_fp8_groups
    monkeypatch.setattr(
        fp8_block_mm,
        "quantize_fp8_groups",
        lambda x, group_size, *args: (
            calls.append((tuple(x.shape), group_size)) or launch(x, group_size, *args)
        ),
    )
    return calls


def _llm(directory: str, dtype: str) -> LLM:
    llm = LLM(directory, dtype=dtype, attention_backend="triton", block_size=BLOCK, num_blocks=32)
    model = llm.engine.model_runner.model
    for layer in model.model.layers:  # on by default
        assert layer.self_attn.qkv_proj.method.matmul in ("rowwise", "tensorwise")
        assert layer.input_layernorm.fuses_fp8_quant and layer.mlp.act.fuses_fp8_quant
    return llm


def _select_fusion(llm: LLM, fused: bool) -> None:
    runner = llm.engine.model_runner
    kernels = dataclasses.replace(
        runner.kernels,
        fuse_fp8_quant_norm=fused,
        fuse_fp8_quant_norm_groups=fused,
        fuse_fp8_quant_silu=fused,
    )
    for module in runner.model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.select(kernels)


def _final_hidden(llm: LLM, lengths: tuple[int, ...]) -> torch.Tensor:
    """A prefill step of one request per length: the final norm's output [sum(lengths), hidden]."""
    generator = torch.Generator().manual_seed(sum(lengths))
    requests, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = -(-length // BLOCK)
        tokens = tuple(torch.randint(4, 200, (length,), generator=generator).tolist())
        blocks = tuple(range(next_block, next_block + num_blocks))
        requests.append(ScheduledRequest(f"r{i}", tokens, 0, blocks, True))
        next_block += num_blocks
    runner = llm.engine.model_runner
    captured = []
    hook = runner.model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out[0].clone()))
    try:
        runner.execute_model(SchedulerOutput(tuple(requests), sum(lengths)))
    finally:
        hook.remove()
    assert len(captured) == 1
    return captured[0]


@pytest.mark.parametrize(
    ("source", "activations"),
    [
        ("llama_dir", "token"),
        ("llama_dir", "static"),
        ("qwen3_dir", "token"),  # its own attention module (q/k norms)
        ("qwen3_dir", "static"),
        ("qwen2_dir", "token"),  # qkv_proj with a bias, added after the product from the fused codes
    ],
)
def test_fused_quantization_gives_the_same_hidden_states_with_fewer_launches(
    source, activations, request, tmp_path, scaled_mm_on_cpu, quant_launches
):
    directory = write_fp8_checkpoint(
        request.getfixturevalue(source), str(tmp_path / "fp8"), weights="channel", activations=activations
    )
    llm = _llm(directory, "bfloat16")
    q_size = llm.engine.model_runner.model.model.layers[0].self_attn.o_proj.input_size
    for lengths in [(4, 9, 15), (30, 41)]:  # 28 rows: fp8_skinny_mm; 71: _scaled_mm
        rows = sum(lengths)
        quant_launches.clear()
        fused = _final_hidden(llm, lengths)
        assert quant_launches == [(rows, q_size)] * NUM_LAYERS  # o_proj's only
        _select_fusion(llm, False)
        quant_launches.clear()
        unfused = _final_hidden(llm, lengths)
        _select_fusion(llm, True)
        # qkv, o, gate_up, down
        per_layer = [(rows, HIDDEN), (rows, q_size), (rows, HIDDEN), (rows, INTERMEDIATE)]
        assert quant_launches == per_layer * NUM_LAYERS
        assert fused.dtype == torch.bfloat16 and fused.shape == (rows, HIDDEN) and fused.isfinite().all()
        assert torch.equal(fused, unfused)
    quant_launches.clear()
    one_row = _final_hidden(llm, (1,))  # every layer on fp8_gemv: nothing to fuse, nothing launched
    assert quant_launches == [] and one_row.isfinite().all()


def test_fused_greedy_tokens_equal_transformers(llama_dir, tmp_path, scaled_mm_on_cpu, quant_launches):
    """float32 on `_scaled_mm` (tensorwise) with the fusion on: 3 prompts, so the decode steps run 3 rows
    (fused) and the prefills 28."""
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="channel", activations="token")
    llm = _llm(directory, "float32")
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)
    q_size = llm.engine.model_runner.model.model.layers[0].self_attn.o_proj.input_size
    assert quant_launches and all(shape[1] == q_size for shape in quant_launches)  # o_proj's only


@pytest.mark.parametrize(("source", "block"), [("llama_dir", (32, 32)), ("qwen3_dir", (16, 16))])
def test_fused_group_quantization_for_block_fp8_gives_the_same_hidden_states(
    source, block, request, tmp_path, block_triton_on_cpu, group_launches
):
    """A block checkpoint (llm-compressor's FP8_BLOCK) on block_triton: with the fusion on, each decoder
    layer launches `quantize_fp8_groups` once (o_proj) instead of four times, and the final hidden states
    are bit for bit those with it off. By default the norm leaves the groups to the linears (slower fused on
    an H200, run 12) and SiLU-and-mul writes them: a one-row step launches it for qkv, o and gate_up."""
    directory = write_fp8_checkpoint(
        request.getfixturevalue(source),
        str(tmp_path / "fp8"),
        weights="block",
        activations="group",
        block=block,
    )
    llm = LLM(directory, dtype="bfloat16", attention_backend="triton", block_size=BLOCK, num_blocks=32)
    layers = llm.engine.model_runner.model.model.layers
    assert all(layer.mlp.down_proj.method.matmul == "block_triton" for layer in layers)
    q_size = layers[0].self_attn.o_proj.input_size
    group = block[1]
    one_row = _final_hidden(llm, (1,))  # the defaults
    per_layer = [(1, HIDDEN), (1, q_size), (1, HIDDEN)]  # qkv, o, gate_up; down's came from SiLU-and-mul
    assert group_launches == [(shape, group) for shape in per_layer] * NUM_LAYERS
    assert one_row.isfinite().all()
    _select_fusion(llm, True)
    group_launches.clear()
    rows = 28
    fused = _final_hidden(llm, (4, 9, 15))
    assert group_launches == [((rows, q_size), group)] * NUM_LAYERS  # o_proj's only
    _select_fusion(llm, False)
    group_launches.clear()
    unfused = _final_hidden(llm, (4, 9, 15))
    per_layer = [
        (rows, HIDDEN),
        (rows, q_size),
        (rows, HIDDEN),
        (rows, INTERMEDIATE),
    ]  # qkv, o, gate_up, down
    assert group_launches == [(shape, group) for shape in per_layer] * NUM_LAYERS
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, HIDDEN) and fused.isfinite().all()
    assert torch.equal(fused, unfused)


def test_fused_group_quantization_greedy_tokens_equal_transformers(
    llama_dir, tmp_path, block_triton_on_cpu, group_launches
):
    """float32 on block_triton with the fusion on (3-row decode steps and 28-row prefills fused)."""
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="block", activations="group", block=(16, 16)
    )
    llm = LLM(directory, dtype="float32", attention_backend="triton", block_size=BLOCK, num_blocks=32)
    _select_fusion(llm, True)
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)
    q_size = llm.engine.model_runner.model.model.layers[0].self_attn.o_proj.input_size
    assert group_launches and all(shape[1] == q_size for shape, _ in group_launches)  # o_proj's only


class _PartialSums(TensorParallelGroup):
    """Rank `rank` of 2 whose all-reduce returns the rank's own partial product (no other process)."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, 2, torch.device("cpu"), process_group=object())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _rank_mlp(
    rank: int, weights: dict[str, torch.Tensor], weight_block: int | None
) -> tuple[GatedMLP, KernelConfig]:
    """Rank `rank`'s part of a 64 -> 2 x 96 -> 64 MLP quantized at load (per-token activations on
    `_scaled_mm`, or in weight blocks with activation groups on block_triton), bfloat16, on the Triton ops."""
    kernels = KernelConfig(
        torch.device("cpu"),
        torch.bfloat16,
        TritonAttentionBackend(),
        quantization="fp8",
        fp8=quantize_at_load(weight_block),
        tensor_parallel=_PartialSums(rank),
        fuse_fp8_quant_silu=True,
    )
    mlp = GatedMLP(HIDDEN, 96, "silu").to(torch.bfloat16)
    mlp.gate_up_proj.select(kernels, "model.layers.0.mlp.gate_up_proj")
    mlp.down_proj.select(kernels, "model.layers.0.mlp.down_proj")
    mlp.act.select(kernels)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, weights["gate"], 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, weights["up"], 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, weights["down"])
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.process_weights_after_loading()
        assert linear.method.matmul == ("rowwise" if weight_block is None else "block_triton")
    assert mlp.down_proj.input_size == 48 and mlp.act.fuses_fp8_quant
    return mlp, kernels


@pytest.mark.parametrize("weight_block", [None, 16])
def test_row_parallel_down_proj_gets_the_codes_of_its_own_slice(
    weight_block, scaled_mm_on_cpu, block_triton_on_cpu, quant_launches, group_launches
):
    """On each of 2 ranks the fused SiLU-and-mul quantizes the rank's 48 intermediate columns per token (or
    per group of 16 of them), as down_proj's own launch does on that slice: the rank's partial sums are bit
    for bit the same."""
    launches = quant_launches if weight_block is None else group_launches
    generator = torch.Generator().manual_seed(3)
    shapes = {"gate": (96, HIDDEN), "up": (96, HIDDEN), "down": (HIDDEN, 96)}
    weights = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()
    }
    x = torch.randn(9, HIDDEN, generator=generator).to(torch.bfloat16)

    def launched(*shapes: tuple[int, int]) -> list:
        return list(shapes) if weight_block is None else [(shape, weight_block) for shape in shapes]

    for rank in (0, 1):
        mlp, kernels = _rank_mlp(rank, weights, weight_block)
        gate_up = mlp.gate_up_proj(x)
        assert gate_up.shape == (9, 96)  # [this rank's 48 gate columns | its 48 up columns]
        codes = mlp.act.activate_for(mlp.down_proj, gate_up)
        assert isinstance(codes, Fp8Activations) and codes.x_q.shape == (9, 48)
        assert codes.x_scale.shape == (9, 1 if weight_block is None else 3)
        launches.clear()
        fused = mlp(x)
        assert launches == launched((9, HIDDEN))  # gate_up's own; down_proj's input came quantized
        mlp.act.select(dataclasses.replace(kernels, fuse_fp8_quant_silu=False))
        launches.clear()
        unfused = mlp(x)
        assert launches == launched((9, HIDDEN), (9, 48))  # down_proj quantizes its slice itself
        assert fused.shape == (9, HIDDEN) and fused.isfinite().all() and torch.equal(fused, unfused)
