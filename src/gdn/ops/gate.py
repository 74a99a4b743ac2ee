"""gdn_gate: the log-space decay of Qwen3-Next / FlashInfer, differentiable in a, A_log and dt_bias."""
from __future__ import annotations

import torch

from .. import reference as ref
from ..backend import use_triton
from . import _validate as V_


class _GateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, A_log, dt_bias):
        from ..kernels.gate import gdn_gate_fwd

        ctx.save_for_backward(a, A_log, dt_bias)
        return gdn_gate_fwd(a, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dg):
        from ..kernels.gate import gdn_gate_bwd

        a, A_log, dt_bias = ctx.saved_tensors
        return gdn_gate_bwd(a, A_log, dt_bias, dg)


class _GatesFn(torch.autograd.Function):
    """(g, beta) from (a, b) in one kernel each way; the backward writes da / db into ``grad_buffer``'s blocks "a"
    and "b" where one is given (:mod:`gdn.ops._grad_buffer`)."""

    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, grad_buffer):
        from ..kernels.gate import gdn_gate_fwd

        g, beta = gdn_gate_fwd(a, A_log, dt_bias, b)
        ctx.save_for_backward(a, b, A_log, dt_bias)
        ctx.grad_buffer = grad_buffer
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        from ..kernels.gate import gdn_gate_bwd

        a, b, A_log, dt_bias = ctx.saved_tensors
        gb, da, db = ctx.grad_buffer, None, None
        if gb is not None:
            rows = a.numel() // max(1, a.shape[-1])
            db = gb.block("b", rows, b.dtype, b.device).view(b.shape)
            da = gb.block("a", rows, a.dtype, a.device).view(a.shape)
        da, dA, ddt, db = gdn_gate_bwd(a, A_log, dt_bias, dg, b=b, dbeta=dbeta, da=da, db=db)
        return da, db, dA, ddt, None


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, grad_buffer=None):
    """The layer's two gates: ``(gdn_gate(a, A_log, dt_bias), sigmoid(b))`` (g fp32, beta in b's dtype), one kernel
    forward and one backward on the Triton backend. a, b ``[..., HV]`` (row-strided views allowed); the caller
    (the GatedDeltaNet layer) has checked the shapes. ``grad_buffer``: a :class:`~gdn.ops._grad_buffer.ColumnGradBuffer`
    with blocks "b" and "a" for the backward to write into, or None."""
    if a.dtype == torch.float64 or not use_triton(a.device) or torch.compiler.is_compiling():
        return gdn_gate(a, A_log, dt_bias), b.sigmoid()
    return _GatesFn.apply(a, b, A_log, dt_bias, grad_buffer)


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (log-space decay, g <= 0).

    a ``[..., HV]``; A_log, dt_bias ``[HV]``. Differentiable with respect to all three.
    """
    V_.tensor("a", a, dtypes=V_.FLOAT_DTYPES + (torch.float64,), shape_doc="[..., HV]")
    if a.dim() < 1:
        raise ValueError("a: expected a tensor [..., HV], got a scalar")
    HV = a.shape[-1]
    V_.tensor("A_log", A_log, ndim=1, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=a.device, shape_doc="[HV]")
    V_.shape("A_log", A_log, (HV,), "[HV] (HV = a.shape[-1])")
    V_.tensor("dt_bias", dt_bias, ndim=1, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=a.device,
              shape_doc="[HV]")
    V_.shape("dt_bias", dt_bias, (HV,), "[HV] (HV = a.shape[-1])")
    if a.dtype == torch.float64 or not use_triton(a.device):
        return ref.gdn_gate_ref(a, A_log, dt_bias).to(torch.float64 if a.dtype == torch.float64 else torch.float32)
    if torch.compiler.is_compiling():
        from ._library import gate_fwd

        return gate_fwd(a.contiguous(), A_log, dt_bias)
    return _GateFn.apply(a, A_log, dt_bias)
