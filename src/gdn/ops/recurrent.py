"""fused_recurrent_gated_delta_rule: token-by-token form for decode and short multi-token steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import reference as ref
from ..backend import use_triton
from . import _validate as V_
from ._library import _none_if_empty

# kernel read/write modes (see gdn.kernels.recurrent)
READ_ZERO, READ_ROW, READ_POOL = 0, 1, 2
WRITE_NONE, WRITE_NEW, WRITE_SAME_ROW, WRITE_PER_TOKEN = 0, 1, 2, 3


@dataclass
class RecurrentPlan:
    """Everything the kernel (or the torch path) needs after validation."""
    B: int
    T: int
    N: int
    H: int
    HV: int
    K: int
    V: int
    scale: float
    read_mode: int
    write_mode: int
    state_layout: str


def validate_qkv(q, k, v):
    V_.tensor("q", q, ndim=4, dtypes=V_.FLOAT_DTYPES, shape_doc="[B, T, H, K]")
    dev = q.device
    V_.tensor("k", k, ndim=4, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, H, K]")
    V_.tensor("v", v, ndim=4, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, HV, V]")
    B, T, H, K = q.shape
    V_.shape("k", k, (B, T, H, K), "[B, T, H, K] (same as q)")
    HV, Vd = v.shape[2], v.shape[3]
    V_.shape("v", v, (B, T, None, None), "[B, T, HV, V]")
    if H == 0 or HV % H != 0:
        raise ValueError(f"v: the number of value heads HV = {HV} must be a multiple of the q/k heads H = {H}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got k {k.dtype} and v {v.dtype}")
    if K > 256 or Vd > 256:
        raise ValueError(f"q, v: head dims up to 256 are supported, got K = {K}, V = {Vd}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        V_.last_dim_contiguous(name, x)
    return B, T, H, K, HV, Vd


def validate_gates(B, T, HV, dev, g, beta, A_log, a, dt_bias, b):
    """Either log-space g (+ beta) or the raw form (A_log, a, dt_bias, b)."""
    raw = [x is not None for x in (A_log, a, dt_bias)]
    if g is not None and any(raw):
        raise ValueError("g: give either g (log-space) or A_log/a/dt_bias (raw gates), not both")
    if g is None and not all(raw):
        raise ValueError("g: missing; give g [B, T, HV] (log-space) or all of A_log [HV], a [B, T, HV], dt_bias [HV]")
    if g is not None:
        V_.tensor("g", g, ndim=3, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=dev, shape_doc="[B, T, HV]")
        V_.shape("g", g, (B, T, HV), "[B, T, HV]")
    else:
        V_.tensor("A_log", A_log, ndim=1, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[HV]")
        V_.shape("A_log", A_log, (HV,), "[HV]")
        V_.tensor("dt_bias", dt_bias, ndim=1, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[HV]")
        V_.shape("dt_bias", dt_bias, (HV,), "[HV]")
        V_.tensor("a", a, ndim=3, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, HV]")
        V_.shape("a", a, (B, T, HV), "[B, T, HV]")
    if beta is not None and b is not None:
        raise ValueError("beta: give either beta or the raw b (beta = sigmoid(b)), not both")
    if beta is not None:
        V_.tensor("beta", beta, ndim=3, dtypes=V_.FLOAT_DTYPES + (torch.float64,), device=dev, shape_doc="[B, T, HV]")
        V_.shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if b is not None:
        V_.tensor("b", b, ndim=3, dtypes=V_.FLOAT_DTYPES, device=dev, shape_doc="[B, T, HV]")
        V_.shape("b", b, (B, T, HV), "[B, T, HV]")


def _validate_state(name, st, rows, HV, K, Vd, layout, dev):
    doc = V_.state_doc(layout).replace("N", "P" if rows is None else "N")
    V_.tensor(name, st, ndim=4, dtypes=V_.STATE_DTYPES, device=dev, shape_doc=doc)
    V_.shape(name, st, (rows,) + V_.state_shape(HV, K, Vd, layout), doc)
    V_.contiguous(name, st)


def plan_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_layout,
                   ssm_state_indices, num_accepted_tokens, inplace_final_state, A_log, a, dt_bias, b, *,
                   state_name="initial_state", indices_name="ssm_state_indices",
                   output_state_indices=None) -> RecurrentPlan:
    B, T, H, K, HV, Vd = validate_qkv(q, k, v)
    dev = q.device
    validate_gates(B, T, HV, dev, g, beta, A_log, a, dt_bias, b)
    layout = V_.layout(state_layout)
    scale = V_.scale_value(scale, K)
    N = V_.cu_seqlens(cu_seqlens, B, T, dev)
    pool = ssm_state_indices is not None
    if pool:
        if initial_state is None:
            raise ValueError(f"{state_name}: {indices_name} needs the state pool [P, HV, ...] as {state_name}")
        _validate_state(state_name, initial_state, None, HV, K, Vd, layout, dev)
        max_len = T if cu_seqlens is None else None
        if cu_seqlens is not None and V_.host_checks_allowed(dev) and N > 0:
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        need_cols = max_len if (inplace_final_state and ssm_state_indices.dim() == 2) else None
        V_.pool_indices(indices_name, ssm_state_indices, N, initial_state.shape[0], dev, allow_2d=True,
                        max_cols=need_cols)
    elif initial_state is not None:
        _validate_state(state_name, initial_state, N, HV, K, Vd, layout, dev)
    if num_accepted_tokens is not None:
        if not pool or ssm_state_indices.dim() != 2:
            raise ValueError("num_accepted_tokens: needs 2-D ssm_state_indices [N, T_max] (one slot per token)")
        V_.tensor("num_accepted_tokens", num_accepted_tokens, ndim=1, dtypes=V_.INDEX_DTYPES, device=dev,
                  shape_doc="[N]")
        V_.shape("num_accepted_tokens", num_accepted_tokens, (N,), "[N]")
        if V_.host_checks_allowed(dev) and N > 0:
            lo, hi = int(num_accepted_tokens.min()), int(num_accepted_tokens.max())
            cols = ssm_state_indices.shape[1]
            if lo < 1 or hi > cols:
                raise ValueError(f"num_accepted_tokens: values must lie in [1, {cols}] (columns of "
                                 f"ssm_state_indices), got range [{lo}, {hi}]")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state: needs initial_state (the state or pool to update in place)")
    if output_state_indices is not None:
        if not pool:
            raise ValueError(f"output_state_indices: needs a state pool ({indices_name} and {state_name} [P, ...])")
        if not inplace_final_state:
            raise ValueError("output_state_indices: the pool rows are written only with inplace_final_state=True")
        read_rows = None
        if ssm_state_indices.dim() == 2 and num_accepted_tokens is not None and V_.host_checks_allowed(dev) and N:
            col = (num_accepted_tokens.to(torch.int64) - 1).clamp(0, ssm_state_indices.shape[1] - 1)
            read_rows = ssm_state_indices.gather(1, col[:, None].to(ssm_state_indices.device))
        V_.write_indices("output_state_indices", output_state_indices, ssm_state_indices, indices_name,
                         initial_state.shape[0], dev, read_rows=read_rows)

    read_mode = READ_POOL if pool else (READ_ROW if initial_state is not None else READ_ZERO)
    if inplace_final_state:
        write_mode = WRITE_PER_TOKEN if pool and ssm_state_indices.dim() == 2 else WRITE_SAME_ROW
    else:
        write_mode = WRITE_NEW if output_final_state else WRITE_NONE
    return RecurrentPlan(B, T, N, H, HV, K, Vd, scale, read_mode, write_mode, layout)


def _cache_row(cache, slot: int, t: int) -> torch.Tensor:
    """State t of slot ``slot`` of a per-token buffer, addressed by strides as the kernel does (the view's dim-1 size
    may be smaller than the tokens it covers)."""
    return torch.as_strided(cache, cache.shape[2:], cache.stride()[2:],
                            cache.storage_offset() + slot * cache.stride(0) + t * cache.stride(1))


def _recurrent_torch(q, k, v, o, plan: RecurrentPlan, g, beta, A_log, a, dt_bias, b, state_in, state_out, idx,
                     num_accepted, cu_seqlens, l2norm, cache=None, cache_idx=None, parent=None, out_idx=None):
    """The torch path: the same semantics as the kernel, one sequence at a time, fp32 state arithmetic (``cache`` /
    ``parent``: the kernel's per-token state buffer and tree verification, see :func:`run_recurrent`)."""
    g, beta = ref.resolve_gates(g, beta, A_log, a, dt_bias, b)
    dt = torch.float32
    qf, kf = q.to(dt), k.to(dt)
    if l2norm:
        qf, kf = ref.l2norm_ref(qf), ref.l2norm_ref(kf)
    qf = ref._expand_heads(qf, plan.HV) * plan.scale
    kf = ref._expand_heads(kf, plan.HV)
    vf, g = v.to(dt), g.to(dt)
    beta = torch.ones_like(g) if beta is None else beta.to(dt)
    kv = (lambda s: s) if plan.state_layout == "v_last" else (lambda s: s.transpose(-1, -2))
    P_in = state_in.shape[0] if state_in is not None else 0
    widx = idx if out_idx is None else out_idx
    for n, (bi, s, e) in enumerate(ref.sequence_spans(plan.B, plan.T, cu_seqlens)):
        if plan.read_mode == READ_POOL:
            col = int(num_accepted[n]) - 1 if num_accepted is not None else 0
            row = int(idx[n, col]) if idx.dim() == 2 else int(idx[n])
            if not 0 <= row < P_in:
                o[bi, s:e] = 0
                continue
        else:
            row = n
        S = (kv(state_in[row]).to(dt).clone() if plan.read_mode != READ_ZERO
             else torch.zeros(plan.HV, plan.K, plan.V, dtype=dt, device=q.device))
        S0 = S
        slot = int(cache_idx[n]) if cache is not None else -1
        for t in range(s, e):
            if parent is not None and t > s and slot >= 0:
                p = int(parent[n, t - s])
                S = kv(_cache_row(cache, slot, p)).to(dt) if p >= 0 else S0
            S = S * torch.exp(g[bi, t])[:, None, None]
            u = beta[bi, t][:, None] * (vf[bi, t] - torch.einsum("hk,hkv->hv", kf[bi, t], S))
            S = S + kf[bi, t][:, :, None] * u[:, None, :]
            o[bi, t] = torch.einsum("hk,hkv->hv", qf[bi, t], S).to(o.dtype)
            if slot >= 0:
                _cache_row(cache, slot, t - s).copy_(kv(S))
            if plan.write_mode == WRITE_PER_TOKEN:
                r = int(widx[n, t - s])
                if 0 <= r < state_out.shape[0]:
                    state_out[r] = kv(S).to(state_out.dtype)
        if plan.write_mode == WRITE_NEW:
            state_out[n] = kv(S).to(state_out.dtype)
        elif plan.write_mode == WRITE_SAME_ROW:
            r = row if out_idx is None else int(out_idx[n])
            if 0 <= r < state_out.shape[0]:
                state_out[r] = kv(S).to(state_out.dtype)
    return o


def _launch(q, k, v, o, g, beta, A_log, a, dt_bias, b, state_in, state_out, idx, num_accepted, cu_seqlens, scale,
            read_mode, write_mode, l2norm, k_last, seqlen, num_seqs, cache=None, cache_idx=None, parent=None,
            out_idx=None):
    from ..kernels.recurrent import recurrent_gdn_fwd

    recurrent_gdn_fwd(q, k, v, o, g=g, beta=beta, A_log=A_log, a=a, dt_bias=dt_bias, b=b, scale=scale,
                      state_in=state_out if state_in is None and read_mode != READ_ZERO else state_in,
                      state_out=state_out, idx=idx, num_accepted=num_accepted, cu_seqlens=cu_seqlens,
                      read_mode=read_mode, write_mode=write_mode, l2norm=l2norm, k_last=k_last, seqlen=seqlen,
                      num_seqs=num_seqs, cache=cache, cache_idx=cache_idx, parent=parent, out_idx=out_idx)


@torch.library.custom_op("gdn::recurrent_fwd", mutates_args=("o", "state_out", "cache"))
def _recurrent_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, g: Optional[torch.Tensor],
                      beta: Optional[torch.Tensor], A_log: Optional[torch.Tensor], a: Optional[torch.Tensor],
                      dt_bias: Optional[torch.Tensor], b: Optional[torch.Tensor], state_in: Optional[torch.Tensor],
                      state_out: torch.Tensor, idx: Optional[torch.Tensor],
                      num_accepted: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                      read_mode: int, write_mode: int, l2norm: bool, k_last: bool, seqlen: int, num_seqs: int,
                      cache: torch.Tensor, cache_idx: Optional[torch.Tensor] = None,
                      parent: Optional[torch.Tensor] = None, out_idx: Optional[torch.Tensor] = None) -> None:
    """The kernel launch as a torch.library op, so torch.compile traces the ops without a graph break. In-place
    modes pass the pool as ``state_out`` only (``state_in`` None): no two arguments alias. The mutated ``state_out``
    and ``cache`` are never None: an empty 1-D tensor stands for "none" (torch 2.11's fake-tensor pass raised
    IndexError on a mutated optional argument passed as None)."""
    _launch(q, k, v, o, g, beta, A_log, a, dt_bias, b, state_in, _none_if_empty(state_out), idx, num_accepted,
            cu_seqlens, scale, read_mode, write_mode, l2norm, k_last, seqlen, num_seqs, _none_if_empty(cache),
            cache_idx, parent, out_idx)


@_recurrent_fwd_op.register_fake
def _(*args):
    return None


def _raw_gates_rowwise(a, b) -> bool:
    """Raw gates the kernels read in place: both absent / contiguous, or [B, T, HV] views with a contiguous last dim
    and equal strides (the decode kernel reads row n at ``n * stride(0)``; the multi-token launcher makes them
    contiguous itself)."""
    given = [x for x in (a, b) if x is not None]
    if not given or all(x.is_contiguous() for x in given):
        return True
    return given[0].stride(-1) == 1 and all(x.stride() == given[0].stride() for x in given)


def run_recurrent(q, k, v, plan: RecurrentPlan, *, g=None, beta=None, A_log=None, a=None, dt_bias=None, b=None,
                  initial_state=None, ssm_state_indices=None, num_accepted_tokens=None, cu_seqlens=None,
                  l2norm=False, out: Optional[torch.Tensor] = None, cache: Optional[torch.Tensor] = None,
                  cache_idx: Optional[torch.Tensor] = None, parent: Optional[torch.Tensor] = None,
                  output_state_indices: Optional[torch.Tensor] = None):
    """Allocate outputs and run the kernel (or the torch path). Returns (o, final_state_or_None).

    ``cache`` ``[S, T_c, HV, ...]`` (state layout; slot pitch ``cache.stride(0)``, token pitch ``stride(1)`` = one
    state; addressed by strides, so T_c may be smaller than the tokens a slot takes) with ``cache_idx`` ``[N]`` (-1 = none): the state after token t of sequence n is also
    written to ``cache[cache_idx[n], t]``. ``parent`` ``[N, T_max]`` (needs ``cache``): tree verification, token
    t > 0 of a cached sequence starts from the state after token ``parent[n, t]`` (negative: the start state).
    ``output_state_indices``: separate pool write rows (in-place modes). Validated by the caller."""
    o = out if out is not None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if plan.write_mode == WRITE_NEW:
        final = torch.empty((plan.N,) + V_.state_shape(plan.HV, plan.K, plan.V, plan.state_layout),
                            dtype=torch.float32, device=v.device)
    elif plan.write_mode in (WRITE_SAME_ROW, WRITE_PER_TOKEN):
        final = initial_state
    else:
        final = None
    state_in = initial_state if plan.read_mode != READ_ZERO else None
    if use_triton(q.device):
        contig = lambda x: None if x is None else x.contiguous()  # noqa: E731  (gates are [B, T, HV]: small)
        if ssm_state_indices is not None and ssm_state_indices.dim() == 1:
            ssm_state_indices = ssm_state_indices.contiguous()  # the kernel reads idx[n] with stride 1
        if output_state_indices is not None and output_state_indices.dim() == 1:
            output_state_indices = output_state_indices.contiguous()
        inplace = plan.write_mode in (WRITE_SAME_ROW, WRITE_PER_TOKEN)
        if not _raw_gates_rowwise(a, b):
            a, b = contig(a), contig(b)
        g, beta, A_log, dt_bias = contig(g), contig(beta), contig(A_log), contig(dt_bias)

        def launch_args(state_out, per_token_cache):
            return (q, k, v, o, g, beta, A_log, a, dt_bias, b, None if inplace else state_in, state_out,
                    ssm_state_indices, num_accepted_tokens, cu_seqlens, plan.scale, plan.read_mode, plan.write_mode,
                    bool(l2norm), plan.state_layout == "k_last", plan.T, plan.N, per_token_cache, cache_idx, parent,
                    output_state_indices)

        if torch.compiler.is_compiling():
            none = q.new_empty(0)   # the op's "none" for the tensors it mutates (see _recurrent_fwd_op)
            torch.ops.gdn.recurrent_fwd(*launch_args(none if final is None else final,
                                                     none if cache is None else cache))
        else:  # eager: skip the dispatcher's overhead on the decode hot path
            _launch(*launch_args(final, cache))
    else:
        with torch.no_grad():
            _recurrent_torch(q, k, v, o, plan, g, beta, A_log, a, dt_bias, b, state_in, final, ssm_state_indices,
                             num_accepted_tokens, cu_seqlens, l2norm, cache, cache_idx, parent, output_state_indices)
    return o, final


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, *,
                                     state_layout="v_last", ssm_state_indices=None, num_accepted_tokens=None,
                                     inplace_final_state=False, A_log=None, a=None, dt_bias=None, b=None,
                                     output_state_indices=None):
    """Token-by-token gated delta rule (decode, short multi-token steps, speculative verification).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g/beta ``[B, T, HV]`` (or raw A_log ``[HV]``, a ``[B, T, HV]``,
    dt_bias ``[HV]``, b ``[B, T, HV]``). Pools: ``initial_state`` ``[P, HV, ...]`` with ``ssm_state_indices`` ``[N]``
    or ``[N, T_max]``; ``num_accepted_tokens`` ``[N]`` picks the start slot ``idx[n, num_accepted[n] - 1]``;
    ``inplace_final_state`` writes the final state (1-D indices) or every token's state (2-D) into the pool: to the
    rows read, or with ``output_state_indices`` (the shape of ``ssm_state_indices``; -1 = not written) to
    ``output_state_indices[n]`` / ``[n, t]`` (the read rows then stay untouched; two sequences writing one row, or one
    writing a row another reads, is a ValueError).
    Returns ``(o [B, T, HV, V] in v's dtype, final_state)``: the pool when written in place, a new float32
    ``[N, HV, ...]`` tensor with ``output_final_state``, else None. Not differentiable (use the chunked op to train).
    """
    plan = plan_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_layout,
                          ssm_state_indices, num_accepted_tokens, inplace_final_state, A_log, a, dt_bias, b,
                          output_state_indices=output_state_indices)
    o, final = run_recurrent(q, k, v, plan, g=g, beta=beta, A_log=A_log, a=a, dt_bias=dt_bias, b=b,
                             initial_state=initial_state, ssm_state_indices=ssm_state_indices,
                             num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                             l2norm=use_qk_l2norm_in_kernel, output_state_indices=output_state_indices)
    return o, final
