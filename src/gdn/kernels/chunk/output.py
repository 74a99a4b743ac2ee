"""Output kernel of the chunked forward.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import tuning
from ..common import cdiv, l2_rnorm, value_heads_per_program
from .common import (CHUNK_SIZE, _TL, _check_chunk_size, _cu_arg, _dot, _dot_dtype, _empty, _launch, _pow2, _rn,
                     _seq_span, _strides3)
from .plan import ChunkIndex, get_chunk_index


@triton.jit(do_not_specialize=["T", "P0"])
def _chunk_output_kernel(
    q, k, vnew, h, gcum, rq_in, rk_in, o, chunk_indices, chunk_offsets, cu_seqlens, seq_idx, T, P0, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HPP: tl.constexpr,
    USE_L2: tl.constexpr, RQ_INLINE: tl.constexpr, RQ_PIECE: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_IDX: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """o[chunk, V tile] = scale * (diag(exp(g) r_q) (q @ h) + ((q k^T) * r_q r_k^T * Gamma, causal) @ v_new), with
    the K dimension in BK tiles; the L2 row scalings r_q, r_k come from ``rq_in`` / ``rk_in`` [B, T, H] fp32 and are
    applied after the products. RQ_INLINE (one K tile, BK >= K): r_q = rsqrt(sum q^2 + 1e-6) is computed here from
    the q tile instead (as :func:`l2_rnorm` does; no separate launch). One program handles HPP consecutive value
    heads (HPP divides HV / H, so they share one q/k head): q k^T is computed once for them."""
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_g = tl.program_id(2)
    n = tl.load(chunk_indices + 2 * i_t)
    c = tl.load(chunk_indices + 2 * i_t + 1)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    i_h = (i_g * HPP) // (HV // H)
    tok0 = i_b * T
    t0 = bos + c.to(tl.int64) * 64
    to = tl.arange(0, 64)
    rows = t0 + to
    m = rows < eos
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < V
    m_o = m[:, None] & mv[None, :]
    valid = n >= 0
    if HAS_IDX:
        idx = tl.load(seq_idx + n)
        valid = (idx >= 0) & (idx < P0)
    o_base = o + i_b * s_ob + rows[:, None] * s_ot + ov[None, :]
    if valid:
        q_base = q + i_b * s_qb + i_h * s_qh + rows[:, None] * s_qt
        k_base = k + i_b * s_kb + i_h * s_kh + rows[:, None] * s_kt
        h_chunk = (tl.load(chunk_offsets + n).to(tl.int64) + c) * HV
        if RQ_INLINE:   # sum of squares of q's rows, in RQ_PIECE-column pieces (few registers; L1 hits later)
            ssq = tl.zeros([64], tl.float32)
            for p0 in tl.static_range(0, BK, RQ_PIECE):
                op = p0 + tl.arange(0, RQ_PIECE)
                qf = tl.load(q_base + op[None, :], mask=m[:, None] & (op < K)[None, :], other=0.0).to(tl.float32)
                ssq += tl.sum(qf * qf, axis=1)
        # first K tile of q kept for every value head of the program (the only one when BK >= K)
        ok0 = tl.arange(0, BK)
        m_q0 = m[:, None] & (ok0 < K)[None, :]
        q0 = _rn(tl.load(q_base + ok0[None, :], mask=m_q0, other=0.0), DT)
        qk = _dot(q0, tl.trans(_rn(tl.load(k_base + ok0[None, :], mask=m_q0, other=0.0), DT)), PREC)
        for i_k in range(1, tl.cdiv(K, BK)):
            ok = i_k * BK + tl.arange(0, BK)
            mk = ok < K
            b_q = _rn(tl.load(q_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            b_k = _rn(tl.load(k_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            qk += _dot(b_q, tl.trans(b_k), PREC)
        if USE_L2:
            if RQ_INLINE:
                rq = tl.where(m, tl.rsqrt(ssq + 1e-6), 0.0) * scale
            else:
                rq = tl.load(rq_in + (tok0 + rows) * H + i_h, mask=m, other=0.0) * scale
            rk = tl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        else:
            rq = tl.full([64], 1.0, tl.float32) * scale
            rk = tl.full([64], 1.0, tl.float32)
        qk = qk * rq[:, None] * rk[None, :]
        causal = (to[:, None] >= to[None, :]) & m[:, None]
        for j in tl.static_range(HPP):
            i_hv = i_g * HPP + j
            h_base = h + (h_chunk + i_hv) * (K * V) + ov[None, :]
            acc = _dot(q0, _rn(tl.load(h_base + ok0[:, None] * V, mask=(ok0 < K)[:, None] & mv[None, :], other=0.0),
                               DT), PREC)
            for i_k in range(1, tl.cdiv(K, BK)):
                ok = i_k * BK + tl.arange(0, BK)
                mk = ok < K
                b_q = _rn(tl.load(q_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
                b_h = _rn(tl.load(h_base + ok[:, None] * V, mask=mk[:, None] & mv[None, :], other=0.0), DT)
                acc += _dot(b_q, b_h, PREC)
            trow = (tok0 + rows) * HV + i_hv
            b_g = tl.load(gcum + trow, mask=m, other=0.0)
            # inter-chunk part: (scale * exp(g) * q_hat) @ h
            acc = acc * (rq * tl.exp(b_g))[:, None]
            # intra-chunk part: ((q_hat k_hat^T) * Gamma, causal) @ v_new
            d = tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)
            att = tl.where(causal, qk * tl.exp(d), 0.0)
            b_vn = _rn(tl.load(vnew + trow[:, None] * V + ov[None, :], mask=m_o, other=0.0), DT)
            acc += _dot(_rn(att, DT), b_vn, PREC)
            tl.store(o_base + i_hv * s_oh, _rn(acc, o.dtype.element_ty), mask=m_o)
    else:
        for j in tl.static_range(HPP):
            tl.store(o_base + (i_g * HPP + j) * s_oh, _rn(tl.zeros([64, BV], tl.float32), o.dtype.element_ty),
                     mask=m_o)


def _output_heads(H: int, HV: int, device=None) -> int:
    """Value heads per output program: the ``chunk_fwd.output_heads`` field (1, or 0 = every value head of a q/k
    head)."""
    return value_heads_per_program(H, HV, int(tuning.chunk_fwd(device).output_heads), "chunk_fwd.output_heads")


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, g_cum: torch.Tensor,
                 scale: float, cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                 use_qk_l2norm_in_kernel: bool = False, *, out_dtype: Optional[torch.dtype] = None,
                 state_indices: Optional[torch.Tensor] = None, pool_size: int = 0,
                 chunk_index: Optional[ChunkIndex] = None, rq: Optional[torch.Tensor] = None,
                 rk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """o = scale * ((exp(g_cum) q_hat) @ h + ((q_hat k_hat^T) * Gamma, causal) @ v_new), [B, T, HV, V].

    q, k [B, T, H, K] raw (strided ok); v_new [B, T, HV, V]; h [NT, HV, K, V] (start state of every chunk);
    g_cum [B, T, HV] fp32. ``rq`` / ``rk``: the L2 row scalings of q / k (fp32 [B, T, H]); a missing ``rq`` is
    computed inside the kernel when one K tile covers K, else by :func:`l2_rnorm`. With ``state_indices`` ([N], pool
    of ``pool_size`` rows), sequences whose index is negative / out of range get zeros.
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    dev = q.device
    cfg = tuning.chunk_fwd(dev)
    ci = get_chunk_index(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    o = _empty(B, T, HV, V, device=dev, dtype=out_dtype or v_new.dtype)
    if ci.NT == 0 or HV == 0:
        return o
    dt = _dot_dtype(q, k, v_new)
    BV = min(int(cfg.output_BV), _pow2(V))
    while BV > 32 and _pow2(K) * BV * dt.itemsize > 64 * 1024:
        BV //= 2   # the h tile [K, BV] and the q / k tiles stay within shared memory (fp32 operands, K = 256)
    l2 = bool(use_qk_l2norm_in_kernel)
    BK = min(int(cfg.output_BK), _pow2(K))
    rq_inline = l2 and rq is None and BK >= K
    if l2:
        rq = g_cum if rq_inline else (l2_rnorm(q) if rq is None else rq)
        rk = l2_rnorm(k) if rk is None else rk
    else:
        rq = rk = g_cum
    hpp = _output_heads(H, HV, dev)
    _launch(_chunk_output_kernel, (cdiv(V, BV), ci.NT, HV // hpp),
        q, k, v_new, h, g_cum, rq, rk, o, ci.chunk_indices, ci.chunk_offsets, _cu_arg(cu_seqlens, ci.chunk_offsets),
        state_indices if state_indices is not None else ci.chunk_offsets, T, pool_size, float(scale),
        *_strides3(q), *_strides3(k), *_strides3(o),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, HPP=hpp,
        USE_L2=l2, RQ_INLINE=rq_inline, RQ_PIECE=min(32, BK), IS_VARLEN=ci.is_varlen,
        HAS_IDX=state_indices is not None,
        DT=_TL[dt], PREC=cfg.fp32_dot_precision,
        num_warps=int(cfg.output_warps), num_stages=int(cfg.output_stages),
        maxnreg=cfg.output_maxnreg,
    )
    return o
