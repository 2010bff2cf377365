"""Weight-only int4 / int8 on CPU (`sluice.engine.worker.layers.quantization`) against transformers.

The checkpoints' weights are first snapped onto the quantization grid here, with the formats' own
definitions (int4: w = d * q + m over groups of 32 input columns with q in 0..15 and both ends used, as a
GGUF Q4_1 block; int8, and lm_head under either: w = s * q per output row with max |q| = 127), so
quantizing them loses nothing and transformers' float32 run of the same checkpoint is the reference. What
is left is the kernels' bf16 activations and scales: logits within 3% of max |logit|, and greedy tokens
equal up to near-ties (a random tiny model has many: each chosen token scores within that tolerance of
transformers' best at its position).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import VOCAB_SIZE, build_gemma3_checkpoint, build_llama_checkpoint, build_qwen2_checkpoint

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker import model_runner
from sluice.engine.worker.layers.kernel_config import KernelConfig
from sluice.engine.worker.layers.linear import ReplicatedLinear
from sluice.engine.worker.layers.quantization import CpuQuantizedLinearMethod, Int4Weight
from sluice.engine.worker.model_runner import ModelRunner

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Prefills of 3, 9 and 16 rows: int4 runs those up to its row limit quantized (all three with AVX-512, the
# 3-row one with AVX2 only), the rest float32; int8 (4 rows at most) the 3-row one and the decode steps.
PROMPT_LENS = (3, 9, 16)
NUM_NEW_TOKENS = 6
TOLERANCE = 0.03  # of max |logit|
# Gemma 3 rounds worse in bf16: transformers' own bf16 run of the tiny one is off its float32 logits by
# 1.3 / 1.5 / 3.9% on these prompts (Sluice's int4: 1.9 / 0.7 / 3.3%; docs/QUANTIZATION.md).
TOLERANCES = {build_gemma3_checkpoint: 0.05}


def q4_1_grid(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random Q4_1-style blocks of weight's shape: w = d * q + m, every block using codes 0 and 15."""
    rows, cols = weight.shape
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    d = torch.rand(rows, cols // 32, 1, generator=generator) * 0.02 + 0.005
    m = -7.5 * d + torch.randn(rows, cols // 32, 1, generator=generator) * 0.005
    return (d * codes + m).reshape(rows, cols)


def int8_grid(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    codes = torch.randint(-127, 128, weight.shape, generator=generator)
    codes[:, 0] = 127
    return codes * (torch.rand(weight.shape[0], 1, generator=generator) * 0.001 + 0.0005)


def snapped_checkpoint(build, directory: str, method: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build(f"{directory}-source")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    grid = q4_1_grid if method == "int4" else int8_grid
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                param.copy_(grid(param, generator))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # lm_head is int8 either way
                param.copy_(int8_grid(param, generator))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def transformers_logits(directory: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len(seq), vocab] of each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize(
    "build",
    [build_llama_checkpoint, build_qwen2_checkpoint, build_gemma3_checkpoint],
    ids=["llama", "qwen2", "gemma3"],
)
def test_quantized_engine_agrees_with_transformers(method, build, tmp_path):
    directory = snapped_checkpoint(build, str(tmp_path / method), method)
    llm = LLM(directory, dtype="float32", quantization=method, num_blocks=16, block_size=16)
    layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, ReplicatedLinear)]
    assert layers and all(isinstance(m.method, CpuQuantizedLinearMethod) for m in layers)
    lm_head = llm.engine.model_runner.model.lm_head.method
    assert lm_head.quantization == "int8"  # under int4 too: its error reaches the logits directly
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions = llm.generate(prompts(), params)
    sequences = [p + c.token_ids for p, c in zip(prompts(), completions, strict=True)]
    for prompt, seq, expected in zip(
        prompts(), sequences, transformers_logits(directory, sequences), strict=True
    ):
        tolerance = TOLERANCES.get(build, TOLERANCE) * expected.abs().max()
        logits = _prompt_logits(llm.engine.model_runner, prompt)
        assert (logits - expected[len(prompt) - 1]).abs().max() <= tolerance
        # Greedy up to near-ties: each chosen token is within the tolerance of transformers' best there.
        for position in range(len(prompt), len(seq)):
            row = expected[position - 1]
            assert row[seq[position]] >= row.max() - tolerance


def _prompt_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput

    out = SchedulerOutput((ScheduledRequest("p", tuple(prompt), 0, (0, 1, 2), True),), len(prompt))
    return runner.execute_model(out)[0]


def test_int4_keeps_q4_1_codes_exactly():
    generator = torch.Generator().manual_seed(5)
    weight = q4_1_grid(torch.empty(64, 96), generator)
    quantized = Int4Weight(weight)
    torch.testing.assert_close(quantized.dequantize(), weight, rtol=0, atol=1e-6)
    x = torch.randn(4, 96, generator=generator)
    expected = x @ weight.T
    assert (quantized.matmul(x, None) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_quantization_names_the_field(llama_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"^quantization: must be one of \('int4', 'int8', 'fp8'\)$"):
        ModelConfig(model=llama_dir, quantization="int3")
    int4 = KernelConfig(torch.device("cpu"), torch.float32, quantization="int4")
    with pytest.raises(ValueError, match=r"^quantization: int4 needs input_size divisible by 32, got 48$"):
        ReplicatedLinear(48, 16).select(int4, "model.layers.0.mlp.down_proj")
    # A device other than the CPU on any machine: the runner given "meta" (no flag names it).
    monkeypatch.setattr(model_runner, "pick_device", lambda name: torch.device("meta"))
    config = EngineConfig(model=ModelConfig(model=llama_dir, device="cuda", quantization="int8"))
    with pytest.raises(ValueError, match=r"^quantization: int8 runs on cpu, not meta$"):
        ModelRunner(config, load_model_source(config.model))
