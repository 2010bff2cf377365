"""GPU acceptance check: kernel tests on the device, bf16 parity with transformers, decode benchmarks.

Step (b) of `scripts/gpu_check.sh`, which runs it with `--skip-tests` after running the kernel tests itself
(its step (a), `--print-kernel-tests` gives the files); it also runs alone on a CUDA machine whose python
has torch (CUDA build), triton, transformers, pytest and Sluice's own dependencies:
`python scripts/gpu_check.py [--out docs/perf/gpu_check.md]`. Downloads nothing. Sections:

1. pytest on the kernel test files with the kernels compiled for the GPU (no TRITON_INTERPRET);
2. a tiny random Llama saved with save_pretrained, loaded into both transformers and our model in
   bf16: last-token logits after a prefill and 8 greedy decode tokens through the paged cache;
3. the ceilings measured here: device-to-device copy bandwidth and the bf16 matrix product rate;
4. a llama-3.2-1b-shaped random model in bf16: decode step time at batch 1/8/32/64/128, eager vs CUDA
   graphs; batch 1 against the floor (weight bytes / measured copy bandwidth); paged decode
   attention bandwidth at 4k x 32 and 32k x 8 against the copy bandwidth; the prefill attention
   kernel against torch SDPA at 2k and 8k; issue 33's kernel goals, met or not; the same attention
   kernels over an FP8 (e4m3) KV cache against bf16 (`fp8_kv_kernels`); a tile-config sweep of both
   attention kernels at those shapes (`attention_sweep`, capped at SWEEP_CAP_S seconds of wall clock,
   SLUICE_GPU_CHECK_SWEEP_S overrides it, 0 skips it), one results line per shape as each ends;
5. end to end on the same shape: the offline engine (`LLM`, CUDA graphs, Triton kernels) against
   `transformers.generate` one request at a time and in static batches of 8, same weights and prompts.
After the parity step, with 2+ devices: tensor parallelism, the tiny Llama on 2 ranks (NCCL), eager and
with the all-reduces captured in CUDA graphs, must give the 1-rank greedy tokens (with one device the
report says plainly that it was not checked).
Results go to a markdown file, rewritten after each section (a crash or a timeout keeps what was
measured); with `--results FILE` each section's figures are appended to FILE as one JSON line
(`{"step": "gpu_check", "section": ..., "figures": {...}}`, read by the GPU check's report). The exit
status is non-zero when a section fails or raises. `--device cpu` runs the parity section in float32
with the kernels interpreted (set TRITON_INTERPRET=1) and reports the CUDA-only sections as skipped:
the GPU check's CPU mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sluice.benchmarks.gpu import fp8_kv_kernels
from sluice.benchmarks.gpu.attention_sweep import (
    SWEEP_CAP_S,
    SWEEP_ENV,
    sweep_attention,
    sweep_cap_s,
    sweep_section,
)
from sluice.benchmarks.gpu.dependent_launch_step import (
    bench_dependent_launch,
    dependent_launch_figures,
    logits_depart,
)
from sluice.benchmarks.gpu.gpu_benchmarks import (
    BENCH_CONTEXT,
    BLOCK_SIZE,
    GRAPH_MAX_REL_DIFF,
    bench_attention,
    bench_decode,
    bench_end_to_end,
    bench_graph_step_partitions,
    bench_prefill_attention,
    bench_rotary_store_fusion,
    copy_bandwidth_bytes_per_s,
    floor_step_time_s,
    goal_rows,
    matmul_flops_per_s,
    random_kv_caches,
    triton_model,
)
from sluice.benchmarks.gpu.graph_step_kernels import (
    profile_graph_steps,
    step_kernels_figures,
    step_kernels_text,
)
from sluice.benchmarks.gpu.kernel_test_files import (
    CPU_KERNEL_TESTS,
    KERNEL_TESTS,
    KernelTestFile,
    run_kernel_tests,
    select_kernel_tests,
)
from sluice.benchmarks.gpu.mixed_step_attention import MIXED_MAX_REL_DIFF, mixed_step_rows
from sluice.benchmarks.gpu.split_prefill_attention import SPLIT_MAX_REL_DIFF, split_prefill_rows
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import build_model_inputs
from sluice.engine.worker.models.llama import LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent

CUDA_ONLY = "skipped: needs CUDA (this run is on the CPU)"
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

    from sluice.engine.config import ModelConfig
    from sluice.engine.loading.model_loader import load_model_source

    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        _save_tiny_checkpoint(directory)
        hf = HfLlama.from_pretrained(directory, dtype=dtype).to(device).eval()
        source = load_model_source(ModelConfig(model=directory, load_format="safetensors"))
        ours = triton_model(source.arch, dtype, device)
        ours.load_weights(source.weights)
        prompt = torch.randint(
            0, source.arch.vocab_size, (37,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        kv_caches = random_kv_caches(source.arch, 8, dtype, device)
        our_logits, our_tokens = _greedy_ours(ours, kv_caches, prompt, steps, device)
        ids = torch.tensor([prompt], device=device)
        hf_logits = hf(ids).logits[0, -1].float()
        hf.generation_config.eos_token_id = None  # ours never stops early either: compare `steps` tokens
        hf_tokens = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
    max_diff = float((our_logits - hf_logits).abs().max())
    matched = sum(a == b for a, b in zip(our_tokens, hf_tokens.tolist(), strict=True))
    ok = max_diff <= PARITY_LOGIT_ATOL and matched == steps
    return ok, [
        ["prefill last-token logits, max abs diff", max_diff],
        ["greedy tokens equal", f"{matched}/{steps}"],
    ]


# ---- tensor parallelism --------------------------------------------------------------------------


def check_tensor_parallel() -> tuple[bool, list[list[object]]]:
    """The tiny Llama (fp32) on 1 rank, then on 2 (NCCL) eager and with CUDA graphs, which capture the
    row-parallel all-reduces, and with graphs and async scheduling (rank 0's sampled tokens broadcast to
    rank 1's device each step): a batch's greedy tokens must be equal."""
    from sluice.engine.frontend.llm import LLM
    from sluice.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 512, (n,), generator=generator).tolist() for n in (5, 37, 80, 130)]
    runs, rows = {}, []
    with tempfile.TemporaryDirectory() as directory:
        _save_tiny_checkpoint(directory)
        for size, eager, overlapped in (
            (1, False, False),
            (2, True, False),
            (2, False, False),
            (2, False, True),
        ):
            llm = LLM(
                directory,
                tensor_parallel_size=size,
                enforce_eager=eager,
                async_scheduling=overlapped,
                dtype="float32",
                num_blocks=64,
            )
            try:
                runs[size, eager, overlapped] = [c.token_ids for c in llm.generate(prompts, params)]
            finally:
                if size > 1:
                    llm.engine.model_runner.shutdown()
            equal = runs[size, eager, overlapped] == runs[1, False, False]
            run = f"{size} rank(s), {'eager' if eager else 'CUDA graphs'}{', async' if overlapped else ''}"
            rows.append([run, "yes" if equal else "NO"])
    return all(row[1] == "yes" for row in rows), rows


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


def _skipped() -> str:
    return CUDA_ONLY


class GpuCheck:
    """The report's sections, in order; later sections read what earlier ones measured. Each section
    may leave its figures in `self.figures[key]` for the machine-readable results."""

    def __init__(
        self,
        device: torch.device,
        skip_tests: bool,
        skip_e2e: bool,
        results: Path | None = None,
        sweep_s: float = SWEEP_CAP_S,
        kernel_tests: Sequence[KernelTestFile] = KERNEL_TESTS,
    ) -> None:
        self.device, self.skip_tests, self.skip_e2e = device, skip_tests, skip_e2e
        self.results, self.sweep_s, self.kernel_tests = results, sweep_s, kernel_tests
        self.figures: dict[str, dict[str, object]] = {}
        self.bandwidth: float | None = None

    def record(self, section: str, figures: dict[str, object]) -> None:
        """Figures appended to the results file now (a section that records as it goes)."""
        if self.results is not None:
            append_result(self.results, {"step": "gpu_check", "section": section, "figures": figures})

    def sections(self) -> list[tuple[str, str, Callable[[], str]]]:
        """(key, title, body) of each section, in report order; on a CPU the CUDA-only ones say so."""
        sections = [
            ("tests", "Kernel tests (compiled for the GPU)", self.tests, False),
            ("parity", "Parity with transformers (Triton kernels)", self.parity, False),
            ("tensor_parallel", "Tensor parallelism: 2 ranks (NCCL), all-reduces in CUDA graphs",
             self.tensor_parallel, True),
            ("ceilings", "Ceilings measured here", self.ceilings, True),
            ("decode", f"Decode step, llama-3.2-1b shape, bf16, context {BENCH_CONTEXT}", self.decode, True),
            ("fusion", "Batch-1 graph step: rotary + K/V store fused or not (llama-3.2-1b shape)",
             self.fusion, True),
            ("pdl", "Batch-1 graph step: programmatic dependent launch on or off, bf16 linears (cuBLAS's, "
             "Sluice's skinny launch) and FP8 ones (llama-3.2-1b shape)",
             self.pdl, True),
            ("partitions", f"Batch-1 graph step: decode attention's splits and tile (llama-3.2-1b shape, "
             f"context {BENCH_CONTEXT})", self.partitions, True),
            ("step_kernels", f"Batch-1 graph step, kernel by kernel (llama-3.2-1b shape, context "
             f"{BENCH_CONTEXT})", self.step_kernels, True),
            ("attention", "Paged decode attention (bf16, 32 query / 8 KV heads, head_dim 64)",
             self.attention, True),
            ("prefill", "Prefill attention: our paged kernel vs torch SDPA (bf16, causal, 32/8 heads)",
             self.prefill, True),
            ("mixed", "Mixed step attention: long decode rows, then a prompt chunk (bf16, 32 query / 8 KV "
             "heads, head_dim 64)", self.mixed, True),
            ("split_prefill", "Split-KV prefill attention: short queries after long contexts (bf16, 32 query "
             "/ 8 KV heads, head_dim 64)", self.split_prefill, True),
            ("goals", "Goals (issue 33, kernel level)", self.goals, True),
            ("kv_fp8", "FP8 KV cache at kernel level: attention over e4m3 codes vs bf16 (default configs, and"
             " the FP8 decode at bf16's tile)", self.kv_fp8, True),
            ("attention_sweep", "Attention tile configs (sweep)", self.attention_sweep, True),
            ("end_to_end", "End to end: Sluice vs transformers.generate (llama-3.2-1b shape, bf16)",
             self.end_to_end, True),
        ]  # fmt: skip
        on_cpu = self.device.type != "cuda"
        return [
            (key, title, _skipped if cuda_only and on_cpu else body)
            for key, title, body, cuda_only in sections
        ]

    def tests(self) -> str:
        if self.skip_tests:
            return "skipped (scripts/gpu_check.sh runs them as its own step)"
        passed, summary = run_kernel_tests(self.kernel_tests, REPO)
        if not passed:
            raise CheckFailed(summary)
        return f"PASS ({summary})"

    def parity(self) -> str:
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        passed, rows = check_parity(self.device, dtype)
        self.figures["parity"] = {
            "dtype": str(dtype),
            "max_logit_diff": rows[0][1],
            "tokens_equal": rows[1][1],
        }
        table = markdown_table(["check", "value"], [["dtype", str(dtype)], *rows])
        if not passed:
            raise CheckFailed(table)
        return "PASS\n\n" + table

    def ceilings(self) -> str:
        self.bandwidth = copy_bandwidth_bytes_per_s(self.device)
        self.matmul = matmul_flops_per_s(self.device)
        self.figures["ceilings"] = {
            "copy_bytes_per_s": self.bandwidth,
            "bf16_matmul_flops_per_s": self.matmul,
        }
        rows = [["device-to-device copy, read + write (1 GiB)", self.bandwidth / 1e9, "GB/s"],
                ["bf16 matrix product 8192^3, random data", self.matmul / 1e12, "TFLOP/s"]]  # fmt: skip
        return markdown_table(["ceiling", "measured", "unit"], rows)

    def decode(self) -> str:
        self.decode_rows, self.batch1_s, weight_bytes = bench_decode(self.device)
        self.floor_s = floor_step_time_s(int(weight_bytes), self.bandwidth)
        steps = [row for row in self.decode_rows if isinstance(row[0], int)]
        self.figures["decode"] = {
            "context": BENCH_CONTEXT,
            "weight_bytes": weight_bytes,
            "floor_s": self.floor_s,
            "graph_step_s": {str(row[0]): row[2] / 1e3 for row in steps},
            "eager_step_s": {str(row[0]): row[1] / 1e3 for row in steps},
        }
        step_headers = ["batch", "eager ms", "CUDA graph ms", "speedup", "graph vs eager (max rel diff)"]
        floor_headers = ["copy bandwidth GB/s", "weights GB", "floor ms", "graph step ms", "floor / step"]
        floor = [self.bandwidth / 1e9, weight_bytes / 1e9, self.floor_s * 1e3, self.batch1_s * 1e3,
                 self.floor_s / self.batch1_s]  # fmt: skip
        text = "\n\n".join([
            markdown_table(step_headers, self.decode_rows),
            "Batch-1 step vs the memory floor:",
            markdown_table(floor_headers, [floor]),
        ])  # fmt: skip
        if any(row[4] > GRAPH_MAX_REL_DIFF for row in steps):
            raise CheckFailed(
                f"CUDA graph replay departs from eager by more than {GRAPH_MAX_REL_DIFF}\n\n{text}"
            )
        return text

    def fusion(self) -> str:
        rows = bench_rotary_store_fusion(self.device)
        self.figures["fusion"] = {"fused_step_s": rows[0][1] / 1e3, "separate_step_s": rows[1][1] / 1e3}
        table = markdown_table(
            ["kernels", "graph step ms", "vs fused", "logits vs fused (max rel diff)"], rows
        )
        if rows[1][3] > GRAPH_MAX_REL_DIFF:
            raise CheckFailed(
                f"fused and separate rotary + store depart by more than {GRAPH_MAX_REL_DIFF}\n\n{table}"
            )
        return table

    def pdl(self) -> str:
        rows = bench_dependent_launch(self.device)
        self.figures["pdl"] = dependent_launch_figures(rows)
        headers = ["linears", "launches", "graph step ms", "vs with PDL", "logits vs with PDL (max rel diff)"]
        table = markdown_table(headers, rows)
        if any(logits_depart(row) for row in rows):  # PDL starts the same kernels earlier: the same bits
            raise CheckFailed(
                "logits depart from their model's first row: without PDL, a kernel reads before its wait; "
                "SiLU-and-mul in its own launch or in the FP8 down_proj's, down_proj's gated loads round "
                "otherwise; a row that moves "
                "the RMSNorms (the bf16 skinny ones apart, the FP8 ones folded), beyond "
                f"{GRAPH_MAX_REL_DIFF}: a linear's norm prologue is wrong\n\n{table}"
            )
        return table

    def partitions(self) -> str:
        rows = bench_graph_step_partitions(self.device)
        keys = ("graph_context", "tile", "partition", "splits", "step_ms", "speed_vs_default", "rel_diff")
        self.figures["partitions"] = {"rows": [dict(zip(keys, row, strict=True)) for row in rows]}
        headers = ["graph for (positions)", "decode tile", "partition", "splits", "graph step ms",
                   "speed vs the graph's default", "logits vs the first row (max rel diff)"]  # fmt: skip
        table = markdown_table(headers, rows)
        if any(row[6] > GRAPH_MAX_REL_DIFF for row in rows):
            raise CheckFailed(f"decode splits or tiles depart by more than {GRAPH_MAX_REL_DIFF}\n\n{table}")
        return table

    def step_kernels(self) -> str:
        profiles = profile_graph_steps(self.device)
        self.figures["step_kernels"] = step_kernels_figures(profiles)
        return step_kernels_text(profiles, getattr(self, "floor_s", None))

    def attention(self) -> str:
        self.attention_rows = bench_attention(self.device, self.bandwidth)
        keys = ("context", "batch", "us", "gb_per_s", "of_copy_bw")
        self.figures["attention"] = {
            "rows": [dict(zip(keys, row, strict=True)) for row in self.attention_rows]
        }
        return markdown_table(["context", "batch", "us", "GB/s", "of copy bw"], self.attention_rows)

    def prefill(self) -> str:
        self.prefill_rows = bench_prefill_attention(self.device)
        keys = ("prompt", "ours_ms", "ours_tflops", "sdpa_ms", "sdpa_tflops", "ours_over_sdpa_speed")
        self.figures["prefill"] = {"rows": [dict(zip(keys, row, strict=True)) for row in self.prefill_rows]}
        headers = ["prompt", "ours ms", "ours TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "ours / SDPA speed"]
        return markdown_table(headers, self.prefill_rows)

    def mixed(self) -> str:
        rows = mixed_step_rows(self.device)
        keys = ("decode_rows", "context", "prompt", "one_launch_ms", "served_ms", "speedup", "rel_diff")
        self.figures["mixed"] = {"rows": [dict(zip(keys, row, strict=True)) for row in rows]}
        headers = ["decode rows", "their context", "prompt tokens", "one prefill launch ms",
                   "as served ms (decode + prefill)", "speedup", "outputs (max rel diff)"]  # fmt: skip
        table = markdown_table(headers, rows)
        if any(row[6] > MIXED_MAX_REL_DIFF for row in rows):
            raise CheckFailed(f"the two paths depart by more than {MIXED_MAX_REL_DIFF}\n\n{table}")
        return table

    def split_prefill(self) -> str:
        rows = split_prefill_rows(self.device)
        keys = ("seqs", "query", "context", "splits", "one_split_ms", "split_ms", "speedup", "double_ms",
                "double_speedup", "rel_diff")  # fmt: skip
        self.figures["split_prefill"] = {"rows": [dict(zip(keys, row, strict=True)) for row in rows]}
        headers = ["sequences", "query tokens", "context", "splits picked", "one split ms", "picked ms",
                   "speedup", "twice the splits ms", "speedup", "outputs (max rel diff)"]  # fmt: skip
        table = markdown_table(headers, rows)
        if any(row[-1] > SPLIT_MAX_REL_DIFF for row in rows):
            raise CheckFailed(
                f"split and one-split outputs depart by more than {SPLIT_MAX_REL_DIFF}\n\n{table}"
            )
        return table

    def goals(self) -> str:
        speedup = self.decode_rows[0][3]
        rows = goal_rows(self.batch1_s, self.floor_s, speedup, self.attention_rows, self.prefill_rows)
        return markdown_table(["goal", "measured", "status"], rows)

    def kv_fp8(self) -> str:
        rows = fp8_kv_kernels.bench_fp8_kv_kernels(self.device)
        self.figures["kv_fp8"] = fp8_kv_kernels.figures(rows)
        table = markdown_table(fp8_kv_kernels.HEADERS, rows)
        if not fp8_kv_kernels.passed(rows):
            raise CheckFailed(f"an FP8 kernel departs from bf16 on the dequantized cache\n\n{table}")
        return table

    def attention_sweep(self) -> str:
        if self.sweep_s <= 0:
            return f"skipped ({SWEEP_ENV}=0)"
        shapes = []
        for shape in sweep_attention(self.device, self.bandwidth, self.sweep_s):
            self.record("attention_sweep", shape.record)
            print(shape.text(), flush=True)  # into steps.log at once, should the step be killed later
            shapes.append(shape)
        text, wrong_default = sweep_section(self.sweep_s, shapes)
        if wrong_default:
            raise CheckFailed(f"the default config is off torch SDPA at {', '.join(wrong_default)}\n\n{text}")
        return text

    def end_to_end(self) -> str:
        if self.skip_e2e:
            return "skipped"
        torch.cuda.empty_cache()
        rows = bench_end_to_end(self.device)
        self.figures["end_to_end"] = {"rows": [{"run": r[0], "tokens_per_s": r[3]} for r in rows]}
        return markdown_table(["run", "output tokens", "seconds", "tok/s", "vs sequential"], rows)

    def tensor_parallel(self) -> str:
        visible = torch.cuda.device_count()
        if visible < 2:
            return f"NOT CHECKED: {visible} CUDA device visible, tensor parallelism needs 2"
        passed, rows = check_tensor_parallel()
        table = markdown_table(["run", "greedy tokens equal 1 rank's"], rows)
        if not passed:
            raise CheckFailed(table)
        return "PASS\n\n" + table


def append_result(path: Path, record: dict[str, object]) -> None:
    """One JSON line appended to the GPU check's results file."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "perf" / "gpu_check.md"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--results", default=None, help="append each section's figures here (JSON lines)")
    parser.add_argument("--skip-tests", action="store_true", help="skip the pytest step")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end comparison")
    parser.add_argument(
        "--print-kernel-tests",
        action="store_true",
        help="print the kernel test files of --device, one a line with its pytest arguments tab-separated",
    )
    parser.add_argument(
        "--kernel-tests", default="", help="only these kernel test files (whitespace-separated)"
    )
    args = parser.parse_args(argv)
    try:
        if args.kernel_tests.strip():
            entries = select_kernel_tests(args.kernel_tests)
        else:
            entries = KERNEL_TESTS if args.device == "cuda" else CPU_KERNEL_TESTS
        sweep_s = sweep_cap_s()
    except ValueError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    if args.print_kernel_tests:
        print("\n".join(entry.line() for entry in entries))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--device cpu runs the CPU mode)", file=sys.stderr)
        return 2
    import triton

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    report = Report(Path(args.out), f"# GPU check: {name} ({versions})")
    results = Path(args.results) if args.results else None
    check = GpuCheck(device, args.skip_tests, args.skip_e2e, results, sweep_s, entries)
    for key, title, body in check.sections():
        report.section(title, body)
        if args.results and key in check.figures:
            append_result(
                Path(args.results), {"step": "gpu_check", "section": key, "figures": check.figures[key]}
            )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
