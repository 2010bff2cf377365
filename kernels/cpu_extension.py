"""Builds and loads the C++ CPU kernels in `kernels/` with torch's JIT extension loader, once per machine.

The kernels (`kernels/cpu_<name>.h`, the names in KERNELS) are one extension module, built from one
translation unit, `kernels/cpu_kernels.cpp`: torch's and pybind11's headers take most of a kernel's
compile time, and one unit parses them once (seven units took ~2.6 minutes on 2 cores, one ~40 s). Each
kernel's functions are the submodule named after it, which `load_cpu_extension(name)` returns.

The build lands in `<repo>/.build/cpu_extensions/<tag>/cpu_kernels/` (ignored by git;
`$SLUICE_CPU_BUILD_DIR/<tag>/...` when that is set), where the tag names the torch version and this CPU's
instruction-set flags (the code is compiled with -march=native), so `make test` or `make serve` builds on
first use and every later process, and every later run, reuses the library (torch's loader rebuilds only
when the source or flags change). Concurrent builds and loads are serialised by an flock on
`sluice_build.lock` in its directory. torch's loader has its own lock, a file (`lock`) that a process
killed while building leaves behind, after which every load waits on it forever; the OS drops an flock with
its process, so a `lock` file found by the holder of the flock is stale, and is removed (with a warning).

`load_cpu_extension(name)` returns the kernel's module, or None after logging why (no C++ compiler, no
ninja, a build directory that cannot be made, a failed build); `cpu_extension_available(name)` says whether
it loaded; `cpu_extension_unavailable_reason(name)` says why not without raising. `python -m
sluice.kernels.cpu_extension` builds them up front (`make test` and `make serve` run it), so no engine
process compiles on its first step (up to minutes on 2 busy cores, past the frontend's liveness timeout).

`SLUICE_CPU_MARCH` compiles for a named target instead of this CPU (GCC's -march: `x86-64-v3` for any
AVX2 host, `x86-64-v4` for AVX-512, `armv8.2-a` ...), and the tag names that target in place of the CPU's
flags: a build made once then runs on every host of that level. The kernels' vector width follows the
target (kernels/cpu_vector_math.h); a target the host lacks dies on its first kernel with an illegal
instruction, so name one every host has.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).resolve().parent
# $SLUICE_CPU_BUILD_DIR where the project's own directory is not writable (an installed package run by
# another user).
BUILD_ROOT = Path(os.environ.get("SLUICE_CPU_BUILD_DIR") or KERNELS_DIR.parent / ".build" / "cpu_extensions")
# OpenMP: at::parallel_for is inlined from torch's headers; the extension links the libgomp torch already
# loaded (same soname), so there is one OpenMP thread pool, sized by torch.set_num_threads.
# -fno-trapping-math: without it GCC leaves any loop that calls std::floor (the exp in cpu_vector_math.h)
# scalar; no kernel reads the floating-point exception flags.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
MARCH_ENV = "SLUICE_CPU_MARCH"
# The kernels, each `kernels/<name>.h` and a submodule of the one extension module (kernels/cpu_kernels.cpp).
KERNELS = (
    "cpu_argmax",
    "cpu_decoder_stack",
    "cpu_packed_linear",
    "cpu_paged_attention",
    "cpu_rms_norm",
    "cpu_rotary",
    "cpu_silu_and_mul",
)
MODULE = "cpu_kernels"  # kernels/cpu_kernels.cpp


def _march() -> str:
    """The -march target: $SLUICE_CPU_MARCH, else this CPU (native)."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def _machine_tag() -> str:
    """torch version + a hash of the CPU's flags (a library built for one CPU is never loaded on another),
    or + the named -march target."""
    torch_tag = f"torch{torch.__version__.replace('+', '_')}"
    if _march() != "native":
        return f"{torch_tag}-{_march()}"
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    digest = hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]
    return f"{torch_tag}-{digest}"


def _headers_digest() -> str:
    """A hash of the shared headers (`kernels/*.h`): torch's loader rebuilds when the sources or the flags
    change, and this flag is how a header change reaches it."""
    digest = hashlib.sha256()
    for header in sorted(KERNELS_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:12]


def _ninja_on_path() -> bool:
    """torch's loader runs `ninja`; the pip package puts it beside this interpreter, maybe not on PATH."""
    if shutil.which("ninja"):
        return True
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "ninja")):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return True
    return False


@functools.cache
def _build() -> tuple[ModuleType | None, str | None]:
    """The extension module (every kernel), or None and why not."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler ({compiler!r} not found on PATH)"
    if not _ninja_on_path():
        return None, "ninja not found (pip install ninja)"
    build_dir = BUILD_ROOT / _machine_tag() / MODULE
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return None, f"cannot create {build_dir} ({error}); set SLUICE_CPU_BUILD_DIR to a writable directory"
    from torch.utils.cpp_extension import load

    try:
        with _only_builder(build_dir):
            module = load(
                name=f"sluice_{MODULE}",
                sources=[str(KERNELS_DIR / f"{MODULE}.cpp")],
                extra_cflags=[*CFLAGS, f"-march={_march()}", f"-DSLUICE_HEADERS={_headers_digest()}"],
                extra_include_paths=[str(KERNELS_DIR)],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as error:  # a compiler error, a missing header: the caller falls back
        return None, f"building kernels/{MODULE}.cpp failed: {error}"
    return module, None


@contextlib.contextmanager
def _only_builder(build_dir: Path) -> Iterator[None]:
    """Holds the directory's flock (module docstring) and removes torch's `lock` file if a dead builder
    left it."""
    with open(build_dir / "sluice_build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes or the process dies
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s: torch's build lock, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def load_cpu_extension(name: str) -> ModuleType | None:
    """The compiled kernel `name` (one of KERNELS: its submodule of the extension), or None (logged once as
    a warning, with the reason)."""
    module, reason = _kernel(name)
    if module is None:
        _warn_once(name, reason)
    return module


def _kernel(name: str) -> tuple[ModuleType | None, str | None]:
    if name not in KERNELS:
        raise ValueError(f"name: not a C++ CPU kernel: {name!r} (kernels: {', '.join(KERNELS)})")
    module, reason = _build()
    return (None, reason) if module is None else (getattr(module, name), None)


def require_cpu_extension(name: str) -> ModuleType:
    """The compiled kernel `name`; RuntimeError pointing at the log where it is not built (the launchers'
    check)."""
    module = load_cpu_extension(name)
    if module is None:
        raise RuntimeError(f"the C++ kernel {name} (kernels/{name}.h) is not available (see the log)")
    return module


def cpu_extension_available(name: str) -> bool:
    """Whether the kernel `name` is built and loaded (building it on first call; if it cannot be, the
    reason is logged once): the layers' test before taking a kernel's prechecked path."""
    return load_cpu_extension(name) is not None


def cpu_extension_unavailable_reason(name: str) -> str | None:
    """None when the kernel `name` is built and loaded (building it if needed), else why not."""
    return _kernel(name)[1]


@functools.cache
def _warn_once(name: str, reason: str | None) -> None:
    logger.warning("C++ CPU kernel %s unavailable: %s", name, reason)


def main() -> None:
    """Build (or find built) the kernels; one line each, in name order. Kernels that cannot build are
    reported, not fatal: their callers fall back as the module docstring says."""
    for name in KERNELS:
        reason = cpu_extension_unavailable_reason(name)
        print(f"kernels/{name}.h: {'ready' if reason is None else reason}")


if __name__ == "__main__":
    main()
