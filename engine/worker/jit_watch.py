"""Triton JIT compiles after start-up, logged: the step that needs a new kernel variant waits for its
compile (about a second), and so does every request in that step.

The runner compiles what it can foresee at start-up (profile run, CUDA graph capture, every prefill tile
height), so a compile while serving means a variant nobody warmed. On an H100 (2026-11-26) a server over an
FP8 KV cache, whose attention variants were new to Triton's cache, saw a TTFT p90 at concurrency 64 0.2-0.5 s
above the same weights over a bf16 cache; this log says whether a compile is why, which kernel, and how long
the step waited, and how Triton specialized the other arguments (a variant also differs from a warmed one by a
pointer's 16-byte alignment or an integer's divisibility by 16: the first H100 logs showed a kernel compiled
again while serving with the same constexprs, which was a view at an odd offset; model inputs are aligned
since).

`JitCompileWatch.install()` chains Triton's `knobs.runtime.jit_cache_hook` (called before a compile; it
must return a falsy value, or Triton skips the compile) and `jit_post_compile_hook` (after), keeping any
hooks already set; `uninstall()` puts them back. A Triton without these knobs gets no watch (install
returns False).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Hook = Callable[..., Any]


class JitCompileWatch:
    """Logs a WARNING per kernel variant compiled while installed, and counts them (`compiles`)."""

    def __init__(self, knobs: Any = None) -> None:
        self._runtime = knobs.runtime if knobs is not None else _triton_runtime_knobs()
        self._started: dict[Any, float] = {}
        self._previous: tuple[Hook | None, Hook | None] | None = None
        self.compiles = 0

    def install(self) -> bool:
        """Sets the hooks; False (nothing set) without Triton's knobs, or where a watch is on already (a
        second runner in the process, e.g. a draft model's, would log each compile twice)."""
        runtime = self._runtime
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or self._previous is not None:
            return False
        if isinstance(getattr(runtime.jit_post_compile_hook, "__self__", None), JitCompileWatch):
            return False
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._previous
            self._previous = None

    def _before(self, **kwargs: Any) -> Any:
        self._started[kwargs["key"]] = time.perf_counter()
        previous = self._previous[0] if self._previous else None
        return previous(**kwargs) if previous is not None else None

    def _after(self, **kwargs: Any) -> Any:
        started = self._started.pop(kwargs["key"], None)
        waited_ms = 0.0 if started is None else (time.perf_counter() - started) * 1e3
        self.compiles += 1
        fn = kwargs["fn"]
        constants = kwargs.get("compile", {}).get("constants", {})
        logger.warning(
            "Triton compiled %s while serving (%.0f ms: its step waited); constexprs %s; arguments %s",
            fn.name,
            waited_ms,
            ", ".join(f"{_param_name(fn, path)}={value}" for path, value in constants.items()),
            _argument_types(kwargs.get("repr", "")),
        )
        previous = self._previous[1] if self._previous else None
        return previous(**kwargs) if previous is not None else None


def _argument_types(text: str) -> str:
    """The other arguments' specializations from the hook's `repr`, `name[options](x_ptr: *bf16D, n: i32,
    ...)`: a variant differs from a warmed one by these too (D: the value or pointer is divisible by 16)."""
    start, end = text.find("]("), text.rfind(")")
    if start < 0 or end < start:
        return "unknown"
    types = [arg for arg in text[start + 2 : end].split(", ") if arg and not arg.endswith("constexpr")]
    return ", ".join(types)


def _param_name(fn: Any, path: Any) -> str:
    """A constexpr's parameter name: Triton keys them by their path in the arguments, (index,) at the top."""
    params = getattr(getattr(fn, "jit_function", None), "params", None)
    if isinstance(path, tuple) and len(path) == 1 and params is not None and path[0] < len(params):
        return params[path[0]].name
    return str(path)


def _triton_runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # no triton, or one older than its knobs (3.4)
        return None
    return getattr(knobs, "runtime", None)
