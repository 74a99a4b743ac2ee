"""Long sequences split into segments (forward state pass).

With few sequences x heads the plain state pass leaves most SMs idle. Every sequence is then cut into segments of L
chunks (:func:`gdn.kernels.chunk.plan.choose_segment_len`), and the state pass (:mod:`.state`) runs three times:

1. per segment s, in parallel: the local state H_s from zero with the true v, and the K x K transition P_s (the pass
   from the identity with v = 0), both in one launch (INIT 3);
2. here, sequentially per sequence: S_{s+1} = P_s S_s + H_s from the sequence's initial state (the true start state
   of every segment, fp32 [S, HV, K, V]); the last one is the final state;
3. per segment again, from S_s: h and v_new of every chunk.

The head-start schedule (``plan.HeadStart``) runs step 3 on every sequence's first segment beside step 1 on its middle
segments only (the first segment's final pass starts from the sequence's own initial state, and the last segment's
local state and transition are never used); its merge starts from the first segments' end states and steps through
the middle segments.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import tuning
from .common import _launch, _pow2, _rn, _state_row
from ..common import cdiv, pdl_enter
from ..launch import pdl_args


@triton.jit
def _merge_start_tile(h0, hs, row, ok0, s0, keep, i_hv, okk, ov, m, s0n, s0h, s0k, s0v,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr):
    """Rows ``okk`` x columns ``ov`` of the sequence's start state (h0's row ``row`` when HAS_H0 and ``ok0``, else
    zeros), fp32, written to hs[s0] when ``keep`` and returned."""
    if HAS_H0:
        x = tl.load(h0 + row * s0n + i_hv * s0h + okk[:, None] * s0k + ov[None, :] * s0v,
                    mask=tl.where(ok0, m, False), other=0.0).to(tl.float32)
    else:
        x = tl.zeros([BK, BV], tl.float32)
    tl.store(hs + ((s0.to(tl.int64) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], x,
             mask=tl.where(keep, m, False))
    return x


@triton.jit
def _merge_store_final(x, ht, row1, ok1, i_hv, okk, ov, m, s1n, s1h, s1k, s1v):
    """A sequence's final state tile ``x`` -> ht's row ``row1`` (when ``ok1``), in ht's dtype."""
    tl.store(ht + row1 * s1n + i_hv * s1h + okk[:, None] * s1k + ov[None, :] * s1v, _rn(x, ht.dtype.element_ty),
             mask=tl.where(ok1, m, False))


@triton.jit
def _merge_store_step(x, hs, ht, s64, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, STORE_FINAL: tl.constexpr):
    """Step s64's result tile ``x`` (rows okk, columns ov) -> hs[s64 + 1] unless it is the last segment's, and with
    STORE_FINAL the last one -> ht's row ``row1`` (when ``ok1``)."""
    tl.store(hs + (((s64 + 1) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], x,
             mask=tl.where(s64 + 1 < s1, m, False))
    if STORE_FINAL:
        _merge_store_final(x, ht, row1, ok1 & (s64 + 1 == s1), i_hv, okk, ov, m, s1n, s1h, s1k, s1v)


@triton.jit(do_not_specialize=["P0", "P1"])
def _chunk_merge_kernel(
    h0, ht, h0_idx, ht_idx, trans, hloc, hs, seg_offsets, mid_offsets, P0, P1,
    s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, H0_INDEXED: tl.constexpr, STORE_FINAL: tl.constexpr, HT_INDEXED: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False, HEAD: tl.constexpr = False,
):
    """Sequential merge of one sequence's segment states, one V tile of one value head.

    Program -> work: ``program_id(0)`` = V tile (BV columns), ``program_id(1)`` = value head, ``program_id(2)`` =
    sequence n (its segments are ``seg_offsets[n] .. seg_offsets[n + 1]``).

    1. hs[s0] = h0[n] (row through h0_idx when H0_INDEXED; zeros without h0 or for an invalid row);
    2. for s = s0 .. s1 - 1: hs[s + 1] = trans[s] @ hs[s] + hloc[s]: with one K tile (BK >= K) the state stays in
       registers; over K tiles each step reads what the previous one wrote (a barrier between steps, reads through
       L2);
    3. STORE_FINAL: the last value -> ht[n] (row through ht_idx when HT_INDEXED).

    HEAD (the head-start schedule, ``plan.HeadStart``): h0 [N, HV, K, V] holds the end states of the sequences' first
    segments; ``seg_offsets`` / ``mid_offsets`` are the sequence's rows [b0, b1) of the segments after its first and
    [m0, m1) of its middle ones (b1 - b0 - 1 = m1 - m0 where b1 > b0): hs[b0] = h0[n], then for j = m0 .. m1 - 1:
    hs[b0 + 1 + j - m0] = trans[j] @ hs[b0 + j - m0] + hloc[j]; a sequence of one segment (b1 = b0) has no hs row:
    h0[n] is its final state (STORE_FINAL: -> ht[n]; the others' final states are their last final pass's).

    Layouts: trans [S, HV, K, K], hloc / hs [S, HV, K, V] fp32 contiguous; h0 / ht with strides (s0n, s0h, s0k, s0v)
    / (s1n, ...), so either state layout. PDL: ``pdl_enter``'s switch."""
    pdl_enter(PDL)
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    n = tl.program_id(2)
    s0 = tl.load(seg_offsets + n)
    s1 = tl.load(seg_offsets + n + 1)
    if HEAD:
        m0 = tl.load(mid_offsets + n).to(tl.int64)
        m1 = tl.load(mid_offsets + n + 1).to(tl.int64)
        keep = s1 > s0
    else:
        m0 = s0.to(tl.int64)
        m1 = s1.to(tl.int64)
        keep = True
    d = s0 - m0       # hs row of step j's input, less j
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < V
    ob = tl.arange(0, BK)
    # rows of the sequence's start state (h0) and final state (ht)
    row, ok0 = _state_row(h0_idx, n, n, P0, False, H0_INDEXED)
    row1, ok1 = _state_row(ht_idx, n, n, P1, False, HT_INDEXED)
    if BK >= K:
        # one K tile: the running state stays in registers (the next product's right operand; hs is written, never
        # read back); the loop pipelined STAGES deep, so step s + 1's transition goes to shared memory (the
        # product's operand) while step s computes
        okk = ob
        m = (okk < K)[:, None] & mv[None, :]
        x = _merge_start_tile(h0, hs, row, ok0, s0, keep, i_hv, okk, ov, m, s0n, s0h, s0k, s0v, HV, K, V, BK, BV,
                              HAS_H0)
        if HEAD and STORE_FINAL:
            _merge_store_final(x, ht, row1, tl.where(keep, False, ok1), i_hv, okk, ov, m, s1n, s1h, s1k, s1v)
        mt = (okk < K)[:, None] & (okk < K)[None, :]
        for s64 in tl.range(m0, m1, num_stages=STAGES):
            if BK == K:
                pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + okk[None, :])
            else:
                pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + okk[None, :], mask=mt, other=0.0)
            hl = tl.load(hloc + ((s64 * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], mask=m, other=0.0)
            x = tl.dot(pm, x, hl, input_precision=PREC)
            _merge_store_step(x, hs, ht, s64 + d, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v, HV, K, V,
                              STORE_FINAL and not HEAD)
    else:
        for i_k in range(0, tl.cdiv(K, BK)):
            okk = i_k * BK + ob
            m = (okk < K)[:, None] & mv[None, :]
            x = _merge_start_tile(h0, hs, row, ok0, s0, keep, i_hv, okk, ov, m, s0n, s0h, s0k, s0v, HV, K, V, BK,
                                  BV, HAS_H0)
            if HEAD and STORE_FINAL:
                _merge_store_final(x, ht, row1, tl.where(keep, False, ok1), i_hv, okk, ov, m, s1n, s1h, s1k, s1v)
        tl.debug_barrier()
        for s64 in range(m0, m1):
            for i_k in range(0, tl.cdiv(K, BK)):
                okk = i_k * BK + ob
                m = (okk < K)[:, None] & mv[None, :]
                acc = tl.load(hloc + ((s64 * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], mask=m, other=0.0)
                for j_k in range(0, tl.cdiv(K, BK)):
                    ojj = j_k * BK + ob
                    mj = ojj < K
                    pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + ojj[None, :],
                                 mask=(okk < K)[:, None] & mj[None, :], other=0.0)
                    # written by this program in the previous step (barrier in between): read through L2
                    xs = tl.load(hs + (((s64 + d) * HV + i_hv) * K + ojj[:, None]) * V + ov[None, :],
                                 mask=mj[:, None] & mv[None, :], other=0.0, cache_modifier=".cg")
                    acc = tl.dot(pm, xs, acc, input_precision=PREC)
                _merge_store_step(acc, hs, ht, s64 + d, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v, HV, K,
                                  V, STORE_FINAL and not HEAD)
            tl.debug_barrier()


def merge_segment_states(trans, hloc, plan, ci, initial_state, ht, idx, s0, s1, dummy, ht_idx=None, half=True,
                         firsts=None):
    """Step 2: the start state of every segment, fp32 [S, HV, K, V] (and the final state into ``ht`` when given).
    trans [S, HV, K, K], hloc [S, HV, K, V] fp32; initial_state / ht with their (row, head, K, V) strides s0 / s1
    (pool rows through ``idx`` when given; the final state through ``ht_idx``, default ``idx``). ``half``: the
    inputs are 16-bit (the products take ``merge_precision_16bit``, else ``merge_precision``).
    ``firsts`` (a head-start plan, ``plan.head``): fp32 [N, HV, K, V] end states of the sequences' first segments, which
    the merge starts from instead of ``initial_state`` (not read); trans / hloc then hold the middle segments'
    ([NM, ...]) and the result the start states of the plan's own segments (those after the first ones; a sequence
    of one segment writes its final state from ``firsts``)."""
    ht_idx = idx if ht_idx is None else ht_idx
    HV, K, V = hloc.shape[1:]
    head = firsts is not None
    S = plan.S
    cfg = tuning.chunk_fwd(hloc.device)
    hs = torch.empty(S, HV, K, V, device=hloc.device, dtype=torch.float32)
    if cfg.debug_poison:
        hs.fill_(float("nan"))
    if head:
        initial_state, idx, P = firsts, None, firsts.shape[0]
        s0 = firsts.stride()
    else:
        P = initial_state.shape[0] if initial_state is not None else 0
    P1 = ht.shape[0] if ht is not None else 0
    BKM = min(int(cfg.merge_BK), _pow2(K))
    BVM = min(int(cfg.merge_BV), _pow2(V))
    _launch(_chunk_merge_kernel, (cdiv(V, BVM), HV, ci.N),
        initial_state if initial_state is not None else dummy, ht if ht is not None else dummy,
        idx if idx is not None else ci.chunk_offsets, ht_idx if ht_idx is not None else ci.chunk_offsets,
        trans, hloc, hs, plan.seg_offsets, plan.head.offsets[1] if head else plan.seg_offsets, P, P1, *s0, *s1,
        HV=HV, K=K, V=V, BK=BKM, BV=BVM,
        HAS_H0=initial_state is not None, H0_INDEXED=idx is not None, STORE_FINAL=ht is not None,
        HT_INDEXED=ht_idx is not None, PREC=cfg.merge_precision_16bit if half else cfg.merge_precision,
        STAGES=int(cfg.merge_stages), num_warps=int(cfg.merge_warps),
        # (head-start: the first segments' final pass ran on another stream, which this launch waits for as a whole)
        **(dict(HEAD=True) if head else pdl_args(cfg.pdl, hloc.device)))
    return hs


__all__ = ["merge_segment_states"]
