"""Triton kernels: fused gated RMSNorm ``y = x * rsqrt(mean(x^2) + eps) * weight * silu(z)`` over the last dim.

Rows are all leading dimensions flattened (``[M, N]`` views with a row stride and a contiguous last dim). Each
program normalises ``BM`` rows of ``BN >= N`` columns in one tile (math in float32, float64 for float64 inputs); the
forward saves ``rstd`` per row for the backward. The backward loops over row blocks (grid of a few programs per SM),
writes dx and dz directly and per-program partial sums of dweight (``[G, N]``, reduced with ``torch.sum``).

With ``xhat = x * rstd``, ``g = silu(z)``, ``dxhat = dy * w * g``::

    dx = rstd * (dxhat - xhat * mean(dxhat * xhat))
    dz = dy * xhat * w * sigmoid(z) * (1 + z * (1 - sigmoid(z)))
    dw = sum_rows dy * xhat * g
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import config
from .common import cdiv, next_pow2
from .launch import launch


def _device_fn(fn):
    """``triton.jit`` for device helpers; plain Python under Triton's interpreter (see gdn.kernels.conv)."""
    return fn if config.triton_interpret() else triton.jit(fn)


@_device_fn
def _rsqrt(v, IS_F64: tl.constexpr):
    if IS_F64:
        r = 1.0 / tl.sqrt(v)
    else:
        r = tl.rsqrt(v)
    return r


@triton.jit
def gated_rmsnorm_fwd_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr,
    M, N, sx, sz, szg, ZG, sy, eps,
    BM: tl.constexpr, BN: tl.constexpr, HAS_Z: tl.constexpr, CD: tl.constexpr, IS_F64: tl.constexpr,
):
    """Row m of z sits at (m // ZG) * sz + (m % ZG) * szg (a [M / ZG, ZG, N] view; ZG = 1: plain rows)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    mr = rows < M
    mc = cols < N
    m = mr[:, None] & mc[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=m, other=0.0).to(CD)
    ms = tl.sum(x * x, 1) / N
    rstd = _rsqrt(ms + eps, IS_F64)
    w = tl.load(w_ptr + cols, mask=mc, other=0.0).to(CD)
    y = x * rstd[:, None] * w[None, :]
    if HAS_Z:
        zrow = (rows // ZG) * sz + (rows % ZG) * szg
        z = tl.load(z_ptr + zrow[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
        y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + rows, rstd, mask=mr)


@triton.jit
def gated_rmsnorm_bwd_kernel(
    x_ptr, z_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dz_ptr, dw_ptr,
    M, N, sx, sz, szg, ZG, sdy, sdx, sdz, sdzg, ITERS, G,
    BM: tl.constexpr, BN: tl.constexpr, HAS_Z: tl.constexpr, CD: tl.constexpr,
):
    """Program ``pid`` handles the ITERS row blocks pid * ITERS, ...; dw_ptr: [G, N] partial sums; z rows as in the
    forward kernel, dz rows the same way at dz's strides (sdz per group of ZG rows, sdzg within one)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    mc = cols < N
    w = tl.load(w_ptr + cols, mask=mc, other=0.0).to(CD)
    dw = tl.zeros([BN], dtype=CD)
    for it in range(0, ITERS):
        blk = pid * ITERS + it
        rows = blk.to(tl.int64) * BM + tl.arange(0, BM)
        mr = rows < M
        m = mr[:, None] & mc[None, :]
        x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=m, other=0.0).to(CD)
        dy = tl.load(dy_ptr + rows[:, None] * sdy + cols[None, :], mask=m, other=0.0).to(CD)
        rstd = tl.load(rstd_ptr + rows, mask=mr, other=0.0).to(CD)
        xhat = x * rstd[:, None]
        if HAS_Z:
            zrow = (rows // ZG) * sz + (rows % ZG) * szg
            z = tl.load(z_ptr + zrow[:, None] + cols[None, :], mask=m, other=0.0).to(CD)
            sg = 1.0 / (1.0 + tl.exp(-z))
            gz = z * sg
            dz = dy * xhat * w[None, :] * (sg * (1.0 + z * (1.0 - sg)))
            dzrow = (rows // ZG) * sdz + (rows % ZG) * sdzg
            tl.store(dz_ptr + dzrow[:, None] + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=m)
            dyg = dy * gz
        else:
            dyg = dy
        dxhat = dyg * w[None, :]
        c = tl.sum(dxhat * xhat, 1) / N
        dx = rstd[:, None] * (dxhat - xhat * c[:, None])
        tl.store(dx_ptr + rows[:, None] * sdx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(dyg * xhat, 0)
    tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw, mask=mc)


# ----------------------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------------------
def _cfg(N: int, device, backward: bool = False) -> tuple:
    """(BN, BM, num_warps): tiles of about 4K elements in the forward, 2K in the backward (which holds x, z, dy and
    more), on 4 warps (8 for rows longer than the tile) on the GPU; backward rows of up to 1K elements in 1K tiles on
    2 warps (H100, N = 128, 4 x 4096 x 32 rows: 264 us against 293 at 2K on 4 warps, ``bench/NOTES.md``)."""
    BN = next_pow2(max(N, 1))
    if device.type != "cuda":
        return BN, max(1, min(64, 4096 // BN)), 1
    if backward and BN <= 1024:
        return BN, max(1, min(128, 1024 // BN)), 2
    tile = 2048 if backward else 4096
    BM = max(1, min(128, tile // BN))
    num_warps = 4 if BN * BM <= tile else 8
    return BN, BM, num_warps


def _is_f64(t) -> bool:
    import torch

    return t.dtype == torch.float64


def _z_strides(z2):
    """(row stride, group stride, rows per group) of z as [M, N] or as a [M / G, G, N] view."""
    if z2 is None:
        return 0, 0, 1
    if z2.dim() == 3:
        return z2.stride(0), z2.stride(1), max(1, z2.shape[1])
    return z2.stride(0), 0, 1


def rmsnorm_fwd(x2, z2, weight, eps: float):
    """x2: [M, N], z2: [M, N] or a [M / G, G, N] view (e.g. z's heads inside a packed projection), last dims
    contiguous (z2 may be None); returns (y [M, N] in x's dtype, rstd [M])."""
    import torch

    M, N = x2.shape
    f64 = _is_f64(x2)
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty((M,), dtype=torch.float64 if f64 else torch.float32, device=x2.device)
    if M == 0 or N == 0:
        rstd.fill_(1.0 / (eps ** 0.5) if eps > 0 else float("inf"))
        return y, rstd
    BN, BM, num_warps = _cfg(N, x2.device)
    grid = (cdiv(M, BM),)
    launch(gated_rmsnorm_fwd_kernel, grid,
        x2, z2 if z2 is not None else x2, weight, y, rstd,
        M, N, x2.stride(0), *_z_strides(z2), y.stride(0), float(eps),
        BM=BM, BN=BN, HAS_Z=z2 is not None, CD=tl.float64 if f64 else tl.float32, IS_F64=f64,
        num_warps=num_warps,
    )
    return y, rstd


def rmsnorm_bwd(x2, z2, weight, dy2, rstd, dz=None):
    """z2 as in :func:`rmsnorm_fwd`. Returns (dx [M, N] in x's dtype, dz in z's dtype or None, dweight [N] in
    weight's dtype). ``dz``: optional destination with z2's shape ([M, N] or [M / G, G, N], last dim contiguous;
    e.g. a column block of a wider gradient buffer), else a new [M, N] tensor."""
    import torch

    M, N = x2.shape
    f64 = _is_f64(x2)
    dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if z2 is not None and dz is None:
        dz = torch.empty((M, N), dtype=z2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return dx, dz, torch.zeros_like(weight)
    BN, BM, num_warps = _cfg(N, x2.device, backward=True)
    nblocks = cdiv(M, BM)
    # ITERS consecutive row blocks per program: many programs (no wave quantisation) and a small dw partial buffer
    iters = 8 if x2.device.type == "cuda" else max(1, cdiv(nblocks, 2))
    G = cdiv(nblocks, iters)
    acc_dt = torch.float64 if f64 else torch.float32
    dw_part = torch.empty((G, N), dtype=acc_dt, device=x2.device)
    zs = _z_strides(z2)
    if dz is None:
        dzs = (0, 0)
    elif dz.dim() == 3:
        dzs = (dz.stride(0), dz.stride(1))
    else:   # [M, N] rows: a group of ZG rows spans ZG row strides
        dzs = (dz.stride(0) * zs[2], dz.stride(0))
    launch(gated_rmsnorm_bwd_kernel, (G,),
        x2, z2 if z2 is not None else x2, weight, dy2, rstd, dx, dz if dz is not None else dx, dw_part,
        M, N, x2.stride(0), *zs, dy2.stride(0), dx.stride(0), *dzs, iters, G,
        BM=BM, BN=BN, HAS_Z=z2 is not None, CD=tl.float64 if f64 else tl.float32, num_warps=num_warps,
    )
    return dx, dz, dw_part.sum(0).to(weight.dtype)
