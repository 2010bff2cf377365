"""Kernel dispatch is chosen once, at load: a float32 CPU model's norms, rotary and activation take the C++
kernels, a bfloat16 one plain PyTorch, the Triton backend (run by Triton's interpreter here) the Triton
kernels; linears get their `LinearMethod` from the same `KernelConfig`; after loading nothing is re-checked
per call; and no backend flag is threaded through the code any more."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig
from sluice.engine.loading.model_loader import load_model_source
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.attention.triton_backend import TritonAttentionBackend
from sluice.engine.worker.layers.activation import SiluAndMul
from sluice.engine.worker.layers.attention import Attention
from sluice.engine.worker.layers.custom_op import CustomOp
from sluice.engine.worker.layers.kernel_config import CPU_LAYER_KERNELS, KernelConfig
from sluice.engine.worker.layers.linear import LinearBase
from sluice.engine.worker.layers.linear_method import CpuPackedLinearMethod, UnquantizedLinearMethod
from sluice.engine.worker.layers.norm import RMSNorm
from sluice.engine.worker.layers.rotary import RotaryEmbedding
from sluice.engine.worker.model_runner import ModelRunner
from sluice.kernels import cpu_extension
from sluice.kernels.cpu_rms_norm import cpu_rms_norm_prechecked

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _runner(directory: str, dtype: str, attention_backend: str = "auto") -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype=dtype, device="cpu"),
        cache=CacheConfig(block_size=16, num_blocks=8),
        attention_backend=attention_backend,
    )
    return ModelRunner(config, load_model_source(config.model))


def _implementations(model: torch.nn.Module) -> dict[type, set[str]]:
    """op class -> the implementations its instances chose."""
    chosen: dict[type, set[str]] = {}
    for module in model.modules():
        if isinstance(module, CustomOp):
            chosen.setdefault(type(module), set()).add(module.implementation)
    return chosen


def _linear_methods(model: torch.nn.Module) -> set[type]:
    return {type(m.method) for m in model.modules() if isinstance(m, LinearBase)}


def test_a_float32_cpu_model_takes_the_cpp_kernels(qwen3_dir):
    runner = _runner(qwen3_dir, "float32")
    assert runner.kernels.cpu_kernels == frozenset(CPU_LAYER_KERNELS)
    # Qwen3's per-head q/k norms are RMSNorms too: every norm, the rotary and the SiLU gate run C++.
    assert _implementations(runner.model) == {RMSNorm: {"cpu"}, RotaryEmbedding: {"cpu"}, SiluAndMul: {"cpu"}}
    assert _linear_methods(runner.model) == {CpuPackedLinearMethod}


def test_a_bfloat16_cpu_model_runs_plain_pytorch(llama_dir):
    runner = _runner(llama_dir, "bfloat16")
    assert runner.kernels.cpu_kernels == frozenset()
    assert _implementations(runner.model) == {
        RMSNorm: {"native"},
        RotaryEmbedding: {"native"},
        SiluAndMul: {"native"},
    }
    methods = {m.method for m in runner.model.modules() if isinstance(m, LinearBase)}
    assert {type(m) for m in methods} == {UnquantizedLinearMethod}
    assert all(m.column_major for m in methods)
    assert runner.model.rotary.cos.dtype == torch.bfloat16
    assert runner.cpu_stack is None


def test_the_triton_backend_takes_the_triton_kernels(llama_dir):
    runner = _runner(llama_dir, "float32", attention_backend="triton")
    assert runner.kernels.triton
    assert _implementations(runner.model) == {
        RMSNorm: {"triton"},
        RotaryEmbedding: {"triton"},
        SiluAndMul: {"triton"},
    }
    assert runner.cpu_stack is None


def test_the_triton_backend_rotates_and_stores_in_one_kernel(llama_dir, monkeypatch):
    """Each layer's rotary + K/V store is the fused kernel; with fuse_rotary_store=False they run as two,
    with the same logits."""
    runner = _runner(llama_dir, "float32", attention_backend="triton")
    step = SchedulerOutput((ScheduledRequest("r", (5, 6, 7, 8, 9), 0, (0,), True),), 5)
    fused_calls = []
    original = TritonAttentionBackend.rotate_and_store
    monkeypatch.setattr(
        TritonAttentionBackend,
        "rotate_and_store",
        lambda self, *args: fused_calls.append(args[0].shape) or original(self, *args),
    )
    fused = runner.execute_model(step)
    assert fused_calls == [(5,)] * runner.arch.num_hidden_layers
    separate_kernels = dataclasses.replace(runner.kernels, fuse_rotary_store=False)
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.select(separate_kernels)
    fused_calls.clear()
    separate = runner.execute_model(step)
    assert fused_calls == []
    torch.testing.assert_close(separate, fused)


def test_gemma_keeps_its_norms_and_rotary_off_the_triton_kernels(gemma3_dir):
    runner = _runner(gemma3_dir, "float32", attention_backend="triton")
    chosen = {op.__name__: impls for op, impls in _implementations(runner.model).items()}
    # Its norms have no kernel; its rotary takes the C++ one here (float32 on cpu), never Triton's.
    assert chosen == {
        "GemmaRMSNorm": {"native"},
        "GeluTanhAndMul": {"native"},
        "Gemma3RotaryEmbedding": {"cpu"},
    }


def test_ops_do_not_recheck_the_kernels_after_load(qwen3_dir, monkeypatch):
    """Qwen3 runs layer by layer: after load, every availability check fails loudly; the step still runs the
    C++ norm kernel it chose, in every norm, and gives the same logits."""
    runner = _runner(qwen3_dir, "float32")
    step = SchedulerOutput((ScheduledRequest("r", (5, 6, 7, 8, 9), 0, (0,), True),), 5)
    before = runner.execute_model(step)

    def checked(name: str) -> bool:
        raise AssertionError(f"kernels/{name}.cpp checked after load")

    monkeypatch.setattr("sluice.kernels.cpu_extension.cpu_extension_available", checked)
    monkeypatch.setattr("sluice.kernels.cpu_extension.cpu_extension_unavailable_reason", checked)
    monkeypatch.setattr("sluice.engine.worker.layers.kernel_config.cpu_extension_available", checked)
    shapes: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        "sluice.engine.worker.layers.norm.cpu_rms_norm_prechecked",
        lambda x, *rest: shapes.append(tuple(x.shape)) or cpu_rms_norm_prechecked(x, *rest),
    )
    after = runner.execute_model(step)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    num_layers = runner.arch.num_hidden_layers
    assert len(shapes) == 4 * num_layers + 1  # input, post-attention, q and k norms per layer; the final one


def test_kernel_config_names_a_bad_field():
    with pytest.raises(
        ValueError, match=r"^cpu_kernels: the C\+\+ kernels run float32 on cpu, not torch.bfloat16"
    ):
        KernelConfig(CPU, torch.bfloat16, cpu_kernels=frozenset(CPU_LAYER_KERNELS))
    with pytest.raises(ValueError, match=r"^cpu_kernels: unknown \['cpu_gelu'\]"):
        KernelConfig(CPU, torch.float32, cpu_kernels=frozenset({"cpu_gelu"}))
    with pytest.raises(
        ValueError, match=r"^quantization: must be one of \('int4', 'int8', 'fp8'\), got 'int3'$"
    ):
        KernelConfig(CPU, torch.float32, quantization="int3")


def test_an_op_without_a_kernel_it_declares_is_refused():
    with pytest.raises(TypeError, match=r"^Broken: no forward_cpu for implementations \('cpu', 'native'\)$"):

        class Broken(CustomOp):
            implementations = ("cpu", "native")

            def forward_native(self, x: torch.Tensor) -> torch.Tensor:
                return x


def test_no_backend_flag_is_threaded_through_the_code():
    flag = "use_" + "triton"  # spelled apart so that this file does not match itself
    roots = ("engine", "service", "kernels", "benchmarks", "clients", "scripts", "tests", "docs", "deploy")
    files = [p for root in roots for p in (REPO / root).rglob("*") if p.suffix in (".py", ".md")]
    files += [p for p in REPO.glob("*") if p.suffix in (".py", ".md")]
    assert len(files) > 100
    offenders = [str(p.relative_to(REPO)) for p in files if flag in p.read_text(errors="replace")]
    assert offenders == []


def test_without_a_compiler_the_config_lists_no_cpp_kernel(monkeypatch):
    monkeypatch.setenv("CXX", "sluice-no-such-compiler")
    cpu_extension._build.cache_clear()
    try:
        assert KernelConfig.for_model(CPU, torch.float32, None).cpu_kernels == frozenset()
    finally:
        monkeypatch.undo()
        cpu_extension._build.cache_clear()
    assert KernelConfig.for_model(CPU, torch.float32, None).cpu_kernels == frozenset(CPU_LAYER_KERNELS)
