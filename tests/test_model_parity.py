"""ModelRunner vs transformers: tiny Llama (llama3 RoPE, tied), Mistral, Qwen2 (biases, sharded),
with the torch backend, the C++ CPU one (kernels/cpu_paged_attention.h), and the Triton one (attention,
fused RMSNorm + residual and rotary kernels, run by Triton's interpreter on CPU). On "cpu", Llama, Mistral
(windowed too) and Qwen2 run their layers as one C++ call per step (kernels/cpu_decoder_stack.h);
"cpu-layers" runs the same kernels one layer call at a time.

Three prompts are chunked across steps under a small token budget, so steps mix decodes, prefill chunks
with a cached prefix and fresh prefills, over interleaved (non-contiguous) block tables. Tolerance: the
float32 logits of each prompt's last position match transformers' forward within rtol 1e-4, atol
1e-4 * max|logit|; the greedy continuation equals transformers' generate(do_sample=False) token for token.
The same with every linear on Sluice's Triton launch (`skinny_linears`) on Llama and Qwen2.
"""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import VOCAB_SIZE

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.linear_method import SkinnyLinearMethod
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.model_runner import ModelRunner
from sluice.kernels import skinny_mm

PROMPT_LENS = (5, 23, 40)
BLOCK_SIZE = 16
TOKEN_BUDGET = 20
NUM_NEW_TOKENS = 4
BLOCKS_PER_REQUEST = 4


CHECKPOINTS = ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir", "mistral_windowed_dir", "gemma3_dir"]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)


STACKED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@pytest.fixture(scope="module", params=["torch", "cpu", "cpu-layers", "triton"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def _block_ids(index: int) -> tuple[int, ...]:
    """Interleaved: request r owns blocks r, r + 3, r + 6, ... so no table is contiguous."""
    return tuple(index + len(PROMPT_LENS) * i for i in range(BLOCKS_PER_REQUEST))


def _run_sluice(directory: str, prompts: list[list[int]], backend: str, skinny_linears: bool = False):
    """A minimal first-come scheduler over the real runner. Returns (prompt-end logits, generated, steps)."""
    # The Triton kernels run compiled on a GPU, else in the interpreter (TRITON_INTERPRET=1) on CPU.
    interpreted = backend in ("torch", "cpu", "cpu-layers") or os.environ.get("TRITON_INTERPRET") == "1"
    attention_backend = "cpu" if backend == "cpu-layers" else backend
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32", device="cpu" if interpreted else "cuda"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=len(prompts) * BLOCKS_PER_REQUEST),
        attention_backend=attention_backend,
        skinny_linears=skinny_linears,
    )
    runner = ModelRunner(config, load_model_source(config.model))
    assert runner.attention_backend.name == attention_backend
    linears = [module for module in runner.model.modules() if isinstance(module, LinearBase)]
    assert linears and all(
        isinstance(linear.method, SkinnyLinearMethod) == skinny_linears for linear in linears
    )
    # ... and their MLPs' SiLU-and-mul runs in down_proj's launch (all but Gemma's GELU), a one-row step's
    # RMSNorms in qkv_proj's and gate_up_proj's (all but Gemma's)
    fused = [module for module in runner.model.modules() if isinstance(module, (SiluAndMul, RMSNorm))]
    assert all(op.fuses_into_linear == skinny_linears for op in fused)
    arch = runner.arch
    stacked = attention_backend == "cpu" and arch.architecture in STACKED
    assert (runner.cpu_stack is not None) == stacked
    if backend == "cpu-layers":
        runner.cpu_stack = None
    if runner.arch.architecture != "Gemma3ForCausalLM":  # Gemma's norms round differently: plain PyTorch
        assert runner.model.model.norm.implementation == ("triton" if backend == "triton" else "cpu")
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    prompt_logits: list[torch.Tensor | None] = [None] * len(prompts)
    steps = []
    while any(len(t) - len(p) < NUM_NEW_TOKENS for t, p in zip(tokens, prompts, strict=True)):
        budget, scheduled = TOKEN_BUDGET, []
        for i, seq in enumerate(tokens):
            n = min(len(seq) - computed[i], budget)
            if n == 0 or len(seq) - len(prompts[i]) >= NUM_NEW_TOKENS:
                continue
            chunk = tuple(seq[computed[i] : computed[i] + n])
            sample = computed[i] + n == len(seq)
            scheduled.append(ScheduledRequest(str(i), chunk, computed[i], _block_ids(i), sample))
            budget -= n
        out = SchedulerOutput(tuple(scheduled), TOKEN_BUDGET - budget)
        logits = runner.execute_model(out)
        assert logits.shape == (sum(r.sample for r in scheduled), VOCAB_SIZE)
        assert logits.dtype == torch.float32
        sampled = iter(logits)
        for req in scheduled:
            i = int(req.request_id)
            computed[i] += req.num_tokens
            if req.sample:
                row = next(sampled)
                if prompt_logits[i] is None:
                    prompt_logits[i] = row.cpu()
                tokens[i].append(int(row.argmax()))
        steps.append(out)
    generated = [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]
    return prompt_logits, generated, steps


def _hf_reference(directory: str, prompts: list[list[int]]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare a fixed number of greedy tokens
    logits, generated = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(model(ids).logits[0, -1].float())
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            generated.append(out[0, len(prompt) :].tolist())
    return logits, generated


@pytest.fixture(scope="module")
def reference(checkpoint: str):
    return _hf_reference(checkpoint, _prompts())


@pytest.fixture(scope="module")
def runs(checkpoint: str, backend: str, reference):
    return _run_sluice(checkpoint, _prompts(), backend), reference


def test_steps_mix_decodes_cached_prefix_chunks_and_fresh_prefills(runs) -> None:
    (_, _, steps), _ = runs
    mixed = [
        s
        for s in steps
        if any(r.num_tokens == 1 and r.start_position >= PROMPT_LENS[0] for r in s.scheduled)
        and any(r.num_tokens > 1 and r.start_position > 0 for r in s.scheduled)
    ]
    assert mixed, "the schedule must contain a step with a decode next to a continuing prefill chunk"
    assert all(r.num_tokens == 1 for r in steps[-1].scheduled), "the last step must be pure decode"


def test_prompt_logits_match_transformers(runs) -> None:
    (ours, _, _), (reference, _) = runs
    for got, want in zip(ours, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_greedy_tokens_match_transformers_generate(runs) -> None:
    (_, ours, _), (_, reference) = runs
    assert ours == reference


@pytest.mark.parametrize("name", ["llama_dir", "qwen2_dir"])  # a tied lm_head; q, k, v biases
def test_triton_skinny_linears_match_transformers(
    name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every linear on `sluice.kernels.skinny_mm` (the steps here have 1-20 rows), SiLU-and-mul in
    down_proj's launch; then one prompt alone, whose decode steps of one row also make their RMSNorms in
    qkv_proj's and gate_up_proj's launches."""
    directory = request.getfixturevalue(name)
    normed = []
    launch = skinny_mm.skinny_mm

    def spy(x, weight, *, gated, norm):
        normed.append(norm is not None and norm.residual is not None)
        return launch(x, weight, gated=gated, norm=norm)

    monkeypatch.setattr(skinny_mm, "skinny_mm", spy)
    for prompts in (_prompts(), _prompts()[:1]):
        ours, generated, _ = _run_sluice(directory, prompts, "triton", skinny_linears=True)
        reference, reference_generated = _hf_reference(directory, prompts)
        for got, want in zip(ours, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert generated == reference_generated
    assert any(normed)  # the one-row steps' norms with their residual add, in the linears' launches


def test_skinny_linears_refuse_a_backend_without_them(llama_dir: str) -> None:
    config = EngineConfig(
        model=ModelConfig(model=llama_dir, device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=4),
        attention_backend="torch",
        skinny_linears=True,
    )
    with pytest.raises(
        ValueError, match="^skinny_linears: needs the Triton kernels .* got the 'torch' backend$"
    ):
        ModelRunner(config, load_model_source(config.model))


def test_runner_reports_shape_of_cache_and_model(llama_dir: str) -> None:
    config = EngineConfig(
        model=ModelConfig(model=llama_dir, device="cpu"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=10 * 2 * 2 * 16 * 2 * 16 * 4 + 5),
    )
    runner = ModelRunner(config, load_model_source(config.model))
    # bytes per block = 2 (K, V) * 2 layers * 16 slots * 2 kv heads * 16 head_dim * 4 bytes
    assert runner.num_blocks == 10
    assert runner.kv_caches[0][0].shape == (10, 16, 2, 16)
    # The CPU kernel's cache keeps a block's rows of one KV head together: laid out [10, 2, 16, 16].
    assert runner.attention_backend.name == "cpu"
    assert runner.kv_caches[0][0].stride() == (2 * 16 * 16, 16, 16 * 16, 1)
    assert len(runner.kv_caches) == 2
    assert runner.dtype == torch.float32
    assert runner.device == torch.device("cpu")
    assert runner.max_model_len == 256
    assert runner.arch.architecture == "LlamaForCausalLM"
    # Graph buffers address at most min(max_model_len, max_seq_len_to_capture) tokens per sequence.
    assert runner.graph_runner.buffers.max_num_blocks_per_seq == 256 // 16


def test_a_backend_that_does_not_ask_for_heads_first_gets_contiguous_caches(llama_dir: str) -> None:
    config = EngineConfig(
        model=ModelConfig(model=llama_dir, device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=4),
        attention_backend="torch",
    )
    runner = ModelRunner(config, load_model_source(config.model))
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in runner.kv_caches)


def test_graphs_address_at_most_max_seq_len_to_capture(llama_dir: str) -> None:
    config = EngineConfig(
        model=ModelConfig(model=llama_dir, device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=8),
        max_seq_len_to_capture=40,
    )
    runner = ModelRunner(config, load_model_source(config.model))
    assert runner.graph_max_blocks_per_seq == 3  # 40 tokens round up to 3 blocks of 16
    assert runner.graph_runner.buffers.max_num_blocks_per_seq == 3
    with pytest.raises(ValueError, match="^max_seq_len_to_capture: must be > 0, got 0$"):
        EngineConfig(max_seq_len_to_capture=0)


def test_max_model_len_beyond_the_model_limit_is_rejected(llama_dir: str) -> None:
    config = EngineConfig(model=ModelConfig(model=llama_dir, device="cpu", max_model_len=257))
    with pytest.raises(ValueError, match="max_model_len: 257 exceeds the model's limit of 256"):
        ModelRunner(config, load_model_source(config.model))
