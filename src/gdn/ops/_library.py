"""torch.library custom ops around the kernel launches, for torch.compile(fullgraph=True).

Dynamo cannot trace into a Triton launcher (host-side heuristics, the interpreter on CPU), so under
``torch.compiler.is_compiling()`` the public ops call these opaque ops instead; each has a fake (meta) implementation
giving output shapes, and the differentiable ones an autograd formula (``register_autograd``) that calls the backward
op. In eager mode the ops call the launchers directly and skip the dispatcher. The recurrent/decode op registers its
own (``gdn::recurrent_fwd`` in ``ops/recurrent.py``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def _none_if_empty(t: Tensor) -> Optional[Tensor]:
    return None if t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0 else t


# ----------------------------------------------------------------------------------------------------------------------
# gdn_gate
# ----------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("gdn::gate_fwd", mutates_args=())
def gate_fwd(a: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    from ..kernels.gate import gdn_gate_fwd

    return gdn_gate_fwd(a, A_log, dt_bias)


@gate_fwd.register_fake
def _(a, A_log, dt_bias):
    return a.new_empty(a.shape, dtype=torch.float32)


@torch.library.custom_op("gdn::gate_bwd", mutates_args=())
def gate_bwd(a: Tensor, A_log: Tensor, dt_bias: Tensor, dg: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    from ..kernels.gate import gdn_gate_bwd

    da, dA, ddt = gdn_gate_bwd(a, A_log, dt_bias, dg)
    return da, dA.clone(), ddt.clone()    # a custom op's outputs may not alias one another


@gate_bwd.register_fake
def _(a, A_log, dt_bias, dg):
    return torch.empty_like(a), torch.empty_like(A_log), torch.empty_like(dt_bias)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_backward(ctx, dg):
    return gate_bwd(*ctx.saved_tensors, dg.contiguous())


gate_fwd.register_autograd(_gate_backward, setup_context=_gate_setup)


# ----------------------------------------------------------------------------------------------------------------------
# gated RMSNorm (rows [M, N]; z optional: an empty tensor stands for None)
# ----------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("gdn::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x2: Tensor, z2: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    from ..kernels.norm import rmsnorm_fwd as launch

    return launch(x2, _none_if_empty(z2), weight, eps)


@rmsnorm_fwd.register_fake
def _(x2, z2, weight, eps):
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    return torch.empty_like(x2), x2.new_empty((x2.shape[0],), dtype=acc)


@torch.library.custom_op("gdn::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(x2: Tensor, z2: Tensor, weight: Tensor, dy2: Tensor, rstd: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    from ..kernels.norm import rmsnorm_bwd as launch

    dx, dz, dw = launch(x2, _none_if_empty(z2), weight, dy2, rstd)
    return dx, (dz if dz is not None else z2.new_empty((0,))), dw


@rmsnorm_bwd.register_fake
def _(x2, z2, weight, dy2, rstd):
    return torch.empty_like(x2), torch.empty_like(z2), torch.empty_like(weight)


def _norm_setup(ctx, inputs, output):
    x2, z2, weight, _ = inputs
    ctx.save_for_backward(x2, z2, weight, output[1])


def _norm_backward(ctx, dy, drstd):
    x2, z2, weight, rstd = ctx.saved_tensors
    dx, dz, dw = rmsnorm_bwd(x2, z2, weight, dy.contiguous(), rstd)
    return dx, (dz if z2.numel() else None), dw, None


rmsnorm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)


# ----------------------------------------------------------------------------------------------------------------------
# causal conv1d (forward may update a state pool in place; the backward is for the state-free training path)
# ----------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("gdn::conv_fwd", mutates_args=())
def conv_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: bool, cu_seqlens: Optional[Tensor]) -> Tensor:
    """State-free forward (training / plain prefill); differentiable."""
    from ..kernels.conv import conv_fwd as launch

    return launch(x, weight, bias, act, cu_seqlens)


@conv_fwd.register_fake
def _(x, weight, bias, act, cu_seqlens):
    return x.new_empty(x.shape)


@torch.library.custom_op("gdn::conv_fwd_pool", mutates_args=("conv_state",))
def conv_fwd_pool(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: bool, cu_seqlens: Optional[Tensor],
                  conv_state: Tensor, state_indices: Optional[Tensor]) -> Tensor:
    """Forward that reads and updates a conv-state pool in place (inference: prefill with a cache, decode step)."""
    from ..kernels.conv import conv_fwd as launch

    return launch(x, weight, bias, act, cu_seqlens, conv_state, state_indices)


@conv_fwd_pool.register_fake
def _(x, weight, bias, act, cu_seqlens, conv_state, state_indices):
    return x.new_empty(x.shape)


@torch.library.custom_op("gdn::conv_bwd", mutates_args=())
def conv_bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], dy: Tensor, act: bool,
             cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    from ..kernels.conv import conv_bwd as launch

    dx, dw, db = launch(x, weight, bias, dy, act, cu_seqlens)
    return dx, dw, (db if db is not None else weight.new_empty((0,)))


@conv_bwd.register_fake
def _(x, weight, bias, dy, act, cu_seqlens):
    return x.new_empty(x.shape), torch.empty_like(weight), (torch.empty_like(bias) if bias is not None
                                                             else weight.new_empty((0,)))


def _conv_setup(ctx, inputs, output):
    x, weight, bias, act, cu = inputs
    ctx.act = act
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, cu)


def _conv_backward(ctx, dy):
    x, weight, bias, cu = ctx.saved_tensors
    dx, dw, db = conv_bwd(x, weight, bias, dy.contiguous(), ctx.act, cu)
    return dx, dw, (db if ctx.has_bias else None), None, None


conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


# ----------------------------------------------------------------------------------------------------------------------
# chunked gated delta rule (states fp32 v_last inside; an empty tensor stands for an absent state)
# ----------------------------------------------------------------------------------------------------------------------
def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@torch.library.custom_op("gdn::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
              cu_seqlens: Optional[Tensor], scale: float, output_final_state: bool, l2norm: bool,
              chunk_size: int) -> Tuple[Tensor, Tensor]:
    from ..kernels.chunk.forward import chunk_gated_delta_rule_fwd

    o, ht, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                          chunk_size, l2norm, state_layout="v_last", return_states=False)
    return o, (ht if ht is not None else q.new_empty((0,), dtype=torch.float32))


@chunk_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, l2norm, chunk_size):
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    ht = (q.new_empty((_num_seqs(q, cu_seqlens), HV, K, V), dtype=torch.float32) if output_final_state
          else q.new_empty((0,), dtype=torch.float32))
    return v.new_empty(v.shape), ht


@torch.library.custom_op("gdn::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
              cu_seqlens: Optional[Tensor], do: Tensor, dht: Optional[Tensor], scale: float, l2norm: bool,
              chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd

    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                            chunk_size, l2norm, do, dht)
    return dq, dk, dv, dg, dbeta, (dh0 if dh0 is not None else q.new_empty((0,), dtype=torch.float32))


@chunk_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, l2norm, chunk_size):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _chunk_setup(ctx, inputs, output):
    q, k, v, g, beta, h0, cu, scale, output_final_state, l2norm, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, cu)
    ctx.args = (scale, l2norm, chunk_size)
    ctx.has_h0 = h0 is not None
    ctx.has_ht = output_final_state


def _chunk_backward(ctx, do, dht):
    q, k, v, g, beta, h0, cu = ctx.saved_tensors
    scale, l2norm, chunk_size = ctx.args
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, g, beta, h0, cu, do.contiguous(),
                                           dht if ctx.has_ht and dht is not None else None, scale, l2norm, chunk_size)
    return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_h0 else None), None, None, None, None, None


chunk_fwd.register_autograd(_chunk_backward, setup_context=_chunk_setup)


@torch.library.custom_op("gdn::chunk_fwd_pool", mutates_args=("pool",))
def chunk_fwd_pool(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, state_indices: Tensor,
                   cu_seqlens: Optional[Tensor], scale: float, l2norm: bool, chunk_size: int,
                   state_layout: str, output_state_indices: Optional[Tensor] = None,
                   checkpoint_indices: Optional[Tensor] = None, checkpoint_every: int = 0) -> Tensor:
    """Inference prefill over a state pool: initial states read from, final states written to the pool rows (or to
    ``output_state_indices``)."""
    from ..kernels.chunk.forward import chunk_gated_delta_rule_fwd

    o, _, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, pool, False, cu_seqlens, chunk_size, l2norm,
                                         state_layout=state_layout, state_indices=state_indices, final_state=pool,
                                         final_indices=output_state_indices, checkpoint_indices=checkpoint_indices,
                                         checkpoint_every=checkpoint_every, return_states=False)
    return o


@chunk_fwd_pool.register_fake
def _(q, k, v, g, beta, pool, state_indices, cu_seqlens, scale, l2norm, chunk_size, state_layout,
      output_state_indices=None, checkpoint_indices=None, checkpoint_every=0):
    return v.new_empty(v.shape)
