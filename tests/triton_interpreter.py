"""Triton's interpreter without its repeated language patching: the tests' kernels run faster on CPU.

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
