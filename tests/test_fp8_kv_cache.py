"""`--kv-cache-dtype fp8`: K/V stored as e4m3 (k / k_scale), read back by the torch and the C++ CPU backends.

The reference is transformers with every K/V it caches rounded to e4m3 the same way (`fp8_checkpoints.
RoundingCache`): greedy tokens must agree with it (equal, or parting at a near tie: `fp8_greedy`), through
mixed batches with chunked prefill, prefix-cache hits, preemption, n > 1 and ngram speculation. The cache
holds twice the blocks of a bf16 one in the same memory; the flash-attn backend refuses it by name. (The
Triton backend's FP8 path: test_triton_fp8_kv.py.)
"""

from __future__ import annotations

import random

import pytest
import torch
from fp8_checkpoints import transformers_greedy, write_fp8_checkpoint
from fp8_greedy import NUM_TOP, assert_agrees, greedy_params, samples, transformers_samples

from sluice.benchmarks.gpu.greedy_compare import Sample
from sluice.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker.attention.selector import get_attention_backend
from sluice.engine.worker.attention.torch_backend import TorchAttentionBackend
from sluice.service.cli import build_parser, load_commands
from sluice.service.engine_args import engine_config_from_args

BLOCK = 16
NUM_NEW = 8
GREEDY = greedy_params(NUM_NEW)
UNIT_SCALES = (1.0, 1.0)


def _prompts() -> list[list[int]]:
    """A shared 3-block system prompt (prefix-cache hits), mixed lengths, and repeats (ngram drafts)."""
    rng = random.Random(8)
    tokens = lambda n: [rng.randrange(4, 512) for _ in range(n)]  # noqa: E731
    system = tokens(3 * BLOCK)
    phrase = tokens(7)
    return [
        system + tokens(5),
        tokens(3),
        system + phrase * 3,
        tokens(37),
        system + tokens(20),
        tokens(6) * 4,
    ]


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[Sample]:
    return transformers_samples(llama_dir, _prompts(), NUM_NEW, kv_scales=UNIT_SCALES)


def greedy(llm: LLM) -> list[Sample]:
    return samples(llm.generate(_prompts(), GREEDY))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("source", ["llama_dir", "qwen2_dir", "mistral_windowed_dir", "gemma3_dir"])
def test_fp8_kv_greedy_equals_transformers_with_rounded_kv(source, backend, request):
    """Llama (GQA, tied), Qwen2 (biases), Mistral with a 12-token window (blocks freed behind it), Gemma 3
    (local and global layers)."""
    directory = request.getfixturevalue(source)
    llm = LLM(directory, kv_cache_dtype="fp8", attention_backend=backend, block_size=BLOCK, num_blocks=64)
    runner = llm.engine.model_runner
    assert (
        runner.attention_backend.name == backend
        and runner.attention_backend.kv_cache_dtype == torch.float8_e4m3fn
    )
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in runner.kv_caches)
    assert runner.cpu_stack is None  # the whole-stack C++ path reads a float cache
    assert_agrees(greedy(llm), transformers_samples(directory, _prompts(), NUM_NEW, kv_scales=UNIT_SCALES))


def test_the_rounding_shows(llama_dir, reference):
    """Not a vacuous check: with these prompts the e4m3 cache changes tokens against a float one."""
    float_cache = transformers_greedy(llama_dir, _prompts(), NUM_NEW)
    assert float_cache != [s["tokens"] for s in reference]
    assert [s["tokens"] for s in greedy(LLM(llama_dir, block_size=BLOCK, num_blocks=64))] == float_cache


def test_mixed_batches_chunked_prefill_and_prefix_hits(llama_dir, reference):
    llm = LLM(
        llama_dir,
        kv_cache_dtype="fp8",
        block_size=BLOCK,
        num_blocks=64,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    completions = llm.generate(_prompts(), GREEDY)
    assert_agrees(samples(completions), reference)
    assert [c.cached_tokens for c in completions] == [0, 0, 3 * BLOCK, 0, 3 * BLOCK, 0]
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_preemption(llama_dir, reference):
    # 6 blocks: the longest request alone takes 5 (77 tokens), so running requests preempt each other.
    llm = LLM(
        llama_dir,
        kv_cache_dtype="fp8",
        block_size=BLOCK,
        num_blocks=6,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    completions = llm.generate(_prompts(), GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert_agrees(samples(completions), reference)


def test_n_samples_share_the_prompt_blocks(llama_dir, reference):
    llm = LLM(llama_dir, kv_cache_dtype="fp8", block_size=BLOCK, num_blocks=64, enable_prefix_caching=True)
    prompt = _prompts()[3]  # 37 tokens: samples 1 and 2 read its 2 full blocks from the cache
    completions = llm.generate(
        prompt, SamplingParams(n=3, temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=NUM_TOP)
    )
    assert [c.token_ids for c in completions] == [completions[0].token_ids] * 3
    assert_agrees(samples(completions[:1]), reference[3:4])
    assert [c.cached_tokens for c in completions] == [0, 2 * BLOCK, 2 * BLOCK]


def test_ngram_speculation(llama_dir, reference):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    llm = LLM(llama_dir, kv_cache_dtype="fp8", speculative=spec, block_size=BLOCK, num_blocks=64)
    assert_agrees(greedy(llm), reference)
    stats = llm.engine.stats()
    assert stats.num_accepted_draft_tokens > 0


def test_fp8_weights_with_the_checkpoints_kv_scales(llama_dir, tmp_path):
    kv_scales = (0.05, 0.02)
    directory = write_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), kv_scales=kv_scales)
    llm = LLM(directory, kv_cache_dtype="fp8", block_size=BLOCK, num_blocks=64)
    attn = llm.engine.model_runner.model.model.layers[1].self_attn.attn
    assert (attn.k_scale.item(), attn.v_scale.item()) == (pytest.approx(0.05), pytest.approx(0.02))
    assert_agrees(greedy(llm), transformers_samples(directory, _prompts(), NUM_NEW, kv_scales=kv_scales))
    # a float cache skips the scales
    assert_agrees(
        greedy(LLM(directory, block_size=BLOCK, num_blocks=64)),
        transformers_samples(directory, _prompts(), NUM_NEW),
    )


def test_an_autofp8_checkpoint_with_kv_scales_loads_as_the_same_tensors_do_in_vllms_format(
    llama_dir, tmp_path
):
    """AutoFP8 writes "kv_cache_scheme": "static" beside calibrated KV scales (k_proj.output_scale): the
    config was refused as an unknown field, with or without an FP8 cache."""
    kv_scales = (0.05, 0.02)
    formats = {
        names: write_fp8_checkpoint(
            llama_dir, str(tmp_path / names), weights="tensor", activations="static", kv_scales=kv_scales,
            quant_method="fp8", names=names,
        )
        for names in ("autofp8", "vllm")
    }  # fmt: skip
    runs = {}
    for names, directory in formats.items():
        llm = LLM(directory, kv_cache_dtype="fp8", block_size=BLOCK, num_blocks=64)
        attn = llm.engine.model_runner.model.model.layers[1].self_attn.attn
        assert (attn.k_scale.item(), attn.v_scale.item()) == (pytest.approx(0.05), pytest.approx(0.02))
        runs[names] = greedy(llm)
    assert runs["autofp8"] == runs["vllm"]
    assert greedy(LLM(formats["autofp8"], block_size=BLOCK, num_blocks=64))  # a float cache skips them


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_the_kv_capacity_reported_at_start_grows_by_the_bytes_saved(llama_dir, dtype, ratio, caplog):
    memory = 1 << 20
    infos = {}
    for kv_cache_dtype in ("auto", "fp8"):
        with caplog.at_level("INFO", logger="sluice.engine.worker.model_runner"):
            llm = LLM(llama_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=memory)
        infos[kv_cache_dtype] = llm.engine.core.model_info
    # 2 layers x (K, V) x 16 slots x 2 heads x 16 dims = 2048 values a block
    assert infos["fp8"].num_kv_blocks == memory // 2048
    assert infos["fp8"].num_kv_blocks == ratio * infos["auto"].num_kv_blocks
    assert infos["fp8"].kv_capacity_tokens == ratio * infos["auto"].kv_capacity_tokens
    assert (
        f"KV cache: {memory // 2048} blocks of 16 tokens ({memory // 2048 * 16} tokens), torch.float8_e4m3fn"
        in caplog.text
    )


def test_backends_without_an_fp8_read_path_refuse_it():
    fp8 = torch.float8_e4m3fn
    with pytest.raises(
        ValueError, match=r"^attention_backend: 'flash-attn' cannot run: kv_cache_dtype: flash-attn 2 reads"
    ):
        get_attention_backend(
            "flash-attn", torch.device("cuda"), block_size=256, dtype=torch.bfloat16, kv_cache_dtype=fp8
        )
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: must be one of \('auto', 'fp8', 'fp8_e4m3'\)$"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: must be one of"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")  # vLLM's e5m2 cache: not a format Sluice stores
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: None or torch.float8_e4m3fn, got torch.float16$"):
        TorchAttentionBackend(torch.float16)


def test_the_flag_and_the_keyword():
    args = build_parser(load_commands(["serve"])).parse_args(
        ["serve", "--kv-cache-dtype", "fp8", "--quantization", "fp8"]
    )
    config = engine_config_from_args(args)
    assert (config.cache.kv_cache_dtype, config.model.quantization) == ("fp8", "fp8")
    assert EngineConfig.from_kwargs(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    # vLLM's name for the same cache
    args = build_parser(load_commands(["serve"])).parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"])
    assert engine_config_from_args(args).cache.kv_cache_dtype == "fp8"
