"""FP8 weights against transformers: compressed-tensors FP8 checkpoints (written here in llm-compressor's
layout, `fp8_checkpoints.py`) load as they are and give transformers + compressed-tensors' greedy tokens on
the same checkpoint (up to near ties where both round activations to e4m3: `fp8_greedy`); `--quantization
fp8` on the float checkpoint gives the same tokens as that checkpoint quantized per channel; how the layers
hold what they loaded. All on CPU: the emulated matmul (fp32, the e4m3 weights and per-token-quantized
activations exact in it), the numerics of `torch._scaled_mm`."""

from __future__ import annotations

import pytest
import torch
from checkpoints import VOCAB_SIZE
from fp8_checkpoints import FP8, transformers_logits, write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from safetensors.torch import load_file, save_file

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import Fp8Scheme, resolve_fp8_config
from sluice.engine.loading.model_loader import read_arch
from sluice.engine.loading.weight_loader import checkpoint_shapes
from sluice.engine.model_registry import get_model_class
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.layers.fp8_linear import Fp8LinearMethod
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import LinearBase, QKVLinear

MAX_TOKENS = 6


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(21)
    return [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (4, 9, 15)]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [c.token_ids for c in llm.generate(prompts(), params)]


def linears(llm: LLM) -> dict[str, LinearBase]:
    model = llm.engine.model_runner.model
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize(
    ("source", "weights", "activations"),
    [
        ("llama_dir", "channel", "token"),
        ("llama_dir", "tensor", "static"),
        ("llama_dir", "tensor", "token"),
        ("llama_dir", "channel", None),
        ("qwen2_dir", "channel", "token"),
        ("qwen2_dir", "tensor", "static"),
        ("qwen2_dir", "channel", None),
    ],
    ids=lambda value: value.removesuffix("_dir") if isinstance(value, str) else "weights-only",
)
def test_an_fp8_checkpoint_gives_transformers_greedy_tokens(source, weights, activations, request, tmp_path):
    directory = write_fp8_checkpoint(
        request.getfixturevalue(source), str(tmp_path / "fp8"), weights=weights, activations=activations
    )
    llm = LLM(directory, num_blocks=32)
    scheme = Fp8Scheme(weights, activations or "none", serialized=True)
    layers = linears(llm)
    assert all(layers[name].method.scheme == scheme for name in layers if name != "lm_head")
    assert not isinstance(layers["lm_head"].method, Fp8LinearMethod)  # ignored: stays float
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)


def test_dynamic_per_tensor_activations_take_one_scale_per_step(llama_dir, tmp_path):
    """One scale for the whole step's x: a one-prompt prefill's logits equal transformers' on the prompt."""
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="channel", activations="tensor"
    )
    llm = LLM(directory, num_blocks=32)
    prompt = prompts()[2]
    out = SchedulerOutput((ScheduledRequest("p", tuple(prompt), 0, (0,), True),), len(prompt))
    logits = llm.engine.model_runner.execute_model(out)[0]
    expected = transformers_logits(directory, prompt)[-1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("source", ["llama_dir", "qwen2_dir", "qwen3_dir", "gemma3_dir"])
def test_quantize_at_load_equals_the_checkpoint_quantized_per_channel(source, request, tmp_path):
    float_dir = request.getfixturevalue(source)
    directory = write_fp8_checkpoint(float_dir, str(tmp_path / "fp8"), weights="channel", activations="token")
    llm = LLM(float_dir, quantization="fp8", num_blocks=32)
    layers = linears(llm)
    assert not isinstance(layers["lm_head"].method, Fp8LinearMethod)
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert qkv.method.scheme == Fp8Scheme("channel", "token", serialized=False)
    assert qkv.method.matmul == "emulated"
    # emulated: the e4m3 values widened to float32, once; they and the scales are the checkpoint's
    saved = load_file(f"{directory}/model.safetensors")
    q_rows = saved["model.layers.0.self_attn.q_proj.weight"]
    assert qkv.weight.dtype == torch.float32
    torch.testing.assert_close(qkv.weight[: q_rows.shape[0]], q_rows.float(), rtol=0, atol=0)
    q_scale = saved["model.layers.0.self_attn.q_proj.weight_scale"][:, 0]
    torch.testing.assert_close(qkv.weight_scale[: q_rows.shape[0]], q_scale, rtol=0, atol=0)
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)


def test_per_tensor_scales_of_packed_shards_stay_per_shard(llama_dir, tmp_path):
    """q, k and v each keep their own per-tensor weight_scale on their rows (nothing requantized); static
    input_scales of the shards become their largest."""
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="static")
    saved = load_file(f"{directory}/model.safetensors")
    prefix = "model.layers.1.self_attn"
    saved[f"{prefix}.k_proj.input_scale"] = saved[f"{prefix}.q_proj.input_scale"] * 2  # shards differ
    save_file(saved, f"{directory}/model.safetensors")
    llm = LLM(directory, num_blocks=32)
    qkv = linears(llm)[f"{prefix}.qkv_proj"]
    llm_scales = qkv.weight_scale
    start = 0
    for shard in ("q_proj", "k_proj", "v_proj"):
        rows = saved[f"{prefix}.{shard}.weight"].shape[0]
        expected = saved[f"{prefix}.{shard}.weight_scale"].expand(rows)
        torch.testing.assert_close(llm_scales[start : start + rows], expected, rtol=0, atol=0)
        start += rows
    assert qkv.input_scale.shape == () and qkv.input_scale == saved[f"{prefix}.k_proj.input_scale"]
    layer = QKVLinear(64, 16, 4, 2)
    layer.set_method(
        Fp8LinearMethod(Fp8Scheme("tensor", "static", serialized=True), "emulated"), torch.float32
    )
    for shard, scale in enumerate((0.25, 0.5, 0.125)):
        layer.weight_loader(layer.input_scale, torch.tensor([scale]), shard)
        layer.weight_loader(layer.weight_scale, torch.tensor([scale]), shard)
        layer.weight_loader(layer.weight, torch.zeros(layer.output_sizes[shard], 64, dtype=FP8), shard)
    layer.process_weights_after_loading()
    assert layer.input_scale.item() == 0.5
    assert layer.weight_scale.tolist() == [0.25] * 64 + [0.5] * 32 + [0.125] * 32


def test_checkpoint_shapes_of_an_fp8_model_are_the_checkpoints(llama_dir, tmp_path):
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="static")
    arch = read_arch(directory)
    model_class = get_model_class(arch.architecture)
    fp8 = resolve_fp8_config(None, arch.extra, model_class.packed_modules, tied_lm_head=True)
    kernels = KernelConfig(torch.device("meta"), torch.float32, quantization="fp8", fp8=fp8)
    model = model_class(arch, kernels)
    saved = {name: tuple(t.shape) for name, t in load_file(f"{directory}/model.safetensors").items()}
    assert dict(checkpoint_shapes(model)) == saved


def test_a_checkpoint_that_breaks_its_config_is_refused_naming_the_tensor(llama_dir, tmp_path):
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="channel", activations="token")
    path = f"{directory}/model.safetensors"
    saved = load_file(path)
    name = "model.layers.0.self_attn.k_proj"
    cases = [
        ({f"{name}.weight": saved[f"{name}.weight"].float()}, rf"'{name}.weight' has dtype torch.float32, "),
        (
            {f"{name}.weight_scale": torch.ones(1)},
            rf"'{name}.weight_scale' has shape \(1,\), expected \(32, 1\)",
        ),
        (  # exponents as bytes (e8m0 scales): read as numbers they would be 2**127 times too large
            {f"{name}.weight_scale": torch.full((32, 1), 127, dtype=torch.uint8)},
            rf"'{name}.weight_scale' has dtype torch.uint8, expected a float: a scale",
        ),
        (
            {f"{name}.weight_scale": None},
            r"^weights: missing \['model.layers.0.self_attn.qkv_proj.weight_scale'\]",
        ),
    ]
    for change, message in cases:
        tensors = {**saved, **change}
        save_file({k: v for k, v in tensors.items() if v is not None}, path)
        with pytest.raises(ValueError, match=message):
            LLM(directory, num_blocks=32)
    save_file(saved, path)
    with pytest.raises(ValueError, match=r"^quantization: int4 does not go with the checkpoint's FP8"):
        LLM(directory, num_blocks=32, quantization="int4")
