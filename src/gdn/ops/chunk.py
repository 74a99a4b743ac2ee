"""chunk_gated_delta_rule: chunked (WY / UT transform) prefill and training (see API.md).

Validation -> backend choice -> (torch reference | Triton kernels, through an autograd Function when a gradient is
needed). Kernels live in :mod:`gdn.kernels.chunk` (forward and backward) and are
imported lazily.
"""
from __future__ import annotations

from typing import Optional

import torch

from gdn.backend import use_triton
from gdn.ops import _validate as V_

CHUNK_SIZES = (64,)
MAX_HEAD_DIM = 256


def _needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these (None, or not a tensor: never)."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _validate(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
              state_layout, ssm_state_indices, chunk_size, output_state_indices=None, checkpoint_every_n_tokens=None,
              checkpoint_indices=None, return_chunk_states=False):
    q = V_.tensor("q", q, ndim=4, dtypes=V_.FLOAT_DTYPES, shape_doc="[B, T, H, K]")
    dev = q.device
    B, T, H, K = q.shape
    V_.tensor("k", k, ndim=4, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, H, K]")
    V_.shape("k", k, (B, T, H, K), "[B, T, H, K] (the shape of q)")
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected dtype {V_._dt(q.dtype)} (the dtype of q), got {V_._dt(k.dtype)}")
    V_.tensor("v", v, ndim=4, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, HV, V]")
    V_.shape("v", v, (B, T, None, None), "[B, T, HV, V] (B, T of q)")
    HV, Vd = v.shape[2], v.shape[3]
    if H < 1 or HV < 1 or HV % H != 0:
        raise ValueError(f"v: the number of value heads HV = {HV} must be a positive multiple of the number of q/k "
                         f"heads H = {H}")
    if K < 1 or Vd < 1:
        raise ValueError(f"q/v: head dims must be >= 1, got K = {K}, V = {Vd}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        V_.last_dim_contiguous(name, x)
    V_.tensor("g", g, ndim=3, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=dev, shape_doc="[B, T, HV]")
    V_.shape("g", g, (B, T, HV), "[B, T, HV]")
    if beta is not None:
        V_.tensor("beta", beta, ndim=3, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=dev, shape_doc="[B, T, HV]")
        V_.shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")
    scale = V_.scale_value(scale, K)
    layout = V_.layout(state_layout)
    N = V_.cu_seqlens(cu_seqlens, B, T, dev)
    sshape = V_.state_shape(HV, K, Vd, layout)
    sdoc = V_.state_doc(layout)
    if ssm_state_indices is None:
        if initial_state is not None:
            V_.tensor("initial_state", initial_state, ndim=4, dtypes=V_.STATE_DTYPES, device=dev, shape_doc=sdoc)
            V_.shape("initial_state", initial_state, (N, *sshape), sdoc)
    else:
        if initial_state is None:
            raise ValueError("initial_state: a state pool [P, HV, ...] is required when ssm_state_indices is given")
        pdoc = sdoc.replace("[N,", "[P,")
        V_.tensor("initial_state", initial_state, ndim=4, dtypes=V_.STATE_DTYPES, device=dev, shape_doc=pdoc)
        V_.shape("initial_state", initial_state, (None, *sshape), pdoc)
        V_.pool_indices("ssm_state_indices", ssm_state_indices, N, initial_state.shape[0], dev, allow_2d=False)
        if _needs_grad(q, k, v, g, beta, initial_state):
            raise ValueError("ssm_state_indices: state pools are inference-only; call under torch.no_grad() or pass "
                             "initial_state without ssm_state_indices to differentiate")
    ck = _validate_checkpoints(checkpoint_every_n_tokens, checkpoint_indices, ssm_state_indices, initial_state, N,
                               chunk_size, dev)
    if output_state_indices is not None:
        if ssm_state_indices is None:
            raise ValueError("output_state_indices: needs a state pool (ssm_state_indices and initial_state [P, ...])")
        V_.write_indices("output_state_indices", output_state_indices, ssm_state_indices, "ssm_state_indices",
                         initial_state.shape[0], dev, extra=ck)
    elif ck:
        V_.unique_write_rows([("ssm_state_indices", ssm_state_indices)] + ck, ssm_state_indices, dev)
    if not isinstance(return_chunk_states, bool):
        raise TypeError(f"return_chunk_states: expected a bool, got {type(return_chunk_states).__name__}")
    if return_chunk_states and _needs_grad(q, k, v, g, beta, initial_state):
        raise ValueError("return_chunk_states: inference only; call under torch.no_grad()")
    return scale, layout, N


def _validate_checkpoints(every, ck, idx, pool, N, chunk_size, dev) -> list:
    """Checks of ``checkpoint_every_n_tokens`` / ``checkpoint_indices``; returns ``[("checkpoint_indices", ck)]``
    (the extra write rows for the uniqueness check) or [] when off."""
    if every is None and ck is None:
        return []
    if ck is None:
        raise ValueError("checkpoint_indices: required with checkpoint_every_n_tokens (pool rows [N, C], -1 = skip)")
    if every is None:
        raise ValueError("checkpoint_every_n_tokens: required with checkpoint_indices")
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"checkpoint_every_n_tokens: expected an int, got {type(every).__name__}")
    if every <= 0 or every % chunk_size:
        raise ValueError(f"checkpoint_every_n_tokens: expected a positive multiple of chunk_size = {chunk_size}, got "
                         f"{every}")
    if idx is None:
        raise ValueError("checkpoint_indices: needs a state pool (ssm_state_indices and initial_state [P, ...]); the "
                         "checkpoints are written into its rows")
    V_.tensor("checkpoint_indices", ck, ndim=2, dtypes=V_.INDEX_DTYPES, device=dev, shape_doc="[N, C]")
    V_.shape("checkpoint_indices", ck, (N, None), "[N, C]")
    V_.pool_indices("checkpoint_indices", ck, N, pool.shape[0], dev, allow_2d=True)
    return [("checkpoint_indices", ck)]


def _validate_triton_limits(q, v):
    K, Vd = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim K = {K} is larger than the Triton kernels support (K <= {MAX_HEAD_DIM})")
    if Vd > MAX_HEAD_DIM:
        raise ValueError(f"v: head dim V = {Vd} is larger than the Triton kernels support (V <= {MAX_HEAD_DIM})")


# ----------------------------------------------------------------------------------------------------------------------
# torch path
# ----------------------------------------------------------------------------------------------------------------------
def _torch_path(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, layout, idx, chunk_size,
                out_idx=None, ck=None, every=0, want_h=False):
    from gdn.reference import chunk_gated_delta_rule_ref, sequence_spans

    if idx is None:
        o, ht, *h = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                               l2, state_layout=layout, chunk_size=chunk_size,
                                               return_chunk_states=want_h)
        return (o, (None if ht is None else ht.to(torch.float32))) + ((h[0].to(torch.float32),) if want_h else ())
    pool = initial_state
    P = pool.shape[0]
    il = idx.to(torch.int64)
    valid = (il >= 0) & (il < P)
    h0 = torch.zeros((il.shape[0],) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
    h0[valid] = pool[il[valid]].to(torch.float32)
    o, fin, h = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, h0, True, cu_seqlens, l2, state_layout=layout,
                                           chunk_size=chunk_size, return_chunk_states=True)
    B, T = q.shape[:2]
    vl = valid.tolist()
    off = 0  # chunk row of the sequence's first chunk in h
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu_seqlens)):
        nc = -(-(e - s) // chunk_size)
        if not vl[n]:
            o[bi, s:e] = 0
        elif ck is not None:  # checkpoint c = the start state of chunk (c + 1) * every / C, or the final state
            for c, r in enumerate(ck[n].tolist()):
                tok = (c + 1) * every
                if 0 <= r < P and tok <= e - s:
                    st = h[off + tok // chunk_size] if tok < e - s else (
                        fin[n] if layout == "v_last" else fin[n].transpose(-1, -2))
                    pool[r] = (st if layout == "v_last" else st.transpose(-1, -2)).to(pool.dtype)
        off += nc
    wl = il if out_idx is None else out_idx.to(torch.int64)
    wvalid = valid & (wl >= 0) & (wl < P)
    pool[wl[wvalid]] = fin[wvalid].to(pool.dtype)
    return (o, (pool if output_final_state else None)) + ((h.to(torch.float32),) if want_h else ())


# ----------------------------------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------------------------------
def _train_forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, chunk_size,
                   cu_seqlens_cpu):
    """The forward of the differentiable Triton op; saves what the backward needs on ``ctx``."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk.forward import chunk_gated_delta_rule_fwd

    # Ainv (tensor-core dtype, [B, T, HV, 64]), the chunk-local gate cumsum and k's L2 row scalings are kept for
    # the backward (as fla keeps A), and with the tuning field chunk_fwd.bwd_save_states (default) the chunk
    # states h and v_new too: the backward then recomputes only W (else also the chunk states); on sm_90 the
    # prepare stores W as well where the backward's reverse pass does not form it itself (chunk_bwd.w_from_forward)
    keep = bool(tuning.chunk_fwd(q.device).bwd_save_states)
    o, ht, aux = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            cu_seqlens, chunk_size, l2, state_layout="v_last",
                                            store_ainv=True, cu_seqlens_cpu=cu_seqlens_cpu, return_states=keep,
                                            keep_w=True)
    keep = keep and aux["h"] is not None
    # W is read by the backward's reverse pass only: held here, not in saved_tensors, so that the backward can drop
    # it before its last kernel (the parts kernel), where the memory of a training step peaks
    ctx.w = aux["w"]
    ctx.scale = scale
    ctx.chunk_size = chunk_size
    ctx.chunk_index = aux["chunk_index"]
    ctx.l2 = l2
    ctx.set_materialize_grads(False)
    return o, ht, (g, beta, initial_state, cu_seqlens, aux["g_cum"], aux["ainv"], aux["rk"], aux["rq"],
                   aux["h"] if keep else None, aux["v_new"] if keep else None)


def _train_backward(ctx, q, k, v, saved, do, dht, out=None):
    """``(dq, dk, dv, dg, dbeta, dh0)`` of the differentiable Triton op (``out``: dq, dk, dv to write into)."""
    from gdn.kernels.chunk.backward import chunk_gated_delta_rule_bwd

    g, beta, h0, cu_seqlens, g_cum, ainv, rk, rq, h, v_new = saved
    if do is None:
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    # W popped into the call (no reference left here or on ctx): the backward frees it after the reverse pass
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, ctx.scale, h0, cu_seqlens, ctx.chunk_size, ctx.l2, do, dht,
                                      g_cum=g_cum, ainv=ainv, rk=rk, rq=rq, h=h, v_new=v_new,
                                      w=ctx.__dict__.pop("w", None), chunk_index=ctx.chunk_index, out=out)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Differentiable Triton op. States here are fp32 in v_last order ([N, HV, K, V]); layout conversion happens in
    :func:`chunk_gated_delta_rule`."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                chunk_size, cu_seqlens_cpu=None):
        o, ht, saved = _train_forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel, chunk_size, cu_seqlens_cpu)
        ctx.save_for_backward(q, k, v, *saved)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _train_backward(ctx, q, k, v, saved, do, dht)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None, None


def split_packed_qkv(qkv: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int):
    """Views q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` of a packed ``qkv [B, T, 2 H K + HV V]`` (q | k | v
    along the last dim, e.g. a causal conv's output). By ``torch.split``: through autograd its backward writes the
    packed gradient once, where three slices would each make a zero-filled full-size gradient and add them."""
    kd = num_k_heads * head_k_dim
    q, k, v = torch.split(qkv, [kd, kd, num_v_heads * head_v_dim], dim=-1)
    return (q.unflatten(-1, (num_k_heads, head_k_dim)), k.unflatten(-1, (num_k_heads, head_k_dim)),
            v.unflatten(-1, (num_v_heads, head_v_dim)))


class ChunkGatedDeltaRulePackedFunction(torch.autograd.Function):
    """The differentiable Triton op on a packed ``qkv [B, T, 2 H K + HV V]``: its backward writes dq, dk, dv
    straight into one packed gradient (the sm_90 parts kernel stores at the packed row stride), where split views
    of qkv would have autograd concatenate three separate gradients."""

    @staticmethod
    def forward(ctx, qkv, dims, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, chunk_size, cu_seqlens_cpu=None):
        q, k, v = split_packed_qkv(qkv, *dims)
        o, ht, saved = _train_forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                      use_qk_l2norm_in_kernel, chunk_size, cu_seqlens_cpu)
        ctx.dims = dims
        ctx.save_for_backward(qkv, *saved)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        qkv, *saved = ctx.saved_tensors
        q, k, v = split_packed_qkv(qkv, *ctx.dims)
        dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        out = split_packed_qkv(dqkv, *ctx.dims)
        _, _, _, dg, dbeta, dh0 = _train_backward(ctx, q, k, v, saved, do, dht, out=out)
        return dqkv, None, dg, dbeta, None, dh0, None, None, None, None, None


def chunk_gated_delta_rule_packed(qkv, num_k_heads, head_k_dim, num_v_heads, head_v_dim, g, beta, scale=None,
                                  cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, chunk_size=64,
                                  cu_seqlens_cpu=None):
    """:func:`chunk_gated_delta_rule` on a packed ``qkv [B, T, 2 H K + HV V]`` (q | k | v along the last dim; no
    initial or final state): ``o [B, T, HV, V]``. Same validation and result as the public op on the split views;
    where the Triton backward runs, its gradient of qkv is written as one tensor (no concatenation)."""
    V_.tensor("qkv", qkv, ndim=3, dtypes=V_.FLOAT_DTYPES, shape_doc="[B, T, 2 H K + HV V]")
    dims = tuple(int(x) for x in (num_k_heads, head_k_dim, num_v_heads, head_v_dim))
    if min(dims) < 1 or qkv.shape[-1] != 2 * dims[0] * dims[1] + dims[2] * dims[3]:
        raise ValueError(f"qkv: last dim {qkv.shape[-1]} is not 2 H K + HV V for (H, K, HV, V) = {dims}")
    q, k, v = split_packed_qkv(qkv, *dims)
    if not (use_triton(qkv.device) and _needs_grad(qkv, g, beta)) or torch.compiler.is_compiling():
        return chunk_gated_delta_rule(q, k, v, g, beta, scale, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                                      cu_seqlens_cpu=cu_seqlens_cpu)[0]
    cu_host = V_.cu_seqlens_host("cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    scale, _, _ = _validate(q, k, v, g, beta, scale, None, False, cu_seqlens if cu_host is None else
                            (cu_seqlens, cu_host), use_qk_l2norm_in_kernel, "v_last", None, chunk_size)
    _validate_triton_limits(q, v)
    if beta is None:
        beta = torch.ones((), dtype=torch.float32, device=q.device).expand(g.shape)
    return ChunkGatedDeltaRulePackedFunction.apply(qkv, dims, g, beta, scale, None, False, cu_seqlens,
                                                   bool(use_qk_l2norm_in_kernel), chunk_size, cu_host)[0]


def _triton_path(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, layout, idx, chunk_size,
                 cu_host=None, out_idx=None, ck=None, every=0, want_h=False):
    if beta is None:
        beta = torch.ones((), dtype=torch.float32, device=q.device).expand(g.shape)
    if torch.compiler.is_compiling():  # opaque torch.library ops (gdn/ops/_library.py): no graph break
        from ._library import chunk_fwd, chunk_fwd_pool

        if want_h:
            raise ValueError("return_chunk_states: not available under torch.compile (call the op eagerly)")
        if idx is not None:
            o = chunk_fwd_pool(q, k, v, g, beta, initial_state, idx, cu_seqlens, scale, l2, chunk_size, layout,
                               out_idx, ck, int(every))
            return o, (initial_state if output_final_state else None)
        h0 = initial_state
        if h0 is not None:
            h0 = h0.to(torch.float32)
            h0 = (h0.transpose(-1, -2) if layout == "k_last" else h0).contiguous()
        o, ht = chunk_fwd(q, k, v, g, beta, h0, cu_seqlens, scale, bool(output_final_state), l2, chunk_size)
        if not output_final_state:
            return o, None
        return o, (ht.transpose(-1, -2).contiguous() if layout == "k_last" else ht)
    if _needs_grad(q, k, v, g, beta, initial_state):
        h0 = initial_state
        if h0 is not None:
            h0 = h0.to(torch.float32)
            if layout == "k_last":
                h0 = h0.transpose(-1, -2)
            h0 = h0.contiguous()
        o, ht = ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, h0, bool(output_final_state), cu_seqlens,
                                                  bool(l2), chunk_size, cu_host)
        if ht is not None and layout == "k_last":
            ht = ht.transpose(-1, -2).contiguous()
        return o, ht

    from gdn.kernels.chunk.forward import chunk_gated_delta_rule_fwd

    if idx is None:
        o, ht, aux = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                cu_seqlens, chunk_size, l2, state_layout=layout, cu_seqlens_cpu=cu_host,
                                                return_states=want_h)
        return (o, ht) + ((aux["h"],) if want_h else ())
    pool = initial_state
    o, _, aux = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, pool, False, cu_seqlens, chunk_size, l2,
                                           state_layout=layout, state_indices=idx, final_state=pool,
                                           cu_seqlens_cpu=cu_host, final_indices=out_idx, checkpoint_indices=ck,
                                           checkpoint_every=int(every or 0), return_states=want_h)
    return (o, (pool if output_final_state else None)) + ((aux["h"],) if want_h else ())


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, state_layout="v_last",
                           ssm_state_indices=None, chunk_size=64, cu_seqlens_cpu=None, output_state_indices=None,
                           checkpoint_every_n_tokens=None, checkpoint_indices=None, return_chunk_states=False):
    """Chunked gated delta rule (prefill / training).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (strided views with a contiguous last dim are read in place); g, beta
    ``[B, T, HV]`` (g log-space, beta None = ones). ``initial_state``: ``[N, HV, K, V]`` (``state_layout="v_last"``)
    or ``[N, HV, V, K]`` (``"k_last"``); with ``ssm_state_indices`` ``[N]`` it is a pool ``[P, HV, ...]``: sequence n
    reads row ``ssm_state_indices[n]`` and its final state is written back into that row in place (pool dtype; -1 =
    padding: zeros out, nothing read or written), and the pool itself is returned as final state when
    ``output_final_state``. ``output_state_indices`` ``[N]`` (with a pool): the final state goes to that row
    instead (-1 = not written; the read row stays untouched; two sequences writing one row, or one writing a row that
    another reads, is a ValueError). Prefix-cache checkpoints (with a pool): ``checkpoint_every_n_tokens`` (a
    positive multiple of ``chunk_size``) and ``checkpoint_indices`` ``[N, C]`` (int, -1 = skip): the state of sequence
    n after its ``(c + 1) * checkpoint_every_n_tokens``-th token (its start state included) is written to pool row
    ``checkpoint_indices[n, c]`` in the pool's dtype and layout during the same pass (checkpoints past the end: not
    written); it equals the final state of a prefill that stops there. ``return_chunk_states`` (inference, eager):
    a third return value h ``[NT, HV, K, V]`` (v_last order whatever ``state_layout``; fp32 or the kernels'
    tensor-core dtype): the state at the start of every chunk of C tokens, sequences in order, for callers that keep
    their own prefix cache (SGLang). Returns ``(o [B, T, HV, V] in v's dtype, final_state fp32 or None)``.
    Differentiable w.r.t. q, k, v, g, beta and ``initial_state`` (not a pool).
    ``cu_seqlens_cpu``: the values of ``cu_seqlens`` on the host (CPU int tensor or sequence of ints; as fla's and
    vLLM's precomputed chunk metadata): then nothing reads ``cu_seqlens`` back from the device, so the call does not
    wait for the GPU and can be captured in a CUDA graph. It must equal ``cu_seqlens`` (checked against it only on
    the host copy: start 0, non-decreasing, end T, same length).
    """
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            state_layout, ssm_state_indices, chunk_size, cu_seqlens_cpu, output_state_indices,
            checkpoint_every_n_tokens, checkpoint_indices, return_chunk_states)
    if _plannable(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, ssm_state_indices,
                  output_state_indices, checkpoint_indices):
        return _planned_call()(*args)
    return _call(*args)


def _call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
          state_layout, ssm_state_indices, chunk_size, cu_seqlens_cpu, output_state_indices, checkpoint_every_n_tokens,
          checkpoint_indices, return_chunk_states):
    """The public op's body: validation, then the reference or the Triton path."""
    cu_host = V_.cu_seqlens_host("cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    scale, layout, N = _validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 cu_seqlens if cu_host is None else (cu_seqlens, cu_host),
                                 use_qk_l2norm_in_kernel, state_layout, ssm_state_indices, chunk_size,
                                 output_state_indices, checkpoint_every_n_tokens, checkpoint_indices,
                                 return_chunk_states)
    extra = dict(out_idx=output_state_indices, ck=checkpoint_indices, every=checkpoint_every_n_tokens or 0,
                 want_h=return_chunk_states)
    if not use_triton(q.device):
        return _torch_path(q, k, v, g, beta, scale, initial_state, bool(output_final_state), cu_seqlens,
                           bool(use_qk_l2norm_in_kernel), layout, ssm_state_indices, chunk_size, **extra)
    _validate_triton_limits(q, v)
    return _triton_path(q, k, v, g, beta, scale, initial_state, bool(output_final_state), cu_seqlens,
                        bool(use_qk_l2norm_in_kernel), layout, ssm_state_indices, chunk_size, cu_host, **extra)


def _plannable(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, ssm_state_indices,
               output_state_indices, checkpoint_indices) -> bool:
    """Whether a call may go through the public op's host plan (:func:`_planned_call`): an inference call on the
    Triton path whose validation reads no device values. A replay skips the validation, so everything it checks must
    be fixed by the plan's key (dtypes, shapes, strides, devices, scalars, host copies of cu_seqlens by value); the
    rest is decided here per call: no gradient, not traced, the Triton backend, no device copy of cu_seqlens read
    back (``cu_seqlens_cpu`` given, <= 256 entries: checked in Python), no pool index checks on the host (they
    run unless skipped: ``GDN_SKIP_VALUE_CHECKS``, graph capture) and no scale given as a tensor (read back)."""
    if not isinstance(q, torch.Tensor) or isinstance(scale, torch.Tensor) or torch.compiler.is_compiling():
        return False
    if _needs_grad(q, k, v, g, beta, initial_state):
        return False
    if cu_seqlens is not None and not 0 < _host_len(cu_seqlens_cpu) <= 256:
        return False
    if (ssm_state_indices is not None or output_state_indices is not None or checkpoint_indices is not None) and \
            V_.host_checks_allowed(q.device):
        return False
    try:
        return use_triton(q.device)
    except RuntimeError:    # raised by the call itself, after its validation
        return False


def _host_len(x) -> int:
    """The number of entries of a host copy of cu_seqlens (0: none, or not a 1-D sequence)."""
    if isinstance(x, torch.Tensor):
        return x.numel() if x.dim() == 1 else 0
    try:
        return len(x)
    except TypeError:
        return 0


_PLANNED = []


def _planned_call():
    """:func:`_call` under a host plan (``gdn.kernels.host_plan.planned``): one key for the whole public call, so
    that a replay runs neither the validation nor the Python of the Triton path (the kernel-level plan of the
    forward inside is not consulted either: its launches are the public plan's)."""
    if not _PLANNED:
        from gdn.kernels.host_plan import planned

        _PLANNED.append(planned(_call))
    return _PLANNED[0]


__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_packed", "ChunkGatedDeltaRuleFunction",
           "ChunkGatedDeltaRulePackedFunction", "split_packed_qkv"]
