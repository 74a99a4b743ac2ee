r"""Backward pass of the chunked gated delta rule (Triton).

Notation (one sequence, one value head, one chunk of C tokens; rows are tokens)
------------------------------------------------------------------------------
``Q = scale * qn``, ``K = kn`` (``qn``/``kn`` = q/k after the optional in-kernel L2 norm), ``V``, ``b`` = beta,
``c`` = chunk-local cumulative log-gate (``c_r = g_1 + ... + g_r``), ``cL`` = ``c`` at the chunk's last position
(padding tokens of a partial chunk have g = 0, so ``cL = c_{C-1}``), ``H`` = state entering the chunk ``[K, V]``,
``Gm = dL/dH_next`` (gradient of the state leaving the chunk). Masks: ``Mc`` causal (i >= j), ``SL`` strictly lower.
``Gam_ij = exp(c_i - c_j)`` on ``Mc`` (0 elsewhere; every exponent used anywhere is of a non-positive difference).

Forward (recomputed, see ``gdn.reference.chunk_gated_delta_rule_ref``)::

    A    = SL * diag(b) (Gam * K K^T)          Ainv = (I + A)^-1
    Kb   = diag(b e^c) K,  Vb = diag(b) V,     W = Ainv Kb,  U = Ainv Vb
    Vn   = U - W H                              (= Ainv X  with  X = Vb - Kb H)
    O    = diag(e^c) Q H + (Q K^T * Gam) Vn
    Hnext= e^cL H + (diag(e^(cL - c)) K)^T Vn

Backward, derived by hand and checked piece by piece against float64 autograd
(``tests/ops/test_chunk_bwd.py::test_math_prototype`` runs this exact algebra in torch):

1. Reverse pass over chunks (sequential, state gradients in fp32; ``chunk_bwd_dh_kernel``)::

       dVn  = (K Q^T * Gam^T) dO + diag(e^(cL - c)) K Gm          ("dv_local" + state part)
       dH   = e^cL Gm + (diag(e^c) Q)^T dO - W^T dVn              (Gm of the previous chunk)

   It stores ``Gm`` of every chunk and ``dVn``; the final ``dH`` is ``dh0``. It needs no forward state, so on
   CUDA it runs on a side stream concurrently with the recomputation of the forward states H.

2. Per chunk, fully parallel (``chunk_bwd_main_kernel``), with P-terms written without any transposed
   register tensor::

       dPm  = (dO Vn^T) * Gam            dPmT = (Vn dO^T) * Gam^T          (both from loaded tiles)
       dQ   = diag(e^c) dO H^T + dPm K                                      (grad of scale*qn)
       dKs  = diag(e^(cL - c)) Vn Gm^T   dK = dPmT Q + dKs + (WY terms below)
       dc_i = Q_i.dQ_i - K_i.(dPmT Q + dKs)_i                               (gate terms of attention/state)
       dcL  = e^cL <H, Gm> + sum(K * dKs)                                   (added at the last position)

   WY / UT-transform backward. Because ``Vn = Ainv X`` the adjoints collapse to (``dU = dVn``,
   ``dW = -dVn H^T``)::

       dVb  = Ainv^T dVn                 dV = diag(b) dVb,   db += rowsum(dVb * V)
       dKb  = Ainv^T dW = -dVb H^T       dK += diag(b e^c) dKb,  db += e^c rowsum(dKb*K),  dc += b e^c rowsum(dKb*K)
       dA   = -Ainv^T dAinv Ainv^T = -dVb Vn^T    (dAinv = dVn X^T)
       dA^T = -Vn dVbT,  dVbT = dVn^T Ainv          (computed, not transposed)
       M    = SL * dA * diag(b) Gam,   M^T likewise from dA^T
       dK  += (M + M^T) K,  db += rowsum(SL * dA * Gam * K K^T),  dc += rowsum(dA*A) - colsum(dA*A)

   then ``dg`` = reverse cumulative sum of ``dc`` inside the chunk, ``dq = scale * dQ`` and, with the in-kernel L2
   norm, ``dx = r (dy - y (y.dy))`` (``y = x r``, ``r = rsqrt(|x|^2 + 1e-6)``).

Kernels (bwd), after the forward kept Ainv, the gate cumsum and the L2 scalings (only W / U are recomputed, then the
forward states H and v_new on a side stream, concurrently with 1-2):

1. ``chunk_bwd_dv_local_kernel`` (parallel, chunk x value head): ``dv_local = (K Q^T * Gam^T) dO`` into ``dvn``.
2. ``chunk_bwd_dh_kernel`` (sequential in chunks; sequences x value heads x V blocks, long sequences in segments
   with ``chunk_bwd_dh_merge_kernel``): adds the state term to ``dvn`` and stores ``Gm`` per chunk.
3. ``chunk_bwd_out_kernel`` (parallel, chunk x value head x side): side 0 dQ per value head, side 1 dK per value
   head (state, attention and WY-through-H terms on one accumulator); both over V tiles.
4. ``chunk_bwd_wy_kernel`` (parallel, chunk x value head): dv, dbeta, dg and the remaining dK terms, over V tiles.
5. ``chunk_bwd_qk_kernel`` (parallel, chunk x q/k head): the GVA sum over value heads (deterministic, no atomics)
   and the L2-norm backward.

Every register tile is fp32 (fp64 for fp64 inputs); tl.dot takes operands in the input dtype (bf16/fp16) with fp32
accumulation. No program holds more than two [C, K]-or-larger accumulators, so at 4 warps nothing spills beyond
~0.3 KB/thread on sm_90 (``bench/aot_regs.py``).

Hopper / Triton 3.4-3.7.0 (fla-org/flash-linear-attention#640, #984): the miscompiles reported there are
``tl.dot(tl.trans(x), y)`` where ``x`` is itself the (converted) result of a ``tl.dot`` (the wgmma accumulator
layout transposed into a ``#linear`` layout, BK=64 tiling), and a large fused WY-backward kernel with BT=64 at
num_warps=4. These kernels never call ``tl.trans`` on anything but a freshly loaded tile (a shared-memory view, the
FlashAttention idiom); every transposed product of computed tensors (dPm^T, dA^T) is obtained as its own dot of
loaded operands instead. The parallel kernels use no K tiling (BK = K). On an H200 with Triton 3.6 every gradient
passes ``gdn check`` against float64 (42/42).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import l2_rnorm, value_heads_per_program

L2_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """The C token rows of global chunk i_t: (batch row of strided inputs, flat token index [C] for contiguous
    [B*T, ...] tensors, token index inside the batch row [C] (both int64), row mask [C], valid rows n_valid)."""
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        L = (eos - bos).to(tl.int32)
        row = tl.zeros([], dtype=tl.int64)
        tok0 = bos
    else:
        NTs = tl.cdiv(T, C)
        i_n = (i_t // NTs).to(tl.int64)
        i_c = i_t % NTs
        bos = tl.zeros([], dtype=tl.int64)
        L = T
        row = i_n
        tok0 = i_n * T
    t = i_c * C + tl.arange(0, C)
    return row, tok0 + t, (bos + t).to(tl.int64), t < L, tl.minimum(L - i_c * C, C)


@triton.jit
def _chunk_gates(gcum, tok, i_hv, m_t, n_valid, HV: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr):
    """(chunk-local cumulative gates c [C], c at the last valid row cL); padding rows of a partial chunk carry cL."""
    b_gc = tl.load(gcum + tok * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    b_gl = tl.sum(tl.where(tl.arange(0, C) == n_valid - 1, b_gc, 0.0), axis=0)
    return tl.where(m_t, b_gc, b_gl), b_gl


@triton.jit
def chunk_bwd_dh_kernel(
    q, k, w, gcum, do, rq, rk, x0, xend, gs, dvn, segments, chunk_offsets, cu_seqlens,
    scale, T,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, VC: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, INIT: tl.constexpr, HAS_R: tl.constexpr,
    STORE_STEPS: tl.constexpr, STORE_END: tl.constexpr, END_BY_SEG: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse pass over the chunks ``[c_beg, c_end)`` of one segment (row of ``segments`` = (sequence, c_beg,
    c_end); a whole sequence when unsegmented) for one value head and one column block of the state gradient.

    Per chunk (last to first): ``dVn = dv_local + Kdec G`` (dv_local read from ``dvn``, where
    ``chunk_bwd_dv_local_kernel`` put it) and ``G <- e^cL G + Qdec^T dO - W^T dVn``.
    INIT: 0 zeros, 1 ``x0[sequence]`` (dht), 2 ``x0[segment]``, 3 identity (VC = K: the segment's K x K transition,
    then HAS_R is False: no dO terms). STORE_STEPS: ``gs[chunk]`` <- G leaving the chunk, ``dvn`` <- dVn.
    STORE_END: ``xend[segment if END_BY_SEG else sequence]`` <- G entering the first chunk (dh0 when unsegmented).
    The k, q^T, w^T tiles are pure dot operands (the L2-norm factors rq/rk are precomputed vectors applied to rows or
    columns of the small side), so the pipeliner can copy them asynchronously into shared memory.
    """
    DT = w.dtype.element_ty
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_s = tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n = tl.load(segments + 3 * i_s).to(tl.int64)
    c_beg = tl.load(segments + 3 * i_s + 1)
    c_end = tl.load(segments + 3 * i_s + 2)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        L = (eos - bos).to(tl.int32)
        row = tl.zeros([], dtype=tl.int64)
        tok0 = bos
    else:
        bos = tl.zeros([], dtype=tl.int64)
        L = T
        row = i_n
        tok0 = i_n * T
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < VC
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * VC + o_v[None, :]

    if INIT == 3:
        b_dh = tl.where((o_k[:, None] == o_v[None, :]) & m_s, 1.0, 0.0).to(ACC)
    else:
        b_dh = tl.zeros([BK, BV], dtype=ACC)
    if INIT == 1:
        b_dh += tl.load(x0 + (i_n * HV + i_hv) * K * VC + o_s, mask=m_s, other=0.0).to(ACC)
    if INIT == 2:
        b_dh += tl.load(x0 + (i_s.to(tl.int64) * HV + i_hv) * K * VC + o_s, mask=m_s, other=0.0).to(ACC)

    for it in range(0, c_end - c_beg):
        i_t = c_end - 1 - it
        t = i_t * C + o_c
        m_t = t < L
        n_last = tl.minimum(L - i_t * C, C) - 1
        tok = tok0 + t                       # flat token index (int64) for contiguous [B*T, ...] tensors
        st = (bos + t).to(tl.int64)          # token index inside batch row ``row`` for strided q/k/do
        if STORE_STEPS:
            tl.store(gs + ((c0 + i_t) * HV + i_hv) * K * VC + o_s, b_dh.to(gs.dtype.element_ty), mask=m_s)

        b_gc = tl.load(gcum + tok * HV + i_hv, mask=m_t, other=0.0).to(ACC)
        b_gl = tl.sum(tl.where(o_c == n_last, b_gc, 0.0), axis=0)
        b_gc = tl.where(m_t, b_gc, b_gl)    # padding rows of a partial chunk carry the last cumulative gate

        b_k = tl.load(k + row * s_kb + st[:, None] * s_kt + i_h * s_kh + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_wt = tl.load(w + (tok[None, :] * HV + i_hv) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                       other=0.0)                                              # w^T [BK, C], loaded transposed
        b_fk = tl.exp(b_gl - b_gc)                                             # k_i -> e^(cL - c_i) kn_i
        if L2NORM:
            b_rk = tl.load(rk + (tok0 + t) * H + i_h, mask=m_t, other=0.0)
            b_fk = b_fk * b_rk
        b_dv = tl.dot(b_k.to(MM), b_dh.to(DT).to(MM), input_precision=PREC, out_dtype=ACC) * b_fk[:, None]
        if HAS_R:
            b_qt = tl.load(q + row * s_qb + st[None, :] * s_qt + i_h * s_qh + o_k[:, None],
                           mask=m_k[:, None] & m_t[None, :], other=0.0)           # q^T [BK, C], loaded transposed
            b_fq = tl.exp(b_gc) * scale                                        # q_j -> scale e^(c_j) qn_j
            if L2NORM:
                b_fq = b_fq * tl.load(rq + (tok0 + t) * H + i_h, mask=m_t, other=0.0)
            b_do = tl.load(do + row * s_ob + st[:, None] * s_ot + i_hv * s_oh + o_v[None, :],
                           mask=m_t[:, None] & m_v[None, :], other=0.0)
            # + dv_local = (K Q^T * Gam^T) dO, written into dvn beforehand by chunk_bwd_dv_local_kernel
            b_dv += tl.load(dvn + (tok[:, None] * HV + i_hv) * VC + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                            other=0.0).to(ACC)
        if STORE_STEPS:
            tl.store(dvn + (tok[:, None] * HV + i_hv) * VC + o_v[None, :], b_dv.to(dvn.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
        b_ndv = (-b_dv).to(DT)
        b_dh = b_dh * tl.exp(b_gl)
        if HAS_R:
            b_dod = (b_do.to(ACC) * b_fq[:, None]).to(DT).to(MM)                 # (diag(f) Q)^T dO = Q^T (f dO)
            b_dh = tl.dot(b_qt.to(MM), b_dod, b_dh, input_precision=PREC, out_dtype=ACC)
        b_dh = tl.dot(b_wt.to(MM), b_ndv.to(MM), b_dh, input_precision=PREC, out_dtype=ACC)

    if STORE_END:
        if END_BY_SEG:
            tl.store(xend + (i_s.to(tl.int64) * HV + i_hv) * K * VC + o_s, b_dh.to(xend.dtype.element_ty), mask=m_s)
        else:
            tl.store(xend + (i_n * HV + i_hv) * K * VC + o_s, b_dh.to(xend.dtype.element_ty), mask=m_s)


@triton.jit
def chunk_bwd_dv_local_kernel(
    q, k, gcum, do, rq, rk, dvl, cu_seqlens, chunk_indices, scale, T,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HPP: tl.constexpr,
    VARLEN: tl.constexpr, L2NORM: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, PREC: tl.constexpr,
):
    """One chunk x HPP value heads (of one q/k head), parallel: ``dv_local = (K Q^T * Gam^T) dO`` ([C, V], the
    gradient of v_new through the intra-chunk attention), written to ``dvl`` (the reverse pass adds its state term in
    place). ``(K Q^T)_ij = scale r_k,i r_q,j k_i.q_j exp(c_j - c_i)`` for j >= i, else 0; the raw K Q^T once for the
    program's value heads, their gates per head, all V tiles."""
    DT = dvl.dtype.element_ty
    i_t = tl.program_id(0)
    i_g = tl.program_id(1)
    i_h = (i_g * HPP) // (HV // H)
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
    for j in tl.static_range(HPP):
        i_hv = i_g * HPP + j
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


@triton.jit
def chunk_bwd_dh_merge_kernel(
    dht, dh0, trans, rloc, xin, seg_offsets,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, PREC: tl.constexpr,
):
    """Segmented reverse pass, step 3 (sequential over the segments of one sequence, last to first):
    ``xin[s]`` <- X (gradient of the state leaving segment s), ``X <- P_s X + R_s``; finally ``dh0`` <- X."""
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_n = tl.program_id(2).to(tl.int64)
    s_beg = tl.load(seg_offsets + i_n)
    s_end = tl.load(seg_offsets + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_s = m_k[:, None] & (o_v < V)[None, :]
    o_s = o_k[:, None] * V + o_v[None, :]
    o_p = o_k[:, None] * K + o_k[None, :]
    m_p = m_k[:, None] & m_k[None, :]
    b_x = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_x += tl.load(dht + (i_n * HV + i_hv) * K * V + o_s, mask=m_s, other=0.0).to(tl.float32)
    for it in range(0, s_end - s_beg):
        i_s = (s_end - 1 - it).to(tl.int64)
        tl.store(xin + (i_s * HV + i_hv) * K * V + o_s, b_x, mask=m_s)
        b_p = tl.load(trans + (i_s * HV + i_hv) * K * K + o_p, mask=m_p, other=0.0)
        b_r = tl.load(rloc + (i_s * HV + i_hv) * K * V + o_s, mask=m_s, other=0.0)
        b_x = tl.dot(b_p, b_x, input_precision=PREC) + b_r
    if HAS_DH0:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + o_s, b_x.to(dh0.dtype.element_ty), mask=m_s)


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


# ----------------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _mm_dtype(dtype: torch.dtype):
    """tl.dot operand dtype: the input dtype, except that Triton's CPU interpreter (3.6) computes bf16 dots wrongly,
    so there the operands are rounded to bf16 and then multiplied in fp32."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision for fp32/fp64 operands (bf16/fp16 operands ignore it)."""
    if dtype == torch.float32:
        return os.environ.get("GDN_FP32_DOT", "ieee")
    return "ieee"


def _strides(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)


def chunk_tables(B: int, T: int, cu_seqlens: Optional[torch.Tensor], C: int, device):
    """Chunk bookkeeping (``gdn.kernels.chunk_fwd.ChunkIndex``: N, NT, nchunks, chunk_indices [NT, 2] = (sequence,
    chunk in sequence), chunk_offsets [N + 1]); reads ``cu_seqlens`` on the host once."""
    from .chunk_fwd import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, T, C, B, device=device)


def _cfg(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _dh_config(V: int, n_prog: int, device):
    """(BV, warps, stages) of the reverse pass (env GDN_BWD_DH_BV / _WARPS / _STAGES). BV 64, 1 stage: with dv_local
    out of the loop this compiles without spills on sm_90 and was fastest on an H200 (1x32768 16/32: 1.86 ms for the
    three segmented passes vs 3.29 ms at BV 32 / 2 stages; BV 32 at 1 stage failed there)."""
    bv = _cfg("GDN_BWD_DH_BV", 0)
    if bv <= 0:
        bv = min(64, max(16, triton.next_power_of_2(V)))
    return bv, _cfg("GDN_BWD_DH_WARPS", 4), _cfg("GDN_BWD_DH_STAGES", 1)


def _dv_local_heads(H: int, HV: int) -> int:
    """Value heads per dv_local program (env GDN_BWD_DVL_HEADS: 1 (default) or 0 = every value head of a q/k head):
    they share q, k and the raw K Q^T."""
    return value_heads_per_program(H, HV, _cfg("GDN_BWD_DVL_HEADS", 1), "GDN_BWD_DVL_HEADS")


def _v_tile(V: int) -> int:
    """V tile of the parallel backward kernels (dv_local, parts A and B; env GDN_BWD_BV, default 64)."""
    return min(_cfg("GDN_BWD_BV", 64), max(16, triton.next_power_of_2(V)))


def _main_config(part: str):
    """(num_warps, num_stages) of parallel kernel A / B (env GDN_BWD_{A,B}_WARPS / _STAGES). 4 warps: the chained
    M = 64 dots get one warpgroup (Triton puts all warps along M for chained dots, 8 warps would duplicate)."""
    return _cfg(f"GDN_BWD_{part}_WARPS", 4), _cfg(f"GDN_BWD_{part}_STAGES", 2)


def _segment_len(N: int, nchunks, HV: int, nv: int, device, force: Optional[int]) -> Optional[int]:
    """Chunks per segment of the segmented reverse pass, or None for the plain sequential pass.

    ``force`` (or env ``GDN_BWD_SEGMENT``): -1 never, n > 0 segments of n chunks. Heuristic (CUDA only): segment
    when fewer programs than SMs would run the plain pass and a sequence has >= 16 chunks, aiming at 2 programs per
    SM and >= 8 chunks per segment."""
    env = os.environ.get("GDN_BWD_SEGMENT", "").strip()
    if force is None and env:
        force = int(env)
    if force is not None and force != 0:
        return None if force < 0 else int(force)
    if device.type != "cuda" or not nchunks:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    longest = max(nchunks)
    if N * HV * nv >= sms or longest < 16:
        return None
    seg = max(8, -(-sum(nchunks) * HV * nv // (2 * sms)))
    return None if seg >= longest else seg


def _plan_segments(nchunks, seg_len: Optional[int], device):
    rows, offs = [], [0]
    for n, nc in enumerate(nchunks):
        if seg_len is None or nc <= seg_len:
            rows.append((n, 0, nc))
        else:
            rows += [(n, c, min(nc, c + seg_len)) for c in range(0, nc, seg_len)]
        offs.append(len(rows))
    segs = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device)
    return len(rows), segs, torch.tensor(offs, dtype=torch.int32).to(device)


def chunk_bwd_dh(q, k, w, g_cum, do, dht, scale, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel, need_dh0,
                 state_dtype=None, chunk_index=None, segment_chunks: Optional[int] = None, rq=None, rk=None):
    """Reverse state-gradient pass (kernel 1 of the backward).

    q, k [B, T, H, K] raw (strided ok), w [B, T, HV, K] (forward's w, its dtype is the dot operand dtype),
    g_cum [B, T, HV] chunk-local cumsum, do [B, T, HV, V], dht None or [N, HV, K, V].
    Returns ``(gs [NT, HV, K, V] (gradient of the state leaving each chunk, ``state_dtype``, default w's dtype),
    dvn [B, T, HV, V] (dL/dv_new, w's dtype), dh0 [N, HV, K, V] fp32 or None)``.
    ``segment_chunks``: None heuristic, -1 never, n > 0 split every sequence into segments of n chunks that run in
    parallel (local pass + K x K transitions, a short sequential merge, then the final pass).
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    C = int(chunk_size)
    dev = q.device
    ci = chunk_index if chunk_index is not None else chunk_tables(B, T, cu_seqlens, C, dev)
    sdt = state_dtype or w.dtype
    acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    gs = torch.empty(ci.NT, HV, K, V, dtype=sdt, device=dev)
    dvn = torch.empty(B, T, HV, V, dtype=w.dtype, device=dev)
    dh0 = torch.empty(ci.N, HV, K, V, dtype=acc_t, device=dev) if need_dh0 else None
    if ci.N == 0 or HV == 0:
        return gs, dvn, dh0
    if do.stride(-1) != 1:
        do = do.contiguous()
    if dht is not None:
        dht = dht.contiguous()
    g_cum = g_cum.contiguous()
    l2 = bool(use_qk_l2norm_in_kernel)
    if l2 and rq is None:
        rq, rk = l2_rnorm(q), l2_rnorm(k)
    BK = max(16, triton.next_power_of_2(K))
    meta = dict(H=H, HV=HV, K=K, C=C, BK=BK, VARLEN=cu_seqlens is not None, L2NORM=l2, ACC=_acc_dtype(q.dtype),
                MM=_mm_dtype(w.dtype), PREC=_dot_precision(w.dtype))
    args = (cu_seqlens, float(scale), T, *_strides(q), *_strides(k), *_strides(do))
    hpp = _dv_local_heads(H, HV)
    chunk_bwd_dv_local_kernel[(ci.NT, HV // hpp)](
        q, k, g_cum, do, rq, rk, dvn, cu_seqlens, ci.chunk_indices, *args[1:], V=V, BV=_v_tile(V), HPP=hpp,
        num_warps=4, num_stages=2, **meta)
    BV, nw, ns = _dh_config(V, ci.N * HV, dev)
    seg = _segment_len(ci.N, ci.nchunks, HV, triton.cdiv(V, BV), dev, segment_chunks)
    S, segments, seg_offsets = _plan_segments(ci.nchunks, seg, dev)
    common = dict(meta, num_warps=nw, num_stages=ns)
    if seg is None:
        chunk_bwd_dh_kernel[(triton.cdiv(V, BV), HV, S)](
            q, k, w, g_cum, do, rq, rk, dht, dh0, gs, dvn, segments, ci.chunk_offsets, *args,
            VC=V, BV=BV, INIT=1 if dht is not None else 0, HAS_R=True, STORE_STEPS=True, STORE_END=need_dh0,
            END_BY_SEG=False, **common)
        return gs, dvn, dh0
    # segmented: (1) local pass from zero and (2) K x K transition of every segment, in parallel over segments
    rloc = torch.empty(S, HV, K, V, dtype=acc_t, device=dev)
    trans = torch.empty(S, HV, K, K, dtype=acc_t, device=dev)
    xin = torch.empty(S, HV, K, V, dtype=acc_t, device=dev)
    chunk_bwd_dh_kernel[(triton.cdiv(V, BV), HV, S)](
        q, k, w, g_cum, do, rq, rk, None, rloc, gs, dvn, segments, ci.chunk_offsets, *args,
        VC=V, BV=BV, INIT=0, HAS_R=True, STORE_STEPS=False, STORE_END=True, END_BY_SEG=True, **common)
    BVK = min(BV, BK)
    chunk_bwd_dh_kernel[(triton.cdiv(K, BVK), HV, S)](
        q, k, w, g_cum, do, rq, rk, None, trans, gs, dvn, segments, ci.chunk_offsets, *args,
        VC=K, BV=BVK, INIT=3, HAS_R=False, STORE_STEPS=False, STORE_END=True, END_BY_SEG=True, **common)
    # (3) sequential merge over segments (K x K times K x V per segment)
    BVM = min(64, max(16, triton.next_power_of_2(V)))
    chunk_bwd_dh_merge_kernel[(triton.cdiv(V, BVM), HV, ci.N)](
        dht, dh0, trans, rloc, xin, seg_offsets, HV=HV, K=K, V=V, BK=BK, BV=BVM, HAS_DHT=dht is not None,
        HAS_DH0=need_dh0, PREC="ieee" if acc_t == torch.float64 else os.environ.get("GDN_BWD_MERGE_DOT", "tf32x3"),
        num_warps=8)
    # (4) the final pass of every segment from its true end gradient, storing gs and dvn
    chunk_bwd_dh_kernel[(triton.cdiv(V, BV), HV, S)](
        q, k, w, g_cum, do, rq, rk, xin, None, gs, dvn, segments, ci.chunk_offsets, *args,
        VC=V, BV=BV, INIT=2, HAS_R=True, STORE_STEPS=True, STORE_END=False, END_BY_SEG=True, **common)
    return gs, dvn, dh0


def chunk_bwd_main(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, scale, cu_seqlens, chunk_size,
                   use_qk_l2norm_in_kernel, *, g_dtype=None, chunk_index=None, rq=None, rk=None):
    """Parallel per-chunk gradients: kernel A (output/state terms, per value head and side), kernel B (WY terms:
    dv, dbeta, dg, dk terms), then the q/k kernel (GVA sum, L2-norm backward). Returns ``(dq, dk, dv, dbeta, dg)`` in
    the dtypes of q, k, v, beta and ``g_dtype`` (default g_cum's). ``v_new``'s dtype is the dot operand dtype.
    Scratch: dQ per value head [B, T, HV, K] (dot dtype), dK per value head (fp32), four
    dg / dbeta slots [4, B, T, HV] (fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = int(chunk_size)
    dev = q.device
    ci = chunk_index if chunk_index is not None else chunk_tables(B, T, cu_seqlens, C, dev)
    NT = ci.NT
    dq = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    dk = torch.empty(B, T, H, K, dtype=k.dtype, device=dev)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=dev)
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
    dq_v = torch.empty(B, T, HV, K, dtype=v_new.dtype, device=dev)
    dk_v = torch.empty(B, T, HV, K, dtype=acc_t, device=dev)
    dg_part = torch.empty(4, B, T, HV, dtype=acc_t, device=dev)
    g_cum = g_cum.contiguous()
    BK = max(16, triton.next_power_of_2(K))
    meta = dict(H=H, HV=HV, K=K, C=C, BK=BK, VARLEN=cu_seqlens is not None, L2NORM=l2, ACC=_acc_dtype(q.dtype))
    mm = dict(V=V, BV=_v_tile(V), MM=_mm_dtype(v_new.dtype), PREC=_dot_precision(v_new.dtype))
    nw, ns = _main_config("A")
    beta = beta.contiguous()
    ainv = ainv.contiguous()
    chunk_bwd_out_kernel[(NT, HV, 2)](
        q, k, g_cum, v_new, do, h, gs, rq, rk, dq_v, dk_v, dg_part, beta, ainv, dvn, cu_seqlens, ci.chunk_indices,
        float(scale), T, B * T * HV, *_strides(q), *_strides(k), *_strides(do), num_warps=nw, num_stages=ns,
        **meta, **mm)
    nw, ns = _main_config("B")
    chunk_bwd_wy_kernel[(NT, HV)](
        k, v, g_cum, beta, ainv, v_new, dvn, rk, dv, dbeta, dg, dk_v, dg_part,
        cu_seqlens, ci.chunk_indices, T, B * T * HV, *_strides(k), *_strides(v), num_warps=nw, num_stages=ns,
        **meta, **mm)
    chunk_bwd_qk_kernel[(NT, H)](
        q, k, rq, rk, dq_v, dk_v, dq, dk, cu_seqlens, ci.chunk_indices, float(scale), T, *_strides(q),
        *_strides(k), num_warps=4, **meta)
    return dq, dk, dv, dbeta, dg


_SIDE_STREAMS = {}


def _side_stream(device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size,
                               use_qk_l2norm_in_kernel, do, dht, *, g_cum=None, ainv=None, w=None, u=None,
                               h=None, v_new=None, segment_chunks=None, rq=None, rk=None, chunk_index=None):
    """Gradients of ``chunk_gated_delta_rule`` (v_last states). Returns ``(dq, dk, dv, dg, dbeta, dh0)``.

    q, k [B, T, H, K] (strided, last dim contiguous); v [B, T, HV, V]; g, beta [B, T, HV]; initial_state None or
    [N, HV, K, V]; do [B, T, HV, V]; dht None or [N, HV, K, V]. dq/dk are summed over each q/k head's value heads;
    grads come back in the inputs' dtypes; dh0 is fp32 [N, HV, K, V], or None without initial_state.

    Pipeline: W / U from the forward's Ainv (``recompute_w_u``; the whole ``chunk_fwd_prepare`` when ``ainv`` is not
    given) -> the forward state pass (h, v_new; on a side CUDA stream) concurrently with ``chunk_bwd_dh`` (dv_local,
    then the reverse pass; needs only w and g_cum) -> ``chunk_bwd_main`` (parts A and B, the q/k kernel).
    Intermediates saved by the forward can be passed in (``g_cum``, ``ainv``, ``w``, ``u``, ``h``, ``v_new``, ``rq``,
    ``rk``, as returned by gdn.kernels.chunk_fwd) to skip their recomputation.
    ``segment_chunks``: reverse-pass segmentation (None heuristic, -1 off, n chunks per segment).
    ``chunk_index``: the forward's chunk tables (saves reading cu_seqlens on the host again).
    """
    from . import chunk_fwd as F

    B, T, H, K = q.shape
    C = int(chunk_size)
    l2 = bool(use_qk_l2norm_in_kernel)
    dev = q.device
    ci = chunk_index if chunk_index is not None else F.prepare_chunk_indices(cu_seqlens, T, C, B, device=dev)
    need_h = h is None or v_new is None
    if g_cum is None or ainv is None:
        g_cum, ainv, w, u = F.chunk_fwd_prepare(k, v, g, beta, cu_seqlens, C, l2, store_ainv=True, store_wu=True,
                                                chunk_index=ci, ainv_dtype=F._dot_dtype(k, v))
    elif w is None or (need_h and u is None):
        w, u = F.recompute_w_u(k, v, beta, ainv, g_cum, cu_seqlens, C, l2, chunk_index=ci, store_u=need_h)
    h_dtype = h.dtype if h is not None else (torch.float32 if F.CONFIG["h_dtype"] == "fp32" else w.dtype)

    if l2 and (rq is None or rk is None):
        rq, rk = l2_rnorm(q), l2_rnorm(k)

    def state_pass():
        return F.chunk_state_pass(k, w, u, g_cum, initial_state, False, cu_seqlens, C, l2, h_dtype=h_dtype,
                                  chunk_index=ci, rk=rk)[:2]

    concurrent = need_h and dev.type == "cuda" and os.environ.get("GDN_BWD_CONCURRENT", "1") != "0" \
        and not torch.cuda.is_current_stream_capturing()
    if concurrent:
        # the forward states (h, v_new) and the reverse pass are independent: overlap them
        cur = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            h, v_new = state_pass()
    elif need_h:
        h, v_new = state_pass()
    gs, dvn, dh0 = chunk_bwd_dh(q, k, w, g_cum, do, dht, scale, cu_seqlens, C, l2, initial_state is not None,
                                state_dtype=h_dtype, chunk_index=ci, segment_chunks=segment_chunks, rq=rq, rk=rk)
    if concurrent:
        cur.wait_stream(side)
        h.record_stream(cur)
        v_new.record_stream(cur)
    del w, u  # peak memory: not needed by the last kernel
    dq, dk, dv, dbeta, dg = chunk_bwd_main(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, scale, cu_seqlens, C,
                                           l2, g_dtype=g.dtype, chunk_index=ci, rq=rq, rk=rk)
    return dq, dk, dv, dg, dbeta, dh0


__all__ = ["chunk_gated_delta_rule_bwd", "chunk_bwd_dh", "chunk_bwd_main", "chunk_tables", "l2_rnorm"]
