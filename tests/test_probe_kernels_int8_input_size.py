"""`--quantization int8` on input sizes torch's int8 CPU kernel cannot read: refused at load naming the size.

`aten._weight_int8pack_mm` on CPU walks each row's input 16 columns at a time with AVX-512 (8 with AVX2), with
aligned loads and no remainder loop, and checks nothing: with an input size of 8, 24 or 40 it returned
garbage (a hidden-40 Llama generated other tokens than its float32 run from the first one), with 3, 33 or
100 it died with SIGSEGV. The layer now refuses such a shape at load, as int4 refuses its own; the sizes it
takes (multiples of 16) still match the dequantized weight.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import SHAPE, _save
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.engine.frontend.llm import LLM
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import ReplicatedLinear
from sluice.engine.worker.layers.quantization import Int8Weight, unsupported_reason

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hidden_40_dir(tmp_path_factory) -> str:
    shape = {**SHAPE, "hidden_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    config = LlamaConfig(**shape, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), str(tmp_path_factory.mktemp("hidden-40")), None, 5)


@pytest.mark.parametrize("input_size", [1, 3, 8, 24, 33, 40, 100])
def test_int8_refuses_an_input_size_the_kernel_cannot_read(input_size):
    reason = f"needs input_size divisible by 16, got {input_size}"
    assert unsupported_reason("int8", input_size, 32, CPU) == reason
    int8 = KernelConfig(CPU, torch.float32, quantization="int8")
    with pytest.raises(ValueError, match=rf"^quantization: int8 {reason}$"):
        ReplicatedLinear(input_size, 32).select(int8, "model.layers.0.mlp.down_proj")


def test_a_model_of_hidden_size_40_is_refused_at_load(hidden_40_dir):
    with pytest.raises(ValueError, match=r"^quantization: int8 needs input_size divisible by 16, got 40$"):
        LLM(hidden_40_dir, dtype="float32", quantization="int8", num_blocks=16, block_size=16)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("input_size", "output_size"), [(16, 1), (48, 5), (80, 33), (112, 7)])
def test_the_sizes_it_takes_equal_the_dequantized_weight(rows, input_size, output_size):
    generator = torch.Generator().manual_seed(rows * input_size + output_size)
    weight = torch.randn(output_size, input_size, generator=generator) * 0.1
    x = torch.randn(rows, input_size, generator=generator)
    assert unsupported_reason("int8", input_size, output_size, CPU) is None
    quantized = Int8Weight(weight)
    # The kernel's bf16 activations and scales: x rounded to bf16, the result within bf16's rounding.
    reference = x.to(torch.bfloat16).float() @ quantized.dequantize().T
    torch.testing.assert_close(quantized.matmul(x, None), reference, atol=2e-2, rtol=2e-2)
