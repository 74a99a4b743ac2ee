"""Backward step 1: ``dv_local = (K Q^T * Gam^T) dO``, the gradient of v_new through the intra-chunk attention
(parallel over chunks; the reverse pass adds its state term to it in place).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_gates, _chunk_rows, _v_tile
from ...launch import launch


@triton.jit
def chunk_bwd_dv_local_kernel(
    q, k, gcum, do, rq, rk, dvl, cu_seqlens, chunk_indices, scale, T,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, PREC: tl.constexpr,
):
    """``dv_local = (K Q^T * Gam^T) dO`` for one chunk and one value head.

    Program -> work: ``program_id(0)`` = global chunk i_t (row of ``chunk_indices`` [NT, 2] = (sequence, chunk)),
    ``program_id(1)`` = value head i_hv (of q/k head i_hv // (HV / H)).

    1. raw K Q^T [C, C] once (k, q [B, T, H, K] strided, BK = K), scaled by ``scale r_k,i`` (rows), ``r_q,j`` (columns;
       rq / rk [B*T, H] fp32 with the L2 norm);
    2. ``(K Q^T)_ij * exp(c_j - c_i)`` for j >= i, else 0 (c = g_cum [B*T, HV] fp32);
    3. per V tile of BV columns: times dO (do [B, T, HV, V] strided) -> ``dvl`` [B*T, HV, V] (dot dtype)."""
    DT = dvl.dtype.element_ty
    i_t = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    row, tok, st, m_t, n_valid = _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C, VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_k = tl.load(k + row * s_kb + st[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.0)
    b_q = tl.load(q + row * s_qb + st[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_tk, other=0.0)
    b_kq = tl.dot(b_k.to(MM), tl.trans(b_q.to(MM)), input_precision=PREC, out_dtype=ACC)
    upper = o_c[None, :] >= o_c[:, None]
    b_fr = tl.zeros([C], dtype=ACC) + scale
    b_fc = tl.zeros([C], dtype=ACC) + 1.0
    if L2NORM:
        b_fr = b_fr * tl.load(rk + tok * H + i_h, mask=m_t, other=0.0)
        b_fc = tl.load(rq + tok * H + i_h, mask=m_t, other=0.0)
    b_kq = b_kq * b_fr[:, None] * b_fc[None, :]
    b_gc, b_gl = _chunk_gates(gcum, tok, i_hv, m_t, n_valid, HV, C, ACC)
    b_a = tl.where(upper, b_kq * tl.exp(tl.where(upper, b_gc[None, :] - b_gc[:, None], 0.0)), 0.0)
    b_a = b_a.to(DT).to(MM)
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + row * s_ob + st[:, None] * s_ot + i_hv * s_oh + o_v[None, :], mask=m_tv,
                       other=0.0)
        b_dv = tl.dot(b_a, b_do.to(DT).to(MM), input_precision=PREC, out_dtype=ACC)
        tl.store(dvl + (tok[:, None] * HV + i_hv) * V + o_v[None, :], b_dv.to(DT), mask=m_tv)


def dv_local(q, k, g_cum, do, rq, rk, dvn, ci, cu_seqlens, scale, T, strides, meta):
    """Launch :func:`chunk_bwd_dv_local_kernel` into ``dvn`` [B, T, HV, V] (``meta``: the constexprs the backward
    kernels share; ``strides``: q, k, do (batch, token, head))."""
    HV, V = meta["HV"], do.shape[3]
    launch(chunk_bwd_dv_local_kernel, (ci.NT, HV),
        q, k, g_cum, do, rq, rk, dvn, cu_seqlens, ci.chunk_indices, scale, T, *strides, V=V,
        BV=_v_tile(V, q.device), num_warps=4, num_stages=2, **meta)
