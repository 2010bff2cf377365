"""`--quantization int4` on shapes torch's int4 CPU kernel cannot pack: refused at load naming the size.

`aten._convert_weight_to_int4pack_for_cpu` packs output rows in 16s; a layer with another output size
(here a q/k/v of 8 heads of 4 and one KV head: 40 rows) used to stop the load with torch's own
RuntimeError from inside the packing. int8 has no such limit and runs the same model.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import SHAPE, _save
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import ReplicatedLinear
from sluice.engine.worker.layers.quantization import Int8Weight


@pytest.fixture(scope="module")
def narrow_qkv_dir(tmp_path_factory) -> str:
    shape = {**SHAPE, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 4}
    config = LlamaConfig(**shape, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), str(tmp_path_factory.mktemp("narrow-qkv")), None, 5)


def test_int4_refuses_an_output_size_the_kernel_cannot_pack(narrow_qkv_dir):
    with pytest.raises(ValueError, match=r"^quantization: int4 needs output_size divisible by 16, got 40$"):
        LLM(narrow_qkv_dir, dtype="float32", quantization="int4", num_blocks=16, block_size=16)
    int4 = KernelConfig(torch.device("cpu"), torch.float32, quantization="int4")
    with pytest.raises(ValueError, match=r"^quantization: int4 needs output_size divisible by 16, got 24$"):
        ReplicatedLinear(64, 24).select(int4, "model.layers.0.mlp.down_proj")


def test_int8_runs_the_same_shapes(narrow_qkv_dir):
    llm = LLM(narrow_qkv_dir, dtype="float32", quantization="int8", num_blocks=16, block_size=16)
    qkv = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.output_size == 40 and isinstance(qkv.quantized, Int8Weight)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
