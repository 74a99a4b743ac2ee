"""The GDN gates, elementwise over ``[rows, HV]``: g = -exp(A_log) * softplus(a + dt_bias) and, with b, the write
strength beta = sigmoid(b); and their backward.

a and b are read at their row strides (column slices of a projection output, as the layer passes them); g is fp32,
beta in b's dtype, both contiguous ``[rows, HV]``. Backward: with x = a + dt_bias, dg/da = -exp(A_log) * sigmoid(x)
(1 past softplus's threshold of 20), dg/dA_log = g, dbeta/db = beta (1 - beta) with beta = sigmoid(b) recomputed in
fp32 (not read back rounded); da and db are written at their row strides (they may be column slices of one gradient
buffer); the per-head sums for A_log and dt_bias are per-program partial sums in the kernel, summed over programs
after it.
"""
import torch
import triton
import triton.language as tl

from .common import cdiv, sigmoid, softplus
from .launch import launch

BLOCK = 1024


@triton.jit
def gdn_gate_fwd_kernel(a, b, A_log, dt_bias, g, beta, rows, s_a, s_b, HV: tl.constexpr, BHV: tl.constexpr,
                        R: tl.constexpr, HAS_B: tl.constexpr):
    """R rows x HV per program: g (fp32) and, HAS_B, beta = sigmoid(b) (beta's dtype), both ``[rows, HV]``."""
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    hv = tl.arange(0, BHV)
    mh = hv < HV
    m = (r < rows)[:, None] & mh[None, :]
    x = tl.load(a + r[:, None] * s_a + hv[None, :], mask=m, other=0.0).to(tl.float32) + \
        tl.load(dt_bias + hv, mask=mh, other=0.0).to(tl.float32)[None, :]
    A = tl.exp(tl.load(A_log + hv, mask=mh, other=0.0).to(tl.float32))[None, :]
    offs = r[:, None] * HV + hv[None, :]
    tl.store(g + offs, -A * softplus(x), mask=m)
    if HAS_B:
        bb = tl.load(b + r[:, None] * s_b + hv[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(beta + offs, sigmoid(bb).to(beta.dtype.element_ty), mask=m)


@triton.jit
def gdn_gate_bwd_kernel(a, A_log, dt_bias, dg, da, part, b, dbeta, db, rows, P, s_a, s_da, s_b, s_dbeta, s_db,
                        HV: tl.constexpr, BHV: tl.constexpr, R: tl.constexpr, HAS_B: tl.constexpr):
    """R rows x HV of ``[rows, HV]`` per program: da, and the program's column sums of dg * g and of da (fp32,
    before da's rounding) into ``part [2, P, HV]`` (the dA_log and dt_bias gradients, summed over programs by the
    caller); HAS_B: db = dbeta * beta (1 - beta), beta = sigmoid(b) in fp32."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * R + tl.arange(0, R)
    hv = tl.arange(0, BHV)
    mh = hv < HV
    m = (r < rows)[:, None] & mh[None, :]
    offs = r[:, None] * HV + hv[None, :]
    x = tl.load(a + r[:, None] * s_a + hv[None, :], mask=m, other=0.0).to(tl.float32) + \
        tl.load(dt_bias + hv, mask=mh, other=0.0).to(tl.float32)[None, :]
    A = tl.exp(tl.load(A_log + hv, mask=mh, other=0.0).to(tl.float32))[None, :]
    b_dg = tl.load(dg + offs, mask=m, other=0.0).to(tl.float32)
    dsp = tl.where(x > 20.0, 1.0, sigmoid(x))
    b_da = tl.where(m, -A * dsp * b_dg, 0.0)
    tl.store(da + r[:, None] * s_da + hv[None, :], b_da.to(da.dtype.element_ty), mask=m)
    tl.store(part + pid * HV + hv, tl.sum(tl.where(m, -A * softplus(x) * b_dg, 0.0), axis=0), mask=mh)
    tl.store(part + (P + pid) * HV + hv, tl.sum(b_da, axis=0), mask=mh)
    if HAS_B:
        bt = sigmoid(tl.load(b + r[:, None] * s_b + hv[None, :], mask=m, other=0.0).to(tl.float32))
        d = tl.load(dbeta + r[:, None] * s_dbeta + hv[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(db + r[:, None] * s_db + hv[None, :], (d * bt * (1.0 - bt)).to(db.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, HV: int) -> torch.Tensor:
    """``[rows, HV]`` view with contiguous columns (a copy only where no such view exists)."""
    t2 = t.reshape(-1, HV)
    return t2 if t2.stride(-1) == 1 or HV == 1 else t2.contiguous()


def _tiles(HV: int):
    BHV = triton.next_power_of_2(HV)
    return BHV, max(1, BLOCK // BHV)


def gdn_gate_fwd(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor = None):
    """g = -exp(A_log) softplus(a + dt_bias) (fp32, a's shape); with ``b`` (a's shape) also beta = sigmoid(b) in b's
    dtype: returns (g, beta)."""
    HV = A_log.numel()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device) if b is not None else None
    rows = a.numel() // HV if HV else 0
    if rows:
        a2 = _rows(a, HV)
        b2 = _rows(b, HV) if b is not None else a2
        BHV, R = _tiles(HV)
        launch(gdn_gate_fwd_kernel, (cdiv(rows, R),), a2, b2, A_log, dt_bias, g, beta if b is not None else g,
               rows, a2.stride(0), b2.stride(0), HV=HV, BHV=BHV, R=R, HAS_B=b is not None)
    return g if b is None else (g, beta)


def gdn_gate_bwd(a, A_log, dt_bias, dg, b=None, dbeta=None, da=None, db=None):
    """Returns (da, dA_log, ddt_bias) and, with ``b`` / ``dbeta`` (b and the gradient of beta = sigmoid(b)), db after
    them. ``da`` / ``db``: optional destinations of a's / b's shape (row-strided views, e.g. columns of one
    gradient buffer); else new tensors of a's / b's dtype. dA_log and ddt_bias may be the two rows of one [2, HV]
    tensor (one reduction for both)."""
    HV = A_log.numel()
    has_b = dbeta is not None
    if da is None:
        da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if has_b and db is None:
        db = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    rows = a.numel() // HV if HV else 0
    if rows == 0:
        out = (da, torch.zeros_like(A_log), torch.zeros_like(dt_bias))
        return out + (db,) if has_b else out
    # destinations as [rows, HV] views (``view`` raises rather than write into a copy)
    a2, dg2, da2 = _rows(a, HV), dg.reshape(-1, HV).contiguous(), da.view(-1, HV)
    if has_b:
        b2, dbeta2, db2 = _rows(b, HV), _rows(dbeta, HV), db.view(-1, HV)
    else:
        b2, dbeta2, db2 = a2, dg2, dg2
    if da2.stride(-1) != 1 or db2.stride(-1) != 1:
        raise ValueError("da / db: expected destinations with contiguous columns")
    BHV, R = _tiles(HV)
    P = cdiv(rows, R)
    part = torch.empty(2, P, HV, dtype=torch.float32, device=a.device)
    launch(gdn_gate_bwd_kernel, (P,), a2, A_log, dt_bias, dg2, da2, part, b2, dbeta2, db2, rows, P,
           a2.stride(0), da2.stride(0), b2.stride(0), dbeta2.stride(0), db2.stride(0), HV=HV, BHV=BHV, R=R,
           HAS_B=has_b)
    sums = part.sum(1)
    out = (da, sums[0].to(A_log.dtype), sums[1].to(dt_bias.dtype))
    return out + (db,) if has_b else out
