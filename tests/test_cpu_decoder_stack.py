"""The one-call C++ decoder stack (kernels/cpu_decoder_stack.h) against the model's per-layer path on the
same kernels: equal hidden states on a mixed step (a fresh prefill, a chunk after a cached prefix, decodes),
for tiny Llama (GQA, llama3 RoPE, tied embeddings), Mistral with a sliding window shorter than the contexts,
and Qwen2 (qkv biases). Its parity with transformers is in
test_model_parity.py. Also: the same results whether a step runs as one team of threads (kernels/cpu_team.h)
or a parallel region per kernel, for any number of threads; the team's barrier; when the model keeps its
per-layer path; and the checks the C++ side makes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import build_model_inputs
from sluice.engine.worker.layers.quantization import CpuQuantizedLinearMethod
from sluice.engine.worker.model_runner import ModelRunner
from sluice.kernels.cpu_extension import require_cpu_extension

BLOCK_SIZE = 8
NUM_BLOCKS = 24


def _runner(directory: str, attention_backend: str = "cpu", **model_options) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(**{"model": directory, "dtype": "float32", "device": "cpu", **model_options}),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        attention_backend=attention_backend,
    )
    return ModelRunner(config, load_model_source(config.model))


def _steps() -> list[SchedulerOutput]:
    """Step 1 prefills three prompts; step 2 continues one as a chunk after its cached prefix, decodes the
    second, and prefills a fourth fresh: contexts ending mid-block, non-contiguous block tables. Step 3
    decodes three (3 rows: quantized projections run their kernels, as they do up to 4 rows)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 500, (n,), generator=generator).tolist() for n in (13, 21, 6, 9)]
    blocks = [(0, 5, 9, 14), (1, 6, 10), (2, 7), (3, 11, 15)]
    first = SchedulerOutput(
        (
            ScheduledRequest("a", tuple(prompts[0][:10]), 0, blocks[0], False),
            ScheduledRequest("b", tuple(prompts[1]), 0, blocks[1], True),
            ScheduledRequest("c", tuple(prompts[2]), 0, blocks[2], True),
        ),
        37,
    )
    second = SchedulerOutput(
        (
            ScheduledRequest("a", tuple(prompts[0][10:]), 10, blocks[0], True),
            ScheduledRequest("b", (17,), 21, blocks[1], True),
            ScheduledRequest("d", tuple(prompts[3]), 0, blocks[3], True),
        ),
        13,
    )
    third = SchedulerOutput(
        (
            ScheduledRequest("a", (31,), 13, blocks[0], True),
            ScheduledRequest("b", (45,), 22, blocks[1], True),
            ScheduledRequest("d", (59,), 9, blocks[3], True),
        ),
        3,
    )
    return [first, second, third]


def _hidden_states(runner: ModelRunner, stacked: bool) -> list[torch.Tensor]:
    """Each step's hidden states, from fresh (zeroed) caches, with the stack or the model's layers."""
    forward = runner.cpu_stack if stacked else runner.model
    caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    with torch.inference_mode():
        results = []
        for out in _steps():
            inputs = build_model_inputs(out, BLOCK_SIZE, runner.device)
            results.append(forward(inputs.input_ids, inputs.positions, caches, inputs.metadata))
    return results


@pytest.mark.parametrize(
    ("checkpoint", "options"),
    [
        ("llama_dir", {}),
        ("mistral_windowed_dir", {}),
        ("qwen2_dir", {}),
        ("llama_dir", {"quantization": "int4"}),
        ("qwen2_dir", {"quantization": "int8"}),  # the qkv bias added after the int8 kernel
    ],
)
def test_stack_equals_the_per_layer_path_on_a_mixed_step(checkpoint, options, request):
    runner = _runner(request.getfixturevalue(checkpoint), **options)
    assert runner.cpu_stack is not None
    projections = [layer.mlp.down_proj for layer in runner.model.model.layers]
    quantized = [isinstance(p.method, CpuQuantizedLinearMethod) for p in projections]
    assert quantized == [("quantization" in options)] * len(projections)
    stacked, layered = _hidden_states(runner, True), _hidden_states(runner, False)
    for got, want in zip(stacked, layered, strict=True):
        assert got.shape == want.shape
        assert torch.isfinite(want).all()
        # The same kernels in the same order: the same roundings.
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op threads for one test (the stack's team has as many), then restores them."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("checkpoint", ["llama_dir", "mistral_windowed_dir", "qwen2_dir"])
def test_a_team_of_any_size_computes_what_a_region_per_kernel_does(
    checkpoint, threads, request, torch_threads
):
    torch_threads(threads)
    runner = _runner(request.getfixturevalue(checkpoint))
    assert runner.cpu_stack.team  # the default without quantized projections
    teamed = _hidden_states(runner, True)
    runner.cpu_stack.team = False
    per_kernel, layered = _hidden_states(runner, True), _hidden_states(runner, False)
    for team, regions, layers in zip(teamed, per_kernel, layered, strict=True):
        assert torch.isfinite(layers).all()
        torch.testing.assert_close(team, regions, rtol=0, atol=0)
        torch.testing.assert_close(team, layers, rtol=0, atol=0)


def test_a_quantized_stack_runs_a_region_per_kernel(llama_dir):
    runner = _runner(llama_dir, quantization="int8")
    assert not runner.cpu_stack.team
    with pytest.raises(RuntimeError, match="team: a stack with quantized projections runs a parallel region"):
        runner.cpu_stack.team = True


@pytest.mark.parametrize("threads", [2, 3, "processors + 1"])
def test_the_team_barrier_lets_no_thread_run_ahead(threads, torch_threads):
    # More threads than processors: the barrier sleeps at once instead of spinning (cpu_team.h, kSpin).
    torch_threads(len(os.sched_getaffinity(0)) + 1 if threads == "processors + 1" else threads)
    check = require_cpu_extension("cpu_decoder_stack").team_barrier_check
    assert check(500, -1) == 0


def test_the_team_barrier_does_not_spin_for_a_thread_on_the_waiters_own_cpu(torch_threads):
    # Both threads pinned to one CPU: a spinning waiter would hold the CPU its partner needs for the whole
    # spin (cpu_team.h). Once each thread has been seen on that CPU, no wait spins (300 rounds: 300 spun
    # waits without the check).
    torch_threads(2)
    assert require_cpu_extension("cpu_decoder_stack").team_spun_waits(300, True) <= 2


def test_the_team_barrier_spins_for_a_thread_on_another_cpu(torch_threads):
    # One CPU each: every round's waiter spins first, as the barrier did before the check (its first
    # arrival of a round is the one that waits; the machine has the two CPUs the project runs on).
    torch_threads(2)
    assert require_cpu_extension("cpu_decoder_stack").team_spun_waits(300, False) == 300


@pytest.mark.parametrize("failing_thread", [0, 1])
def test_an_error_in_one_thread_of_a_team_ends_it_and_is_raised(failing_thread, torch_threads):
    torch_threads(2)
    check = require_cpu_extension("cpu_decoder_stack").team_barrier_check
    with pytest.raises(RuntimeError, match=f"thread {failing_thread} failed in round 250"):
        check(500, failing_thread)
    assert check(10, -1) == 0  # the pool is usable afterwards


@pytest.mark.parametrize(
    ("checkpoint", "options", "reason"),
    [
        ("llama_dir", {"attention_backend": "torch"}, "attention is not the C++ backend"),
        ("llama_dir", {"dtype": "bfloat16"}, "rotary does not run the C++ kernel (not float32 on cpu)"),
    ],
)
def test_models_off_the_stack_keep_their_layers_and_say_why(checkpoint, options, reason, request, caplog):
    with caplog.at_level(logging.INFO, logger="sluice.engine.worker.models.llama_cpu_stack"):
        runner = _runner(request.getfixturevalue(checkpoint), **options)
    assert runner.cpu_stack is None
    assert any(reason in record.getMessage() for record in caplog.records), caplog.text


def test_a_subclassed_layer_stays_off_the_stack(qwen3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="sluice.engine.worker.models.llama_cpu_stack"):
        runner = _runner(qwen3_dir)
    assert runner.cpu_stack is None
    assert "Qwen3ForCausalLM's layers are not the Llama decoder layer the stack runs" in caplog.text


@pytest.fixture(scope="module")
def llama_runner(llama_dir) -> ModelRunner:
    return _runner(llama_dir)


def _forward_args(runner: ModelRunner):
    inputs = build_model_inputs(_steps()[0], BLOCK_SIZE, runner.device)
    embeddings = runner.model.model.embed_tokens(inputs.input_ids)
    return embeddings, inputs.positions, runner.kv_caches, inputs.metadata


def test_a_position_past_the_rotary_table_is_refused(llama_runner):
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    positions = positions.clone()
    positions[3] = llama_runner.model.rotary.cos_sin_cache.shape[0]
    with pytest.raises(RuntimeError, match=r"positions: \d+ \(token 3\) is outside the rotary table"):
        llama_runner.cpu_stack.run(embeddings, positions, caches, metadata)


def test_a_block_id_outside_the_cache_is_refused(llama_runner):
    """As the per-layer kernel refuses it: the stack's attention read any id a table held."""
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    block_tables = metadata.block_tables.clone()
    block_tables[0, 0] = caches[0][0].shape[0]
    metadata = dataclasses.replace(metadata, block_tables=block_tables)
    with pytest.raises(ValueError, match=r"^block_tables: sequence 0 block 0 is \d+, not one of the cache's"):
        llama_runner.cpu_stack.run(embeddings, positions, caches, metadata)


def test_embeddings_of_another_width_are_refused(llama_runner):
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    with pytest.raises(
        RuntimeError, match=r"embeddings: must be a contiguous float32 \[num_tokens, 64\] tensor"
    ):
        llama_runner.cpu_stack.run(embeddings[:, :32].contiguous(), positions, caches, metadata)


def test_a_cache_per_layer_is_required(llama_runner):
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    with pytest.raises(RuntimeError, match=r"kv_caches: \d+ for \d+ layers"):
        llama_runner.cpu_stack.run(embeddings, positions, caches[:-1], metadata)


def test_a_slot_past_the_cache_is_refused_before_any_layer_runs(llama_runner):
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    num_slots = caches[0][0].shape[0] * caches[0][0].shape[1]
    metadata.slot_mapping[5] = num_slots
    before = [k.clone() for k, _ in caches]
    with pytest.raises(
        RuntimeError, match=rf"slot_mapping: slot {num_slots} \(token 5\) is past the cache's"
    ):
        llama_runner.cpu_stack.run(embeddings, positions, caches, metadata)
    assert all(torch.equal(k, b) for (k, _), b in zip(caches, before, strict=True))


def test_query_rows_must_cover_the_step(llama_runner):
    embeddings, positions, caches, metadata = _forward_args(llama_runner)
    with pytest.raises(RuntimeError, match="query_start_loc: must run from 0 to 36"):
        llama_runner.cpu_stack.run(embeddings[:36], positions[:36], caches, metadata)
