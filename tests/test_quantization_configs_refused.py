"""A checkpoint quantized in a format Sluice does not run is refused at load, naming its quant_method.

GPTQ, AWQ and bitsandbytes configs as their tools write them into config.json: every field but
quant_method is unknown to the FP8 readers, and the refusal used to name the first of those
("quantization_config.bits: unknown field") instead of the format.
"""

from __future__ import annotations

import json
import shutil

import pytest

from sluice.engine.frontend.llm import LLM

GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "sym": True,
        "true_sequential": True, "quant_method": "gptq", "checkpoint_format": "gptq"}  # fmt: skip
AWQ = {"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm", "zero_point": True}
BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
       "bnb_4bit_compute_dtype": "bfloat16"}  # fmt: skip


@pytest.mark.parametrize("config", [GPTQ, AWQ, BNB], ids=lambda c: c["quant_method"])
def test_another_quant_method_is_refused_by_name(llama_dir, tmp_path, config):
    directory = str(tmp_path / "quantized")
    shutil.copytree(llama_dir, directory)
    with open(f"{directory}/config.json") as f:
        hf_config = json.load(f)
    with open(f"{directory}/config.json", "w") as f:
        json.dump({**hf_config, "quantization_config": config}, f)
    method = config["quant_method"]
    with pytest.raises(
        ValueError,
        match=rf"^quantization_config.quant_method: '{method}' is not supported, only compressed-tensors, ",
    ):
        LLM(directory, num_blocks=16)
