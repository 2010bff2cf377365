"""GPU acceptance check: kernel tests on the device, bf16 parity with transformers, decode benchmarks.

Needs one CUDA device with torch, triton and transformers; downloads nothing. Run `make gpu-check`
(or `python scripts/gpu_check.py [--out docs/perf/gpu_check.md]`). Steps:

1. pytest on the kernel test files with the kernels compiled for the GPU (no TRITON_INTERPRET);
2. a tiny random Llama saved with save_pretrained, loaded into both transformers and our model in
   bf16: last-token logits after a prefill and 8 greedy decode tokens through the paged cache;
3. a llama-3.2-1b-shaped random model in bf16: decode step time at batch 1/8/32/128, eager vs CUDA
   graphs; batch 1 against the floor (weight bytes / measured copy bandwidth); paged decode
   attention bandwidth at 4k and 32k context against the measured bandwidth; the prefill attention
   kernel against torch SDPA; the issue's three goals, met or not;
4. end to end on the same shape: the offline engine (`LLM`, CUDA graphs, Triton kernels) against
   `transformers.generate` one request at a time and in static batches of 8, same weights and prompts.
Results go to a markdown file, rewritten after each section (a crash or a timeout keeps what was
measured); the exit status is non-zero when a section fails or raises.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from engine.input_batch import ModelInputs, build_model_inputs  # noqa: E402
from engine.model_arch import ModelArchConfig  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402
from engine.presets import preset_arch  # noqa: E402
from engine.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402

KERNEL_TESTS = (
    "tests/test_kernels_store_kv.py",
    "tests/test_kernels_attention.py",
    "tests/test_kernels_norm_rope.py",
    "tests/test_cuda_graph_runner.py",
)
BLOCK_SIZE = 16
BENCH_BATCHES = (1, 8, 32, 128)
BENCH_CONTEXT = 512
PARITY_LOGIT_ATOL = 0.25  # bf16 logits of a 2-layer model: different kernels round differently


# ---- pure helpers (unit-tested on CPU) -------------------------------------------------------------


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are printed with 3 significant digits."""

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"rows: a row has {len(row)} cells, expected {len(headers)}")
        lines.append("| " + " | ".join(cell(value) for value in row) + " |")
    return "\n".join(lines)


def floor_step_time_s(weight_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """Lower bound of a batch-1 decode step: every weight byte is read once from device memory."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth_bytes_per_s: must be > 0, got {bandwidth_bytes_per_s}")
    return weight_bytes / bandwidth_bytes_per_s


def kv_read_bytes(num_seqs: int, context_len: int, num_kv_heads: int, head_dim: int, item_size: int) -> int:
    """Bytes a decode attention step must read: K and V of every context position of every sequence."""
    return 2 * num_seqs * context_len * num_kv_heads * head_dim * item_size


def decode_step_inputs(
    batch: int, context_len: int, block_size: int, device: torch.device, first_block: int = 0
) -> ModelInputs:
    """A pure-decode step for `batch` sequences of `context_len` tokens with disjoint block tables."""
    blocks_per_seq = -(-context_len // block_size)
    scheduled = tuple(
        ScheduledRequest(
            request_id=f"b{i}",
            token_ids=(1 + i,),
            start_position=context_len - 1,
            block_ids=tuple(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq)),
            sample=True,
        )
        for i in range(batch)
    )
    return build_model_inputs(SchedulerOutput(scheduled, batch), block_size, device)


# ---- measurements -------------------------------------------------------------------------------


def time_cuda_s(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_bytes_per_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_cuda_s(lambda: dst.copy_(src), iters=10)


def run_kernel_tests() -> tuple[bool, str]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", *KERNEL_TESTS]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return proc.returncode == 0, summary


def _triton_model(
    arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> LlamaForCausalLM:
    """Our model as ModelRunner builds it on CUDA: Triton attention, fused RMSNorm and rotary."""
    backend = TritonAttentionBackend()
    return LlamaForCausalLM(arch, backend, dtype, device, max_positions, use_triton_kernels=True)


def _random_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    model = _triton_model(arch, dtype, device, max_positions=4 * BENCH_CONTEXT)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    return model.eval()


def _kv_caches(arch: ModelArchConfig, num_blocks: int, dtype: torch.dtype, device: torch.device):
    shape = (num_blocks, BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
    return [
        (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
        for _ in range(arch.num_hidden_layers)
    ]


# ---- parity with transformers -------------------------------------------------------------------


def _save_tiny_checkpoint(directory: str) -> None:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HfLlama

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )  # fmt: skip
    torch.manual_seed(0)
    HfLlama(config).save_pretrained(directory)


def _greedy_ours(model: LlamaForCausalLM, kv_caches, prompt: list[int], steps: int, device: torch.device):
    """Prefill then `steps` greedy decodes through the paged cache; returns (prefill logits, tokens)."""
    blocks = tuple(range(-(-(len(prompt) + steps) // BLOCK_SIZE)))
    tokens, first_logits = list(prompt), None
    for _ in range(steps):
        start = 0 if first_logits is None else len(tokens) - 1
        request = ScheduledRequest("p", tuple(tokens[start:]), start, blocks, sample=True)
        inputs = build_model_inputs(SchedulerOutput((request,), len(tokens) - start), BLOCK_SIZE, device)
        hidden = model(inputs.input_ids, inputs.positions, kv_caches, inputs.metadata)
        logits = model.compute_logits(hidden[inputs.logits_indices])[0]
        first_logits = logits if first_logits is None else first_logits
        tokens.append(int(logits.argmax()))
    return first_logits, tokens[len(prompt) :]


def check_parity(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, steps: int = 8
) -> tuple[bool, list[list[object]]]:
    """Our Triton model vs transformers on one tiny checkpoint: prefill logits and greedy tokens."""
    from transformers import LlamaForCausalLM as HfLlama

    from engine.config import ModelConfig
    from engine.model_loader import load_model_source

    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        _save_tiny_checkpoint(directory)
        hf = HfLlama.from_pretrained(directory, dtype=dtype).to(device).eval()
        source = load_model_source(ModelConfig(model=directory, load_format="safetensors"))
        ours = _triton_model(source.arch, dtype, device)
        ours.load_weights(source.weights)
        prompt = torch.randint(
            0, source.arch.vocab_size, (37,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        kv_caches = _kv_caches(source.arch, 8, dtype, device)
        our_logits, our_tokens = _greedy_ours(ours, kv_caches, prompt, steps, device)
        ids = torch.tensor([prompt], device=device)
        hf_logits = hf(ids).logits[0, -1].float()
        hf_tokens = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, pad_token_id=0,
        )[0, len(prompt) :]  # fmt: skip
    max_diff = float((our_logits - hf_logits).abs().max())
    matched = sum(a == b for a, b in zip(our_tokens, hf_tokens.tolist(), strict=True))
    ok = max_diff <= PARITY_LOGIT_ATOL and matched == steps
    return ok, [
        ["prefill last-token logits, max abs diff", max_diff],
        ["greedy tokens equal", f"{matched}/{steps}"],
    ]


# ---- benchmarks ---------------------------------------------------------------------------------


def bench_decode(device: torch.device) -> tuple[list[list[object]], float, float]:
    """Rows (batch, eager ms, graph ms, speedup) and the graph pool size; batch-1 graph step seconds;
    weight bytes. A step is the forward plus the logits of the sampled rows."""
    arch = preset_arch("llama-3.2-1b")
    model = _random_model(arch, torch.bfloat16, device)
    blocks_per_seq = -(-BENCH_CONTEXT // BLOCK_SIZE)
    kv_caches = _kv_caches(arch, max(BENCH_BATCHES) * blocks_per_seq + 1, torch.bfloat16, device)
    runner = CudaGraphRunner(model, kv_caches, max(BENCH_BATCHES), blocks_per_seq, BLOCK_SIZE, device)
    rows, batch1_graph_s = [], 0.0
    with torch.inference_mode():
        runner.capture()
        for batch in BENCH_BATCHES:
            inputs = decode_step_inputs(batch, BENCH_CONTEXT, BLOCK_SIZE, device)
            eager_s = time_cuda_s(
                lambda i=inputs: _logits(model, model(i.input_ids, i.positions, kv_caches, i.metadata), i)
            )
            graph_s = time_cuda_s(lambda i=inputs: _logits(model, runner.run(i), i))
            batch1_graph_s = graph_s if batch == 1 else batch1_graph_s
            rows.append([batch, eager_s * 1e3, graph_s * 1e3, eager_s / graph_s])
    rows.append(["graph pool MiB", runner.memory_bytes / 2**20, "", ""])
    return rows, batch1_graph_s, _weight_bytes(model)


def _logits(model: LlamaForCausalLM, hidden: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    return model.compute_logits(hidden[inputs.logits_indices])


def _weight_bytes(model: torch.nn.Module) -> float:
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return float(sum(unique.values()))


def bench_attention(device: torch.device, bandwidth: float) -> list[list[object]]:
    """Paged decode attention alone at 4k and 32k context with llama-3.2-1b's heads, in bf16."""
    arch = preset_arch("llama-3.2-1b")
    rows = []
    for context, batch in ((4096, 32), (32768, 8)):
        md = decode_step_inputs(batch, context, BLOCK_SIZE, device).metadata
        shape = (batch * -(-context // BLOCK_SIZE), BLOCK_SIZE, arch.num_key_value_heads, arch.head_dim)
        k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch, arch.num_attention_heads, arch.head_dim, dtype=torch.bfloat16, device=device)
        seconds = time_cuda_s(
            lambda md=md, q=q, k=k_cache, v=v_cache: paged_decode_attention(
                q, k, v, md.block_tables, md.seq_lens, arch.head_dim**-0.5, md.max_seq_len
            )
        )
        moved = kv_read_bytes(batch, context, arch.num_key_value_heads, arch.head_dim, 2)
        rows.append([context, batch, seconds * 1e6, moved / seconds / 1e9, moved / seconds / bandwidth])
    return rows


def prefill_step_inputs(prompt_len: int, block_size: int, device: torch.device) -> ModelInputs:
    """One fresh prompt of `prompt_len` tokens prefilled in one step, on blocks 0, 1, 2, ..."""
    blocks = tuple(range(-(-prompt_len // block_size)))
    request = ScheduledRequest("prefill", (1,) * prompt_len, 0, blocks, sample=True)
    return build_model_inputs(SchedulerOutput((request,), prompt_len), block_size, device)


def causal_attention_flops(prompt_len: int, num_heads: int, head_dim: int) -> float:
    """Multiply-adds of QK^T and PV under a causal mask (half the square), 2 flops each."""
    return 2 * 2 * num_heads * head_dim * prompt_len * (prompt_len + 1) / 2


def bench_prefill_attention(device: torch.device) -> list[list[object]]:
    """Our paged varlen prefill kernel against torch's scaled_dot_product_attention (flash) on the same
    q/k/v, contiguous, causal, GQA: one prompt of 2k and of 8k tokens, llama-3.2-1b heads, bf16."""
    import torch.nn.functional as F

    arch = preset_arch("llama-3.2-1b")
    heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    rows = []
    for prompt_len in (2048, 8192):
        md = prefill_step_inputs(prompt_len, BLOCK_SIZE, device).metadata
        q = torch.randn(prompt_len, heads, dim, dtype=torch.bfloat16, device=device)
        k = torch.randn(prompt_len, kv_heads, dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        k_cache = k.view(-1, BLOCK_SIZE, kv_heads, dim)  # blocks 0, 1, ... hold positions in order
        v_cache = v.view(-1, BLOCK_SIZE, kv_heads, dim)
        ours = time_cuda_s(
            lambda md=md, q=q, kc=k_cache, vc=v_cache: prefill_attention(
                q, kc, vc, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len, dim**-0.5
            )
        )
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, heads, T, dim]
        sdpa = time_cuda_s(
            lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=True
            )
        )
        tflop = causal_attention_flops(prompt_len, heads, dim) / 1e12
        rows.append([prompt_len, ours * 1e3, tflop / ours, sdpa * 1e3, tflop / sdpa, sdpa / ours])
    return rows


def bench_end_to_end(
    device: torch.device, num_requests: int = 32, output_len: int = 64
) -> list[list[object]]:
    """`engine.bench`'s mixed workload (prompts of 32-512 tokens) on a llama-3.2-1b-shaped random bf16
    checkpoint: transformers first (its model stays loaded), then the engine with CUDA graphs."""
    from engine import bench

    with tempfile.TemporaryDirectory() as directory:
        hf = bench.build_checkpoint("llama-3.2-1b", directory, 0, "bfloat16", device.type)
        prompts = bench.mixed_workload(num_requests, hf.config.vocab_size, seed=0)
        results = [
            bench.run_hf_sequential(hf, prompts, output_len),
            bench.run_hf_static_batches(hf, prompts, output_len, 8),
            bench.run_sluice(
                "sluice (LLM, CUDA graphs)", directory, prompts, output_len, device=device.type,
                dtype="bfloat16", gpu_memory_utilization=0.6, max_num_batched_tokens=2048,
            ),
        ]  # fmt: skip
    base = results[0].tokens_per_second
    return [
        [r.name, r.output_tokens, r.seconds, r.tokens_per_second, r.tokens_per_second / base] for r in results
    ]


def goal_rows(
    batch1_step_s: float, floor_s: float, batch1_speedup: float, long_context_fraction: float
) -> list[list[object]]:
    """The issue's three GPU goals, each with its measured value and whether it was met."""
    goals = (
        ("batch-1 graph step / floor <= 1.5", batch1_step_s / floor_s, batch1_step_s / floor_s <= 1.5),
        ("CUDA graphs vs eager at batch 1 >= 1.5x", batch1_speedup, batch1_speedup >= 1.5),
        ("decode attention at 32k >= 70% of copy bw", long_context_fraction, long_context_fraction >= 0.7),
    )
    return [[name, value, "met" if met else "NOT met"] for name, value, met in goals]


class CheckFailed(Exception):
    """A section measured what it should and the result fails its check; the message is its body."""


class Report:
    """Markdown sections, rewritten to `path` after each one so that a crash, or a command killed at its
    time limit, keeps everything measured before it. A section that raises is recorded with its
    traceback and the next one still runs."""

    def __init__(self, path: Path, title: str) -> None:
        self.path, self.parts, self.ok = path, [title], True
        path.parent.mkdir(parents=True, exist_ok=True)

    def section(self, title: str, body: Callable[[], str]) -> None:
        try:
            text = body()
        except CheckFailed as failed:
            self.ok, text = False, f"**FAIL**\n\n{failed}"
        except Exception:  # noqa: BLE001 (one broken section must not lose the others)
            self.ok, text = False, f"**ERROR**\n\n```\n{traceback.format_exc()[-4000:]}```"
        self.parts.append(f"## {title}\n\n{text}")
        self.path.write_text("\n\n".join(self.parts) + "\n")
        print(self.parts[-1], flush=True)


class GpuCheck:
    """The report's sections, in order; later sections read what earlier ones measured."""

    def __init__(self, device: torch.device, skip_tests: bool, skip_e2e: bool) -> None:
        self.device, self.skip_tests, self.skip_e2e = device, skip_tests, skip_e2e

    def sections(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("Kernel tests (compiled for the GPU)", self.tests),
            ("Parity with transformers (bf16, Triton kernels)", self.parity),
            (f"Decode step, llama-3.2-1b shape, bf16, context {BENCH_CONTEXT}", self.decode),
            ("Paged decode attention (bf16, 32 query / 8 KV heads, head_dim 64)", self.attention),
            ("Prefill attention: our paged kernel vs torch SDPA (bf16, causal, 32/8 heads)", self.prefill),
            ("Goals", self.goals),
            ("End to end: Sluice vs transformers.generate (llama-3.2-1b shape, bf16)", self.end_to_end),
        ]

    def tests(self) -> str:
        if self.skip_tests:
            return "skipped"
        passed, summary = run_kernel_tests()
        if not passed:
            raise CheckFailed(summary)
        return f"PASS ({summary})"

    def parity(self) -> str:
        passed, rows = check_parity(self.device)
        table = markdown_table(["check", "value"], rows)
        if not passed:
            raise CheckFailed(table)
        return "PASS\n\n" + table

    def decode(self) -> str:
        self.bandwidth = copy_bandwidth_bytes_per_s(self.device)
        self.decode_rows, self.batch1_s, weight_bytes = bench_decode(self.device)
        self.floor_s = floor_step_time_s(int(weight_bytes), self.bandwidth)
        floor_headers = ["copy bandwidth GB/s", "weights GB", "floor ms", "graph step ms", "floor / step"]
        floor = [self.bandwidth / 1e9, weight_bytes / 1e9, self.floor_s * 1e3, self.batch1_s * 1e3,
                 self.floor_s / self.batch1_s]  # fmt: skip
        return "\n\n".join([
            markdown_table(["batch", "eager ms", "CUDA graph ms", "speedup"], self.decode_rows),
            "Batch-1 step vs the memory floor:",
            markdown_table(floor_headers, [floor]),
        ])  # fmt: skip

    def attention(self) -> str:
        self.attention_rows = bench_attention(self.device, self.bandwidth)
        return markdown_table(["context", "batch", "us", "GB/s", "of copy bw"], self.attention_rows)

    def prefill(self) -> str:
        headers = ["prompt", "ours ms", "ours TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "ours / SDPA speed"]
        return markdown_table(headers, bench_prefill_attention(self.device))

    def goals(self) -> str:
        speedup, fraction = self.decode_rows[0][3], self.attention_rows[-1][4]
        rows = goal_rows(self.batch1_s, self.floor_s, speedup, fraction)
        return markdown_table(["goal", "measured", "status"], rows)

    def end_to_end(self) -> str:
        if self.skip_e2e:
            return "skipped"
        torch.cuda.empty_cache()
        rows = bench_end_to_end(self.device)
        return markdown_table(["run", "output tokens", "seconds", "tok/s", "vs sequential"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "perf" / "gpu_check.md"))
    parser.add_argument("--skip-tests", action="store_true", help="skip the pytest step")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end comparison")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    report = Report(Path(args.out), f"# GPU check: {torch.cuda.get_device_name(device)} ({versions})")
    for title, body in GpuCheck(device, args.skip_tests, args.skip_e2e).sections():
        report.section(title, body)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
