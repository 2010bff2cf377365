"""Triton's interpreter without the work it repeats or throws away: the tests' kernels run faster on CPU,
computing the same values.

Under TRITON_INTERPRET=1 a launch (`GridExecutor`) patches triton.language's builtins for the interpreter
(`_patch_lang`: an `inspect.getmembers` over the language modules, ~1 ms), runs every program of the grid
and restores them. A `@triton.jit` helper called from inside a kernel (`InterpretedFunction.__call__`)
patches them again at every call: per program, per helper, per loop iteration.
`skip_repeated_language_patches` makes that call a no-op inside a launch that patched every language module
the helper sees, and makes a launch's own patch once per set of modules, re-applying the attributes it set
at later launches. A helper called outside a launch is patched as Triton does; so is the first call in a
launch of one that sees another module (`tl.sum`, `tl.max`: triton.language.standard sees tl.core, a kernel
tl), after which the launch counts that module as patched: Triton never restores a helper's patch. The same
patched builtins run: nothing a kernel computes changes. Measured alternated on a 2-core AMD EPYC (AVX2):
test_triton_fp8_kv.py's unit-scale tests 96-101 s -> 76-80 s with the skip alone;
test_fp8_fused_quant_model.py's hidden-state tests 179-180 s -> 162-165 s with both; a later session's
once-per-launch patch for other modules took test_kernels_fused_fp8_quant.py from 40.8-44.7 s to
35.4-39.1 s (its rms_norm kernels call tl.sum and tl.max in every program).

Every tensor operation of an interpreted program then goes through Triton's front end (`TritonSemantic`)
as a compile would, and two parts of that are waste here (`skip_unasserted_work`):
- Each integer add, sub and mul narrower than 64 bits is redone in int64 for an overflow check
  (`binary_op_sanitize_overflow_impl`: two casts, the op, two constants, two comparisons, an `and`) whose
  only effect is `device_assert`, which returns without reading its condition unless the options ask for
  debugging: the interpreter's never do (`InterpreterOptions().debug` is False). Skipped while that holds;
  with debug on, Triton's check runs as before.
- Every result's `block_type` validates and formats its shape again, and every load, store and cast looks
  its numpy dtype up in a table `_get_np_dtype` rebuilds at each call. Both are remembered: a block type's
  fields by its element type (as a string) and its shape, numpy dtypes by Triton dtype name; any other
  input (a shape that is not a list or `tl.tuple` of ints, a type outside the table) takes Triton's own
  path, and with it Triton's errors. (`block_type` is patched for compiles in this process too: the same
  fields.)
Measured alternated on a quiet 2-core AMD EPYC (AVX-512), user CPU of test_triton_fp8_kv.py,
test_kernels_attention.py and test_kernels_fp8_gated_linears.py under two workers: 158-176 s -> 103-105 s
with the overflow checks skipped, 80-81 s with the types remembered too; `make test` 1147 -> 939 s.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import triton.language as tl
from triton.runtime import interpreter

_launches = threading.local()  # .stack: per launch being run, the language modules it patched (None: not yet)


class _Unpatched:
    """The scope of a patch that was not made: nothing to restore."""

    def restore(self) -> None:
        pass


# language modules -> Triton's scope class and the (object, attribute, value) its first patch set, in order
_patched: dict[frozenset[int], tuple[type, list[tuple[object, str, object]]]] = {}


@functools.cache
def _language_modules(fn: Callable) -> frozenset[int]:
    """The ids of the language modules `_patch_lang(fn)` patches: tl and tl.core, as fn's module sees them."""
    return frozenset(id(value) for value in fn.__globals__.values() if value is tl or value is tl.core)


def skip_repeated_language_patches() -> bool:
    """Installs the skip (once); False, nothing installed, where this Triton's interpreter has no
    `_patch_lang` and `GridExecutor` to wrap."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if getattr(patch_lang, "skips_repeats", False):
        return True
    if patch_lang is None or executor is None:
        return False
    run_grid = executor.__call__

    def launch(self, *args, **kwargs):
        stack = _launches.__dict__.setdefault("stack", [])
        stack.append(None)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            stack.pop()

    def patch_once_per_launch(fn):
        stack = getattr(_launches, "stack", None)
        if not stack or stack[-1] is not None:  # a helper's call
            modules = _language_modules(fn)
            if stack and modules <= stack[-1]:
                return _Unpatched()  # inside a launch that patched what the helper sees
            scope = patch_once_per_launch.patch(fn)
            if stack:  # Triton never restores a helper's patch: the rest of the launch sees it
                stack[-1] = stack[-1] | modules
            return scope
        stack[-1] = modules = _language_modules(fn)  # the launch's own patch, before its first program
        if modules in _patched:  # set the same values again, in a scope of Triton's that restores them
            scope_type, patched = _patched[modules]
            scope = scope_type()
            for obj, name, value in patched:
                scope.set_attr(obj, name, value)
            return scope
        scope = patch_once_per_launch.patch(fn)
        changes = getattr(scope, "_changes", None)  # Triton's [(object, attribute, original)], in order
        if isinstance(changes, list) and hasattr(scope, "set_attr"):
            _patched[modules] = (type(scope), [(obj, name, getattr(obj, name)) for obj, name, _ in changes])
        return scope

    patch_once_per_launch.skips_repeats = True
    patch_once_per_launch.patch = patch_lang  # Triton's own (a test counts its calls here)
    executor.__call__ = launch
    interpreter._patch_lang = patch_once_per_launch
    return True


def skip_unasserted_work() -> bool:
    """Installs the module docstring's two shortcuts (once): the interpreter's overflow checks skipped while
    its options leave them unasserted, block types' fields and numpy dtypes remembered. False, nothing
    installed, where this Triton's interpreter lacks what they wrap."""
    semantic = getattr(interpreter, "interpreter_semantic", None)
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    check = getattr(semantic, "binary_op_sanitize_overflow_impl", None)
    if getattr(check, "skips_unasserted", False):
        return True
    if check is None or get_np_dtype is None or not hasattr(semantic, "builder"):
        return False

    def overflow_check(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:  # `device_assert` would drop the check's condition unread
            return None
        return overflow_check.check(lhs, rhs, binary_op)

    overflow_check.skips_unasserted = True
    overflow_check.check = check  # Triton's own (a test counts its calls here)
    semantic.binary_op_sanitize_overflow_impl = overflow_check
    interpreter._get_np_dtype = _remembered_np_dtypes(get_np_dtype)
    tl.block_type.__init__ = _remembered_block_fields(tl.block_type.__init__)
    return True


def _remembered_np_dtypes(get_np_dtype: Callable) -> Callable:
    """`get_np_dtype` (Triton's `_get_np_dtype`) from a table by dtype name, built once from its answers."""
    table = {
        dtype.name: get_np_dtype(dtype)
        for dtype in (
            tl.int1, tl.int8, tl.int16, tl.int32, tl.int64, tl.uint8, tl.uint16, tl.uint32, tl.uint64,
            tl.float16, tl.bfloat16, tl.float32, tl.float64,
            tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15,
        )
    }  # fmt: skip
    pointer = get_np_dtype(tl.pointer_type(tl.int8))

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return pointer
        found = table.get(element.name) if type(element) is tl.dtype else None
        return get_np_dtype(tt_dtype) if found is None else found

    np_dtype.original = get_np_dtype
    return np_dtype


def _remembered_block_fields(init: Callable) -> Callable:
    """`block_type.__init__` (`init`) that sets the fields it set before for the same element type (as a
    string) and shape of ints: the shape (a `tl.tuple` of ints, rebuilt for each type), numel and name
    depend on nothing else. Shapes Triton takes are lists and `tl.tuple`s; anything else goes to `init`."""
    fields: dict[tuple[str, tuple], tuple[list[int], object, int, str]] = {}

    def block_type_init(self, element_ty, shape):
        values = shape if isinstance(shape, list) else None
        if isinstance(shape, tl.core.tuple):
            values = shape.values
        if values is not None:
            dims = tuple([dim.value if isinstance(dim, tl.constexpr) else dim for dim in values])
            if all(type(dim) is int for dim in dims):
                key = (str(element_ty), dims)
                known = fields.get(key)
                if known is None:
                    init(self, element_ty, shape)  # Triton's checks: a shape that fails them is never kept
                    fields[key] = (list(self.shape.values), self.shape.type, self.numel, self.name)
                    return
                dims_values, shape_type, self.numel, self.name = known
                self.element_ty = element_ty
                self.shape = tl.core.tuple(dims_values, shape_type)  # the values copied, the type shared
                return
        init(self, element_ty, shape)

    block_type_init.original = init
    return block_type_init
