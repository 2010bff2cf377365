"""Every Triton kernel compiles for the H100 (sm_90) with the constexprs its launcher picks for real
model shapes, on this GPU-less machine: scripts/compile_kernels.py records each launch from the real
launchers and compiles it ahead of time with Triton's bundled ptxas. The interpreter used by the other
kernel tests does not check `tl.dot` shapes, dtype rules or layouts; the GPU compiler does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "compile_kernels.py"
KERNELS = {
    "_store_kv_kernel",
    "_decode_partition_kernel",
    "_decode_reduce_kernel",
    "_prefill_attention_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_rotary_store_kv_kernel",
    "_silu_and_mul_kernel",
}

# ~70 variants at a few CPU seconds each (the attention kernels inline three tile loops): a 2-core machine
# shared with other jobs has taken over 4 minutes.
pytestmark = pytest.mark.timeout(1200)


def _compile(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args],
        env=env, capture_output=True, text=True, check=False, timeout=1150,
    )  # fmt: skip
    return proc, json.loads(out.read_text()) if out.exists() else []


def test_every_kernel_compiles_for_sm90_in_every_shape_and_dtype(tmp_path):
    proc, results = _compile(tmp_path)
    failed = [(r["kernel"], r["shape"], r["dtype"], r["error"]) for r in results if r["error"]]
    assert proc.returncode == 0 and not failed, proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = {(r["kernel"], r["shape"], r["dtype"]) for r in results}
    for shape in ("llama-3.2-1b", "llama-3-8b", "qwen2-0.5b"):
        assert {kernel for kernel, s, dtype in compiled if s == shape and dtype == "bf16"} >= KERNELS - {
            "_decode_reduce_kernel"  # shares its constexprs across shapes with equal head_dim
        }
    for dtype in ("bf16", "fp16", "fp32"):
        assert {kernel for kernel, s, d in compiled if s == "llama-3.2-1b" and d == dtype} == KERNELS
    # The decode launches' split counts (11 and 33 slices at 8 KV heads) give distinct reduce kernels,
    # and a large batch the single-split kernel that writes the output itself.
    one_b = [r for r in results if r["shape"] == "llama-3.2-1b" and r["dtype"] == "bf16"]
    assert len([r for r in one_b if r["kernel"] == "_decode_reduce_kernel"]) >= 2
    decode = [r["constexprs"] for r in one_b if r["kernel"] == "_decode_partition_kernel"]
    assert any("SINGLE_SPLIT=True" in c for c in decode) and any("SINGLE_SPLIT=False" in c for c in decode)
    # Prefill: the full 128-row tile of a long prompt and the group-sized tile of short queries.
    prefill = [r["constexprs"] for r in one_b if r["kernel"] == "_prefill_attention_kernel"]
    assert any("BLOCK_M=128" in c for c in prefill) and any("BLOCK_M=16," in c for c in prefill)
    assert all(r["registers"] > 0 and r["registers"] <= 255 for r in results)
    assert f"{len(results)} of {len(results)} kernel variants compiled for sm_90" in proc.stdout


def test_refuses_to_run_under_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "compile_kernels: unset TRITON_INTERPRET" in proc.stderr
