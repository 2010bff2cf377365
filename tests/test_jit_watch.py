"""`JitCompileWatch`: a Triton compile after start-up is logged with its kernel, its wait and its constexprs,
and the hooks it chains are kept and put back. Triton calls the hooks around each compile; no GPU compiles
here, so the tests call them as Triton does (keyword arguments) on a stand-in of `triton.knobs`."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import triton

from sluice.engine.worker.jit_watch import JitCompileWatch

# A JITFunction's parameters as Triton keeps them (the tests run interpreted kernels, which have none).
KERNEL = SimpleNamespace(params=[SimpleNamespace(name=name) for name in ("x_ptr", "n", "BLOCK_SIZE")])


def _knobs(cache_hook=None, post_hook=None):
    runtime = SimpleNamespace(jit_cache_hook=cache_hook, jit_post_compile_hook=post_hook)
    return SimpleNamespace(runtime=runtime)


def _compile(runtime, key="k1"):
    """What Triton's `_do_compile` does with the hooks, for one variant of a kernel `_store_kv_kernel`
    whose constexpr BLOCK_SIZE (argument 2) is 16."""
    fn = SimpleNamespace(module=None, name="_store_kv_kernel", jit_function=KERNEL)
    text = "_store_kv_kernel[num_warps=4, num_ctas=1](x_ptr: *bf16D, n: i32, BLOCK_SIZE: constexpr)"
    kwargs = {"key": key, "repr": text, "fn": fn, "compile": {"constants": {(2,): 16}},
              "is_manual_warmup": False, "already_compiled": False}  # fmt: skip
    skipped = runtime.jit_cache_hook(**kwargs) if runtime.jit_cache_hook else None
    if not skipped:
        runtime.jit_post_compile_hook(**kwargs)
    return skipped


def test_a_compile_while_installed_is_logged_and_counted(caplog):
    knobs = _knobs()
    watch = JitCompileWatch(knobs)
    assert watch.install()
    with caplog.at_level(logging.WARNING, logger="sluice.engine.worker.jit_watch"):
        assert not _compile(knobs.runtime)  # the watch never makes Triton skip a compile
    assert watch.compiles == 1
    (record,) = caplog.records
    assert record.getMessage().startswith("Triton compiled _store_kv_kernel while serving (")
    assert record.getMessage().endswith(
        "ms: its step waited); constexprs BLOCK_SIZE=16; arguments x_ptr: *bf16D, n: i32"
    )


def test_hooks_set_before_are_chained_and_put_back():
    calls = []
    cache_hook = lambda **kwargs: calls.append(("cache", kwargs["key"]))  # noqa: E731
    post_hook = lambda **kwargs: calls.append(("post", kwargs["key"]))  # noqa: E731
    knobs = _knobs(cache_hook, post_hook)
    watch = JitCompileWatch(knobs)
    assert watch.install() and not watch.install()  # installed once
    _compile(knobs.runtime, key="k2")
    assert calls == [("cache", "k2"), ("post", "k2")] and watch.compiles == 1
    watch.uninstall()
    assert knobs.runtime.jit_cache_hook is cache_hook and knobs.runtime.jit_post_compile_hook is post_hook


def test_one_watch_a_process():
    knobs = _knobs()
    first, second = JitCompileWatch(knobs), JitCompileWatch(knobs)
    assert first.install() and not second.install()
    _compile(knobs.runtime)
    assert (first.compiles, second.compiles) == (1, 0)


def test_a_triton_without_the_knobs_gets_no_watch():
    assert not JitCompileWatch(SimpleNamespace(runtime=SimpleNamespace())).install()


def test_this_triton_has_the_knobs_the_watch_sets():
    from triton import knobs

    assert hasattr(knobs.runtime, "jit_cache_hook") and hasattr(knobs.runtime, "jit_post_compile_hook")
    assert triton.__version__
