"""FP8 quantization of a model's linear layers: the scheme each layer runs, from a checkpoint's
`quantization_config` (the compressed-tensors format that llm-compressor writes) or from `--quantization fp8`.

A compressed-tensors FP8 checkpoint says, in config.json:

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false,
                      "strategy": "channel" | "tensor" | "block", "block_structure": [128, 128] (block)},
          "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                                "strategy": "token" (dynamic) | "tensor" (dynamic or static)
                                            | "group" (dynamic, "group_size": the block's columns)} | null}},
      "ignore": ["lm_head"],                                  # names, or "re:<regex>" (re.match)
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false} | null}

and holds, for each quantized linear (checkpoint names, before q/k/v or gate/up are packed):

    weight         [out, in] float8_e4m3fn
    weight_scale   [out, 1] (channel) or [1] (tensor), float:  w = weight * weight_scale
                   [cdiv(out, bn), cdiv(in, bk)] (block [bn, bk]):
                                                  w[n, k] = weight[n, k] * weight_scale[n // bn, k // bk]
    input_scale    [1], static activations only:               x_q = round(x / input_scale)

and, with a kv_cache_scheme, each attention layer's `self_attn.k_scale` and `self_attn.v_scale`.

The other FP8 formats are read into the same `Fp8Config`: `quant_method: "fp8"` (transformers'
FineGrainedFP8, DeepSeek-V3, Qwen3-*-FP8, AutoFP8) by `sluice.engine.loading.fp8_method_config`, NVIDIA
ModelOpt's by `modelopt_config`, FBGEMM's (`fbgemm_fp8`, Meta's Llama-3.1-405B-FP8) by `fbgemm_config`.

Anything else is refused with the field named (another quant_method, int weights, group weight strategies,
output activations, a field this reader does not know): a quantized checkpoint never runs as if it were not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

WEIGHT_STRATEGIES = ("channel", "tensor", "block")
# token: dynamic, a scale per row of x; tensor: dynamic, one scale per step; static: the checkpoint's
# input_scale; group: dynamic, a scale per row of x and group of block[1] columns (block weights only);
# none: weights only (x stays in the model dtype).
ACTIVATION_MODES = ("token", "tensor", "static", "group", "none")
COMPRESSED_TENSORS = "compressed-tensors"
FLOAT_QUANTIZED = "float-quantized"
# The same tensors: compressed-tensors' naive compressor stores each weight cast to its scheme's dtype (e4m3
# for float 8-bit args, which `_parse_args` requires) beside its scale, as the float compressor does.
FP8_FORMATS = (FLOAT_QUANTIZED, "naive-quantized")
_ARGS_FIELDS = {
    "num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure", "actorder",
    "observer", "observer_kwargs", "scale_dtype", "zp_dtype",
}  # fmt: skip
_CONFIG_FIELDS = {
    "quant_method", "format", "quantization_status", "config_groups", "ignore", "kv_cache_scheme",
    "global_compression_ratio", "sparsity_config", "transform_config", "version", "moe_sparsity_config",
}  # fmt: skip
_GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}


@dataclass(frozen=True)
class Fp8Scheme:
    """How one linear runs FP8: `weight_strategy` ("channel": a scale per output row; "tensor": one per
    checkpoint tensor, so a packed layer's shards each keep theirs; "block": one per `block` = (rows,
    columns) of the weight), `activations` (one of ACTIVATION_MODES; "group" goes with block weights, its
    groups `block[1]` columns wide), `serialized` (the checkpoint holds the e4m3 weights and their scales;
    False: float weights, quantized at load per channel or per block), `scale_name` (the checkpoint's name
    for the weight scales: "weight_scale", or "weight_scale_inv" in the quant_method fp8 format) and `aliases`
    ((checkpoint name, parameter) pairs: other names a checkpoint may give a parameter, e.g. transformers'
    weight_scale_inv for a per-tensor scale that vLLM and AutoFP8 call weight_scale).
    `activation_scale_ub` (token activations only): a row's amax is capped there before its scale is
    taken (FBGEMM's `quantize_fp8_per_row`), None: no cap."""

    weight_strategy: str = "channel"
    activations: str = "token"
    serialized: bool = False
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    aliases: tuple[tuple[str, str], ...] = ()
    activation_scale_ub: float | None = None

    def __post_init__(self) -> None:
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"weight_strategy: one of {WEIGHT_STRATEGIES}, got {self.weight_strategy!r}")
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"activations: must be one of {ACTIVATION_MODES}, got {self.activations!r}")
        if not self.serialized and (self.weight_strategy, self.activations) not in (
            ("channel", "token"),
            ("block", "group"),
        ):
            raise ValueError(
                "serialized: weights quantized at load take channel scales with token activations, or "
                "block scales with group activations"
            )
        blocked = self.weight_strategy == "block"
        if blocked != (self.block is not None) or (self.block is not None and not _is_block(self.block)):
            raise ValueError(f"block: two powers of two >= 16 with weight_strategy 'block', got {self.block}")
        if (self.activations not in ("group", "none")) if blocked else self.activations == "group":
            raise ValueError(
                f"activations: block weights take 'group' (or 'none') activations, got {self.activations!r} "
                f"with weight_strategy {self.weight_strategy!r}"
            )
        if self.scale_name not in ("weight_scale", "weight_scale_inv"):
            raise ValueError(f"scale_name: 'weight_scale' or 'weight_scale_inv', got {self.scale_name!r}")
        cap = self.activation_scale_ub
        if cap is not None and not (self.activations == "token" and 0 < cap < float("inf")):
            raise ValueError(
                f"activation_scale_ub: a positive finite cap on token activations, got {cap!r} with "
                f"activations {self.activations!r}"
            )


@dataclass(frozen=True)
class Fp8Group:
    """Linears matching any of `targets` ("Linear": every one; "re:<regex>": re.match on the checkpoint
    module name; else that exact name) run `scheme`, unless another group's target names them more closely
    (`_precedence`)."""

    name: str
    targets: tuple[str, ...]
    scheme: Fp8Scheme


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 scheme of every linear layer, by module name; `kv_cache_scales`: the checkpoint holds each
    attention layer's k_scale and v_scale. `packed_modules` maps a packed module of ours to the checkpoint
    modules it stacks (qkv_proj -> q_proj, k_proj, v_proj), whose names the targets match."""

    groups: tuple[Fp8Group, ...]
    ignore: tuple[str, ...] = ()
    kv_cache_scales: bool = False
    packed_modules: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def scheme_for(self, prefix: str) -> Fp8Scheme | None:
        """The scheme of the linear named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj"), None when it
        stays unquantized. Raises ValueError when the checkpoint modules a packed layer stacks differ."""
        parent, _, leaf = prefix.rpartition(".")
        parts = dict(self.packed_modules).get(leaf, (leaf,))
        names = [f"{parent}.{part}" if parent else part for part in parts]
        schemes = {name: self._scheme_of(name) for name in names}
        if len(set(schemes.values())) > 1:
            raise ValueError(
                f"quantization_config: {', '.join(names)} are quantized differently "
                f"({', '.join(f'{n}: {s}' for n, s in schemes.items())}); Sluice runs them as one matmul"
            )
        return schemes[names[0]]

    def _scheme_of(self, name: str) -> Fp8Scheme | None:
        """The scheme of checkpoint module `name`: none where `ignore` matches it, else that of the group
        whose target names it most closely (`_precedence`), as compressed-tensors and vLLM choose."""
        if any(_matches(target, name) for target in self.ignore):
            return None
        matched = [
            (_precedence(target), group.scheme)
            for group in self.groups
            for target in group.targets
            if _matches(target, name)
        ]
        if not matched:
            return None
        closest = min(rank for rank, _ in matched)
        schemes = {scheme for rank, scheme in matched if rank == closest}
        if len(schemes) > 1:
            raise ValueError(f"quantization_config.config_groups: {name} matches groups of different schemes")
        return schemes.pop()


# `--quantization fp8` on a float checkpoint: every linear but lm_head (its error reaches the logits
# directly; llm-compressor's recipes ignore it too), per-channel weights, dynamic per-token activations.
QUANTIZE_AT_LOAD = Fp8Config(groups=(Fp8Group("fp8", ("Linear",), Fp8Scheme()),), ignore=("lm_head",))


def quantize_at_load(weight_block: int | None) -> Fp8Config:
    """`--quantization fp8`'s config: QUANTIZE_AT_LOAD, or with `--fp8-weight-block N` the same linears in
    N x N weight blocks with dynamic activation groups of N columns (DeepSeek-V3 / Qwen3-FP8's layout)."""
    if weight_block is None:
        return QUANTIZE_AT_LOAD
    scheme = Fp8Scheme("block", "group", block=(weight_block, weight_block))
    return replace(QUANTIZE_AT_LOAD, groups=(Fp8Group("fp8", ("Linear",), scheme),))


def resolve_fp8_config(
    quantization: str | None,
    hf_config: Mapping[str, Any],
    packed_modules: Mapping[str, tuple[str, int]],
    *,
    tied_lm_head: bool = False,
    random_weights: bool = False,
    weight_block: int | None = None,
) -> Fp8Config | None:
    """The FP8 config a model runs under: its checkpoint's `quantization_config` (which must be FP8
    compressed-tensors, quant_method fp8, modelopt or fbgemm_fp8), else `--quantization fp8`'s, else None.
    A checkpoint that quantizes only its KV cache has float weights: `--quantization fp8` quantizes them at
    load.
    `random_weights` (load_format dummy): the weights are random floats, so a checkpoint's FP8 scheme is
    made at load. `weight_block` (`--fp8-weight-block`): what is quantized at load is in blocks
    (`quantize_at_load`). Raises ValueError naming the field when the checkpoint's config is not one Sluice
    runs, does not go with `quantization` or `weight_block` (its weights are FP8 already), or quantizes an
    lm_head tied to the embeddings (`tied_lm_head`)."""
    raw = hf_config.get("quantization_config")
    at_load = quantize_at_load(weight_block)
    if raw is None:
        config = at_load if quantization == "fp8" else None
    else:
        config = _parse(raw)
        if quantization not in (None, "fp8"):
            raise ValueError(
                f"quantization: {quantization} does not go with the checkpoint's FP8 quantization_config "
                "(leave it unset, or fp8)"
            )
        if random_weights:  # float weights: FP8 where the checkpoint's are, or where asked
            config = at_load if config.groups or quantization == "fp8" else None
        elif weight_block is not None and config.groups:
            raise ValueError(
                "fp8_weight_block: the checkpoint's weights are FP8 already (quantization_config); "
                "leave it unset"
            )
        elif quantization == "fp8" and not config.groups:
            config = replace(at_load, kv_cache_scales=config.kv_cache_scales)
    if config is None:
        return None
    if tied_lm_head and config.scheme_for("lm_head") is not None:
        raise ValueError(
            "quantization_config.ignore: lm_head shares the embeddings' weight (tie_word_embeddings) and "
            "cannot run FP8; list it in ignore"
        )
    return replace(config, packed_modules=_packed_parts(packed_modules))


def _parse(raw: Any) -> Fp8Config:
    """A quantization_config in an FP8 format: quant_method fp8, modelopt, fbgemm_fp8, else
    compressed-tensors."""
    # both import this module
    from sluice.engine.loading.fbgemm_config import FBGEMM_FP8, parse_fbgemm_fp8
    from sluice.engine.loading.fp8_method_config import FP8_METHOD, parse_fp8_method
    from sluice.engine.loading.modelopt_config import MODELOPT, parse_modelopt

    parsers = {FP8_METHOD: parse_fp8_method, MODELOPT: parse_modelopt, FBGEMM_FP8: parse_fbgemm_fp8}
    if isinstance(raw, Mapping) and raw.get("quant_method") in parsers:
        return parsers[raw["quant_method"]](raw)
    return parse_compressed_tensors(raw)


def parse_compressed_tensors(raw: Mapping[str, Any]) -> Fp8Config:
    """A checkpoint's `quantization_config` dict -> Fp8Config (serialized schemes). Raises ValueError naming
    the first field (dotted from `quantization_config`) that is not FP8 compressed-tensors as above."""
    where = "quantization_config"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method != COMPRESSED_TENSORS:  # before the fields: a GPTQ / AWQ config's are all unknown here
        raise ValueError(
            f"{where}.quant_method: {method!r} is not supported, only {COMPRESSED_TENSORS}, fp8, modelopt or "
            "fbgemm_fp8"
        )
    refuse_unknown(raw, _CONFIG_FIELDS, where)
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status: {status!r} is not supported; supported: 'compressed'")
    for extra in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if raw.get(extra):
            raise ValueError(f"{where}.{extra}: is not supported")
    groups_raw = raw.get("config_groups", {})
    if not isinstance(groups_raw, Mapping) or not (groups_raw or raw.get("kv_cache_scheme")):
        raise ValueError(f"{where}.config_groups: must be a non-empty object (or a kv_cache_scheme given)")
    default_format = raw.get("format", FLOAT_QUANTIZED)
    groups = tuple(
        _parse_group(name, group, default_format, f"{where}.config_groups.{name}")
        for name, group in groups_raw.items()
    )
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(name, str) for name in ignore):
        raise ValueError(f"{where}.ignore: must be a list of module names")
    _check_regexes(ignore, f"{where}.ignore")
    kv_scheme = raw.get("kv_cache_scheme")
    if kv_scheme is not None:
        args = _parse_args(kv_scheme, f"{where}.kv_cache_scheme")
        if args["strategy"] != "tensor" or args["dynamic"]:
            raise ValueError(
                f"{where}.kv_cache_scheme.strategy: only static per-tensor ('tensor', dynamic false) K/V "
                f"scales are supported, got {args['strategy']!r} with dynamic {args['dynamic']}"
            )
    return Fp8Config(groups, tuple(ignore), kv_cache_scales=kv_scheme is not None)


def _parse_group(name: str, group: Any, default_format: str, where: str) -> Fp8Group:
    if not isinstance(group, Mapping):
        raise ValueError(f"{where}: must be a scheme object with targets and weights, got {group!r}")
    refuse_unknown(group, _GROUP_FIELDS, where)
    group_format, field = (
        (group["format"], f"{where}.format") if group.get("format") else (default_format, "")
    )
    if group_format not in FP8_FORMATS:
        field = field or "quantization_config.format"
        raise ValueError(f"{field}: {group_format!r} is not supported; supported: {', '.join(FP8_FORMATS)}")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{where}.targets: must be a non-empty list of names")
    _check_regexes(targets, f"{where}.targets")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: output quantization is not supported")
    weights = group.get("weights")
    if weights is None:
        raise ValueError(f"{where}.weights: missing; Sluice runs FP8 weights")
    weight_args = _parse_args(weights, f"{where}.weights")
    if weight_args["dynamic"]:
        raise ValueError(f"{where}.weights.dynamic: True is not supported (FP8 weights have stored scales)")
    if weight_args["strategy"] not in WEIGHT_STRATEGIES:
        raise ValueError(
            f"{where}.weights.strategy: {weight_args['strategy']!r} is not supported; supported: "
            f"{', '.join(WEIGHT_STRATEGIES)}"
        )
    block = None
    if weight_args["strategy"] == "block":
        block = parse_block(weight_args["block_structure"], f"{where}.weights.block_structure")
    activations = _activation_mode(group, where, block)
    return Fp8Group(name, tuple(targets), Fp8Scheme(weight_args["strategy"], activations, True, block))


def parse_block(raw: Any, where: str) -> tuple[int, int]:
    """A weight block's [rows, columns] (two powers of two >= 16, as Sluice's kernels tile them)."""
    block = tuple(raw) if isinstance(raw, list) else raw
    if not _is_block(block):
        raise ValueError(f"{where}: {raw!r} is not supported (two powers of two >= 16, e.g. [128, 128])")
    return block


def _activation_mode(group: Mapping[str, Any], where: str, block: tuple[int, int] | None) -> str:
    """The group's activation mode; block weights take dynamic groups as wide as the block (or none)."""
    inputs = group.get("input_activations")
    if inputs is None:
        return "none"
    where = f"{where}.input_activations"
    args = _parse_args(inputs, where)
    strategy, dynamic = args["strategy"], args["dynamic"]
    if block is not None:
        if strategy != "group" or not dynamic:
            raise ValueError(
                f"{where}.strategy: {strategy!r} (dynamic {dynamic}) is not supported with block weights; "
                "supported: dynamic 'group'"
            )
        if args["group_size"] != block[1]:
            raise ValueError(
                f"{where}.group_size: {args['group_size']!r} is not supported; block weights take groups "
                f"as wide as their blocks ({block[1]})"
            )
        return "group"
    if strategy == "token" and dynamic:
        return "token"
    if strategy == "tensor":
        return "tensor" if dynamic else "static"
    raise ValueError(
        f"{where}.strategy: {strategy!r} (dynamic {dynamic}) is not supported; supported: "
        "dynamic 'token', dynamic or static 'tensor' (dynamic 'group' with block weights)"
    )


def _parse_args(args: Any, where: str) -> dict[str, Any]:
    """A compressed-tensors QuantizationArgs object that is symmetric 8-bit float; returns it."""
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}: must be an object, got {args!r}")
    refuse_unknown(args, _ARGS_FIELDS, where)
    checks = (
        ("num_bits", args.get("num_bits", 8) == 8, "FP8 takes 8"),
        ("type", str(args.get("type", "int")).lower() == "float", "FP8 takes 'float'"),
        ("symmetric", args.get("symmetric", True) is True, "FP8 scales are symmetric"),
        ("group_size", args.get("group_size") in (None, -1) or args.get("strategy") == "group",
         "only with strategy 'group'"),
        ("block_structure", args.get("block_structure") is None or args.get("strategy") == "block",
         "only with strategy 'block'"),
        ("actorder", args.get("actorder") in (None, False), "no activation ordering"),
        ("dynamic", args.get("dynamic", False) in (True, False), "true or false"),
        ("scale_dtype", _is_float_dtype(args.get("scale_dtype")), "scales are floats: a torch float dtype"),
        ("zp_dtype", args.get("zp_dtype") is None, "symmetric scales have no zero point"),
    )  # fmt: skip
    for field, ok, why in checks:
        if not ok:
            raise ValueError(f"{where}.{field}: {args.get(field)!r} is not supported ({why})")
    strategy = args.get("strategy")
    if not isinstance(strategy, str):
        raise ValueError(f"{where}.strategy: missing")
    return {
        "strategy": strategy,
        "dynamic": args.get("dynamic", False),
        "group_size": args.get("group_size"),
        "block_structure": args.get("block_structure"),
    }


def _is_float_dtype(name: Any) -> bool:
    """None (the scales' own dtype), or a torch floating dtype as compressed-tensors writes it
    ("torch.bfloat16", "bfloat16"): the scales are read as they are stored, widened to float32."""
    if name is None:
        return True
    import torch  # here: parsing a config needs no torch until a field names a dtype

    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _check_regexes(names: list[str], where: str) -> None:
    """Every "re:" entry of `names` (at `where`) is a regular expression; ValueError naming it otherwise
    (else re.error, naming neither, when the first module is matched)."""
    for name in names:
        if name.startswith("re:"):
            try:
                re.compile(name.removeprefix("re:"))
            except re.error as error:
                raise ValueError(f"{where}: {name!r} is not a regular expression ({error})") from None


def refuse_unknown(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    """Raise ValueError naming the first field of `raw` (at `where`) that is not in `known`."""
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field; Sluice does not know what it changes")


def transformers_left_out(names: Any, where: str) -> tuple[str, ...]:
    """A `modules_to_not_convert` list (at `where`) as `Fp8Config.ignore` regex targets, each matching as
    transformers' `should_convert_module` does: the entry as a regex, re.match up to a module boundary, or the
    name ending with the entry. ValueError naming `where` unless it is a list of non-empty regexes (an empty
    entry would end every name)."""
    if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"{where}: must be a list of module names")
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    targets = []
    for name in names:
        try:
            re.compile(name)
        except re.error as error:
            raise ValueError(f"{where}: {name!r} is not a regular expression ({error})") from None
        targets.append(f"re:(?:(?:{name}){boundary}|.*{re.escape(name)}$)")
    return tuple(targets)


def _packed_parts(packed_modules: Mapping[str, tuple[str, int]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """{"q_proj": ("qkv_proj", 0), ...} -> (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ...)."""
    parts: dict[str, list[tuple[int, str]]] = {}
    for checkpoint_part, (ours, shard) in packed_modules.items():
        parts.setdefault(ours, []).append((shard, checkpoint_part))
    return tuple((ours, tuple(part for _, part in sorted(shards))) for ours, shards in parts.items())


def _is_block(block: object) -> bool:
    return (
        isinstance(block, tuple)
        and len(block) == 2
        and all(isinstance(n, int) and n >= 16 and n & (n - 1) == 0 for n in block)
    )


def _precedence(target: str) -> int:
    """How closely a target that matches a module names it, closest first: the module's name (0), a "re:"
    regex (1), the class "Linear" (2). A module that two groups' targets match takes the closer one's scheme
    (a "re:.*down_proj$" group over a "Linear" one), as compressed-tensors' `match_targets` orders them."""
    if target == "Linear":
        return 2
    return 1 if target.startswith("re:") else 0


def _matches(target: str, name: str) -> bool:
    if target == "Linear":
        return True  # the class name: every linear layer
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name
