"""Backward step 2: the reverse pass over chunks (sequential), with the long-sequence split and its merge.

Per chunk, last to first (one value head, one column block of the state gradient G = dL/dH_next)::

    1. dVn = dv_local + diag(e^(cL - c) r_k) K G            (stored into dvn, the input of the parallel parts)
    2. G  <- e^cL G + (diag(e^c r_q scale) Q)^T dO - W^T dVn  (G of every chunk stored into gs)

Segmented (few sequences x heads, long sequences): per segment in parallel the local pass from zero and the K x K
transition from the identity (no dO terms); the sequential merge X <- P_s X + R_s (last segment first); then the
pass of every segment from its true end gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...common import cdiv, l2_rnorm, next_pow2
from ... import tuning
from ..plan import (choose_reverse_segment_len, one_wave_segment_len, one_wave_tile, plan_segments,
                    prepare_chunk_indices, segment_count)
from .. import plan as _plan
from .common import _acc_dtype, _dot_precision, _mm_dtype, _strides
from .dv_local import dv_local
from . import hopper
from ...launch import launch


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
def chunk_bwd_dh_merge_kernel(
    dht, dh0, trans, rloc, xin, seg_offsets,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_DH0: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr = 1,
):
    """Segmented reverse pass, step 3 (sequential over the segments of one sequence, last to first):
    ``xin[s]`` <- X (gradient of the state leaving segment s), ``X <- P_s X + R_s``; finally ``dh0`` <- X. X stays in
    registers; the loop is pipelined STAGES deep (step s - 1's P and R loaded while step s computes)."""
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
    for it in tl.range(0, s_end - s_beg, num_stages=STAGES):
        i_s = (s_end - 1 - it).to(tl.int64)
        tl.store(xin + (i_s * HV + i_hv) * K * V + o_s, b_x, mask=m_s)
        b_p = tl.load(trans + (i_s * HV + i_hv) * K * K + o_p, mask=m_p, other=0.0)
        b_r = tl.load(rloc + (i_s * HV + i_hv) * K * V + o_s, mask=m_s, other=0.0)
        b_x = tl.dot(b_p, b_x, input_precision=PREC) + b_r
    if HAS_DH0:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + o_s, b_x.to(dh0.dtype.element_ty), mask=m_s)


def _dh_config(V: int, device):
    """(BV, warps, stages) of the reverse pass (``chunk_bwd.dh_BV`` / ``dh_warps`` / ``dh_stages``). BV 64, 1 stage:
    with dv_local out of the loop this compiles without spills on sm_90 and was fastest on an H200 (1x32768 16/32:
    1.86 ms for the three segmented passes vs 3.29 ms at BV 32 / 2 stages; BV 32 at 1 stage failed there)."""
    cfg = tuning.chunk_bwd(device)
    bv = int(cfg.dh_BV)
    if bv <= 0:
        bv = min(64, max(16, next_pow2(V)))
    return bv, int(cfg.dh_warps), int(cfg.dh_stages)


def chunk_bwd_dh(q, k, w, g_cum, do, dht, scale, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel, need_dh0,
                 state_dtype=None, chunk_index=None, segment_chunks: Optional[int] = None, rq=None, rk=None,
                 plan=None, ainv=None, beta=None):
    """Reverse state-gradient pass (dv_local, then the reverse pass; the unsegmented sm_90 pass computes dv_local
    itself).

    q, k [B, T, H, K] raw (strided ok), w [B, T, HV, K] (forward's w, its dtype is the dot operand dtype),
    g_cum [B, T, HV] chunk-local cumsum, do [B, T, HV, V], dht None or [N, HV, K, V].
    Returns ``(gs [NT, HV, K, V] (gradient of the state leaving each chunk, ``state_dtype``, default w's dtype),
    dvn [B, T, HV, V] (dL/dv_new, w's dtype), dh0 [N, HV, K, V] fp32 or None)``.
    ``segment_chunks``: None heuristic, -1 never, n > 0 split every sequence into segments of n chunks that run in
    parallel (local pass + K x K transitions, a short sequential merge, then the final pass).
    ``plan``: :func:`reverse_plan` of these arguments when the caller has it already.
    ``w`` None: W is formed inside the sm_90 pass from ``ainv`` [B, T, HV, 64] and ``beta`` [B, T, HV] (both
    contiguous; only where the plan runs the unsegmented pass at V tile 128: :func:`w_in_pass`).
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    C = int(chunk_size)
    dev = q.device
    ci = chunk_index if chunk_index is not None else prepare_chunk_indices(cu_seqlens, T, C, B, device=dev)
    wdt = w.dtype if w is not None else ainv.dtype
    sdt = state_dtype or wdt
    acc_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    gs = torch.empty(ci.NT, HV, K, V, dtype=sdt, device=dev)
    dvn = torch.empty(B, T, HV, V, dtype=wdt, device=dev)
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
    BK = max(16, next_pow2(K))
    meta = dict(H=H, HV=HV, K=K, C=C, BK=BK, VARLEN=cu_seqlens is not None, L2NORM=l2, ACC=_acc_dtype(q.dtype),
                MM=_mm_dtype(wdt), PREC=_dot_precision(wdt, dev))
    args = (cu_seqlens, float(scale), T, *_strides(q), *_strides(k), *_strides(do))
    BV, nw, ns = _dh_config(V, dev)
    plan = plan if plan is not None else reverse_plan(q, k, do, w, sdt, ci, HV, K, V, dev, segment_chunks)
    seg, sm90 = plan
    # the unsegmented sm_90 pass computes dv_local itself where there are enough sequences x heads
    # (chunk_bwd.dh_sm90_local_min_heads); otherwise its own kernel writes it into dvn first
    cfg = tuning.chunk_bwd(dev)
    local = seg is None and runs_sm90(plan, ci, HV, V) and ci.N * HV >= int(cfg.dh_sm90_local_min_heads)
    if w is None and not (local and sm90(ci.N * HV, V) == 128):
        raise ValueError("chunk_bwd_dh: w=None (W from Ainv) needs the unsegmented sm_90 pass at V tile 128")
    if not local:
        dv_local(q, k, g_cum, do, rq, rk, dvn, ci, cu_seqlens, args[1], T, args[3:], meta)
    segs = plan_segments(ci, seg, dev)
    S, segments, seg_offsets = segs.S, segs.segments, segs.seg_offsets
    common = dict(meta, num_warps=nw, num_stages=ns)
    stages9 = int(cfg.dh_sm90_stages)

    def rev_pass(x0, xend, VC, **flags):
        """One launch of the reverse pass over the S segments (flags as ``chunk_bwd_dh_kernel``'s): the sm_90 pass
        where its grid fits one wave, else the portable kernel."""
        bv9 = sm90(S * HV, VC)
        if bv9:
            hopper.launch_dh_pass((VC // bv9, HV, S), q, k, w if w is not None else ainv, g_cum, do, rq, rk, x0, xend,
                                  gs, dvn, segments, ci.chunk_offsets, cu_seqlens, scale, T, H=H, HV=HV, K=K, V=VC,
                                  BV=bv9, use_l2=l2, local=local, stages=stages9, w_ainv=w is None, beta=beta,
                                  **flags)
            return
        bv = BV if VC == V else min(BV, BK)
        launch(chunk_bwd_dh_kernel, (cdiv(VC, bv), HV, S),
               q, k, w, g_cum, do, rq, rk, x0, xend, gs, dvn, segments, ci.chunk_offsets, *args,
               VC=VC, BV=bv, **flags, **common)

    if seg is None:
        rev_pass(dht, dh0, V, INIT=1 if dht is not None else 0, HAS_R=True, STORE_STEPS=True, STORE_END=need_dh0,
                 END_BY_SEG=False)
        return gs, dvn, dh0
    # segmented: (1) local pass from zero and (2) K x K transition of every segment, in parallel over segments
    rloc = torch.empty(S, HV, K, V, dtype=acc_t, device=dev)
    trans = torch.empty(S, HV, K, K, dtype=acc_t, device=dev)
    xin = torch.empty(S, HV, K, V, dtype=acc_t, device=dev)
    rev_pass(None, rloc, V, INIT=0, HAS_R=True, STORE_STEPS=False, STORE_END=True, END_BY_SEG=True)
    rev_pass(None, trans, K, INIT=3, HAS_R=False, STORE_STEPS=False, STORE_END=True, END_BY_SEG=True)
    # (3) sequential merge over segments (K x K times K x V per segment)
    bcfg = tuning.chunk_bwd(dev)
    BVM = min(int(bcfg.merge_BV), max(16, next_pow2(V)))
    prec = "ieee" if acc_t == torch.float64 else (bcfg.merge_dot_16bit if q.dtype in (torch.bfloat16, torch.float16)
                                                  else bcfg.merge_dot)
    launch(chunk_bwd_dh_merge_kernel, (cdiv(V, BVM), HV, ci.N),
        dht, dh0, trans, rloc, xin, seg_offsets, HV=HV, K=K, V=V, BK=BK, BV=BVM, HAS_DHT=dht is not None,
        HAS_DH0=need_dh0, PREC=prec, STAGES=int(bcfg.merge_stages), num_warps=8)
    # (4) the final pass of every segment from its true end gradient, storing gs and dvn
    rev_pass(xin, None, V, INIT=2, HAS_R=True, STORE_STEPS=True, STORE_END=False, END_BY_SEG=True)
    return gs, dvn, dh0


def reverse_plan(q, k, do, w, state_dtype, ci, HV: int, K: int, V: int, dev, segment_chunks: Optional[int] = None):
    """(chunks per segment or None, ``tile(programs, VC)``) of the reverse pass. ``tile`` gives the V tile (32, then
    64; unsegmented with K = 128 and at least ``dh_sm90_local_min_heads`` sequences x value heads, then 128) of the
    sm_90 pass for a launch of ``programs`` x (VC / tile) CTAs that fits one wave (one CTA per SM: as the forward's
    sm_90 state pass, a chunk step slows down when SMs are shared), or 0 (the portable kernel). Past one wave the
    unsegmented pass takes V tile 128 for up to ``chunk_bwd.dh_sm90_bv128_waves`` waves (it holds a whole SM per CTA
    by its shared memory, so waves do not share SMs).

    Segments: forced ones (``segment_chunks`` / ``chunk_bwd.segment_chunks`` > 0) as asked; where
    :func:`choose_reverse_segment_len` would segment, the cheapest of the plain sm_90 pass and one-wave sm_90
    segments by :func:`_reverse_segments` (H200: 1x65536 2/8 reverse pass 0.86 ms in 17 portable segments, 0.61 in 8
    segments on the sm_90 pass; the plain sm_90 pass, 32 CTAs over 1024 chunks, 1.5 ms)."""
    cfg = tuning.chunk_bwd(dev)
    seg = choose_reverse_segment_len(ci, HV, cdiv(V, _dh_config(V, dev)[0]), dev, segment_chunks)
    if not cfg.dh_sm90 or dev.type != "cuda" or not ci.nchunks or not hopper.supported(q, k, do, w, state_dtype, K, V):
        return seg, _no_tile

    def tile(programs: int, VC: int) -> int:
        return one_wave_tile(programs, VC, dev)

    forced = segment_chunks if segment_chunks is not None else cfg.segment_chunks
    if seg is not None and not forced:
        seg = _reverse_segments(ci, HV, K, V, dev, cfg, tile(ci.N * HV, V), seg)
    waves = int(cfg.dh_sm90_bv128_waves)
    if seg is None and K == 128 and waves > 0 and ci.N * HV >= int(cfg.dh_sm90_local_min_heads):
        # unsegmented, many sequences x heads: the whole V per CTA (two warpgroups, dv_local in the pass) where
        # narrower tiles do not fit one wave, in up to ``waves`` waves
        def wide(programs: int, VC: int) -> int:
            bv = one_wave_tile(programs, VC, dev, tiles=(32, 64, 128))
            if not bv and VC % 128 == 0 and programs * (VC // 128) <= waves * _plan._num_sms(dev):
                bv = 128
            return bv
        return seg, wide
    return seg, tile


def _reverse_segments(ci, HV: int, K: int, V: int, dev, cfg, plain_bv: int, portable_seg: int) -> Optional[int]:
    """:func:`_reverse_segments_uncached`, memoised in the planner's cache (:func:`plan._cached`) per (chunk table,
    heads, sizes, device, tuning row, SM count): its segment counts walk every sequence (~15 us of host time per
    backward on a GPU machine's CPU). The entry holds ci and cfg, so their ids stay theirs while it lives."""
    key = ("reverse_segments", id(ci), HV, K, V, str(dev), id(cfg), plain_bv, portable_seg, _plan._num_sms(dev))
    return _plan._cached(key, lambda: (ci, cfg, _reverse_segments_uncached(ci, HV, K, V, dev, cfg, plain_bv,
                                                                             portable_seg)))[2]


def _reverse_segments_uncached(ci, HV: int, K: int, V: int, dev, cfg, plain_bv: int,
                               portable_seg: int) -> Optional[int]:
    """Chunks per segment of the reverse pass (None: unsegmented) where the heuristic would segment and the sm_90
    pass is available. Candidates, in steps of the plain sm_90 pass at V tile 32: the plain pass (when its grid fits
    one wave, ``plain_bv``), the longest sequence's chunks; and at V tile 32 / 64 the shortest power-of-two
    segments whose three sm_90 passes (local gradients, transitions, the final pass) fit one wave, 3 L steps
    (``dh_sm90_wide_step_cost`` each at tile 64) + ``dh_sm90_merge_cost`` per segment + ``dh_sm90_segment_fixed_cost``
    (three launches more). Segments where they cost below ``dh_sm90_segment_gain`` x the plain pass; without a plain
    candidate the cheapest one-wave segments, else the heuristic's (portable) ones."""
    longest = max(ci.nchunks)
    best = None
    for bv in (32, 64):
        L = 0 if V % bv or K % bv else one_wave_segment_len(ci, HV * (max(V, K) // bv), dev, 8)
        if not L:
            continue
        step = 1.0 if bv == 32 else float(cfg.dh_sm90_wide_step_cost)
        cost = 3 * L * step + float(cfg.dh_sm90_merge_cost) * (-(-longest // L)) + float(cfg.dh_sm90_segment_fixed_cost)
        if best is None or cost < best[0]:
            best = (cost, L)
    if not plain_bv:
        return best[1] if best is not None else portable_seg
    plain = longest * (1.0 if plain_bv == 32 else float(cfg.dh_sm90_wide_step_cost))
    return best[1] if best is not None and best[0] < float(cfg.dh_sm90_segment_gain) * plain else None


def w_in_pass(plan, ci, HV: int, V: int, dev) -> bool:
    """Whether the backward lets the reverse pass form W from Ainv (no W recompute kernel, no W tensor): the plan
    runs the unsegmented sm_90 pass at V tile 128 with dv_local in it, and ``chunk_bwd.dh_sm90_w_from_ainv``."""
    cfg = tuning.chunk_bwd(dev)
    seg, tile = plan
    return bool(cfg.dh_sm90_w_from_ainv) and seg is None and tile(ci.N * HV, V) == 128 \
        and ci.N * HV >= int(cfg.dh_sm90_local_min_heads)


def _no_tile(programs: int, VC: int) -> int:
    return 0


def runs_sm90(plan, ci, HV: int, V: int) -> bool:
    """Whether a :func:`reverse_plan` runs the reverse pass on the sm_90 kernel, unsegmented or in one-wave segments
    (the backward then skips its side stream: two one-CTA-per-SM kernels cannot share the SMs)."""
    seg, tile = plan
    return bool(tile((ci.N if seg is None else segment_count(ci, seg)) * HV, V))


__all__ = ["chunk_bwd_dh", "reverse_plan", "runs_sm90", "w_in_pass"]
