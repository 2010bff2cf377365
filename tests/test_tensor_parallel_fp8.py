"""FP8 under tensor parallelism (gloo on CPU, real worker processes): FP8 checkpoints (compressed-tensors) and
the FP8 KV cache on 2 ranks, with the Llama whose 4 KV heads split over them.

Where FP8's scales do not depend on how the input is split (static activation scales from the checkpoint,
weights-only FP8, the KV cache's per-layer scales, block weights with their activation groups), 2 ranks give
the one-rank engine's greedy tokens, which agree with transformers' (compressed-tensors, K/V rounded to e4m3),
through test_tensor_parallel's mixed workload
(chunks, prefix hits, preemption, n = 2, ngram drafts). Dynamic per-token activation scales are taken, on a
row-parallel layer (o_proj, down_proj), over the rank's own slice of the input, as vLLM does: each rank
quantizes its part, so the result moves by FP8 rounding. Its bound here: 2 ranks move the prompt logprobs
less than FP8 itself moves them from the float model.

"Give the one-rank engine's tokens" is up to near ties (`fp8_greedy.assert_agrees`) where activations are
rounded to e4m3: a row-parallel layer's two partial sums, added by the all-reduce, round otherwise than one
rank's sum, and a value within that of an e4m3 rounding boundary then rounds the other way in the next
layer's input (or the KV cache), which moves the logits by up to ~0.1 nats. Seen on an AVX2 build (torch's
AVX2 kernels, the C++ ones compiled for x86-64-v3): block weights on 2 ranks parted from 1 rank at a
0.04-nat tie, where AVX-512 had not. Weights-only FP8 rounds no activation: its tokens are equal.
"""

from __future__ import annotations

import pytest
from checkpoints import SHAPE, _save, build_llama_kv4_checkpoint
from fp8_checkpoints import quantize_weight, write_fp8_checkpoint
from fp8_greedy import assert_agrees, greedy_params, samples, transformers_samples
from safetensors.torch import load_file, save_file
from test_tensor_parallel import MIXED, NUM_NEW, _prompts

from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)

KV_SCALES = (0.05, 0.02)
GREEDY = greedy_params(NUM_NEW)
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llama_kv4_checkpoint(str(tmp_path_factory.mktemp("llama_kv4")))


def _fp8_dir(float_dir: str, tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs) -> str:
    return write_fp8_checkpoint(float_dir, str(tmp_path_factory.mktemp(name)), **kwargs)


def _generate(directory: str, size: int, params: SamplingParams, **kwargs) -> list[Completion]:
    llm = LLM(directory, tensor_parallel_size=size, **{**MIXED, **kwargs})
    try:
        return llm.generate(_prompts(), params)
    finally:
        if size > 1:
            llm.engine.model_runner.shutdown()


def _tokens(completions: list[Completion]) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_static_scales_and_an_fp8_kv_cache_on_two_ranks_give_one_ranks_and_transformers_tokens(
    float_dir, tmp_path_factory
):
    directory = _fp8_dir(float_dir, tmp_path_factory, "static", activations="static", kv_scales=KV_SCALES)
    one = _generate(directory, 1, GREEDY, kv_cache_dtype="fp8")
    two = _generate(directory, 2, GREEDY, kv_cache_dtype="fp8")
    assert_agrees(samples(two), samples(one))  # up to near ties (above)
    assert_agrees(samples(two), transformers_samples(directory, _prompts(), NUM_NEW, KV_SCALES))
    assert [c.cached_tokens for c in two] == [c.cached_tokens for c in one]


def test_fp8_weights_only_on_two_ranks_give_one_ranks_tokens(float_dir, tmp_path_factory):
    directory = _fp8_dir(float_dir, tmp_path_factory, "weights_only", activations=None)
    assert _tokens(_generate(directory, 2, GREEDY)) == _tokens(_generate(directory, 1, GREEDY))


def test_dynamic_token_scales_per_rank_move_logprobs_less_than_fp8_itself(float_dir, tmp_path_factory):
    directory = _fp8_dir(float_dir, tmp_path_factory, "dynamic")  # per-token activation scales

    def logprobs(path: str, size: int) -> list[float]:
        completions = _generate(path, size, PROMPT_LOGPROBS)
        return [p.sampled.logprob for c in completions for p in c.prompt_logprobs]

    one, two, unquantized = logprobs(directory, 1), logprobs(directory, 2), logprobs(float_dir, 1)
    by_ranks = max(abs(a - b) for a, b in zip(two, one, strict=True))
    by_fp8 = max(abs(a - b) for a, b in zip(one, unquantized, strict=True))
    assert 0 < by_ranks < by_fp8  # 2 ranks do change them (each quantizes its slice), by less than FP8 does


def test_block_scales_on_two_ranks_give_one_ranks_and_transformers_tokens(float_dir, tmp_path_factory):
    """32 x 32 blocks: each rank holds whole blocks, and a row-parallel rank's input columns are whole
    activation groups, so its groups (and their scales) are the one-rank engine's: the same tokens, up to
    near ties (the module's docstring)."""
    block = (32, 32)
    directory = _fp8_dir(
        float_dir, tmp_path_factory, "block", weights="block", activations="group", block=block
    )
    two = _generate(directory, 2, GREEDY)
    assert_agrees(samples(two), samples(_generate(directory, 1, GREEDY)))
    assert_agrees(samples(two), transformers_samples(directory, _prompts(), NUM_NEW))


@pytest.mark.parametrize(
    ("block", "cut"),
    [
        ((32, 128), r"self_attn.o_proj \(64 input columns a rank, blocks of 128\)"),  # o_proj's 128 columns
        ((64, 32), r"self_attn.qkv_proj \(32 rows a rank, blocks of 64\)"),  # 2 KV heads of 16 a rank
    ],
)
def test_blocks_a_rank_would_cut_are_refused_before_any_rank_starts(block, cut, float_dir, tmp_path_factory):
    directory = _fp8_dir(
        float_dir, tmp_path_factory, "cut", weights="block", activations="group", block=block
    )
    with pytest.raises(
        ValueError, match=rf"^tensor_parallel_size: 2 ranks would cut the FP8 weight blocks of {cut}"
    ):
        _generate(directory, 2, GREEDY)
    one = LLM(directory, num_blocks=32)  # one rank cuts nothing
    assert len(one.generate(_prompts()[:1], GREEDY)[0].token_ids) == NUM_NEW


def test_blocks_made_at_load_that_a_rank_would_cut_are_refused_before_any_rank_starts(float_dir):
    """`--fp8-weight-block 64` on two ranks: a rank's k rows (2 KV heads of 16) are not whole blocks; one
    rank's (4 heads) are."""
    with pytest.raises(
        ValueError,
        match=r"^tensor_parallel_size: 2 ranks would cut the FP8 weight blocks of self_attn.qkv_proj "
        r"\(32 rows a rank, blocks of 64\)",
    ):
        _generate(float_dir, 2, GREEDY, quantization="fp8", fp8_weight_block=64)
    one = LLM(float_dir, quantization="fp8", fp8_weight_block=64, num_blocks=32)
    assert len(one.generate(_prompts()[:1], GREEDY)[0].token_ids) == NUM_NEW


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_an_fp8_lm_head_on_two_ranks_gives_one_ranks_tokens(strategy, tmp_path_factory):
    """An lm_head quantized too (`ignore` leaves it out), of a vocabulary two ranks split unevenly (513
    rows: rank 1's last row is padding): its per-row scale was checked as whole-vocabulary rows and its
    per-tensor scale as a row per token, so no rank loaded it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPE, "vocab_size": 513}, tie_word_embeddings=False)
    float_dir = _save(LlamaForCausalLM(config), str(tmp_path_factory.mktemp("vocab513")), None, seed=8)
    directory = _fp8_dir(
        float_dir, tmp_path_factory, f"lm_head_{strategy}", weights=strategy, activations=None, ignore=()
    )
    tensors = load_file(f"{directory}/model.safetensors")
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = quantize_weight(
        tensors["lm_head.weight"], strategy
    )
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    one = _generate(directory, 1, GREEDY, num_blocks=32)
    assert _tokens(_generate(directory, 2, GREEDY, num_blocks=32)) == _tokens(one)
