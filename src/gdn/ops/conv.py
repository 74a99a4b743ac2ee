"""Depthwise causal conv1d of the GDN block (channels last): ``causal_conv1d`` (prefill / training, varlen, conv-state
pools) and ``causal_conv1d_update`` (decode and multi-token verify steps, CUDA-graph capturable).

``y[t, d] = act(bias[d] + sum_j weight[d, j] * x[t - (W - 1) + j, d])`` within each sequence; the ``W - 1`` inputs
before a sequence come from its conv-state row (``[P, D, W-1]``, oldest first) or are zeros. With a state the last
``W - 1`` inputs of the sequence (of ``old state | x`` for sequences shorter than ``W - 1``) are written back to the
row in place; a negative (or, when host-side checks were skipped, out-of-range) index marks a padding sequence: zero
output, no row read or written.

The Triton kernels (``gdn.kernels.conv``) handle widths 1..4; other widths run the PyTorch reference path.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import use_triton
from . import _validate as _v

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_TRITON_WIDTH = 4


# ----------------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------------
def _activation(activation) -> bool:
    if activation is None or activation is False:
        return False
    if isinstance(activation, str) and activation in ("silu", "swish"):
        return True
    if activation is True:
        return True
    raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if isinstance(t, torch.Tensor) and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got {t.device}")


def _check_weight_bias(weight, bias, D: int, device) -> int:
    _v.tensor("weight", weight, ndim=2, dtypes=X_DTYPES, shape_doc="[D, W]")
    _device("weight", weight, device)
    if weight.shape[0] != D:
        raise ValueError(f"weight: expected shape [D, W] with D = {D} (the last dimension of x), got "
                         f"{tuple(weight.shape)}")
    W = weight.shape[1]
    if W < 1:
        raise ValueError(f"weight: expected a width W >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        _v.tensor("bias", bias, ndim=1, dtypes=X_DTYPES, shape_doc="[D]")
        _device("bias", bias, device)
        if bias.shape[0] != D:
            raise ValueError(f"bias: expected shape [D] = [{D}], got {tuple(bias.shape)}")
    return W


def _check_state(conv_state, conv_state_indices, N: int, D: int, W: int, device) -> None:
    _v.tensor("conv_state", conv_state, ndim=3, dtypes=X_DTYPES, shape_doc="[P, D, W-1]")
    _device("conv_state", conv_state, device)
    if conv_state.shape[1] != D or conv_state.shape[2] != W - 1:
        raise ValueError(f"conv_state: expected shape [P, D, W-1] = [*, {D}, {W - 1}] (D from x, W from weight), "
                         f"got {tuple(conv_state.shape)}")
    P = conv_state.shape[0]
    if conv_state_indices is None:
        if P != N:
            raise ValueError(f"conv_state: without conv_state_indices expected one row per sequence, shape "
                             f"[N, D, W-1] = [{N}, {D}, {W - 1}], got {tuple(conv_state.shape)}")
    else:
        _device("conv_state_indices", conv_state_indices, device)
        _v.pool_indices("conv_state_indices", conv_state_indices, N, P, device, allow_2d=False)


# ----------------------------------------------------------------------------------------------------------------------
# torch path (reference + pool gather / scatter)
# ----------------------------------------------------------------------------------------------------------------------
def _slots(conv_state, idx, N, device):
    P = conv_state.shape[0]
    slots = idx.to(torch.long) if idx is not None else torch.arange(N, device=device)
    valid = (slots >= 0) & (slots < P)
    return slots, valid


def _gather_init(conv_state, idx, N, device, dtype=None):
    """Copy of the initial states ``[N, D, W-1]`` (zeros for padding) and the per-sequence validity."""
    slots, valid = _slots(conv_state, idx, N, device)
    P = conv_state.shape[0]
    if P == 0:
        init = conv_state.new_zeros((N,) + tuple(conv_state.shape[1:]), dtype=dtype)
    else:
        init = conv_state[slots.clamp(0, P - 1)]
        init = torch.where(valid[:, None, None], init, torch.zeros((), dtype=init.dtype, device=device))
        if dtype is not None:
            init = init.to(dtype)
    return init, slots, valid


def _torch_conv(x, weight, bias, act: bool, cu, conv_state, idx, N):
    from ..reference import causal_conv1d_ref

    activation = "silu" if act else None
    if conv_state is None:
        y, _ = causal_conv1d_ref(x, weight, bias, activation, cu_seqlens=cu)
        return y
    init, slots, valid = _gather_init(conv_state, idx, N, x.device)
    y, finals = causal_conv1d_ref(x, weight, bias, activation, cu_seqlens=cu, initial_conv_state=init)
    if N == 0:
        return y
    if cu is None:
        mask = valid[:, None, None]
    else:
        lens = (cu[1:] - cu[:-1]).to(torch.long)
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lens)
        mask = valid[seq][None, :, None]
    y = torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))
    rows = valid.nonzero().flatten()
    if rows.numel():
        with torch.no_grad():
            conv_state[slots[rows]] = finals[rows].to(conv_state.dtype)
    return y


# ----------------------------------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------------------------------
class _CausalConv1dFn(torch.autograd.Function):
    """Triton forward (writes the pool in place) and backward (dx, dweight, dbias); the initial states the forward
    read are saved as a copy so the backward sees them after the pool was overwritten."""

    @staticmethod
    def forward(ctx, x, weight, bias, act, cu, conv_state, idx, N):
        from ..kernels.conv import conv_fwd

        init = bidx = None
        if conv_state is not None:
            init, _, valid = _gather_init(conv_state, idx, N, x.device)
            bidx = torch.where(valid, torch.arange(N, device=x.device), -1).to(torch.int32)
        y = conv_fwd(x, weight, bias, act, cu, conv_state, idx)
        ctx.save_for_backward(x, weight, bias, cu, init, bidx)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.conv import conv_bwd

        x, weight, bias, cu, init, bidx = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx, dw, db = conv_bwd(x, weight, bias, dy, ctx.act, cu, init, bidx)
        return dx, dw, db, None, None, None, None, None


def _triton_conv(x, weight, bias, act: bool, cu, conv_state, idx, N):
    if cu is not None and not cu.is_contiguous():
        cu = cu.contiguous()
    if idx is not None and not idx.is_contiguous():
        idx = idx.contiguous()
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if torch.compiler.is_compiling() and not (needs_grad and conv_state is not None):
        from ._library import conv_fwd as conv_op, conv_fwd_pool

        if conv_state is None:
            return conv_op(x, weight, bias, act, cu)
        return conv_fwd_pool(x, weight, bias, act, cu, conv_state, idx)
    if needs_grad:
        return _CausalConv1dFn.apply(x, weight, bias, act, cu, conv_state, idx, N)
    from ..kernels.conv import conv_fwd

    return conv_fwd(x, weight, bias, act, cu, conv_state, idx)


def _run(x, weight, bias, act, cu, conv_state, idx, N, W):
    if use_triton(x.device) and W <= MAX_TRITON_WIDTH:
        return _triton_conv(x, weight, bias, act, cu, conv_state, idx, N)
    return _torch_conv(x, weight, bias, act, cu, conv_state, idx, N)


# ----------------------------------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------------------------------
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, activation="silu", *,
                  cu_seqlens: Optional[torch.Tensor] = None, conv_state: Optional[torch.Tensor] = None,
                  conv_state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal conv1d over time, channels last.

    Args:
        x: ``[B, T, D]`` (``[1, total, D]`` with ``cu_seqlens``); may be a strided view with contiguous last dim.
        weight: ``[D, W]``; ``weight[:, -1]`` multiplies the current token.
        bias: optional ``[D]``.
        activation: ``"silu"`` / ``"swish"`` or ``None``.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N packed sequences (B must be 1).
        conv_state: optional pool ``[P, D, W-1]`` (oldest first): sequence n reads its previous W-1 inputs from row
            ``conv_state_indices[n]`` (row n without indices, then P must be N) and writes its last W-1 inputs back
            in place. Index -1 = padding sequence (zero output, nothing read or written).
        conv_state_indices: optional ``[N]`` int32/int64 pool rows.

    Returns:
        ``y`` of shape ``[B, T, D]`` in x's dtype (contiguous). Differentiable with respect to x, weight and bias.
    """
    _v.tensor("x", x, ndim=3, dtypes=X_DTYPES, shape_doc="[B, T, D] (or [1, total, D] with cu_seqlens)")
    device = x.device
    _v.last_dim_contiguous("x", x)
    B, T, D = x.shape
    W = _check_weight_bias(weight, bias, D, device)
    act = _activation(activation)
    if cu_seqlens is not None:
        _device("cu_seqlens", cu_seqlens, device)
    N = _v.cu_seqlens(cu_seqlens, B, T, device)
    if conv_state is not None:
        _check_state(conv_state, conv_state_indices, N, D, W, device)
    elif conv_state_indices is not None:
        raise ValueError("conv_state_indices: given without conv_state (expected a pool [P, D, W-1] to index)")
    return _run(x, weight, bias, act, cu_seqlens, conv_state, conv_state_indices, N, W)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation="silu", *,
                         conv_state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode step of the causal conv: ``x`` ``[N, D]`` (one token per sequence) or ``[N, T, D]`` (T tokens each,
    e.g. speculative verify); ``y`` has x's shape and dtype. Reads and updates ``conv_state`` (``[P, D, W-1]``) rows
    in place: row ``conv_state_indices[n]`` (row n without indices, then P must be N); -1 = padding sequence.

    No host synchronisation when value checks are skipped (CUDA-graph capture, torch.compile tracing,
    ``GDN_SKIP_VALUE_CHECKS=1``): the kernel then treats an out-of-range index as padding.
    """
    _v.tensor("x", x, dtypes=X_DTYPES, shape_doc="[N, D] or [N, T, D]")
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected a 2-D [N, D] or 3-D [N, T, D] tensor, got shape {tuple(x.shape)}")
    device = x.device
    _v.last_dim_contiguous("x", x)
    if not isinstance(conv_state, torch.Tensor):
        raise TypeError(f"conv_state: expected a torch.Tensor [P, D, W-1], got {type(conv_state).__name__}")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    N, T, D = x3.shape
    W = _check_weight_bias(weight, bias, D, device)
    act = _activation(activation)
    _check_state(conv_state, conv_state_indices, N, D, W, device)
    y = _run(x3, weight, bias, act, None, conv_state, conv_state_indices, N, W)
    return y.reshape(x.shape)


__all__ = ["causal_conv1d", "causal_conv1d_update"]
