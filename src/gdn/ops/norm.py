"""Fused gated RMSNorm of the GDN block output (Qwen3-Next's ``RMSNormGated``), differentiable.

``y = x * rsqrt(mean(x^2) + eps) * weight * silu(z)`` over the last dimension (the norm is per value head:
``x``, ``z`` ``[..., head_v_dim]``, ``weight`` ``[head_v_dim]``); math in float32 (float64 for float64 inputs),
output in x's dtype. ``z=None`` gives a plain RMSNorm.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import use_triton
from . import _validate as _v

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _rows(name: str, t: torch.Tensor, N: int) -> torch.Tensor:
    """``[M, N]`` view (a copy only when the leading dims cannot be flattened or the last dim is strided)."""
    t2 = t.reshape(-1, N)
    if N > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _z_rows(z: torch.Tensor, N: int) -> torch.Tensor:
    """z as ``[M, N]`` rows, or, when that would copy, as a ``[M / G, G, N]`` view over its last two dims (z's heads
    as strided views into a packed projection output are read in place)."""
    if z.dim() >= 3 and N > 1 and z.stride(-1) == 1:
        try:
            z2 = z.view(-1, N)
        except RuntimeError:
            try:
                return z.view(-1, z.shape[-2], N)
            except RuntimeError:
                pass
        else:
            return z2
    return _rows("z", z, N)


class _GatedRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, grad_buffer=None):
        from ..kernels.norm import rmsnorm_fwd

        N = x.shape[-1]
        x2 = _rows("x", x, N)
        z2 = _z_rows(z, N) if z is not None else None
        y, rstd = rmsnorm_fwd(x2, z2, weight, eps)
        ctx.save_for_backward(x2, z2, weight, rstd)
        ctx.shape = x.shape
        ctx.grad_buffer = grad_buffer if z is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.norm import rmsnorm_bwd

        x2, z2, weight, rstd = ctx.saved_tensors
        N = x2.shape[-1]
        dy2 = _rows("dy", dy, N)
        dz = None
        gb = ctx.grad_buffer
        if gb is not None and z2.dim() == 3 and z2.shape[1] * N == gb.widths["z"]:
            # z's gradient as block "z" ([rows, G N]) of the shared buffer, z's [M / G, G, N] row grouping
            dz = gb.block("z", z2.shape[0], z2.dtype, z2.device).view(-1, z2.shape[1], N)
        dx, dz, dw = rmsnorm_bwd(x2, z2, weight, dy2, rstd, dz=dz)
        return dx.view(ctx.shape), (dz.view(ctx.shape) if dz is not None else None), dw, None, None


def _torch_norm(x, z, weight, eps):
    from ..reference import gated_rmsnorm_ref

    if z is not None:
        return gated_rmsnorm_ref(x, z, weight, eps)
    dt = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    xf = x.to(dt)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
                   *, _grad_buffer=None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * silu(z)``.

    Args:
        x: ``[..., N]`` float tensor (rows = all leading dims).
        z: gate of x's shape (any float dtype), or None for a plain RMSNorm.
        weight: ``[N]``.
        eps: added to the mean square.

    Returns:
        y of x's shape and dtype. Differentiable with respect to x, z and weight.

    ``_grad_buffer`` (internal, the GatedDeltaNet layer's): a :class:`~gdn.ops._grad_buffer.ColumnGradBuffer` whose
    block "z" receives z's gradient.
    """
    _v.tensor("x", x, dtypes=X_DTYPES, shape_doc="[..., N]")
    if x.dim() < 1:
        raise ValueError(f"x: expected a tensor [..., N] with at least 1 dimension, got shape {tuple(x.shape)}")
    device = x.device
    N = x.shape[-1]
    if z is not None:
        _v.tensor("z", z, dtypes=X_DTYPES, shape_doc="of x's shape")
        if z.device != device:
            raise ValueError(f"z: expected a tensor on {device} (the device of x), got {z.device}")
        if z.shape != x.shape:
            raise ValueError(f"z: expected x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    _v.tensor("weight", weight, ndim=1, dtypes=X_DTYPES, shape_doc="[N]")
    if weight.device != device:
        raise ValueError(f"weight: expected a tensor on {device} (the device of x), got {weight.device}")
    if weight.shape[0] != N:
        raise ValueError(f"weight: expected shape [N] = [{N}] (the last dimension of x), got {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps}")
    if not use_triton(device):
        return _torch_norm(x, z, weight, float(eps))
    if weight.stride(0) != 1 and N > 1:
        weight = weight.contiguous()
    if torch.compiler.is_compiling():
        from ._library import rmsnorm_fwd

        N = x.shape[-1]
        z2 = _rows("z", z, N) if z is not None else x.new_empty((0,))
        return rmsnorm_fwd(_rows("x", x, N), z2, weight, float(eps))[0].view(x.shape)
    return _GatedRMSNormFn.apply(x, z, weight, float(eps), _grad_buffer)


__all__ = ["gated_rms_norm"]
