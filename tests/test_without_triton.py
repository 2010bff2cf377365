"""Triton is optional (pyproject installs it on Linux x86_64 only): without it the engine, the offline API
and the server still import, and the C++ CPU backend (or the torch one) serves requests. Run in a
subprocess whose import system refuses `triton`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from sluice.kernels.cpu_extension import cpu_extension_unavailable_reason
from sluice.kernels.cpu_paged_attention import EXTENSION

_PROGRAM = textwrap.dedent(
    """
    import importlib.abc, sys

    class RefuseTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError("No module named 'triton'", name="triton")
            return None

    sys.meta_path.insert(0, RefuseTriton())
    import sluice.service.server, sluice.service.cli  # noqa: F401
    from sluice.engine.frontend.llm import LLM
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(None, load_format="dummy", preset="tiny", device="cpu", kv_cache_memory_bytes=2**24)
    [done] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(done.token_ids) == 3, done
    assert "triton" not in sys.modules and "sluice.kernels.rms_norm" not in sys.modules
    print("served without triton:", llm.engine.model_runner.attention_backend.name)
    """
)


def test_engine_and_server_run_without_triton():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=False, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The C++ CPU kernel needs no Triton; without a compiler auto falls back to the torch backend.
    expected = "torch" if cpu_extension_unavailable_reason(EXTENSION) else "cpu"
    assert proc.stdout.strip().endswith(f"served without triton: {expected}")
