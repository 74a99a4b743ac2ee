"""Token-by-token gated delta rule: decode (T = 1) and short multi-token steps (speculative verification).

One program owns the state tile ``S[:, v0:v0+BV]`` (all K rows, BV value columns) of one (sequence, value head) pair,
keeps it in registers in fp32 and walks the sequence's tokens::

    S = exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale S^T q_t

Grid: ``(N * HV, V / (BV * NV_LOOP))``; a program walks NV_LOOP tiles (pipelined for single-token decode). The state is read once and written once per launch (per token in per-token mode), so the
kernel is bound by state bytes / copy bandwidth. Pool rows, sequence offsets and token offsets are 64-bit.

Constexpr switches (one kernel for every form):
- ``GATE_RAW``: g from (A_log, a, dt_bias) in the kernel, else g read (log-space).
- ``BETA_MODE``: 0 beta = 1, 1 beta read, 2 beta = sigmoid(b) from raw b.
- ``READ_MODE``: 0 zero start, 1 row n of ``state_in``, 2 pool row ``idx[n]`` (1-D) or ``idx[n, col]`` (2-D; col =
  ``num_accepted[n] - 1`` with ``SPEC``, else 0).
- ``WRITE_MODE``: 0 none, 1 row n of ``state_out`` (a new [N, ...] tensor), 2 the row that was read (in place),
  3 per token: the state after token t goes to pool row ``idx[n, t]`` (2-D indices).
- ``K_LAST``: state rows stored ``[V, K]`` instead of ``[K, V]``.
A negative or out-of-range pool row marks a padding sequence: its outputs are zeros and no state row is touched.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import gdn_gate_value, next_pow2, sigmoid


@triton.jit
def _token_step(b_s, q, k, v, g, beta, a, b, o, t, p_q, p_k, p_v, p_o, p_gate, s_qt, s_kt, s_vt, b_A, b_dtb, scale,
                m_k, m_v, HV: tl.constexpr, V: tl.constexpr, GATE_RAW: tl.constexpr, BETA_MODE: tl.constexpr,
                L2NORM: tl.constexpr):
    """One token: decay, delta-rule write, read-out (stored). Returns the new fp32 state tile [BK, BV]."""
    b_q = tl.load(p_q + t * s_qt, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(p_k + t * s_kt, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(p_v + t * s_vt, mask=m_v, other=0.0).to(tl.float32)
    if L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    b_q = b_q * scale
    if GATE_RAW:
        b_g = gdn_gate_value(tl.load(a + p_gate + t * HV).to(tl.float32), b_A, b_dtb)
    else:
        b_g = tl.load(g + p_gate + t * HV).to(tl.float32)
    if BETA_MODE == 0:
        b_beta = 1.0
    elif BETA_MODE == 1:
        b_beta = tl.load(beta + p_gate + t * HV).to(tl.float32)
    else:
        b_beta = sigmoid(tl.load(b + p_gate + t * HV).to(tl.float32))
    b_s = b_s * tl.exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0)
    tl.store(p_o + t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def recurrent_gdn_fwd_kernel(
    q, k, v, g, beta, A_log, a, dt_bias, b,
    o, state_in, state_out, idx, num_accepted, cu_seqlens,
    scale, T, P_in, P_out, n_cols,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_idx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV_LOOP: tl.constexpr,
    VARLEN: tl.constexpr, SINGLE: tl.constexpr, GATE_RAW: tl.constexpr, BETA_MODE: tl.constexpr,
    L2NORM: tl.constexpr, READ_MODE: tl.constexpr, IDX_2D: tl.constexpr, SPEC: tl.constexpr,
    WRITE_MODE: tl.constexpr, K_LAST: tl.constexpr, EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    i_nh = tl.program_id(0)  # N * HV can pass 65535: keep it on the first grid axis
    i_vb = tl.program_id(1)  # this program's NV_LOOP tiles of BV value columns
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)

    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        seq_len = eos - bos
        tok0 = bos                              # flat token index of the first token (gates, output)
        row_b = tl.zeros([], dtype=tl.int64)    # q/k/v batch row (B == 1)
    else:
        seq_len = T
        tok0 = i_n.to(tl.int64) * T
        bos = tl.zeros([], dtype=tl.int64)
        row_b = i_n.to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    head_off = i_hv.to(tl.int64) * (K * V)

    # which state row starts the sequence
    if READ_MODE == 2:
        if IDX_2D:
            col = 0
            if SPEC:
                col = tl.load(num_accepted + i_n).to(tl.int64) - 1
                col = tl.minimum(tl.maximum(col, 0), n_cols - 1)
            row_in = tl.load(idx + i_n.to(tl.int64) * s_idx + col).to(tl.int64)
        else:
            row_in = tl.load(idx + i_n).to(tl.int64)
        valid = (row_in >= 0) & (row_in < P_in)
    else:
        row_in = i_n.to(tl.int64)
        valid = row_in >= 0

    p_q = q + row_b * s_qb + bos * s_qt + i_h * s_qh + o_k
    p_k = k + row_b * s_kb + bos * s_kt + i_h * s_kh + o_k
    p_gate = tok0 * HV + i_hv
    b_A = 0.0
    b_dtb = 0.0
    if GATE_RAW:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
        b_dtb = tl.load(dt_bias + i_hv).to(tl.float32)

    if valid:
        for j in range(NV_LOOP):
            o_v = (i_vb * NV_LOOP + j) * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_s = m_k[:, None] & m_v[None, :]
            if K_LAST:
                o_s = o_v[None, :] * K + o_k[:, None]
            else:
                o_s = o_k[:, None] * V + o_v[None, :]
            p_v = v + row_b * s_vb + bos * s_vt + i_hv * s_vh + o_v
            p_o = o + (tok0 * HV + i_hv) * V + o_v
            if READ_MODE == 0:
                b_s = tl.zeros([BK, BV], dtype=tl.float32)
            else:
                b_s = tl.load(state_in + row_in * (HV * K * V) + head_off + o_s, mask=m_s, other=0.0,
                              eviction_policy=EVICT).to(tl.float32)
            if SINGLE:  # one token (decode): straight-line code, so the tile loop pipelines
                b_s = _token_step(b_s, q, k, v, g, beta, a, b, o, 0, p_q, p_k, p_v, p_o, p_gate, s_qt, s_kt, s_vt,
                                  b_A, b_dtb, scale, m_k, m_v, HV, V, GATE_RAW, BETA_MODE, L2NORM)
            else:
                for t in range(0, seq_len):
                    b_s = _token_step(b_s, q, k, v, g, beta, a, b, o, t, p_q, p_k, p_v, p_o, p_gate, s_qt, s_kt,
                                      s_vt, b_A, b_dtb, scale, m_k, m_v, HV, V, GATE_RAW, BETA_MODE, L2NORM)
                    if WRITE_MODE == 3:  # the state after token t goes to pool row idx[n, t]
                        row_t = tl.load(idx + i_n.to(tl.int64) * s_idx + tl.minimum(t, n_cols - 1)).to(tl.int64)
                        row_t = tl.where(t < n_cols, row_t, -1)
                        if (row_t >= 0) & (row_t < P_out):
                            tl.store(state_out + row_t * (HV * K * V) + head_off + o_s,
                                     b_s.to(state_out.dtype.element_ty), mask=m_s)
            if WRITE_MODE == 1:
                tl.store(state_out + i_n.to(tl.int64) * (HV * K * V) + head_off + o_s,
                         b_s.to(state_out.dtype.element_ty), mask=m_s)
            elif WRITE_MODE == 2:
                tl.store(state_out + row_in * (HV * K * V) + head_off + o_s, b_s.to(state_out.dtype.element_ty),
                         mask=m_s, cache_modifier=STORE_CACHE)
            elif WRITE_MODE == 3 and SINGLE:
                row_t = tl.load(idx + i_n.to(tl.int64) * s_idx).to(tl.int64)
                if (row_t >= 0) & (row_t < P_out):
                    tl.store(state_out + row_t * (HV * K * V) + head_off + o_s,
                             b_s.to(state_out.dtype.element_ty), mask=m_s)
    else:
        # padding sequence: zeros out, no state row read or written
        for j in range(NV_LOOP):
            o_v = (i_vb * NV_LOOP + j) * BV + tl.arange(0, BV)
            p_o = o + (tok0 * HV + i_hv) * V + o_v
            for t in range(0, seq_len):
                tl.store(p_o + t * (HV * V), tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty), mask=o_v < V)


def _block_v(N: int, HV: int, K: int, V: int, state_bytes: int, single: bool = True) -> tuple:
    """(BV, num_warps, NV_LOOP, num_stages) from H200 sweeps (bench/results/sweep_decode*_h200.json, K = V = 128):
    small batches want many small programs; large fp32 states one program per head with the whole 128x128 tile and
    8 warps; large 16-bit states 16-column tiles, 8 per program, software-pipelined two deep."""
    BK = next_pow2(K)
    nhv = N * HV
    if nhv < 2048:
        BV, warps, nv_loop, stages = 8, 1, 1, 1
    elif not single:  # several tokens per program: more, smaller programs keep the per-token state writes in flight
        BV, warps, nv_loop, stages = 32, 4, 1, 1
    elif state_bytes >= 4:
        BV, warps, nv_loop, stages = 128, 8, 1, 1
    else:
        BV, warps, nv_loop, stages = 16, 2, 8, 2
    BV = min(BV, next_pow2(V))
    while BV > 8 and BV * BK > 128 * 128:
        BV //= 2
    env = os.environ.get
    BV = int(env("GDN_RECURRENT_BV", BV))
    warps = int(env("GDN_RECURRENT_WARPS", warps))
    nv_loop = int(env("GDN_RECURRENT_NV_LOOP", nv_loop))
    stages = int(env("GDN_RECURRENT_STAGES", stages))
    return BV, warps, nv_loop, stages


def recurrent_gdn_fwd(q, k, v, o, *, g=None, beta=None, A_log=None, a=None, dt_bias=None, b=None, scale: float,
                      state_in=None, state_out=None, idx=None, num_accepted=None, cu_seqlens=None,
                      read_mode: int, write_mode: int, l2norm: bool, k_last: bool, seqlen: int, num_seqs: int):
    """Launch the kernel. All tensors validated by the caller; ``o`` preallocated [B, T, HV, V]."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N = num_seqs
    if N == 0 or o.numel() == 0 and write_mode == 0:
        return o
    st = state_in if state_in is not None else state_out
    single = cu_seqlens is None and seqlen == 1
    BV, warps, nv_loop, stages = _block_v(N, HV, K, V, st.element_size() if st is not None else 4, single)
    nv_loop = max(1, min(nv_loop, triton.cdiv(V, BV)))
    gate_raw = g is None
    beta_mode = 1 if beta is not None else (2 if b is not None else 0)
    dummy = o
    grid = (N * HV, triton.cdiv(triton.cdiv(V, BV), nv_loop))
    recurrent_gdn_fwd_kernel[grid](
        q, k, v,
        dummy if g is None else g, dummy if beta is None else beta,
        dummy if A_log is None else A_log, dummy if a is None else a,
        dummy if dt_bias is None else dt_bias, dummy if b is None else b,
        o, dummy if state_in is None else state_in, dummy if state_out is None else state_out,
        dummy if idx is None else idx, dummy if num_accepted is None else num_accepted,
        dummy if cu_seqlens is None else cu_seqlens,
        float(scale), seqlen,
        state_in.shape[0] if state_in is not None else 0, state_out.shape[0] if state_out is not None else 0,
        idx.shape[1] if idx is not None and idx.dim() == 2 else 1,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), idx.stride(0) if idx is not None and idx.dim() == 2 else 1,
        H=H, HV=HV, K=K, V=V, BK=next_pow2(K), BV=BV, NV_LOOP=nv_loop,
        VARLEN=cu_seqlens is not None, SINGLE=single, GATE_RAW=gate_raw, BETA_MODE=beta_mode, L2NORM=bool(l2norm),
        READ_MODE=read_mode, IDX_2D=idx is not None and idx.dim() == 2, SPEC=num_accepted is not None,
        WRITE_MODE=write_mode, K_LAST=bool(k_last), EVICT=os.environ.get("GDN_RECURRENT_EVICT", ""),
        STORE_CACHE=os.environ.get("GDN_RECURRENT_STORE_CACHE", ""),
        num_warps=warps, num_stages=stages,
    )
    return o
