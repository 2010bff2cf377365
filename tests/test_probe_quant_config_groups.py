"""compressed-tensors configs with more than one config group: a linear that two groups' targets match runs
the scheme of the target that names it most closely (its exact name, then a "re:" regex, then the class
"Linear"), as compressed-tensors' `match_targets` orders them and as transformers + compressed-tensors load
such a checkpoint (vLLM's `find_matched_target` alike); two targets of the same kind with different
schemes stay refused. And `load_format="dummy"` with `quantization="fp8"` on a checkpoint whose
quantization_config quantizes only its KV cache quantizes the random weights at load, as on a float one; a
"re:" target or ignore entry that is no regular expression is refused naming the field and the entry."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from checkpoints import VOCAB_SIZE
from fp8_checkpoints import edited_config, quantization_config, write_fp8_checkpoint
from fp8_greedy import agrees_with_transformers

from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.fp8_config import Fp8Scheme, resolve_fp8_config
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker.layers.fp8_linear import Fp8LinearMethod
from sluice.engine.worker.models.causal_lm import PACKED_QKV_GATE_UP

DOWN = "model.layers.1.mlp.down_proj"
PER_TOKEN = Fp8Scheme("channel", "token", serialized=True)
WEIGHTS_ONLY = Fp8Scheme("channel", "none", serialized=True)
STATIC = Fp8Scheme("tensor", "static", serialized=True)


def _with_groups(**extra: tuple[list[str], str, str | None]) -> dict:
    """The channel/token "Linear" config plus groups name -> (targets, weight strategy, activations)."""
    raw = quantization_config("channel", "token", False, ("lm_head",))
    for name, (targets, weights, activations) in extra.items():
        group = quantization_config(weights, activations, False, ())["config_groups"]["group_0"]
        raw["config_groups"][name] = {**copy.deepcopy(group), "targets": targets}
    return raw


def _resolve(raw: dict):
    return resolve_fp8_config(None, {"quantization_config": raw}, PACKED_QKV_GATE_UP)


def test_the_closest_target_decides_a_modules_scheme():
    config = _resolve(_with_groups(group_1=(["re:.*down_proj$"], "channel", None)))
    assert config.scheme_for(DOWN) == WEIGHTS_ONLY  # the regex over "Linear"
    assert config.scheme_for("model.layers.1.mlp.gate_up_proj") == PER_TOKEN
    config = _resolve(
        _with_groups(group_1=(["re:.*mlp\\..*_proj$"], "tensor", "static"), group_2=([DOWN], "channel", None))
    )
    assert config.scheme_for(DOWN) == WEIGHTS_ONLY  # its exact name over the regex
    assert config.scheme_for("model.layers.0.mlp.down_proj") == STATIC
    assert config.scheme_for("model.layers.0.self_attn.qkv_proj") == PER_TOKEN
    # q by a regex, k and v by "Linear": one matmul cannot run both
    split = _resolve(_with_groups(group_1=(["re:.*q_proj$"], "tensor", "static")))
    with pytest.raises(
        ValueError, match=r"^quantization_config: model.layers.0.self_attn.q_proj, .* differently"
    ):
        split.scheme_for("model.layers.0.self_attn.qkv_proj")
    # two regexes of different schemes: which wins is not the config's to say (the ordering differs)
    tie = _resolve(
        _with_groups(
            group_1=(["re:.*down_proj$"], "channel", None), group_2=(["re:.*mlp.*"], "tensor", "static")
        )
    )
    with pytest.raises(
        ValueError, match=rf"^quantization_config.config_groups: {DOWN} matches groups of diff"
    ):
        tie.scheme_for(DOWN)


def test_a_checkpoint_with_a_closer_group_gives_transformers_greedy_tokens(llama_dir, tmp_path):
    """down_proj's weights are the channel/token checkpoint's; a "re:.*down_proj$" group runs them with
    float activations, as transformers + compressed-tensors do (the checkpoint was refused)."""
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), weights="channel", activations="token")
    with edited_config(directory) as config:
        config["quantization_config"] = _with_groups(group_1=(["re:.*down_proj$"], "channel", None))
    llm = LLM(directory, num_blocks=32)
    model = llm.engine.model_runner.model
    for layer in model.model.layers:
        assert layer.mlp.down_proj.method.scheme == WEIGHTS_ONLY
        assert layer.mlp.down_proj.method.matmul == "dequantized"
        assert layer.mlp.gate_up_proj.method.scheme == PER_TOKEN
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (4, 9, 15)]
    agrees_with_transformers(llm, directory, prompts, 6)


def test_random_weights_under_a_kv_cache_only_config_take_quantization_fp8(llama_dir, tmp_path):
    """Refused before with "fp8: an Fp8Config goes with quantization 'fp8', got 'fp8'"."""
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "kv"), kv_scales=(0.05, 0.02))
    with edited_config(directory) as config:
        config["quantization_config"]["config_groups"] = {}
    llm = LLM(directory, load_format="dummy", quantization="fp8", num_blocks=16)
    qkv = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8LinearMethod)
    assert qkv.method.scheme == Fp8Scheme("channel", "token", serialized=False)
    [completion] = llm.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(completion.token_ids) == 2
    unquantized = LLM(directory, load_format="dummy", num_blocks=16)  # float weights, as before
    qkv = unquantized.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(qkv.method, Fp8LinearMethod)


@pytest.mark.parametrize(
    ("field", "entry"),
    [("ignore", "re:*down_proj"), ("config_groups.group_0.targets", "re:.*(q_proj")],
)
def test_a_target_or_ignore_regex_that_does_not_compile_is_refused_naming_it(field, entry):
    """It raised re.error ("nothing to repeat at position 0"), naming neither the field nor the entry, when
    the first linear was matched."""
    raw = quantization_config("channel", "token", False, ("lm_head",))
    if field == "ignore":
        raw["ignore"].append(entry)
    else:
        raw["config_groups"]["group_0"]["targets"].append(entry)
    with pytest.raises(
        ValueError, match=rf"^quantization_config.{field}: '{re.escape(entry)}' is not a regular"
    ):
        _resolve(raw).scheme_for("model.layers.0.mlp.down_proj")
