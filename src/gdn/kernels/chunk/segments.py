"""Long sequences split into segments (forward state pass).

With few sequences x heads the plain state pass leaves most SMs idle. Every sequence is then cut into segments of L
chunks (:func:`gdn.kernels.chunk.plan.choose_segment_len`), and the state pass (:mod:`.state`) runs three times:

1. per segment s, in parallel: the local state H_s from zero with the true v, and the K x K transition P_s (the pass
   from the identity with v = 0), both in one launch (INIT 3);
2. here, sequentially per sequence: S_{s+1} = P_s S_s + H_s from the sequence's initial state (the true start state
   of every segment, fp32 [S, HV, K, V]); the last one is the final state;
3. per segment again, from S_s: h and v_new of every chunk.
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
def _merge_start_tile(h0, hs, row, ok0, s0, i_hv, okk, ov, m, s0n, s0h, s0k, s0v,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr):
    """Rows ``okk`` x columns ``ov`` of the sequence's start state (h0's row ``row`` when HAS_H0 and ``ok0``, else
    zeros), fp32, written to hs[s0] and returned."""
    if HAS_H0:
        x = tl.load(h0 + row * s0n + i_hv * s0h + okk[:, None] * s0k + ov[None, :] * s0v,
                    mask=tl.where(ok0, m, False), other=0.0).to(tl.float32)
    else:
        x = tl.zeros([BK, BV], tl.float32)
    tl.store(hs + ((s0.to(tl.int64) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], x, mask=m)
    return x


@triton.jit
def _merge_store_step(x, hs, ht, s64, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, STORE_FINAL: tl.constexpr):
    """Step s64's result tile ``x`` (rows okk, columns ov) -> hs[s64 + 1] unless it is the last segment's, and with
    STORE_FINAL the last one -> ht's row ``row1`` (when ``ok1``)."""
    tl.store(hs + (((s64 + 1) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], x,
             mask=tl.where(s64 + 1 < s1, m, False))
    if STORE_FINAL:
        tl.store(ht + row1 * s1n + i_hv * s1h + okk[:, None] * s1k + ov[None, :] * s1v,
                 _rn(x, ht.dtype.element_ty), mask=tl.where(ok1 & (s64 + 1 == s1), m, False))


@triton.jit(do_not_specialize=["P0", "P1"])
def _chunk_merge_kernel(
    h0, ht, h0_idx, ht_idx, trans, hloc, hs, seg_offsets, P0, P1,
    s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, H0_INDEXED: tl.constexpr, STORE_FINAL: tl.constexpr, HT_INDEXED: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    """Sequential merge of one sequence's segment states, one V tile of one value head.

    Program -> work: ``program_id(0)`` = V tile (BV columns), ``program_id(1)`` = value head, ``program_id(2)`` =
    sequence n (its segments are ``seg_offsets[n] .. seg_offsets[n + 1]``).

    1. hs[s0] = h0[n] (row through h0_idx when H0_INDEXED; zeros without h0 or for an invalid row);
    2. for s = s0 .. s1 - 1: hs[s + 1] = trans[s] @ hs[s] + hloc[s]: with one K tile (BK >= K) the state stays in
       registers; over K tiles each step reads what the previous one wrote (a barrier between steps, reads through
       L2);
    3. STORE_FINAL: the last value -> ht[n] (row through ht_idx when HT_INDEXED).

    Layouts: trans [S, HV, K, K], hloc / hs [S, HV, K, V] fp32 contiguous; h0 / ht with strides (s0n, s0h, s0k, s0v)
    / (s1n, ...), so either state layout. PDL: ``pdl_enter``'s switch."""
    pdl_enter(PDL)
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    n = tl.program_id(2)
    s0 = tl.load(seg_offsets + n)
    s1 = tl.load(seg_offsets + n + 1)
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
        x = _merge_start_tile(h0, hs, row, ok0, s0, i_hv, okk, ov, m, s0n, s0h, s0k, s0v, HV, K, V, BK, BV, HAS_H0)
        mt = (okk < K)[:, None] & (okk < K)[None, :]
        for s64 in tl.range(s0.to(tl.int64), s1.to(tl.int64), num_stages=STAGES):
            if BK == K:
                pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + okk[None, :])
            else:
                pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + okk[None, :], mask=mt, other=0.0)
            hl = tl.load(hloc + ((s64 * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], mask=m, other=0.0)
            x = tl.dot(pm, x, hl, input_precision=PREC)
            _merge_store_step(x, hs, ht, s64, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v, HV, K, V,
                              STORE_FINAL)
    else:
        for i_k in range(0, tl.cdiv(K, BK)):
            okk = i_k * BK + ob
            m = (okk < K)[:, None] & mv[None, :]
            _merge_start_tile(h0, hs, row, ok0, s0, i_hv, okk, ov, m, s0n, s0h, s0k, s0v, HV, K, V, BK, BV, HAS_H0)
        tl.debug_barrier()
        for s64 in range(s0.to(tl.int64), s1.to(tl.int64)):
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
                    xs = tl.load(hs + ((s64 * HV + i_hv) * K + ojj[:, None]) * V + ov[None, :],
                                 mask=mj[:, None] & mv[None, :], other=0.0, cache_modifier=".cg")
                    acc = tl.dot(pm, xs, acc, input_precision=PREC)
                _merge_store_step(acc, hs, ht, s64, s1, i_hv, okk, ov, m, row1, ok1, s1n, s1h, s1k, s1v, HV, K, V,
                                  STORE_FINAL)
            tl.debug_barrier()


def merge_segment_states(trans, hloc, plan, ci, initial_state, ht, idx, s0, s1, dummy, ht_idx=None, half=True):
    """Step 2: the start state of every segment, fp32 [S, HV, K, V] (and the final state into ``ht`` when given).
    trans [S, HV, K, K], hloc [S, HV, K, V] fp32; initial_state / ht with their (row, head, K, V) strides s0 / s1
    (pool rows through ``idx`` when given; the final state through ``ht_idx``, default ``idx``). ``half``: the
    inputs are 16-bit (the products take ``merge_precision_16bit``, else ``merge_precision``)."""
    ht_idx = idx if ht_idx is None else ht_idx
    S, HV, K, V = hloc.shape
    cfg = tuning.chunk_fwd(hloc.device)
    hs = torch.empty(S, HV, K, V, device=hloc.device, dtype=torch.float32)
    if cfg.debug_poison:
        hs.fill_(float("nan"))
    P = initial_state.shape[0] if initial_state is not None else 0
    P1 = ht.shape[0] if ht is not None else 0
    BKM = min(int(cfg.merge_BK), _pow2(K))
    BVM = min(int(cfg.merge_BV), _pow2(V))
    _launch(_chunk_merge_kernel, (cdiv(V, BVM), HV, ci.N),
        initial_state if initial_state is not None else dummy, ht if ht is not None else dummy,
        idx if idx is not None else ci.chunk_offsets, ht_idx if ht_idx is not None else ci.chunk_offsets,
        trans, hloc, hs, plan.seg_offsets, P, P1, *s0, *s1, HV=HV, K=K, V=V, BK=BKM, BV=BVM,
        HAS_H0=initial_state is not None, H0_INDEXED=idx is not None, STORE_FINAL=ht is not None,
        HT_INDEXED=ht_idx is not None, PREC=cfg.merge_precision_16bit if half else cfg.merge_precision,
        STAGES=int(cfg.merge_stages), num_warps=int(cfg.merge_warps), **pdl_args(cfg.pdl, hloc.device))
    return hs


__all__ = ["merge_segment_states"]
