"""gdn_gate: g = -exp(A_log) * softplus(a + dt_bias), elementwise over ``[rows, HV]``, and its backward.

Backward: with x = a + dt_bias, dg/da = -exp(A_log) * sigmoid(x) (1 past softplus's threshold of 20) and dg/dA_log = g;
the per-head sums for A_log and dt_bias: per-program partial sums in the kernel, summed over programs after it.
"""
import torch
import triton
import triton.language as tl

from .common import cdiv, sigmoid, softplus
from .launch import launch

BLOCK = 1024


@triton.jit
def gdn_gate_fwd_kernel(a, A_log, dt_bias, g, n, HV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hv = offs % HV
    x = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + hv, mask=m, other=0.0).to(tl.float32)
    A = tl.load(A_log + hv, mask=m, other=0.0).to(tl.float32)
    tl.store(g + offs, -tl.exp(A) * softplus(x), mask=m)


@triton.jit
def gdn_gate_bwd_kernel(a, A_log, dt_bias, dg, da, part, rows, P, HV: tl.constexpr, BHV: tl.constexpr,
                        R: tl.constexpr):
    """R rows x HV of ``[rows, HV]`` per program: da, and the program's column sums of dg * g and of da (fp32,
    before da's rounding) into ``part [2, P, HV]`` (the dA_log and dt_bias gradients, summed over programs by the
    caller)."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * R + tl.arange(0, R)
    hv = tl.arange(0, BHV)
    mh = hv < HV
    m = (r < rows)[:, None] & mh[None, :]
    offs = r[:, None] * HV + hv[None, :]
    x = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + \
        tl.load(dt_bias + hv, mask=mh, other=0.0).to(tl.float32)[None, :]
    A = tl.exp(tl.load(A_log + hv, mask=mh, other=0.0).to(tl.float32))[None, :]
    b_dg = tl.load(dg + offs, mask=m, other=0.0).to(tl.float32)
    dsp = tl.where(x > 20.0, 1.0, sigmoid(x))
    b_da = tl.where(m, -A * dsp * b_dg, 0.0)
    tl.store(da + offs, b_da.to(da.dtype.element_ty), mask=m)
    tl.store(part + pid * HV + hv, tl.sum(tl.where(m, -A * softplus(x) * b_dg, 0.0), axis=0), mask=mh)
    tl.store(part + (P + pid) * HV + hv, tl.sum(b_da, axis=0), mask=mh)


def gdn_gate_fwd(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    a = a.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        launch(gdn_gate_fwd_kernel, (cdiv(n, BLOCK),), a, A_log, dt_bias, g, n, HV=A_log.numel(), BLOCK=BLOCK)
    return g


def gdn_gate_bwd(a, A_log, dt_bias, dg):
    """Returns (da, dA_log, ddt_bias); dA_log and ddt_bias may be the two rows of one [2, HV] tensor (one reduction
    for both)."""
    a, dg = a.contiguous(), dg.contiguous()
    HV = A_log.numel()
    da = torch.empty_like(a)
    rows = a.numel() // HV if HV else 0
    if rows == 0:
        return da, torch.zeros_like(A_log), torch.zeros_like(dt_bias)
    BHV = triton.next_power_of_2(HV)
    R = max(1, BLOCK // BHV)
    P = cdiv(rows, R)
    part = torch.empty(2, P, HV, dtype=torch.float32, device=a.device)
    launch(gdn_gate_bwd_kernel, (P,), a, A_log, dt_bias, dg, da, part, rows, P, HV=HV, BHV=BHV, R=R)
    sums = part.sum(1)
    return da, sums[0].to(A_log.dtype), sums[1].to(dt_bias.dtype)
