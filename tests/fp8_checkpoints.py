"""FP8 checkpoints in the compressed-tensors layout (what llm-compressor writes), made here from the tiny
random float checkpoints of `checkpoints.py`, and the transformers references the FP8 tests compare with.

`write_fp8_checkpoint` quantizes every q/k/v/o/gate/up/down projection to e4m3 with torch's own cast:
weights per output row ("channel") or per tensor ("tensor"), scale = max |w| / 448; static activation
scales ("static") from the float model's largest input to each projection over a calibration batch (q, k
and v see the same input, so they share it; so do gate and up); and, given `kv_scales`, every attention
layer's `self_attn.k_scale` / `v_scale`. config.json gets the matching `quantization_config`. With
weights "block", a scale per weight block and activations quantized per group (llm-compressor's FP8_BLOCK);
quant_method "fp8" writes the same tensors in that format (transformers' FineGrainedFP8Config's config).

References nobody here wrote:
  * `transformers_greedy` on an FP8 checkpoint: transformers with compressed-tensors loading it the usual
    way: it decompresses the e4m3 weights (w = weight * weight_scale) and quantizes each projection's input
    itself (per token, per tensor or with input_scale) before the float matmul.
  * `transformers_greedy(..., kv_scales=...)`: transformers with every K/V it caches rounded to e4m3 as
    k / k_scale (`RoundingCache`): transformers + compressed-tensors here do not apply a
    kv_cache_scheme (compressed-tensors looks for an attention `past_key_values` argument, which
    transformers 5 renamed `cache`), so that rounding, one torch cast, is the test's.
Greedy decoding reruns the whole sequence each step, so every step sees the same rounding as a prefill.

`fp8_layer` builds one FP8 linear layer for the unit tests of the FP8 matmuls.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
from collections.abc import Iterator

import torch
from safetensors.torch import load_file, save_file

from sluice.engine.loading.fp8_config import Fp8Scheme
from sluice.engine.worker.layers import fp8_linear
from sluice.engine.worker.layers.linear import ReplicatedLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}


def write_fp8_checkpoint(
    source: str,
    directory: str,
    *,
    weights: str = "channel",
    activations: str | None = "token",
    kv_scales: tuple[float, float] | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
    block: tuple[int, int] | None = None,
    quant_method: str = "compressed-tensors",
    names: str = "vllm",
    hf_quant_config: bool = False,
) -> str:
    """`source` (a float checkpoint directory) quantized into `directory`; `activations` is "token"
    (dynamic), "tensor" (dynamic per tensor), "static", "group" (dynamic, `block[1]` columns a group; with
    weights "block") or None (weights only). quant_method "fp8": the same tensors in that format
    (`fp8_method_config`), the block scales named weight_scale_inv; its per-tensor scales named as vLLM and
    AutoFP8 name them (`names` "vllm": weight_scale, input_scale) or as transformers' FineGrainedFP8Linear
    does ("transformers": weight_scale_inv, activation_scale, both 0-d); `names` "autofp8": vLLM's names,
    the KV scales as AutoFP8 saves them (k_proj.output_scale, v_proj.output_scale) and its config
    (ignored_layers, kv_cache_scheme "static"). quant_method "modelopt": NVIDIA
    ModelOpt's (`modelopt_config`: tensor weights with static activations, or channel weights with token
    ones; per-tensor scales 0-d, per-channel ones [out]; KV scales as k_proj.k_scale / v_proj.v_scale), its
    config in config.json or, `hf_quant_config`, in hf_quant_config.json."""
    tensors = _read_tensors(source)
    input_scales = _calibrate(source) if activations == "static" else {}
    out = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in PROJECTIONS or module in ignore or not name.endswith(".weight"):
            out[name] = tensor
            continue
        transformers = quant_method == "fp8" and names == "transformers"
        scale_name = (
            "weight_scale_inv" if quant_method == "fp8" and (block or transformers) else "weight_scale"
        )
        scalars = transformers or quant_method == "modelopt"  # 0-d per-tensor scales, [out] per channel
        out[name], scale = quantize_weight(tensor, weights, block)
        out[f"{module}.{scale_name}"] = scale.reshape(() if weights == "tensor" else -1) if scalars else scale
        if activations == "static":
            input_scale = input_scales[module]
            out[f"{module}.activation_scale" if transformers else f"{module}.input_scale"] = (
                input_scale.reshape(()) if scalars else input_scale.reshape(1)
            )
    for layer in range(_layers(source)):
        if kv_scales is not None:
            k, v = ("k_scale", "v_scale")
            if quant_method == "modelopt":
                k, v = ("k_proj.k_scale", "v_proj.v_scale")
            elif names == "autofp8":
                k, v = ("k_proj.output_scale", "v_proj.output_scale")
            out[f"model.layers.{layer}.self_attn.{k}"] = torch.tensor(kv_scales[0])
            out[f"model.layers.{layer}.self_attn.{v}"] = torch.tensor(kv_scales[1])
    os.makedirs(directory, exist_ok=True)
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(source, name), directory)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    if quant_method == "fp8" and names == "autofp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "static" if activations == "static" else "dynamic",
            "ignored_layers": list(ignore),
            "kv_cache_scheme": "static" if kv_scales is not None else None,
        }
    elif quant_method == "fp8":
        config["quantization_config"] = fp8_method_config(block, activations, ignore)
    elif quant_method == "modelopt":
        algo = {("tensor", "static"): "FP8", ("channel", "token"): "FP8_PER_CHANNEL_PER_TOKEN"}[
            weights, activations
        ]
        kv_cache = "FP8" if kv_scales is not None else None
        if hf_quant_config:
            quantization = {
                "quant_algo": algo,
                "kv_cache_quant_algo": kv_cache,
                "exclude_modules": list(ignore),
            }
            with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
                json.dump(
                    {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}, f
                )
        else:
            kv_scheme = {"type": "float", "num_bits": 8, "dynamic": False} if kv_cache else None
            config["quantization_config"] = {
                "quant_method": "modelopt",
                "quant_algo": algo,
                "kv_cache_scheme": kv_scheme,
                "ignore": list(ignore),
            }
    else:
        config["quantization_config"] = quantization_config(
            weights, activations, kv_scales is not None, ignore, block
        )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


@contextlib.contextmanager
def edited_config(directory: str) -> Iterator[dict]:
    """`directory`'s config.json as a dict, written back when the block ends (a test's change to the
    quantization_config a checkpoint was written with)."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    yield config
    with open(path, "w") as f:
        json.dump(config, f)


def quantization_config(
    weights: str,
    activations: str | None,
    kv_cache: bool,
    ignore: tuple[str, ...],
    block: tuple[int, int] | None = None,
) -> dict:
    """The compressed-tensors `quantization_config` of such a checkpoint."""
    inputs = None
    if activations == "group":
        inputs = {**_ARGS, "strategy": "group", "dynamic": True, "group_size": block[1]}
    elif activations is not None:
        strategy = "token" if activations == "token" else "tensor"
        inputs = {**_ARGS, "strategy": strategy, "dynamic": activations != "static"}
    weight_args = {**_ARGS, "strategy": weights, "dynamic": False}
    if block is not None:
        weight_args["block_structure"] = list(block)
    group = {
        "targets": ["Linear"],
        "weights": weight_args,
        "input_activations": inputs,
        "output_activations": None,
    }
    kv_scheme = {**_ARGS, "strategy": "tensor", "dynamic": False} if kv_cache else None
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": kv_scheme,
    }


def fp8_method_config(
    block: tuple[int, int] | None, activations: str | None, ignore: tuple[str, ...]
) -> dict:
    """The `quant_method: "fp8"` quantization_config transformers' FineGrainedFP8Config writes (block
    weights, dynamic groups), or AutoFP8's (tensor weights, "tensor" dynamic or "static" activations)."""
    from transformers import FineGrainedFP8Config

    scheme = "static" if activations == "static" else "dynamic"
    config = FineGrainedFP8Config(
        activation_scheme=scheme, weight_block_size=block, modules_to_not_convert=list(ignore) or None
    )
    return json.loads(config.to_json_string())


def quantize_weight(
    weight: torch.Tensor, strategy: str, block: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale [rows, 1] or [1], or [cdiv(rows, bn), cdiv(columns, bk)] for "block")
    with max |w| -> 448 per row, per tensor or per block."""
    if strategy == "block":
        return quantize_weight_blocks(weight, block)
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    codes = (w / (scale if strategy == "channel" else scale[0])).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale [cdiv(rows, bn), cdiv(columns, bk)]) with max |w| -> 448 per block (edge blocks
    partial), written out block by block: w[n, k] ~ codes[n, k] * scale[n // bn, k // bk]."""
    w = weight.float()
    rows, columns = w.shape
    block_n, block_k = block
    scale = torch.empty(-(-rows // block_n), -(-columns // block_k))
    codes = torch.empty(rows, columns, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * block_n : (i + 1) * block_n, j * block_k : (j + 1) * block_k]
            scale[i, j] = part.abs().amax() / FP8_MAX
            codes[i * block_n : (i + 1) * block_n, j * block_k : (j + 1) * block_k] = (
                (part / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            )
    return codes, scale


def transformers_greedy(
    directory: str,
    prompts: list[list[int]],
    max_tokens: int,
    kv_scales: tuple[float, float] | None = None,
) -> list[list[int]]:
    """Greedy tokens of transformers on `directory` (float, or FP8 through compressed-tensors); with
    `kv_scales`, every cached K/V rounded to e4m3 as k / k_scale (v / v_scale), then scaled back."""
    return [
        [int(step.argmax()) for step in steps]
        for steps in greedy_steps(directory, prompts, max_tokens, kv_scales)
    ]


def transformers_logits(directory: str, prompt: list[int]) -> torch.Tensor:
    """transformers (+ compressed-tensors for an FP8 checkpoint) logits [len(prompt), vocab], one forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def round_to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(x.dtype)


def greedy_steps(
    directory: str, prompts: list[list[int]], max_tokens: int, kv_scales: tuple[float, float] | None = None
) -> list[list[torch.Tensor]]:
    """`transformers_greedy`'s run: each step's last-position logits [vocab], whose argmax is its token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # transformers 5 names the cache argument `cache`, earlier versions `past_key_values`
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(max_tokens):
                kwargs = {} if kv_scales is None else {cache_argument: _rounding_cache(model, kv_scales)}
                steps.append(
                    model(torch.tensor([ids]), use_cache=kv_scales is not None, **kwargs).logits[0, -1]
                )
                ids.append(int(steps[-1].argmax()))
            outputs.append(steps)
    return outputs


def _rounding_cache(model, kv_scales: tuple[float, float]):
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = round_to_fp8(key_states, kv_scales[0]), round_to_fp8(value_states, kv_scales[1])
            return super().update(keys, values, layer_idx, *args, **kwargs)

    return RoundingCache(config=model.config)


def _read_tensors(directory: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _layers(directory: str) -> int:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def _calibrate(source: str) -> dict[str, torch.Tensor]:
    """Each projection's input_scale: max |input| / 448 over a seeded calibration batch, float model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            value = args[0].abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)

        return record

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in PROJECTIONS:
            module.register_forward_pre_hook(hook(name))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model(torch.randint(4, model.config.vocab_size, (4, 24), generator=generator))
    return {name: value / FP8_MAX for name, value in amax.items()}


def fp8_layer(
    weight: torch.Tensor,
    matmul: str,
    dtype: torch.dtype,
    activations: str,
    bias: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> ReplicatedLinear:
    """A ReplicatedLinear over `weight` [out, in] (and `bias`) running `Fp8LinearMethod(..., matmul)` in
    `dtype`: quantized at load per channel for dynamic "token" activations; for "static" ones serialized as
    a checkpoint holds it (e4m3 codes, per-row scales, input_scale 0.01)."""
    out_features, in_features = weight.shape
    scheme = Fp8Scheme("channel", activations, serialized=activations == "static")
    with torch.device(device):
        layer = ReplicatedLinear(in_features, out_features, bias=bias is not None)
        layer.set_method(fp8_linear.Fp8LinearMethod(scheme, matmul), dtype)
    if scheme.serialized:
        codes, scale = fp8_linear.quantize_weight(weight)
        layer.weight_loader(layer.weight, codes)
        layer.weight_loader(layer.weight_scale, scale[:, None])
        layer.weight_loader(layer.input_scale, torch.tensor([0.01]))
    else:
        layer.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.weight_loader(layer.bias, bias.to(dtype))
    layer.process_weights_after_loading()
    return layer
