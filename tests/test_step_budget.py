"""The step budget (max_num_batched_tokens) left unset follows the device, as vLLM's server picks it: 8192
tokens on GPUs of 70 GiB or more other than the A100, 2048 elsewhere; the model runner sets it before the
scheduler is built, and a budget given is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig, default_step_budget
from sluice.engine.errors import ContextLengthError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler import Scheduler
from sluice.engine.worker.model_runner import with_step_budget

GiB = 2**30


@pytest.mark.parametrize(
    ("device_type", "memory", "name", "budget"),
    [
        ("cuda", 80 * GiB, "NVIDIA H100 80GB HBM3", 8192),
        ("cuda", 140 * GiB, "NVIDIA H200", 8192),
        ("cuda", 192 * GiB, "AMD Instinct MI300X", 8192),
        ("cuda", 70 * GiB, "a 70 GiB GPU", 8192),
        ("cuda", 70 * GiB - 1, "just under 70 GiB", 2048),
        ("cuda", 80 * GiB, "NVIDIA A100-SXM4-80GB", 2048),
        ("cuda", 24 * GiB, "NVIDIA L4", 2048),
        ("cpu", 0, "", 2048),
        ("cpu", 512 * GiB, "a CPU with much memory", 2048),
    ],
)
def test_the_default_budget_follows_the_device(device_type, memory, name, budget) -> None:
    assert default_step_budget(device_type, memory, name) == budget
    assert SchedulerConfig().with_step_budget(device_type, memory, name).max_num_batched_tokens == budget


def test_a_budget_given_is_kept_and_the_default_covers_max_num_seqs() -> None:
    given = SchedulerConfig(max_num_batched_tokens=256)
    assert given.with_step_budget("cuda", 80 * GiB, "NVIDIA H100") is given
    many = SchedulerConfig(max_num_seqs=10000).with_step_budget("cuda", 80 * GiB, "NVIDIA H100")
    assert (many.max_num_batched_tokens, many.max_num_seqs) == (10000, 10000)
    assert SchedulerConfig(max_num_seqs=3000).with_step_budget("cpu").max_num_batched_tokens == 3000
    assert SchedulerConfig(max_num_seqs=300).with_step_budget("cpu").max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="^max_num_batched_tokens: must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=128)
    with pytest.raises(ValueError, match="^max_num_batched_tokens: must be > 0$"):
        SchedulerConfig(max_num_batched_tokens=0)


@pytest.mark.parametrize(
    ("name", "memory", "budget"),
    [("NVIDIA H200", 140 * GiB, 8192), ("NVIDIA A100-SXM4-80GB", 80 * GiB, 2048)],
)
def test_the_runner_reads_the_gpu_it_runs_on(monkeypatch, name, memory, budget) -> None:
    asked = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(name=name, total_memory=memory)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    device = torch.device("cuda", 1)
    config = with_step_budget(EngineConfig(), device, 4096)
    assert config.scheduler.max_num_batched_tokens == budget and asked == [device]
    assert config.cache == EngineConfig().cache  # only the budget changes
    given = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512))
    assert with_step_budget(given, device, 4096) is given and asked == [device]  # a given budget asks nothing


def test_an_engine_on_cpu_schedules_with_the_cpu_budget(llama_dir) -> None:
    llm = LLM(llama_dir, dtype="float32", num_blocks=64)
    core = llm.engine.core
    assert core.scheduler.config.max_num_batched_tokens == 2048
    assert core.config.scheduler.max_num_batched_tokens == 2048
    assert core.model_runner.config.scheduler.max_num_batched_tokens == 2048


def test_a_scheduler_refuses_an_unset_budget() -> None:
    with pytest.raises(ValueError, match="^max_num_batched_tokens: unset"):
        Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=8, max_model_len=64)


def test_an_unset_budget_is_the_default_config() -> None:
    assert EngineConfig().scheduler.max_num_batched_tokens is None
    given = EngineConfig.from_kwargs(None, max_num_batched_tokens=4096)
    assert given.scheduler.max_num_batched_tokens == 4096


def test_without_chunked_prefill_the_default_budget_holds_the_whole_context() -> None:
    """As vLLM: else every request was held to 2048 tokens (prompt and max_tokens) on a CPU."""
    whole = SchedulerConfig(enable_chunked_prefill=False)
    assert whole.with_step_budget("cpu", max_model_len=8192).max_num_batched_tokens == 8192
    assert whole.with_step_budget("cpu", max_model_len=1024).max_num_batched_tokens == 2048
    assert SchedulerConfig().with_step_budget("cpu", max_model_len=8192).max_num_batched_tokens == 2048


def test_without_chunked_prefill_a_request_over_the_budget_names_what_to_lower(llama_long_dir) -> None:
    """The engine's default budget covers its context; one given smaller is kept, and a request whose
    prompt fits but not with its max_tokens is refused naming max_tokens (it named the 10-token prompt)."""
    llm = LLM(llama_long_dir, max_model_len=4096, enable_chunked_prefill=False, num_blocks=300)
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == 4096
    small = LLM(llama_long_dir, enable_chunked_prefill=False, max_num_batched_tokens=256, num_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    with pytest.raises(ContextLengthError) as info:
        small.generate([list(range(1, 11))], params)
    assert info.value.field == "max_tokens"
    assert "prompt (10 tokens) + max_tokens (300) exceed max_num_batched_tokens 256" in str(info.value)
