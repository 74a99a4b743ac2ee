"""Backward step 3: the parallel per-chunk gradients. Part A (per chunk, value head and side: dQ, and dK through
the output / state / WY-through-H terms), part B (the WY / UT-transform terms: dv, dbeta, dg, the rest of dK), then
the q/k kernel (GVA sum over value heads, deterministic; the L2-norm backward); on sm_90 all three are one Gluon
kernel (:mod:`.hopper_parts`). The math: :mod:`..backward`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common import l2_rnorm, next_pow2
from ... import tuning
from ..plan import prepare_chunk_indices
from .common import _acc_dtype, _chunk_gates, _chunk_rows, _dot_precision, _mm_dtype, _strides, _v_tile
from ...launch import launch
from . import hopper_parts


@triton.jit
def chunk_bwd_out_kernel(
    q, k, gcum, vn, do, hs, gs, rq, rk, dq_v, dk_v, dg_part, beta, ainv, dvn,
    cu_seqlens, chunk_indices, scale, T, s_dgp,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, PREC: tl.constexpr,
):
    """Parallel part A, one chunk x one value head x one side: gradients through
    ``O = diag(e^c) Q H + (Q K^T * Gam) Vn`` and ``Hnext = e^cL H + (diag(e^(cL - c)) K)^T Vn``.

    side 0 (dQ): ``dPm = (dO Vn^T) * Gam``, ``dQ = diag(e^c) dO H^T + dPm K`` -> ``dq_v`` [B, T, HV, K] (gradient of
    Q = scale qn, per value head); its gate terms ``revcumsum(Q.dQ - K.(dPm^T Q)) + e^cL <H, Gm>`` -> ``dg_part[0]``
    (``dg_part`` is [4, B*T*HV] fp32, slot stride ``s_dgp``).
    side 1 (dK): first the WY terms through H, ``-dKb = (Ainv^T dVn) H^T`` (gate / beta terms -> ``dg_part[2]`` /
    ``dg_part[3]``), then on the same accumulator ``dKs = diag(e^(cL - c)) Vn Gm^T``, so
    ``dK = dPmT Q + dKs + diag(b e^c) dKb`` -> ``dk_v`` (fp32; kernel B adds its terms);
    ``sum_{s < t} k_s.dKs_s`` -> ``dg_part[1]``.
    The V contractions run over V tiles of BV columns (dO, Vn, H, Gm, dVn tiles stream; at most two accumulators
    per side, so nothing spills at 4 warps)."""
    DT = vn.dtype.element_ty
    i_t = tl.program_id(0)      # global chunk index (row of hs / gs)
    i_hv = tl.program_id(1)
    side = tl.program_id(2)
    i_h = i_hv // (HV // H)
    row, tok, st, m_t, n_valid = _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C, VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    strict = o_c[:, None] > o_c[None, :]

    if L2NORM:
        b_rq = tl.load(rq + tok * H + i_h, mask=m_t, other=0.0)
        b_rk = tl.load(rk + tok * H + i_h, mask=m_t, other=0.0)
    else:
        b_rq = tl.zeros([C], dtype=ACC) + 1.0
        b_rk = tl.zeros([C], dtype=ACC) + 1.0
    b_sq = b_rq * scale                          # row factor of Q = scale * qn
    b_gc, b_gl = _chunk_gates(gcum, tok, i_hv, m_t, n_valid, HV, C, ACC)
    p_q = q + row * s_qb + st[:, None] * s_qt + i_h * s_qh + o_k[None, :]
    p_k = k + row * s_kb + st[:, None] * s_kt + i_h * s_kh + o_k[None, :]
    p_do = do + row * s_ob + st[:, None] * s_ot + i_hv * s_oh
    p_vn = vn + (tok[:, None] * HV + i_hv) * V
    hoff = (i_t.to(tl.int64) * HV + i_hv) * K * V
    p_part = (tok[:, None] * HV + i_hv) * K + o_k[None, :]

    if side == 0:
        b_dpm = tl.zeros([C, C], dtype=ACC)
        b_dqs = tl.zeros([C, BK], dtype=ACC)
        b_hgs = tl.zeros([], dtype=ACC)
        for v0 in tl.static_range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            b_do = tl.load(p_do + o_v[None, :], mask=m_tv, other=0.0).to(DT).to(MM)
            b_vn = tl.load(p_vn + o_v[None, :], mask=m_tv, other=0.0).to(MM)
            b_h = tl.load(hs + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)   # H [BK, BV]
            b_hgs += tl.sum(tl.sum(b_h.to(ACC) * tl.load(gs + hoff + o_k[:, None] * V + o_v[None, :], mask=m_kv,
                                                         other=0.0).to(ACC), axis=1), axis=0)
            b_h = b_h.to(MM)
            b_dpm = tl.dot(b_do, tl.trans(b_vn), b_dpm, input_precision=PREC, out_dtype=ACC)   # dO Vn^T
            b_dqs = tl.dot(b_do, tl.trans(b_h), b_dqs, input_precision=PREC, out_dtype=ACC)    # dO H^T
        causal = o_c[:, None] >= o_c[None, :]
        b_dpm = b_dpm * tl.where(causal, tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
        b_q = tl.load(p_q, mask=m_tk, other=0.0)
        b_k = tl.load(p_k, mask=m_tk, other=0.0)
        b_qk = tl.dot(b_q.to(MM), tl.trans(b_k.to(MM)), input_precision=PREC, out_dtype=ACC)
        b_p = tl.where(strict, b_dpm * b_qk * b_sq[:, None] * b_rk[None, :], 0.0)   # the diagonal cancels exactly
        b_dc = tl.sum(b_p, axis=1) - tl.sum(b_p, axis=0)
        b_dqs = b_dqs * tl.exp(b_gc)[:, None]
        b_dc += tl.sum(b_q.to(ACC) * b_dqs, axis=1) * b_sq
        b_dq = tl.dot((b_dpm * b_rk[None, :]).to(DT).to(MM), b_k.to(MM), b_dqs, input_precision=PREC,
                      out_dtype=ACC)
        tl.store(dq_v + p_part, b_dq.to(dq_v.dtype.element_ty), mask=m_tk)
        tl.store(dg_part + tok * HV + i_hv, tl.cumsum(b_dc, axis=0, reverse=True) + b_hgs * tl.exp(b_gl), mask=m_t)
    else:
        # phase 1, the WY part through H: dVb = Ainv^T dVn, -dKb = dVb H^T; its dk terms are -(b e^c) (-dKb);
        # kdkb = r_k e^c k.(-dKb): dbeta -= kdkb (slot 3), dc -= b kdkb (slot 2, reverse-cumsummed)
        m_cct = (o_c < n_valid)[:, None] & m_t[None, :]
        b_ait = tl.load(ainv + (tok[None, :] * HV + i_hv) * C + o_c[:, None], mask=m_cct,
                        other=0.0).to(DT).to(MM)                                 # Ainv^T, loaded transposed
        b_acc = tl.zeros([C, BK], dtype=ACC)
        for v0 in tl.static_range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            b_dvn = tl.load(dvn + (tok[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0).to(MM)
            b_h = tl.load(hs + hoff + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                          other=0.0).to(MM)
            b_dvb = tl.dot(b_ait, b_dvn, input_precision=PREC, out_dtype=ACC).to(DT).to(MM)
            b_acc = tl.dot(b_dvb, tl.trans(b_h), b_acc, input_precision=PREC, out_dtype=ACC)   # -dKb
        b_b = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.0).to(ACC)
        b_eg = tl.exp(b_gc)
        b_fb = b_b * b_eg
        b_k = tl.load(p_k, mask=m_tk, other=0.0)
        b_kn = tl.sum(b_k.to(ACC) * b_acc, axis=1)                                  # k.(-dKb)
        b_kdkb = b_kn * b_rk * b_eg
        tl.store(dg_part + 2 * s_dgp + tok * HV + i_hv, -tl.cumsum(b_kdkb * b_b, axis=0, reverse=True), mask=m_t)
        tl.store(dg_part + 3 * s_dgp + tok * HV + i_hv, -b_kdkb, mask=m_t)

        # phase 2 on the same accumulator: dK = dPmT Q + dKs - diag(b e^c) (-dKb), with
        # dKs = diag(e^(cL - c)) Vn Gm^T (the row factor goes on the Vn tile, so one accumulator holds all of dK)
        b_acc = b_acc * (-b_fb)[:, None]
        b_egl = tl.exp(b_gl - b_gc)
        b_dpmt = tl.zeros([C, C], dtype=ACC)
        for v0 in tl.static_range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            b_do = tl.load(p_do + o_v[None, :], mask=m_tv, other=0.0).to(DT).to(MM)
            b_vn = tl.load(p_vn + o_v[None, :], mask=m_tv, other=0.0)
            b_g = tl.load(gs + hoff + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                          other=0.0)                                                             # Gm [BK, BV]
            b_dpmt = tl.dot(b_vn.to(MM), tl.trans(b_do), b_dpmt, input_precision=PREC, out_dtype=ACC)   # Vn dO^T
            b_vne = (b_vn.to(ACC) * b_egl[:, None]).to(DT).to(MM)
            b_acc = tl.dot(b_vne, tl.trans(b_g.to(MM)), b_acc, input_precision=PREC, out_dtype=ACC)  # + dKs
        # k.dKs = k.acc + b e^c k.(-dKb)   (k reloaded: keeping it across the loop costs registers)
        b_k = tl.load(p_k, mask=m_tk, other=0.0)
        b_kdks = (tl.sum(b_k.to(ACC) * b_acc, axis=1) + b_fb * b_kn) * b_rk
        b_gamt = tl.where(strict, 0.0, tl.exp(tl.where(strict, 0.0, b_gc[None, :] - b_gc[:, None])))
        b_dpmt = (b_dpmt * b_gamt * b_sq[None, :]).to(DT).to(MM)                     # (Vn dO^T) * Gam^T
        b_q = tl.load(p_q, mask=m_tk, other=0.0)
        b_dk = tl.dot(b_dpmt, b_q.to(MM), b_acc, input_precision=PREC, out_dtype=ACC)
        tl.store(dk_v + p_part, b_dk.to(dk_v.dtype.element_ty), mask=m_tk)
        # dg_t gets sum_{s >= t} of (-k_s.dKs_s at s, + sum_s k_s.dKs_s at the last position) = sum_{s < t} k_s.dKs_s
        b_dg1 = tl.cumsum(b_kdks, axis=0) - b_kdks
        tl.store(dg_part + s_dgp + tok * HV + i_hv, b_dg1, mask=m_t)


@triton.jit
def chunk_bwd_wy_kernel(
    k, v, gcum, beta, ainv, vn, dvn, rk, dv, dbeta, dg, dk_v, dg_part,
    cu_seqlens, chunk_indices, T, s_dgp,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, PREC: tl.constexpr,
):
    """Parallel part B, one chunk x one value head: the WY / UT-transform backward
    ``dVb = Ainv^T dVn, dA = -dVb Vn^T, dA^T = -(Vn dVn^T) Ainv`` (V contractions over V tiles; the ``dKb = -dVb H^T``
    terms are kernel A's side 1). Writes dv, dbeta (+ ``dg_part[3]``), dg (= ``dg_part[0..2]`` + these terms) and
    adds its dk terms to ``dk_v`` (per value head, fp32; :func:`chunk_bwd_qk_kernel` sums the value heads and
    applies the L2-norm backward)."""
    DT = vn.dtype.element_ty
    i_t = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    row, tok, st, m_t, n_valid = _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C, VARLEN)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    strict = o_c[:, None] > o_c[None, :]
    if L2NORM:
        b_rk = tl.load(rk + tok * H + i_h, mask=m_t, other=0.0)
    else:
        b_rk = tl.zeros([C], dtype=ACC) + 1.0
    b_gc, b_gl = _chunk_gates(gcum, tok, i_hv, m_t, n_valid, HV, C, ACC)
    b_b = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    m_cct = (o_c < n_valid)[:, None] & m_t[None, :]
    b_ait = tl.load(ainv + (tok[None, :] * HV + i_hv) * C + o_c[:, None], mask=m_cct,
                    other=0.0).to(DT).to(MM)                                     # Ainv^T, loaded transposed
    p_tv = (tok[:, None] * HV + i_hv) * V
    p_v = v + row * s_vb + st[:, None] * s_vt + i_hv * s_vh

    b_db = tl.zeros([C], dtype=ACC)
    b_nda = tl.zeros([C, C], dtype=ACC)
    b_vdv = tl.zeros([C, C], dtype=ACC)
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_dvn = tl.load(dvn + p_tv + o_v[None, :], mask=m_tv, other=0.0).to(MM)
        b_vn = tl.load(vn + p_tv + o_v[None, :], mask=m_tv, other=0.0).to(MM)
        b_dvb = tl.dot(b_ait, b_dvn, input_precision=PREC, out_dtype=ACC)            # dVb = Ainv^T dVn
        tl.store(dv + p_tv + o_v[None, :], (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * tl.load(p_v + o_v[None, :], mask=m_tv, other=0.0).to(ACC), axis=1)
        b_dvb = b_dvb.to(DT).to(MM)
        b_nda = tl.dot(b_dvb, tl.trans(b_vn), b_nda, input_precision=PREC, out_dtype=ACC)   # -dA = dVb Vn^T
        b_vdv = tl.dot(b_vn, tl.trans(b_dvn), b_vdv, input_precision=PREC, out_dtype=ACC)   # Vn dVn^T

    # C x C: A = SL * diag(b) (Gam * K K^T); M = SL * dA * diag(b) Gam and its transpose from dA^T
    b_k = tl.load(k + row * s_kb + st[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.0)
    causal = o_c[:, None] >= o_c[None, :]
    b_gam = tl.where(causal, tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    b_kk = tl.dot(b_k.to(MM), tl.trans(b_k.to(MM)), input_precision=PREC, out_dtype=ACC)
    b_dagk = tl.where(strict, b_nda * b_gam * b_kk * (b_rk[:, None] * b_rk[None, :]), 0.0)
    b_db -= tl.sum(b_dagk, axis=1)
    b_daa = b_dagk * b_b[:, None]                                                # -dA * A
    b_dc = tl.sum(b_daa, axis=0) - tl.sum(b_daa, axis=1)
    b_msym = tl.where(strict, b_nda * b_gam * b_b[:, None], 0.0)
    m_cc = m_t[:, None] & (o_c < n_valid)[None, :]
    b_ai = tl.load(ainv + (tok[:, None] * HV + i_hv) * C + o_c[None, :], mask=m_cc, other=0.0).to(DT).to(MM)
    b_ndat = tl.dot(b_vdv.to(DT).to(MM), b_ai, input_precision=PREC, out_dtype=ACC)  # -dA^T
    strict_t = o_c[:, None] < o_c[None, :]
    b_gamt = tl.where(strict_t, tl.exp(tl.where(strict_t, b_gc[None, :] - b_gc[:, None], 0.0)), 0.0)
    b_msym += b_ndat * b_gamt * b_b[None, :]
    b_msym = (b_msym * b_rk[None, :]).to(DT).to(MM)     # -(M + M^T) with kn = rk * k on the contraction side

    p_part = (tok[:, None] * HV + i_hv) * K + o_k[None, :]
    b_dk = tl.load(dk_v + p_part, mask=m_tk, other=0.0).to(ACC)
    b_dk = tl.dot(-b_msym, b_k.to(MM), b_dk, input_precision=PREC, out_dtype=ACC)
    tl.store(dk_v + p_part, b_dk, mask=m_tk)
    p_g = dg_part + tok * HV + i_hv
    b_db += tl.load(p_g + 3 * s_dgp, mask=m_t, other=0.0)
    b_dgv = tl.cumsum(b_dc, axis=0, reverse=True) + tl.load(p_g, mask=m_t, other=0.0) \
        + tl.load(p_g + s_dgp, mask=m_t, other=0.0) + tl.load(p_g + 2 * s_dgp, mask=m_t, other=0.0)
    tl.store(dg + tok * HV + i_hv, b_dgv.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dbeta + tok * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)


@triton.jit
def chunk_bwd_qk_kernel(
    q, k, rq, rk, dq_v, dk_v, dq, dk, cu_seqlens, chunk_indices, scale, T,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr,
):
    """One chunk x one q/k head: sum the per-value-head gradients of its group (GVA), then
    ``dq = scale dQ`` / ``dk = dK`` through the L2 norm: ``dx = r (dy - y (y.dy))`` with ``y = x r``."""
    GR: tl.constexpr = HV // H
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    row, tok, st, m_t, n_valid = _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C, VARLEN)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_dq = tl.zeros([C, BK], dtype=ACC)
    b_dk = tl.zeros([C, BK], dtype=ACC)
    for j in tl.static_range(GR):
        p_part = (tok[:, None] * HV + i_h * GR + j) * K + o_k[None, :]
        b_dq += tl.load(dq_v + p_part, mask=m_tk, other=0.0).to(ACC)
        b_dk += tl.load(dk_v + p_part, mask=m_tk, other=0.0).to(ACC)
    p_out = (tok[:, None] * H + i_h) * K + o_k[None, :]
    if L2NORM:
        b_rq = tl.load(rq + tok * H + i_h, mask=m_t, other=0.0)
        b_rk = tl.load(rk + tok * H + i_h, mask=m_t, other=0.0)
        b_qf = tl.load(q + row * s_qb + st[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_kf = tl.load(k + row * s_kb + st[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_dq = (b_rq * scale)[:, None] * (b_dq - b_qf * (tl.sum(b_qf * b_dq, axis=1) * b_rq * b_rq)[:, None])
        b_dk = b_rk[:, None] * (b_dk - b_kf * (tl.sum(b_kf * b_dk, axis=1) * b_rk * b_rk)[:, None])
    else:
        b_dq = b_dq * scale
    tl.store(dq + p_out, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_out, b_dk.to(dk.dtype.element_ty), mask=m_tk)


def _qk_scratch(B, T, HV, K, dq_dtype, dk_dtype, dev):
    """dQ (dot dtype) and dK (accumulator dtype) per value head [B, T, HV, K], summed by the q/k kernel."""
    return (torch.empty(B, T, HV, K, dtype=dq_dtype, device=dev), torch.empty(B, T, HV, K, dtype=dk_dtype, device=dev))


def chunk_bwd_main(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, scale, cu_seqlens, chunk_size,
                   use_qk_l2norm_in_kernel, *, g_dtype=None, chunk_index=None, rq=None, rk=None, out=None):
    """Parallel per-chunk gradients: kernel A (output/state terms, per value head and side), kernel B (WY terms:
    dv, dbeta, dg, dk terms) -- on sm_90 both as one Gluon kernel (``hopper_parts``, ``chunk_bwd.parts_sm90``) --,
    then the q/k kernel (GVA sum, L2-norm backward; the sm_90 Gluon kernel does that part itself).
    Returns ``(dq, dk, dv, dbeta, dg)`` in the dtypes of q, k, v, beta and ``g_dtype`` (default g_cum's).
    ``v_new``'s dtype is the dot operand dtype. Scratch: dQ per value head [B, T, HV, K] (dot dtype), dK per value
    head (fp32), and for the portable pair four dg / dbeta slots [4, B, T, HV] (fp32); on sm_90 the parts kernel's
    own GVA slots (``hopper_parts.launch_parts``).
    ``out``: (dq, dk, dv) to write into (shapes and dtypes of q, k, v; e.g. views of one packed gradient of
    q|k|v): the sm_90 kernel writes them in place, the portable kernels into fresh tensors that are then copied."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = int(chunk_size)
    dev = q.device
    ci = chunk_index if chunk_index is not None else prepare_chunk_indices(cu_seqlens, T, C, B, device=dev)
    NT = ci.NT
    if out is None:
        dq = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
        dk = torch.empty(B, T, H, K, dtype=k.dtype, device=dev)
        dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
    else:
        dq, dk, dv = out
    dbeta = torch.empty(B, T, HV, dtype=beta.dtype, device=dev)
    dg = torch.empty(B, T, HV, dtype=g_dtype or g_cum.dtype, device=dev)
    if NT == 0 or H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dbeta.zero_(), dg.zero_()
    if do.stride(-1) != 1:
        do = do.contiguous()
    l2 = bool(use_qk_l2norm_in_kernel)
    if l2 and rq is None:
        rq, rk = l2_rnorm(q), l2_rnorm(k)
    acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    g_cum = g_cum.contiguous()
    BK = max(16, next_pow2(K))
    meta = dict(H=H, HV=HV, K=K, C=C, BK=BK, VARLEN=cu_seqlens is not None, L2NORM=l2, ACC=_acc_dtype(q.dtype))
    cfg = tuning.chunk_bwd(dev)
    beta = beta.contiguous()
    ainv = ainv.contiguous()
    if cfg.parts_sm90 and hopper_parts.supported(q, k, v, do, v_new, dvn, ainv, h, gs, K, V) \
            and all(hopper_parts.token_rows_ok(x) for x in (dq, dk, dv)):
        # the kernel finishes dq, dk itself (no q/k kernel; with GVA through slots it allocates)
        hopper_parts.launch_parts(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, rq, rk, dq, dk, dv, dbeta, dg,
                                  cu_seqlens, ci.chunk_indices, NT, scale, use_l2=l2)
        return dq, dk, dv, dbeta, dg
    if out is not None:   # the portable kernels write contiguous [B*T, heads, D] rows
        res = chunk_bwd_main(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, scale, cu_seqlens, chunk_size,
                             use_qk_l2norm_in_kernel, g_dtype=g_dtype, chunk_index=ci, rq=rq, rk=rk)
        for o, r in zip(out, res):
            o.copy_(r)
        return (*out, *res[3:])
    dq_v, dk_v = _qk_scratch(B, T, HV, K, v_new.dtype, acc_t, dev)
    dg_part = torch.empty(4, B, T, HV, dtype=acc_t, device=dev)
    mm = dict(V=V, BV=_v_tile(V, dev), MM=_mm_dtype(v_new.dtype), PREC=_dot_precision(v_new.dtype, dev))
    nw, ns = int(cfg.a_warps), int(cfg.a_stages)
    launch(chunk_bwd_out_kernel, (NT, HV, 2),
        q, k, g_cum, v_new, do, h, gs, rq, rk, dq_v, dk_v, dg_part, beta, ainv, dvn, cu_seqlens,
        ci.chunk_indices, float(scale), T, B * T * HV, *_strides(q), *_strides(k), *_strides(do),
        num_warps=nw, num_stages=ns, **meta, **mm)
    nw, ns = int(cfg.b_warps), int(cfg.b_stages)
    launch(chunk_bwd_wy_kernel, (NT, HV),
        k, v, g_cum, beta, ainv, v_new, dvn, rk, dv, dbeta, dg, dk_v, dg_part,
        cu_seqlens, ci.chunk_indices, T, B * T * HV, *_strides(k), *_strides(v), num_warps=nw, num_stages=ns,
        **meta, **mm)
    launch(chunk_bwd_qk_kernel, (NT, H),
        q, k, rq, rk, dq_v, dk_v, dq, dk, cu_seqlens, ci.chunk_indices, float(scale), T, *_strides(q),
        *_strides(k), num_warps=4, **meta)
    return dq, dk, dv, dbeta, dg


__all__ = ["chunk_bwd_main"]
