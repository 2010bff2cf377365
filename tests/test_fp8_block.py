"""Block-wise FP8 (a scale per 128 x 128 weight block, activations quantized per token and 128 columns:
DeepSeek-V3, Qwen3-*-FP8, llm-compressor's FP8_BLOCK) and the `quant_method: "fp8"` checkpoint format, on
CPU (the emulated matmul: the blocks multiplied out to float32 at load, each activation group's codes times
its scale).

References nobody here wrote: transformers + compressed-tensors on an FP8_BLOCK checkpoint (it decompresses
the blocks and quantizes each projection's input per group itself) give the greedy tokens (up to near ties:
`fp8_greedy`); transformers' FineGrainedFP8Config writes the quant_method fp8 config, whose checkpoint holds
the same tensors under other names (weight_scale_inv; per tensor, vLLM's and AutoFP8's names or
transformers' own), so it must run exactly as the compressed-tensors one. Blocks are 16 or 32 wide here (the
tiny models are 64-256 wide); a layer whose edges cut blocks is checked element by element.
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import edited_config, fp8_method_config, transformers_greedy, write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers
from safetensors.torch import load_file, save_file
from test_fp8_checkpoint import greedy, linears, prompts

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import Fp8Scheme, resolve_fp8_config
from sluice.engine.worker.layers.fp8_linear import FP8, Fp8LinearMethod
from sluice.engine.worker.layers.linear import ReplicatedLinear
from sluice.engine.worker.models.causal_lm import PACKED_QKV_GATE_UP

MAX_TOKENS = 6
DOWN = "model.layers.1.mlp.down_proj"


def _resolve(raw: dict):
    return resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)


@pytest.mark.parametrize(
    ("source", "block"),
    [("llama_dir", (16, 16)), ("llama_dir", (32, 32)), ("qwen3_dir", (32, 16)), ("qwen2_dir", (16, 32))],
    ids=lambda value: value.removesuffix("_dir") if isinstance(value, str) else "x".join(map(str, value)),
)
def test_a_block_checkpoint_gives_transformers_greedy_tokens(source, block, request, tmp_path):
    directory = write_fp8_checkpoint(
        request.getfixturevalue(source),
        str(tmp_path / "fp8"),
        weights="block",
        activations="group",
        block=block,
    )
    llm = LLM(directory, num_blocks=32)
    layers = linears(llm)
    scheme = Fp8Scheme("block", "group", serialized=True, block=block)
    assert all(layers[name].method.scheme == scheme for name in layers if name != "lm_head")
    assert layers[DOWN].method.matmul == "block_emulated"
    assert not isinstance(layers["lm_head"].method, Fp8LinearMethod)
    agrees_with_transformers(llm, directory, prompts(), MAX_TOKENS)


def test_block_weights_only_are_multiplied_out_at_load(llama_dir, tmp_path):
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="block", activations=None, block=(16, 32)
    )
    llm = LLM(directory, num_blocks=32)
    down = linears(llm)[DOWN]
    assert down.method.matmul == "dequantized" and down.weight.dtype == torch.float32
    assert greedy(llm) == transformers_greedy(directory, prompts(), MAX_TOKENS)


def test_the_fp8_method_format_runs_as_the_same_tensors_in_compressed_tensors(llama_dir, tmp_path):
    """weight_scale_inv is a product like compressed-tensors' weight_scale: the same codes and scales under
    the other names give the same layers and the same tokens (those of transformers, above)."""
    block = (32, 16)
    written = {
        method: write_fp8_checkpoint(
            llama_dir,
            str(tmp_path / method),
            weights="block",
            activations="group",
            block=block,
            quant_method=method,
        )  # fmt: skip
        for method in ("fp8", "compressed-tensors")
    }
    saved = load_file(f"{written['fp8']}/model.safetensors")
    assert saved[f"{DOWN}.weight_scale_inv"].shape == (64 // 32, 128 // 16)
    assert f"{DOWN}.weight_scale" not in saved
    llms = {method: LLM(directory, num_blocks=32) for method, directory in written.items()}
    ours, theirs = linears(llms["fp8"]), linears(llms["compressed-tensors"])
    assert ours[DOWN].method.scheme == Fp8Scheme("block", "group", True, block, scale_name="weight_scale_inv")
    assert not hasattr(ours[DOWN], "weight_scale_inv")  # renamed at load
    for name in ours:
        torch.testing.assert_close(ours[name].weight, theirs[name].weight, rtol=0, atol=0)
    assert greedy(llms["fp8"]) == greedy(llms["compressed-tensors"])
    agrees_with_transformers(llms["fp8"], written["compressed-tensors"], prompts(), MAX_TOKENS)


@pytest.mark.parametrize("names", ["vllm", "transformers"])
@pytest.mark.parametrize("activations", ["token", "static"])
def test_the_fp8_method_format_without_blocks_runs_as_per_tensor_compressed_tensors(
    activations, names, llama_dir, tmp_path
):
    """AutoFP8's layout: one weight_scale a tensor; dynamic activations per token (as transformers
    quantizes them), or the checkpoint's input_scale. transformers' FineGrainedFP8Linear names those
    weight_scale_inv and activation_scale (0-d): the same numbers, read as the same."""
    written = {
        method: write_fp8_checkpoint(
            llama_dir,
            str(tmp_path / method),
            weights="tensor",
            activations=activations,
            quant_method=method,
            names=names,
        )
        for method in ("fp8", "compressed-tensors")
    }
    saved = load_file(f"{written['fp8']}/model.safetensors")
    scale_names = {
        "vllm": ("weight_scale", "input_scale"),
        "transformers": ("weight_scale_inv", "activation_scale"),
    }
    weight_scale, input_scale = (f"{DOWN}.{name}" for name in scale_names[names])
    assert weight_scale in saved and (input_scale in saved) == (activations == "static")
    llms = {method: LLM(directory, num_blocks=32) for method, directory in written.items()}
    ours, theirs = linears(llms["fp8"]), linears(llms["compressed-tensors"])
    assert ours[DOWN].method.scheme.weight_strategy == "tensor"
    assert ours[DOWN].method.scheme.activations == activations
    for name in (name for name, linear in ours.items() if hasattr(linear, "weight_scale")):
        torch.testing.assert_close(ours[name].weight_scale, theirs[name].weight_scale, rtol=0, atol=0)
        if activations == "static":
            torch.testing.assert_close(ours[name].input_scale, theirs[name].input_scale, rtol=0, atol=0)
    assert greedy(llms["fp8"]) == greedy(llms["compressed-tensors"])
    agrees_with_transformers(llms["fp8"], written["compressed-tensors"], prompts(), MAX_TOKENS)


@pytest.mark.parametrize("block", [None, (16, 32)], ids=["tensor", "block"])
def test_the_fp8_method_with_dequantize_runs_the_weights_alone_as_transformers(block, llama_dir, tmp_path):
    """FineGrainedFP8Config's `dequantize: true`: transformers multiplies the codes by their scales at load
    and runs the float model (activations unquantized); Sluice ran FP8 activations."""
    directory = write_fp8_checkpoint(
        llama_dir,
        str(tmp_path / "fp8"),
        weights="block" if block else "tensor",
        activations="group" if block else "token",
        block=block,
        quant_method="fp8",
        names="vllm" if block else "transformers",  # transformers' names: weight_scale_inv, 0-d
    )
    with edited_config(directory) as config:
        config["quantization_config"]["dequantize"] = True
    llm = LLM(directory, num_blocks=32)
    down = linears(llm)[DOWN]
    assert (down.method.scheme.activations, down.method.matmul) == ("none", "dequantized")
    assert greedy(llm) == transformers_greedy(directory, prompts(), MAX_TOKENS)


def test_a_scale_under_both_of_its_names_is_refused(llama_dir, tmp_path):
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="tensor", activations="token", quant_method="fp8"
    )
    path = f"{directory}/model.safetensors"
    saved = load_file(path)
    save_file({**saved, f"{DOWN}.weight_scale_inv": saved[f"{DOWN}.weight_scale"].reshape(()).clone()}, path)
    with pytest.raises(
        ValueError, match=rf"^weights: '{DOWN}\.weight_scale(_inv)?' fills '{DOWN}\.weight_scale', which"
    ):
        LLM(directory, num_blocks=32)
    # a compressed-tensors checkpoint takes no other names
    ct = write_fp8_checkpoint(llama_dir, str(tmp_path / "ct"), weights="tensor", activations="token")
    path = f"{ct}/model.safetensors"
    saved = load_file(path)
    scale = saved.pop(f"{DOWN}.weight_scale")
    save_file({**saved, f"{DOWN}.weight_scale_inv": scale}, path)
    with pytest.raises(ValueError, match=rf"^weights: unexpected tensor '{DOWN}\.weight_scale_inv'"):
        LLM(ct, num_blocks=32)


def test_a_layer_whose_edges_cut_blocks_computes_each_group_and_block(tmp_path):
    """72 x 200 with 32 x 128 blocks: a partial last block row and column, a partial last group; y against
    the definition written out group by group."""
    generator = torch.Generator().manual_seed(3)
    out_features, in_features, block = 72, 200, (32, 128)
    codes = (torch.randn(out_features, in_features, generator=generator) * 40).to(FP8)
    scales = torch.rand(3, 2, generator=generator) + 0.01
    x = torch.randn(5, in_features, generator=generator)
    x[1, :128] = 0.0  # an all-zero group
    layer = ReplicatedLinear(in_features, out_features)
    layer.set_method(
        Fp8LinearMethod(Fp8Scheme("block", "group", True, block), "block_emulated"), torch.float32
    )
    layer.weight_loader(layer.weight, codes)
    layer.weight_loader(layer.weight_scale, scales)
    layer.process_weights_after_loading()
    expected = torch.zeros(5, out_features)
    for m in range(5):
        for group, columns in enumerate((slice(0, 128), slice(128, 200))):
            part = x[m, columns]
            scale = max(part.abs().max().item() / 448, torch.finfo(torch.float32).tiny)
            x_q = (part / scale).to(FP8).float() * scale
            for n in range(out_features):
                w = codes[n, columns].float() * scales[n // 32, group]
                expected[m, n] += (x_q * w).sum()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert layer(x)[1].abs().sum() > 0  # the zero group did not make the row NaN or zero


def test_a_block_checkpoint_that_breaks_its_layout_is_refused(llama_dir, tmp_path):
    directory = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="block", activations="group", block=(16, 16)
    )
    path = f"{directory}/model.safetensors"
    saved = load_file(path)
    save_file({**saved, f"{DOWN}.weight_scale": torch.ones(4, 4)}, path)
    with pytest.raises(
        ValueError, match=rf"^weights: '{DOWN}.weight_scale' has shape \(4, 4\), expected \(4, 8\)"
    ):
        LLM(directory, num_blocks=32)
    # 64-row blocks cannot stack q (64 rows), k (32) and v (32) into qkv_proj's blocks
    wide = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "wide"), weights="block", activations="group", block=(64, 16)
    )
    with pytest.raises(
        ValueError, match=r"weight blocks of 64 rows do not tile the packed shards of \(64, 32, 32\)"
    ):
        LLM(wide, num_blocks=32)


def test_what_transformers_writes_for_the_fp8_method_parses_to_its_scheme():
    config = _resolve(fp8_method_config((128, 128), "group", ("model.layers.1.mlp", "k_proj")))
    block = Fp8Scheme("block", "group", serialized=True, block=(128, 128), scale_name="weight_scale_inv")
    assert config.scheme_for("model.layers.0.self_attn.o_proj") == block
    assert config.scheme_for("model.layers.11.mlp.gate_up_proj") == block  # not model.layers.1.mlp
    assert config.scheme_for("model.layers.1.mlp.gate_up_proj") is None  # from the start, to a boundary
    assert config.scheme_for("model.layers.1.mlp.down_proj") is None
    assert config.scheme_for("lm_head") is None  # never quantized in this format
    with pytest.raises(ValueError, match=r"q_proj, .*k_proj, .*v_proj are quantized differently"):
        config.scheme_for("model.layers.0.self_attn.qkv_proj")  # k_proj left out by its suffix alone
    per_tensor = _resolve(fp8_method_config(None, "tensor", ()))
    inverse = ("weight_scale_inv", "weight_scale")  # transformers' name for the per-tensor scale
    assert per_tensor.scheme_for(DOWN) == Fp8Scheme("tensor", "token", serialized=True, aliases=(inverse,))
    static = _resolve(fp8_method_config(None, "static", ()))
    aliases = (inverse, ("activation_scale", "input_scale"))
    assert static.scheme_for(DOWN) == Fp8Scheme("tensor", "static", serialized=True, aliases=aliases)
    with pytest.raises(ValueError, match=r"^quantization_config.dequantize: true is supported with 'dyn"):
        _resolve({**fp8_method_config(None, "static", ()), "dequantize": True})  # its input scales unused
    deepseek = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert _resolve(deepseek).scheme_for(DOWN) == block
    assert _resolve({**deepseek, "ignored_layers": [DOWN]}).scheme_for(DOWN) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("fmt", "e5m2", "'e5m2' is not supported; supported: 'e4m3'"),
        ("scale_fmt", "ue8m0", "'ue8m0' is not supported; supported: 'float'"),
        ("activation_scheme", "static", "block weights take 'dynamic' activations"),
        ("activation_scheme", "per_token", "'per_token' is not supported; supported: 'dynamic', 'static'"),
        ("weight_block_size", [128, 96], r"\[128, 96\] is not supported \(two powers of two >= 16"),
        ("modules_to_not_convert", "lm_head", "must be a list of module names"),
        ("modules_to_not_convert", ["layers.(1"], r"'layers.\(1' is not a regular expression"),
        ("modules_to_convert", ["q_proj"], r"\['q_proj'\] is not supported; supported: None"),
        ("bits", 8, "unknown field; Sluice does not know what it changes"),
        ("dequantize", "yes", "must be true or false, got 'yes'"),
    ],
)
def test_an_unsupported_fp8_method_config_is_refused_naming_the_field(field, value, message):
    raw = {**fp8_method_config((128, 128), "group", ()), field: value}
    with pytest.raises(ValueError, match=rf"^quantization_config.{field}: {message}"):
        _resolve(raw)


def _block_layer(matmul: str, codes: torch.Tensor, scales: torch.Tensor, block, dtype) -> ReplicatedLinear:
    out_features, in_features = codes.shape
    layer = ReplicatedLinear(in_features, out_features)
    layer.set_method(Fp8LinearMethod(Fp8Scheme("block", "group", True, block), matmul), dtype)
    layer.weight_loader(layer.weight, codes)
    layer.weight_loader(layer.weight_scale, scales)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("num_rows", [1, 7, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_block_path_computes_what_the_emulation_does(dtype, num_rows):
    """`block_triton` (the CUDA path, here under the Triton interpreter): it keeps the e4m3 codes and block
    scales, quantizes x with `quantize_fp8_groups` (the same codes and scales) and multiplies them with
    `fp8_block_skinny_mm` up to SKINNY_MAX_ROWS rows (one row included), `fp8_block_mm` above; y equals the
    emulation's up to the order of the fp32 sums."""
    generator = torch.Generator().manual_seed(5)
    block = (32, 32)
    codes = (torch.randn(80, 96, generator=generator) * 40).to(FP8)
    scales = torch.rand(3, 3, generator=generator) + 0.01
    fast, emulated = (
        _block_layer(m, codes, scales, block, dtype) for m in ("block_triton", "block_emulated")
    )
    assert fast.weight.dtype == FP8 and fast.weight_scale.shape == (3, 3)
    assert emulated.weight.dtype == torch.float32
    calls = []
    skinny = fast.method._fp8_block_skinny_mm
    fast.method._fp8_block_skinny_mm = lambda *args: calls.append(("skinny", args[0].shape)) or skinny(*args)
    x = torch.randn(num_rows, 96, generator=generator).to(dtype)
    y, expected = fast(x), emulated(x)
    taken = {1: [("skinny", (1, 96))], 7: [("skinny", (7, 96))], 65: []}  # 65 rows: fp8_block_mm
    assert calls == taken[num_rows]
    assert y.dtype == expected.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_block_schemes_take_the_triton_kernel_on_sm89_and_up():
    from test_fp8_dispatch import CUDA, method_on

    from sluice.engine.loading.fp8_config import Fp8Config, Fp8Group

    def matmul(capability, activations="group", device=CUDA):
        scheme = Fp8Scheme("block", activations, serialized=True, block=(128, 128))
        fp8 = Fp8Config(groups=(Fp8Group("block", ("Linear",), scheme),))
        return method_on(capability, fp8=fp8, sizes=(256, (256, 128)), device=device).matmul

    assert matmul((9, 0)) == matmul((8, 9)) == "block_triton"
    assert matmul((8, 6)) == matmul(None, device=torch.device("cpu")) == "block_emulated"
    assert matmul((9, 0), activations="none") == "dequantized"
    with pytest.raises(ValueError, match=r"^matmul: 'rowwise' does not run weight_strategy 'block'"):
        Fp8LinearMethod(Fp8Scheme("block", "group", True, (128, 128)), "rowwise")


def test_the_engines_block_quantizer_makes_the_blocks_written_here():
    """`quantize_weight_blocks` (what the benchmarks quantize with) gives the codes and scales of this
    suite's block-by-block writer, partial edge blocks included."""
    from fp8_checkpoints import quantize_weight_blocks as written_here

    from sluice.engine.worker.layers.fp8_blocks import quantize_weight_blocks

    weight = torch.randn(72, 200, generator=torch.Generator().manual_seed(8))
    codes, scale = quantize_weight_blocks(weight, (32, 128))
    want_codes, want_scale = written_here(weight, (32, 128))
    assert scale.shape == (3, 2)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_quantized_at_load_in_blocks_runs_as_the_block_checkpoint(llama_dir, tmp_path):
    """`--quantization fp8 --fp8-weight-block 32` on a float checkpoint makes the blocks that the FP8_BLOCK
    checkpoint of the same weights holds (the engine's block quantizer is this suite's writer's), so the
    layers hold the same numbers and give the same greedy tokens, which are transformers +
    compressed-tensors' on that checkpoint."""
    block = (32, 32)
    written = write_fp8_checkpoint(
        llama_dir, str(tmp_path / "fp8"), weights="block", activations="group", block=block
    )
    at_load = LLM(llama_dir, quantization="fp8", fp8_weight_block=32, num_blocks=32)
    from_checkpoint = LLM(written, num_blocks=32)
    ours, theirs = linears(at_load), linears(from_checkpoint)
    assert ours[DOWN].method.scheme == Fp8Scheme("block", "group", serialized=False, block=block)
    for name in ours:
        torch.testing.assert_close(ours[name].weight, theirs[name].weight, rtol=0, atol=0)
    assert greedy(at_load) == greedy(from_checkpoint)
    agrees_with_transformers(at_load, written, prompts(), MAX_TOKENS)


def test_a_preset_quantized_at_load_in_128_blocks():
    llm = LLM(preset="tiny", quantization="fp8", fp8_weight_block=128, num_blocks=16)
    layer = linears(llm)["model.layers.0.self_attn.qkv_proj"]
    assert layer.method.scheme.block == (128, 128) and layer.method.matmul == "block_emulated"
    assert layer.weight_scale.shape == (5, 3)  # q 384, k 128, v 128 rows; 384 columns


def test_weight_blocks_at_load_are_refused_where_they_cannot_run(llama_dir, tmp_path):
    from sluice.engine.config import ModelConfig

    with pytest.raises(ValueError, match=r"^fp8_weight_block: goes with quantization fp8$"):
        ModelConfig(fp8_weight_block=128)
    with pytest.raises(ValueError, match=r"^fp8_weight_block: must be a power of two >= 16, got 48$"):
        ModelConfig(quantization="fp8", fp8_weight_block=48)
    # q 64, k 32, v 32 rows: 64-row blocks would straddle k and v
    with pytest.raises(
        ValueError,
        match=r"fp8_weight_block: weight blocks of 64 rows do not tile the packed shards of \(64, 32, 32\)",
    ):
        LLM(llama_dir, quantization="fp8", fp8_weight_block=64, num_blocks=32)
    written = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match=r"fp8_weight_block: the checkpoint's weights are FP8 already"):
        LLM(written, quantization="fp8", fp8_weight_block=32, num_blocks=32)
