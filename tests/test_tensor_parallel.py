"""Tensor parallelism on CPU with gloo, in real processes: the offline `LLM` is rank 0, ranks 1..N-1 are
spawned worker processes. Tiny Llama (tied, llama3 RoPE), Qwen2 (biases), Mistral (12-token window), Qwen3
(q/k norms, head_dim 32) and Gemma 3 (windowed local layers) on 2 ranks; a Llama with 4 KV heads on 4
ranks (one KV head each) and the 2-KV-head Llama on 4 ranks (each KV head replicated on 2); the Llama as
a GGUF file on 2 ranks.

One workload mixes what changes a step's shape: prompts chunked under a 24-token budget, prompts sharing a
40-token prefix (prefix-cache hits), 12 KV blocks for 8 running requests (preemption), n = 2 samples and
ngram speculation. Greedy tokens must equal transformers' and the one-rank engine's, with the same
scheduling (preemptions, cache hits, drafts accepted). Each rank holds ~1/N of the parameters, as the ranks
measure them after loading.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from checkpoints import build_llama_kv4_checkpoint
from gguf_export import export_gguf

from sluice.engine.config import EngineConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from sluice.engine.distributed.partition import VocabPartition, partition_heads
from sluice.engine.executor.placement import Placement, place_ranks
from sluice.engine.executor.worker_monitor import WorkerDiedError
from sluice.engine.faults import ENV_VAR
from sluice.engine.frontend.llm import LLM, Completion
from sluice.engine.loading.model_arch import ModelArchConfig
from sluice.engine.loading.presets import PRESETS
from sluice.engine.outputs import EngineStats
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.worker.models.gemma3 import Gemma3ForCausalLM

pytestmark = pytest.mark.timeout(900)

NUM_NEW = 10
MIXED = dict(
    block_size=16,
    max_num_batched_tokens=24,
    max_num_seqs=8,
    num_blocks=12,
    speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3),
)
# (checkpoint fixture, ranks)
CASES = [
    ("llama_dir", 2),
    ("qwen2_dir", 2),  # q/k/v biases, sharded safetensors
    ("mistral_windowed_dir", 2),  # every layer windowed: the cache frees blocks behind the window
    ("qwen3_dir", 2),
    ("gemma3_dir", 2),
    ("llama_kv4_dir", 4),
    ("llama_dir", 4),
]


@pytest.fixture(scope="module")
def llama_kv4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_llama_kv4_checkpoint(str(tmp_path_factory.mktemp("llama_kv4")))


def _prompts() -> list[list[int]]:
    """Eight prompts: four extend one 40-token prefix, four are unrelated (3..60 tokens)."""
    rng = random.Random(11)
    prefix = [rng.randrange(4, 512) for _ in range(40)]
    shared = [prefix + [rng.randrange(4, 512) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    other = [[rng.randrange(4, 512) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    return [p for pair in zip(shared, other, strict=True) for p in pair]


def _params() -> list[SamplingParams]:
    """Greedy; prompts 1 and 4 ask for two samples each, prompt 3 for prompt logprobs (top 3)."""
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=NUM_NEW,
            ignore_eos=True,
            n=2 if i in (1, 4) else 1,
            prompt_logprobs=3 if i == 3 else None,
        )
        for i in range(8)
    ]


def _hf_greedy(directory: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@dataclass
class Run:
    completions: list[Completion]
    stats: EngineStats
    parameter_bytes: list[int]  # per rank


def _run(directory: str, size: int) -> Run:
    llm = LLM(directory, tensor_parallel_size=size, **MIXED)
    try:
        completions = llm.generate(_prompts(), _params())
        runner = llm.engine.model_runner
        per_rank = runner.parameter_bytes if size > 1 else [runner.parameter_bytes]
        return Run(completions, llm.engine.stats(), per_rank)
    finally:
        if size > 1:
            llm.engine.model_runner.shutdown()


@pytest.fixture(scope="module", params=CASES, ids=[f"{name.removesuffix('_dir')}-tp{n}" for name, n in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, int]:
    name, size = request.param
    return request.getfixturevalue(name), size


@pytest.fixture(scope="module")
def runs(case: tuple[str, int]) -> tuple[Run, Run]:
    directory, size = case
    return _run(directory, 1), _run(directory, size)


def test_greedy_tokens_equal_transformers_and_one_rank(case, runs):
    directory, _ = case
    one, many = runs
    prompts = _prompts()
    expected = _hf_greedy(directory, prompts)
    # n = 2 gives two consecutive completions of its prompt, both greedy.
    per_completion = [tokens for tokens, p in zip(expected, _params(), strict=True) for _ in range(p.n)]
    assert [c.token_ids for c in one.completions] == per_completion
    assert [c.token_ids for c in many.completions] == per_completion


def test_the_mix_ran_and_was_scheduled_alike(runs):
    one, many = runs
    stats = many.stats
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_draft_tokens > 0
    for field in ("num_preemptions", "prefix_cache_hits", "num_draft_tokens", "num_accepted_draft_tokens"):
        assert getattr(stats, field) == getattr(one.stats, field), field
    assert stats.num_kv_blocks_used == 0


def test_prompt_logprobs_equal_one_ranks(runs):
    """Every rank computes them (the logits are gathered on every rank); rank 0's are returned."""
    one, many = runs
    (expected,) = [c.prompt_logprobs for c in one.completions if c.prompt_logprobs]
    (got,) = [c.prompt_logprobs for c in many.completions if c.prompt_logprobs]
    assert len(got) == len(expected) == len(_prompts()[3]) - 1
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.sampled.token_id == theirs.sampled.token_id
        assert ours.sampled.logprob == pytest.approx(theirs.sampled.logprob, abs=1e-4)
        assert [t.token_id for t in ours.top] == [t.token_id for t in theirs.top]


def test_each_rank_holds_about_one_nth_of_the_parameters(case, runs):
    directory, size = case
    one, many = runs
    (total,) = one.parameter_bytes
    whole, kv, kv_per_rank, qkv_padding = _replicated_parts(directory, size)
    expected = (total - whole - kv) / size + whole + kv_per_rank + qkv_padding
    assert many.parameter_bytes == [expected] * size
    if kv_per_rank * size == kv:  # KV heads split, not replicated: only the norms are whole on every rank
        assert max(many.parameter_bytes) < 1.01 * total / size


def _replicated_parts(directory: str, size: int) -> tuple[int, int, float, int]:
    """Bytes (float32) every rank holds whole (the norms); of all k/v projection rows; of the k/v rows one
    rank holds (1/N of them, or one KV head's when KV heads are fewer than ranks); and of the zero columns
    the packed CPU kernel pads a rank's qkv_proj with to whole panels. Every other projection of these
    checkpoints splits into whole panels (multiples of 64 rows)."""
    from sluice.engine.loading.model_loader import read_arch
    from sluice.engine.model_registry import get_model_class
    from sluice.kernels.cpu_extension import cpu_extension_available
    from sluice.kernels.cpu_packed_linear import EXTENSION, panel_width

    arch = read_arch(directory)
    model = get_model_class(arch.architecture)(arch, None)  # on meta: the whole model's shapes
    whole = sum(p.numel() for name, p in model.named_parameters() if "norm" in name) * 4
    layers, kv_heads, head_dim = arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim
    kv = layers * 2 * kv_heads * head_dim * arch.hidden_size * 4
    heads_held = max(1, kv_heads // size)
    panel = panel_width() if cpu_extension_available(EXTENSION) else 1
    qkv_rows = (arch.num_attention_heads // size + 2 * heads_held) * head_dim
    padding = layers * (-qkv_rows % panel) * arch.hidden_size * 4
    return whole, kv, kv * heads_held / kv_heads, padding


def test_a_gguf_file_on_two_ranks_gives_transformers_tokens(llama_dir, tmp_path):
    path = export_gguf(llama_dir, str(tmp_path / "tiny-llama.gguf"))
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=2, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=8)
    try:
        completions = llm.generate(prompts, params)
    finally:
        llm.engine.model_runner.shutdown()
    assert [c.token_ids for c in completions] == _hf_greedy(llama_dir, prompts)


def test_a_draft_model_runs_whole_on_rank_zero_and_gives_one_ranks_tokens(llama_dir, mistral_dir):
    draft = SpeculativeConfig(method="draft", draft_model=mistral_dir)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    expected = [
        c.token_ids for c in LLM(llama_dir, num_blocks=64, speculative=draft).generate(prompts, params)
    ]
    llm = LLM(llama_dir, tensor_parallel_size=2, num_blocks=64, speculative=draft)
    try:
        assert [c.token_ids for c in llm.generate(prompts, params)] == expected
        assert llm.engine.stats().num_draft_tokens > 0
    finally:
        llm.engine.model_runner.shutdown()


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_the_flag(llama_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide the 4 query heads"):
        LLM(llama_dir, tensor_parallel_size=3, num_blocks=8)


def test_a_setting_the_ranks_refuse_at_load_is_raised_naming_it(llama_dir):
    """Every rank refuses it alike while loading; before, the other rank's failure replaced rank 0's
    ValueError (a WorkerDiedError quoting it)."""
    with pytest.raises(ValueError, match=r"^fuse_norm_fp8: needs FP8 linears"):
        LLM(llama_dir, tensor_parallel_size=2, fuse_norm_fp8=True, num_blocks=8)


def test_a_cpu_cache_the_ranks_together_do_not_have_memory_for_is_refused(llama_dir, monkeypatch):
    """CPU ranks share one host: each rank checked its own half of the cache against the memory left, so
    two ranks of 2 GiB each started (and then allocated) where 2.8 GiB were left."""
    # 40 blocks of 8192 bytes (the tiny Llama in float32): 4096 a block on each rank.
    monkeypatch.setattr("sluice.engine.worker.model_runner.available_memory_bytes", lambda: 200_000)
    with pytest.raises(ValueError) as refused:
        LLM(llama_dir, tensor_parallel_size=2, num_blocks=40, distributed_timeout_seconds=3600)
    assert str(refused.value) == (
        "num_blocks: a KV cache of 0.0 GiB over 2 ranks is more than the 0.0 GiB of memory available"
    )


def test_more_ranks_than_cuda_devices_is_refused(llama_dir):
    visible = torch.cuda.device_count()
    size = max(2, visible + 1)
    message = rf"tensor_parallel_size: {size} ranks need .* {visible} visible"
    if visible == 0:  # no CUDA device at all: the device is what is refused
        message = r"device: cuda, but torch sees 0 CUDA devices"
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, tensor_parallel_size=size, device="cuda", num_blocks=8)


@pytest.mark.parametrize(
    ("device", "visible", "refusal"),
    [
        ("cuda", 2, None),
        ("cuda", 1, "tensor_parallel_size: 2 ranks need 2 CUDA devices, 1 visible"),
        ("cuda:1", 2, "device: give 'cuda', not cuda:1: tensor-parallel ranks take cuda:0..1"),
    ],
)
def test_cuda_ranks_take_one_visible_device_each_from_cuda_0(monkeypatch, device, visible, refusal):
    """The placement by torch's device count, as a GPU machine reports it (run here without one: the
    placement is decided before any process or device is touched)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    config = EngineConfig(
        model=ModelConfig(model="tiny", device=device), parallel=ParallelConfig(tensor_parallel_size=2)
    )
    arch = ModelArchConfig.from_hf_config(PRESETS["tiny"])
    if refusal is None:
        assert place_ranks(config, arch) == Placement((torch.device("cuda", 0), torch.device("cuda", 1)), 1)
        return
    with pytest.raises(ValueError) as refused:
        place_ranks(config, arch)
    assert str(refused.value) == refusal


def test_a_model_without_tensor_parallel_support_is_refused(gemma3_dir):
    with (
        mock.patch.object(Gemma3ForCausalLM, "supports_tensor_parallel", False),
        pytest.raises(
            ValueError, match="tensor_parallel_size: Gemma3ForCausalLM has no tensor-parallel support"
        ),
    ):
        LLM(gemma3_dir, tensor_parallel_size=2, num_blocks=8)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (6, 3, 2, "tensor_parallel_size: 2 does not divide the 3 KV heads"),
        (8, 2, 6, "tensor_parallel_size: 6 does not divide the 8 query heads"),
        (12, 4, 6, "tensor_parallel_size: 6 ranks cannot share 4 KV heads evenly"),
    ],
)
def test_heads_that_do_not_split_are_refused(heads, kv_heads, size, message):
    with pytest.raises(ValueError, match=message):
        partition_heads(heads, kv_heads, 0, size)


def test_each_rank_finds_its_query_heads_kv_head_on_itself():
    """GQA: query head h reads KV head h // (heads / kv_heads); that KV head is among the rank's own."""
    for heads, kv_heads, size in [(8, 4, 4), (8, 2, 4), (8, 4, 2), (8, 1, 8), (4, 2, 2), (16, 8, 4)]:
        group = heads // kv_heads
        for rank in range(size):
            part = partition_heads(heads, kv_heads, rank, size)
            own = range(part.kv_start, part.kv_start + part.num_kv_heads)
            assert all(h // group in own for h in range(part.q_start, part.q_start + part.num_heads))


def test_the_vocabulary_splits_into_padded_ranges():
    parts = [VocabPartition.of(10, r, 4) for r in range(4)]
    assert [(p.start, p.end, p.num_rows) for p in parts] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


def test_a_worker_that_dies_before_joining_the_group_fails_the_start_naming_it(llama_dir, monkeypatch):
    """Rank 0's join waited for the whole distributed timeout (300 s by default) and then named no rank;
    the monitor's news of the death now ends it at once."""
    monkeypatch.setenv(ENV_VAR, "join:1")
    with pytest.raises(WorkerDiedError, match=r"^tensor-parallel rank 1 \(pid \d+\) failed: InjectedFault"):
        LLM(llama_dir, tensor_parallel_size=2, num_blocks=8, distributed_timeout_seconds=3600)


def test_an_interrupted_step_stops_the_workers_and_the_next_call_says_why(llama_dir):
    """A KeyboardInterrupt in rank 0's part of a step left the workers inside it: the next generate's
    collectives paired with the old step's, and it hung for the distributed timeout (or gloo aborted)."""
    llm = LLM(llama_dir, tensor_parallel_size=2, num_blocks=16, distributed_timeout_seconds=3600)
    executor = llm.engine.model_runner
    workers = list(executor.workers.processes.values())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with (
        mock.patch.object(
            executor.runner, "execute_model_with_prompt_logprobs", side_effect=KeyboardInterrupt
        ),
        pytest.raises(KeyboardInterrupt),
    ):
        llm.generate([[1, 2, 3]], params)
    assert not any(worker.is_alive() for worker in workers)
    with pytest.raises(WorkerDiedError, match="KeyboardInterrupt interrupted a step on rank 0"):
        llm.generate([[1, 2, 3]], params)
    llm.engine.model_runner.shutdown()


def test_a_ctrl_c_at_the_prompt_leaves_the_workers_running(llama_dir):
    """Ctrl-C in a REPL reaches the whole process group: rank 1 died of it (KeyboardInterrupt), and the
    engine with it; the workers ignore SIGINT, as the server's core does."""
    llm = LLM(llama_dir, tensor_parallel_size=2, num_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([[1, 2, 3]], params)[0].token_ids
    (worker,) = llm.engine.model_runner.workers.processes.values()
    os.kill(worker.pid, signal.SIGINT)
    worker.join(timeout=1.0)  # dead within that on the old code; alive for good now
    assert worker.is_alive()
    assert llm.generate([[1, 2, 3]], params)[0].token_ids == expected
    llm.engine.model_runner.shutdown()


def test_shutdown_leaves_alone_the_threads_another_engine_set_since(llama_dir):
    """Rank 0's torch threads go back to what they were at shutdown, unless another engine of the process
    set them since (it still runs on them): an engine shut down first put back its own count under it."""
    before = torch.get_num_threads()
    llm = LLM(llama_dir, tensor_parallel_size=2, num_blocks=16)
    other = max(before, torch.get_num_threads()) + 1  # as a second engine started since would set them
    torch.set_num_threads(other)
    try:
        llm.engine.model_runner.shutdown()
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("method", "intermediate_size"), [("int4", 96), ("int8", 48)])
def test_quantized_parts_a_split_would_cut_are_refused_naming_the_flag_before_any_rank_starts(
    tmp_path, method: str, intermediate_size: int
) -> None:
    """int4: 96 MLP columns are three groups of 32; two ranks' 48 are not whole groups. int8: 48 columns
    are three of its 16-column input steps; two ranks' 24 are not (torch's kernel reads past each row
    there). The quantizer refused it at load on every rank, naming a size ("got 48") no config holds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=intermediate_size, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert LLM(str(tmp_path), quantization=method, load_format="dummy", num_blocks=8)  # one rank: fine
    message = rf"^tensor_parallel_size: 2 ranks leave each a part of mlp.down_proj that {method} cannot"
    with (
        mock.patch("sluice.engine.executor.worker_processes.WorkerProcesses") as spawn,
        pytest.raises(ValueError, match=message),
    ):
        LLM(str(tmp_path), quantization=method, tensor_parallel_size=2, num_blocks=8)
    spawn.assert_not_called()
