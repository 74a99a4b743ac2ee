"""gdn_gate: g = -exp(A_log) * softplus(a + dt_bias), elementwise over ``[rows, HV]``, and its backward.

Backward: with x = a + dt_bias, dg/da = -exp(A_log) * sigmoid(x) (1 past softplus's threshold of 20) and dg/dA_log = g;
the per-head sums for A_log and dt_bias are taken by the caller.
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
def gdn_gate_bwd_kernel(a, A_log, dt_bias, dg, da, dg_times_g, n, HV: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    hv = offs % HV
    x = tl.load(a + offs, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + hv, mask=m, other=0.0).to(tl.float32)
    A = tl.exp(tl.load(A_log + hv, mask=m, other=0.0).to(tl.float32))
    b_dg = tl.load(dg + offs, mask=m, other=0.0).to(tl.float32)
    dsp = tl.where(x > 20.0, 1.0, sigmoid(x))
    tl.store(da + offs, (-A * dsp * b_dg).to(da.dtype.element_ty), mask=m)
    tl.store(dg_times_g + offs, -A * softplus(x) * b_dg, mask=m)


def gdn_gate_fwd(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    a = a.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        launch(gdn_gate_fwd_kernel, (cdiv(n, BLOCK),), a, A_log, dt_bias, g, n, HV=A_log.numel(), BLOCK=BLOCK)
    return g


def gdn_gate_bwd(a, A_log, dt_bias, dg):
    """Returns (da, dA_log, ddt_bias)."""
    a, dg = a.contiguous(), dg.contiguous()
    HV = A_log.numel()
    da = torch.empty_like(a)
    dgg = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        launch(gdn_gate_bwd_kernel, (cdiv(n, BLOCK),), a, A_log, dt_bias, dg, da, dgg, n, HV=HV, BLOCK=BLOCK)
    dA = dgg.reshape(-1, HV).sum(0).to(A_log.dtype)
    ddt = da.reshape(-1, HV).float().sum(0).to(dt_bias.dtype)
    return da, dA, ddt
