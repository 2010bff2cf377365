"""Session-wide tiny checkpoints (see checkpoints.py), built once and shared by every test file."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton reads this when a kernel module is first imported: without a GPU, kernels run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from triton_interpreter import skip_repeated_language_patches, skip_unasserted_work

    skip_repeated_language_patches()  # a fifth of an interpreted attention test's time
    skip_unasserted_work()  # then half of what is left
from checkpoints import (
    LONG_CONTEXT,
    build_gemma3_checkpoint,
    build_llama_checkpoint,
    build_mistral_checkpoint,
    build_mistral_windowed_checkpoint,
    build_qwen2_checkpoint,
    build_qwen3_checkpoint,
)

# The longest files (about one to five minutes each on a 2-core machine) are collected first, so that
# under `make test`'s workers (pytest-xdist, one file at a time, in collection order:
# --no-loadscope-reorder) they start at once instead of leaving one worker to finish them alone (by name
# alone, the fp8-KV engine and tensor-parallel files would start among the last).
LONGEST_FILES = (
    "test_gpu_check_script.py",
    "test_kernels_compile.py",
    "test_fp8_fused_quant_model.py",
    "test_triton_fp8_kv.py",
    "test_triton_fp8_kv_engine.py",
    "test_async_engine.py",
    "test_tensor_parallel_service.py",
    "test_gemma3_270m.py",
    "test_async_scheduling.py",
    "test_tensor_parallel.py",
    "test_fp8_folded_inputs_model.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with rope_scaling llama3 and tied embeddings; one model.safetensors."""
    return build_llama_checkpoint(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def llama_without_tokenizer_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`llama_dir` without its tokenizer.json: a model served on token ids alone."""
    directory = tmp_path_factory.mktemp("no_tokenizer") / "llama"
    shutil.copytree(llama_dir, directory)
    (directory / "tokenizer.json").unlink()
    return str(directory)


@pytest.fixture(scope="session")
def llama_long_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`llama_dir`'s model and weights with a 131,072-token context: room for requests that run until the
    test ends them (service_harness.UNENDING)."""
    directory = str(tmp_path_factory.mktemp("llama_long"))
    return build_llama_checkpoint(directory, max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mistral with an untied lm_head; one model.safetensors."""
    return build_mistral_checkpoint(str(tmp_path_factory.mktemp("mistral")))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2 with q/k/v biases, sharded over several safetensors files plus an index."""
    return build_qwen2_checkpoint(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="session")
def mistral_windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mistral with a sliding window of 12 tokens: every layer windowed."""
    return build_mistral_windowed_checkpoint(str(tmp_path_factory.mktemp("mistral_windowed")))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3 with q/k norms and head_dim 32."""
    return build_qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Gemma 3 text: two local layers (window 8) and one global layer."""
    return build_gemma3_checkpoint(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def server(llama_long_dir: str):
    """A real Sluice gRPC server on a loopback port, serving the long-context tiny Llama (one per test
    module), on which service_harness.UNENDING requests run until the test ends them."""
    from service_harness import ServerThread, long_engine_config

    thread = ServerThread(long_engine_config(llama_long_dir)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def stub(server):
    """Generated stubs on one channel to the module's `server`."""
    channel = server.channel()
    yield server.stub(channel)
    channel.close()


@pytest.fixture(scope="module")
def compiler(llama_dir: str):
    """A grammar compiler (one worker) for the tiny Llama's tokenizer, one per test module."""
    from sluice.engine.structured.grammar_compiler import GrammarCompiler
    from sluice.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(llama_dir)
    vocab_size = json.loads((Path(llama_dir) / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids, num_workers=1)
    yield compiler
    compiler.shutdown()


# FP8 layers on their CUDA kernel path, on CPU (tests/test_fp8_fused_quant_model.py, test_fp8_fbgemm.py).
@pytest.fixture
def scaled_mm_on_cpu(monkeypatch):
    """FP8 layers whose sizes allow it run `_scaled_mm` on CPU ("rowwise" in bfloat16, else "tensorwise")
    instead of the emulation: the matmul on which the linears quantize with the `fp8_quant` kernel."""
    from sluice.engine.worker.layers import quantization

    chosen = quantization.fp8_matmul_for

    def on_cpu(scheme, kernels, input_size, output_size):
        matmul = chosen(scheme, kernels, input_size, output_size)
        if matmul == "emulated" and input_size % 16 == 0 and output_size % 16 == 0:
            return "rowwise" if kernels.dtype == torch.bfloat16 else "tensorwise"
        return matmul

    monkeypatch.setattr(quantization, "fp8_matmul_for", on_cpu)


@pytest.fixture
def quant_launches(monkeypatch) -> list[tuple[int, int]]:
    """The shape of x of every `fp8_quant` launch, in order."""
    from sluice.kernels import fp8_quant

    calls: list[tuple[int, int]] = []
    launch = fp8_quant._launch
    monkeypatch.setattr(
        fp8_quant, "_launch", lambda x, *args: calls.append(tuple(x.shape)) or launch(x, *args)
    )
    return calls
