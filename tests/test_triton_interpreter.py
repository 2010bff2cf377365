"""tests/triton_interpreter.py (installed by conftest under TRITON_INTERPRET=1): Triton patches the language
once however many launches and helper calls follow, the kernels compute what they compute, and each launch
leaves triton.language as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
import triton_interpreter
from triton.runtime import interpreter

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's patching (a GPU compiles kernels)"
)

NUM_PROGRAMS, NUM_CALLS, BLOCK = 5, 3, 16
LANGUAGE = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base)


@triton.jit
def _scaled(x, factor):
    return x * factor + 1.0


@triton.jit
def _helper_loop_kernel(x_ptr, out_ptr, NUM_CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    for _ in tl.static_range(NUM_CALLS):
        x = _scaled(x, 2.0)
    tl.store(out_ptr + offsets, x)


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, NUM_CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    total = tl.sum(x, axis=0) * 0.0
    for _ in tl.static_range(NUM_CALLS):
        total += tl.sum(x, axis=0)  # a helper of triton.language.standard, which sees tl.core, not tl
    tl.store(out_ptr + tl.program_id(0), total)


@pytest.fixture
def patch_calls(monkeypatch) -> list[str]:
    """The function's name at every call of Triton's own `_patch_lang`, with nothing patched yet to
    re-apply."""
    assert triton_interpreter.skip_repeated_language_patches()  # installed by conftest: a no-op here
    skip = interpreter._patch_lang
    calls: list[str] = []
    patch = skip.patch
    monkeypatch.setattr(skip, "patch", lambda fn: calls.append(fn.__name__) or patch(fn))
    monkeypatch.setattr(triton_interpreter, "_patched", {})
    return calls


def test_launches_patch_the_language_once_for_all_their_programs_helper_calls(patch_calls):
    x = torch.randn(NUM_PROGRAMS * BLOCK, generator=torch.Generator().manual_seed(0))
    expected = x.clone()
    for _ in range(NUM_CALLS):
        expected = expected * 2.0 + 1.0
    for _ in range(2):  # the second re-applies the first's patch
        out = torch.full_like(x, float("nan"))
        _helper_loop_kernel[(NUM_PROGRAMS,)](x, out, NUM_CALLS, BLOCK)
        torch.testing.assert_close(out, expected)
    assert patch_calls == ["_helper_loop_kernel"]  # Triton alone: 2 * (1 + NUM_PROGRAMS * NUM_CALLS)


def test_a_helper_seeing_another_language_module_patches_it_once_per_launch(patch_calls):
    x = torch.randn(NUM_PROGRAMS * BLOCK, generator=torch.Generator().manual_seed(2))
    expected = x.view(NUM_PROGRAMS, BLOCK).sum(dim=1) * NUM_CALLS
    for _ in range(2):
        out = torch.full((NUM_PROGRAMS,), float("nan"))
        _row_sums_kernel[(NUM_PROGRAMS,)](x, out, NUM_CALLS, BLOCK)
        torch.testing.assert_close(out, expected)
    # Triton alone: 2 * (1 + NUM_PROGRAMS * (1 + NUM_CALLS))
    assert patch_calls == ["_row_sums_kernel", "sum", "sum"]


def test_each_launch_leaves_the_language_as_it_found_it(patch_calls):
    before = [dict(vars(module)) for module in LANGUAGE]
    x = torch.randn(BLOCK, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _helper_loop_kernel[(1,)](x, torch.empty_like(x), NUM_CALLS, BLOCK)
    after = [dict(vars(module)) for module in LANGUAGE]
    for module, old, new in zip(LANGUAGE, before, after, strict=True):
        assert new.keys() == old.keys(), module
        assert all(new[name] is old[name] for name in old), module
    assert tl.core.is_builtin(tl.load)
