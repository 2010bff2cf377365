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


@triton.jit
def _int_affine_kernel(x_ptr, out_ptr, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * FACTOR + 7)


@pytest.fixture
def overflow_checks(monkeypatch) -> list[str]:
    """The operation's name at every call of Triton's own overflow check."""
    assert triton_interpreter.skip_unasserted_work()  # installed by conftest: a no-op here
    skip = interpreter.interpreter_semantic.binary_op_sanitize_overflow_impl
    calls: list[str] = []
    check = skip.check
    monkeypatch.setattr(skip, "check", lambda lhs, rhs, op: calls.append(op.__name__) or check(lhs, rhs, op))
    return calls


def test_integer_overflow_checks_run_only_where_the_interpreter_asserts_them(overflow_checks, monkeypatch):
    x = torch.tensor([1, -2, 3, 70000] * (BLOCK // 4), dtype=torch.int32)
    expected = (x.long() * 65536 + 7).to(torch.int32)  # int32 wraps: 70000 * 65536 does not fit
    out = torch.zeros_like(x)
    assert interpreter.interpreter_builder.options.debug is False  # Triton's default, never changed
    _int_affine_kernel[(1,)](x, out, 65536, BLOCK)
    assert torch.equal(out, expected) and overflow_checks == []
    # With debugging on, `device_assert` reads the condition: Triton's check runs and catches the overflow.
    monkeypatch.setattr(
        interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True)
    )
    _int_affine_kernel[(1,)](x, torch.zeros_like(x), 1, BLOCK)  # no overflow
    assert overflow_checks == ["mul", "add"]  # the kernel's two integer operations (pointers add unchecked)
    with pytest.raises(interpreter.InterpreterError, match="int32 overflow detected for operation mul"):
        _int_affine_kernel[(1,)](x, out, 65536, BLOCK)


def _fields(element, shape, init) -> dict:
    block = object.__new__(tl.block_type)
    init(block, element, shape)
    return {name: str(value) if name == "shape" else value for name, value in vars(block).items()}


def test_block_types_get_the_fields_triton_gives_them_and_their_shapes_are_read_once(monkeypatch):
    assert triton_interpreter.skip_unasserted_work()
    unwraps: list[object] = []
    unwrap = tl.core._unwrap_shape
    monkeypatch.setattr(tl.core, "_unwrap_shape", lambda shape: unwraps.append(shape) or unwrap(shape))
    remembered = tl.block_type.__init__
    elements = (tl.float32, tl.bfloat16, tl.pointer_type(tl.float16), tl.pointer_type(tl.int8, const=True))
    # One shape as a list and as a tuple of constexprs and ints: an unusual one, so that no earlier test's
    # launch has read it.
    shapes = ([2, 8, 4, 2], tl.core.tuple([tl.constexpr(2), tl.constexpr(8), tl.constexpr(4), 2]))
    for element in elements:
        expected = [_fields(element, shape, remembered.original) for shape in shapes]
        unwraps.clear()
        for _ in range(3):
            assert [_fields(element, shape, remembered) for shape in shapes] == expected
        assert len(unwraps) <= 1  # Triton's own reading of the shape, the first time at most
        assert isinstance(tl.block_type(element, shapes[0]).shape, tl.core.tuple)
    # Triton's errors, for shapes it refuses, also after one it took: 2.0 equals 2 but is not an int.
    _fields(tl.float32, [2], remembered)
    for shape, error in (([], TypeError), ([3], ValueError), ([2.0], TypeError), ((2,), AssertionError)):
        for init in (remembered.original, remembered, remembered):
            with pytest.raises(error):
                _fields(tl.float32, shape, init)


def test_numpy_dtypes_are_the_ones_triton_gives():
    assert triton_interpreter.skip_unasserted_work()
    get_np_dtype = interpreter._get_np_dtype
    scalars = [
        getattr(tl, name)
        for name in ("int1", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
        + ("float16", "bfloat16", "float32", "float64", "float8e5", "float8e4nv", "float8e4b15")
    ]
    for element in [*scalars, tl.pointer_type(tl.float32)]:
        for tt_dtype in (element, tl.block_type(element, [4, 2])):
            assert get_np_dtype(tt_dtype) == get_np_dtype.original(tt_dtype), tt_dtype
    for fails in (get_np_dtype.original, get_np_dtype):
        with pytest.raises(KeyError):
            fails(tl.void)
