"""silu(gate) * up over a packed gate_up projection, in Triton (any float dtype, CUDA or the interpreter):

    x [num_tokens, 2 * d] = [gate | up]  ->  out [num_tokens, d] = silu(gate) * up

Rounded like the unfused model (`act_fn(gate_proj(x)) * up_proj(x)` in transformers): silu in fp32 and
rounded to x's dtype, then the product in fp32 and rounded again. One read of x and one write of out,
instead of ATen's silu (read gate, write) and mul (read both, write). The CPU path has its own C++
kernel (`sluice.kernels.cpu_silu_and_mul`).

Grid (num_tokens, cdiv(d, BLOCK)): BLOCK = 1024 columns per program (untuned; 4 warps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sluice.kernels.tensor_checks import FLOAT_DTYPES, check_tensor, output_like

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_out, D: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, 2 * d] (float, unit last stride) -> [num_tokens, d] = silu(x[:, :d]) * x[:, d:],
    written into `out` when given. Raises ValueError naming a bad argument."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got {width}")
    d = width // 2
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    else:
        out = output_like("out", out, x[:, :d])
    if num_tokens == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        out, x, x.stride(0), out.stride(0), D=d, BLOCK=block
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch version of `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
