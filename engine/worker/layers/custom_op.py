"""The base of ops with one implementation per kernel family, chosen once (vLLM's `CustomOp`, SGLang's
`MultiPlatformOp`).

    forward_native   plain PyTorch: the reference, runs anywhere
    forward_triton   the Triton kernels in `kernels/` (on CUDA, or on CPU under TRITON_INTERPRET=1)
    forward_cpu      the C++ kernel `kernels/<cpu_kernel>.cpp` (float32 on CPU)

    op = RMSNorm(hidden_size, eps)      # built: forward_native
    op.select(kernels)                  # at load (`CausalLM.materialize`): the first of `implementations`
                                        # that runs under this `KernelConfig`
    op(x)                               # calls the chosen one; nothing is re-checked per call
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from sluice.engine.worker.layers.kernel_config import KernelConfig


class CustomOp(nn.Module):
    """Subclasses define `forward_native` and, for each other entry of `implementations` (most preferred
    first), `forward_<name>`; `cpu_kernel` names the C++ extension `forward_cpu` calls."""

    implementations: ClassVar[tuple[str, ...]] = ("native",)
    cpu_kernel: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.implementations[-1:] != ("native",):
            raise TypeError(f"{cls.__name__}.implementations: must end with 'native', the fallback")
        missing = [name for name in cls.implementations if not hasattr(cls, f"forward_{name}")]
        if missing:
            raise TypeError(
                f"{cls.__name__}: no forward_{missing[0]} for implementations {cls.implementations}"
            )

    def __init__(self) -> None:
        super().__init__()
        self.implementation = "native"
        # The class's function, called with self: a bound method kept on self would make every op a
        # reference cycle, and a model dropped would wait for the cycle collector to free it.
        self._forward = type(self).forward_native

    def select(self, kernels: KernelConfig) -> None:
        """Choose the implementation once, from the device, dtype, attention backend and built kernels."""
        self.implementation = next(name for name in self.implementations if self._runs(name, kernels))
        self._forward = getattr(type(self), f"forward_{self.implementation}")

    def _runs(self, implementation: str, kernels: KernelConfig) -> bool:
        if implementation == "triton":
            return kernels.triton
        if implementation == "cpu":
            return self.cpu_kernel is not None and kernels.runs_cpu_kernel(self.cpu_kernel)
        return implementation == "native"

    def forward_native(self, *args: Any) -> Any:
        raise NotImplementedError

    def forward(self, *args: Any) -> Any:
        return self._forward(self, *args)
