"""The sequential state pass of the chunked forward: the start state h of every chunk and v_new, from Ainv / v / beta
(default) or from stored W / U (the backward's recompute), with the long-sequence split of :mod:`.segments`.

Layouts: k [B, T, H, K] (strided, raw: the L2 norm enters as row factors r_k [B, T, H] fp32); v [B, T, HV, V]
(strided); beta [B, T, HV] (any strides); Ainv [B, T, HV, 64]; w [B, T, HV, K], u / v_new [B, T, HV, V]; g_cum
[B, T, HV] fp32; h [NT, HV, K, V] (v_last order, chunk rows from ``ChunkIndex.chunk_offsets``); initial / final states
[N or P, HV, K, V] (v_last) or [.., V, K] (k_last), any strides, optionally a pool addressed by ``state_indices``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import tuning
from ..common import cdiv, l2_rnorm
from .common import (CHUNK_SIZE, _TL, _check_chunk_size, _cu_arg, _dot, _dot_dtype, _empty, _launch, _pow2, _rn,
                     _seq_span, _state_row, _strides3)
from . import hopper, hopper_segments
from .plan import (ChunkIndex, _num_sms, choose_segment_len, get_chunk_index, one_wave_segment_len, one_wave_tile,
                   plan_segments)
from .segments import merge_segment_states


def _state_bv(K: int, V: int, device=None) -> int:
    """V tile of the state pass: the ``chunk_fwd.state_BV`` tuning field, or automatic (0): 32 for K > 128 (register
    budget: no spills at 4 warps on sm_90), else 64."""
    bv = int(tuning.chunk_fwd(device).state_BV) or (32 if K > 128 else 64)
    return max(16, min(bv, _pow2(V)))


@triton.jit
def _dot_h(a, h, h_dt, DT: tl.constexpr, PREC: tl.constexpr, SPLIT_H: tl.constexpr):
    """a @ h for an fp32 state h (``h_dt`` = h rounded to DT): with SPLIT_H (half-precision DT), h = hi + lo in two
    half-precision parts, so the product is nearly fp32-exact at twice the tensor-core work (this product is
    subtracted from v: cancellation)."""
    r = _dot(a, h_dt, PREC)
    if SPLIT_H:
        r += _dot(a, _rn((h - h_dt.to(tl.float32)), DT), PREC)
    return r


@triton.jit
def _store_checkpoint(h, c, CK_E, ck_pool, ck_idx, n, P2, CK_C, s_ckn, s2n, s2h, s2k, s2v, i_hv, ok, ov, m_kv):
    """Store h (the state after ``c`` chunks of sequence n) to pool row ``ck_idx[n, c / CK_E - 1]`` when c is a
    positive multiple of CK_E and that column exists (row -1 / out of [0, P2): skipped)."""
    col = c // CK_E - 1
    hit = (c % CK_E == 0) & (col >= 0) & (col < CK_C)
    row = tl.load(ck_idx + n.to(tl.int64) * s_ckn + tl.minimum(tl.maximum(col, 0), CK_C - 1), mask=hit,
                  other=-1).to(tl.int64)
    p = ck_pool + row * s2n + i_hv * s2h + ok[:, None] * s2k + ov[None, :] * s2v
    tl.store(p, _rn(h, ck_pool.dtype.element_ty), mask=tl.where(hit & (row >= 0) & (row < P2), m_kv, False))


@triton.jit(do_not_specialize=["T", "P0", "P1", "P2", "CK_E", "CK_C"])
def _chunk_state_kernel(
    k, v, beta, ainv, w, u, gcum, rk_in, h_out, vnew, h0, ht, h0_idx, ht_idx, segments, chunk_offsets, cu_seqlens,
    T, P0, P1, NV,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
    s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, FROM_AINV: tl.constexpr,
    INIT: tl.constexpr, H0_BY_SEG: tl.constexpr, H0_INDEXED: tl.constexpr,
    HAS_U: tl.constexpr, STORE_H: tl.constexpr, STORE_VNEW: tl.constexpr,
    STORE_FINAL: tl.constexpr, HT_BY_SEG: tl.constexpr, HT_INDEXED: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, SPLIT_H: tl.constexpr,
    ck_pool=None, ck_idx=None, P2=0, CK_E=1, CK_C=0, s_ckn=0, s2n=0, s2h=0, s2k=0, s2v=0, CKPT: tl.constexpr = False,
):
    """The sequential pass of one (V tile, value head, segment) over the segment's chunks; h [K, BV] fp32 in registers.

    Program -> work: ``program_id(0)`` = V tile i_v (with INIT 3: i_v < NV local-state tiles, i_v >= NV transition
    tiles of K columns), ``program_id(1)`` = value head i_hv (key head i_hv // (HV / H)), ``program_id(2)`` = segment
    i_s (row of ``segments`` int32 [S, 3] = (sequence n, first chunk, end chunk); one per sequence unsegmented).

    Per chunk c (r_k = L2 row scalings of k from ``rk_in`` [B, T, H] fp32; k enters the products raw, the row factors
    go on the [64, BV] sides; g_cum [B, T, HV] fp32, g_last = g_cum at the chunk's last valid token):

    1. STORE_H: ``h_out[chunk_offsets[n] + c, i_hv]`` <- h (start state of the chunk; h_out [NT, HV, K, V]).
    2. v_new = Ainv @ (beta * (v - diag(exp(g_cum) r_k) (k @ h)))   (FROM_AINV; Ainv [B, T, HV, 64], v strided)
       or v_new = U - W h                                             (stored w [B, T, HV, K], u [B, T, HV, V]).
       STORE_VNEW: ``vnew`` [B, T, HV, V] <- v_new.
    3. h = exp(g_last) h + k^T (diag(exp(g_last - g_cum) r_k) v_new).

    INIT: 0 = zeros, 1 = from h0 (row = segment or sequence, optionally through h0_idx with -1/out-of-range = zeros),
    2 = identity (transition matrix; then V == K and HAS_U is False: v / u are taken as zero),
    3 = both passes of a segmented run in one launch: programs i_v < NV run the local pass from zero (final -> ht,
    row = segment), programs i_v >= NV the transition matrix from the identity without v (final -> h0, row =
    segment, with h0's strides). States h0 / ht: any strides (s0* / s1*: row, head, K, V), so v_last [.., K, V] and
    k_last [.., V, K] are both read and written in place; STORE_FINAL writes the state after the last chunk.

    CKPT (prefix-cache checkpoints; not with INIT 3): the state after every ``CK_E`` chunks of the sequence (after
    token ``(c + 1) * CK_E * 64``, counted from the sequence's start) goes to row ``ck_idx[n, c]`` (``[N, CK_C]``
    int, row pitch ``s_ckn``; -1 / out of [0, P2) = skipped) of ``ck_pool`` (strides s2*, any layout, its dtype):
    written at the top of the chunk that starts there (h is then that state), or after the loop when the sequence
    ends exactly there. A segment's pass (from the true start state) writes the checkpoints inside its chunks.
    """
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_s = tl.program_id(2)
    n = tl.load(segments + 3 * i_s)
    c_beg = tl.load(segments + 3 * i_s + 1)
    c_end = tl.load(segments + 3 * i_s + 2)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    i_h = i_hv // (HV // H)
    tok0 = i_b * T
    ok = tl.arange(0, KP)
    mk = ok < K
    if INIT == 3:
        is_t = i_v >= NV
        not_t = i_v < NV
        ov = tl.where(is_t, i_v - NV, i_v) * BV + tl.arange(0, BV)
        mv = ov < tl.where(is_t, K, V)
    else:
        not_t = True
        ov = i_v * BV + tl.arange(0, BV)
        mv = ov < V
    m_kv = mk[:, None] & mv[None, :]

    if INIT == 1:
        row, ok0 = _state_row(h0_idx, i_s, n, P0, H0_BY_SEG, H0_INDEXED)
        p0 = h0 + row * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v
        h = tl.load(p0, mask=tl.where(ok0, m_kv, False), other=0.0).to(tl.float32)
    elif INIT == 2:
        h = tl.where((ok[:, None] == ov[None, :]) & m_kv, 1.0, 0.0)
    elif INIT == 3:
        h = tl.where((ok[:, None] == ov[None, :]) & m_kv & is_t, 1.0, 0.0)
    else:
        h = tl.zeros([KP, BV], tl.float32)

    choff = tl.load(chunk_offsets + n).to(tl.int64)
    k_base = k + i_b * s_kb + i_h * s_kh
    v_base = v + i_b * s_vb + i_hv * s_vh
    b_base = beta + i_b * s_bb + i_hv * s_bh
    to = tl.arange(0, 64)
    if FROM_AINV:
        # beta (16-bit, strided: not copied asynchronously by the pipeliner) is loaded one chunk ahead, at the top of
        # the previous chunk, so its latency is off the chain of products
        rows_n = bos + c_beg.to(tl.int64) * 64 + to
        beta_next = tl.load(b_base + rows_n * s_bt, mask=rows_n < eos, other=0.0)
    for c in range(c_beg.to(tl.int64), c_end.to(tl.int64)):
        t0 = bos + c * 64
        rows = t0 + to
        m = rows < eos
        trow = (tok0 + rows) * HV + i_hv
        if FROM_AINV:
            b_beta = beta_next.to(tl.float32)
            rows_n = rows + 64
            beta_next = tl.load(b_base + rows_n * s_bt, mask=tl.where(c + 1 < c_end, rows_n < eos, False),
                                other=0.0)
        if CKPT:  # h is the state after c * 64 tokens: checkpoint c / CK_E - 1 when c is a multiple of CK_E
            _store_checkpoint(h, c, CK_E, ck_pool, ck_idx, n, P2, CK_C, s_ckn, s2n, s2h, s2k, s2v, i_hv, ok, ov, m_kv)
        if STORE_H:
            hp = h_out + ((choff + c) * HV + i_hv) * (K * V) + ok[:, None] * V + ov[None, :]
            tl.store(hp, _rn(h, h_out.dtype.element_ty), mask=m_kv)
        b_g = tl.load(gcum + trow, mask=m, other=0.0)
        last = tl.minimum(t0 + 64, eos) - 1
        g_last = tl.load(gcum + (tok0 + last) * HV + i_hv)
        b_k = _rn(tl.load(k_base + rows[:, None] * s_kt + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
        if USE_L2:
            rk = tl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        else:
            rk = tl.where(m, 1.0, 0.0)
        h_dt = _rn(h, DT)
        if FROM_AINV:
            b_r = -_dot_h(b_k, h, h_dt, DT, PREC, SPLIT_H) * (tl.exp(b_g) * rk)[:, None]
            if HAS_U:
                b_r += tl.load(v_base + rows[:, None] * s_vt + ov[None, :], mask=tl.where(not_t, m[:, None] & mv[None, :], False),
                               other=0.0).to(tl.float32)
            b_a = _rn(tl.load(ainv + trow[:, None] * 64 + to[None, :], mask=m[:, None], other=0.0), DT)
            b_v = _dot(b_a, _rn(b_r * b_beta[:, None], DT), PREC)
        else:
            b_w = _rn(tl.load(w + trow[:, None] * K + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            b_v = -_dot_h(b_w, h, h_dt, DT, PREC, SPLIT_H)
            if HAS_U:
                b_v += tl.load(u + trow[:, None] * V + ov[None, :], mask=tl.where(not_t, m[:, None] & mv[None, :], False),
                               other=0.0).to(tl.float32)
        if STORE_VNEW:
            tl.store(vnew + trow[:, None] * V + ov[None, :], _rn(b_v, vnew.dtype.element_ty),
                     mask=m[:, None] & mv[None, :])
        dec = tl.where(m, tl.exp(g_last - b_g), 0.0) * rk
        h = h * tl.exp(g_last) + _dot(tl.trans(b_k), _rn(b_v * dec[:, None], DT), PREC)

    if CKPT:  # a sequence that ends on a checkpoint (only the segment that reaches the end writes it)
        if c_end.to(tl.int64) * 64 >= eos - bos:
            _store_checkpoint(h, c_end.to(tl.int64), CK_E, ck_pool, ck_idx, n, P2, CK_C, s_ckn, s2n, s2h, s2k, s2v,
                              i_hv, ok, ov, tl.where((eos - bos) % 64 == 0, m_kv, False))
    if INIT == 3:
        rs = i_s.to(tl.int64)
        tl.store(ht + rs * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v, _rn(h, ht.dtype.element_ty),
                 mask=tl.where(not_t, m_kv, False))
        tl.store(h0 + rs * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v, _rn(h, h0.dtype.element_ty),
                 mask=tl.where(is_t, m_kv, False))
    elif STORE_FINAL:
        row1, ok1 = _state_row(ht_idx, i_s, n, P1, HT_BY_SEG, HT_INDEXED)
        p1 = ht + row1 * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v
        tl.store(p1, _rn(h, ht.dtype.element_ty), mask=tl.where(ok1, m_kv, False))


def _written_rows(rows: torch.Tensor, read_idx: Optional[torch.Tensor], P_read: int) -> torch.Tensor:
    """Write rows with those of padding sequences (read index out of [0, P_read)) set to -1: a padding sequence
    writes nothing (one small elementwise op, no host sync). ``rows`` [N] or [N, C]."""
    if read_idx is None:
        return rows
    ok = (read_idx >= 0) & (read_idx < P_read)
    return torch.where(ok.view(-1, *([1] * (rows.dim() - 1))), rows, -1).contiguous()


def _segment_t(cfg, k, xs, mats, dt, K: int, V: int, split_h: bool, from_ainv: bool = True) -> bool:
    """Whether a segmented run's segment pass is the one-CTA-per-(value head, segment) form
    (``hopper_segments``, ``chunk_fwd.state_sm90_segment_t``): the Gluon segment pass would run (:func:`_segment_sm90`)
    in ainv mode, K = V = 128."""
    return (bool(cfg.state_sm90_segment_t) and from_ainv and _segment_sm90(cfg, k, xs, mats, dt, K, V, split_h)
            and hopper_segments.segment_t_ok(k, xs, mats, K, V))


def _segment_sm90(cfg, k, xs, mats, dt, K: int, V: int, split_h: bool) -> bool:
    """Whether a segmented run's segment pass (local states and transitions, INIT 3) is the Gluon state pass:
    ``chunk_fwd.state_sm90`` and ``state_sm90_segment_pass``, a launch ``hopper.supported`` takes, a tile dividing V
    and K."""
    bv = int(cfg.state_sm90_segment_BV)
    return (bool(cfg.state_sm90 and cfg.state_sm90_segment_pass) and xs is not None and not split_h
            and bv in (32, 64) and V % bv == 0 and K % bv == 0
            and hopper.supported(k, xs, mats, None, None, dt, K, V, 3, False))


def _ainv_like(k: torch.Tensor, v: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """A meta tensor shaped as the Ainv the prepare kernel will write for these inputs (contiguous [B, T, HV, 64] in
    the tensor-core dtype ``dt``), for the support checks made before it exists."""
    return torch.empty((k.shape[0], k.shape[1], v.shape[2], CHUNK_SIZE), dtype=dt, device="meta")


def beta_in_ainv_ok(k: torch.Tensor, v: torch.Tensor, ainv: torch.Tensor, dt: torch.dtype, plan,
                    split_h: Optional[bool] = None) -> bool:
    """Whether every kernel that reads ``ainv`` in a fused V tile 128 run of ``plan`` takes it as Ainv diag(beta)
    (``chunk_fwd_prepare``'s ``beta_in_ainv``): the register-state kernel does, and a segmented plan's segment
    pass where it is the one-CTA form (:func:`_segment_t`; ``split_h`` None: as :func:`chunk_state_pass` derives it)."""
    if not plan.segmented:
        return True
    cfg = tuning.chunk_fwd(k.device)
    if split_h is None:
        split_h = bool(cfg.state_split_h) and dt != torch.float32
    return _segment_t(cfg, k, v, ainv, dt, k.shape[3], v.shape[3], split_h)


def segment_pass_sm90_ok(k: torch.Tensor, v: torch.Tensor, dt: torch.dtype) -> bool:
    """Whether a segmented ainv-mode run of these inputs (no split h) has the Gluon segment pass
    (:func:`_segment_sm90`): the one that reads an Ainv packed into o's rows as it is (the portable kernel reads a
    contiguous Ainv only)."""
    return _segment_sm90(tuning.chunk_fwd(k.device), k, v, _ainv_like(k, v, dt), dt, k.shape[3], v.shape[3], False)


def _state_strides(x: Optional[torch.Tensor], layout: str):
    if x is None:
        return (0, 0, 0, 0)
    if layout == "v_last":
        return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
    return x.stride(0), x.stride(1), x.stride(3), x.stride(2)


def _pass_plan(ci: ChunkIndex, HV: int, K: int, V: int, dev, sm90: bool, segment_chunks: Optional[int]):
    """(segment plan, V tile of the sm_90 pass for a grid of p x (V / tile) CTAs as a function of p; 0 = portable).
    Memoised like :func:`fused_output_plan`."""
    cfg = tuning.chunk_fwd(dev)
    key = (id(ci), HV, K, V, dev, bool(sm90), segment_chunks, id(cfg))
    hit = _PASS_PLANS.get(key)
    if hit is None:
        if len(_PASS_PLANS) >= 64:
            _PASS_PLANS.pop(next(iter(_PASS_PLANS)))
        hit = _PASS_PLANS[key] = (ci, cfg, _plan_pass(ci, HV, K, V, dev, sm90, segment_chunks, cfg))
    return hit[2]


_PASS_PLANS: dict = {}


def _plan_pass(ci, HV, K, V, dev, sm90, segment_chunks, cfg):
    def sm90_tile(programs_per_column_tile: int) -> int:
        if not sm90:
            return 0
        if cfg.state_sm90_BV > 0:
            return cfg.state_sm90_BV
        return one_wave_tile(programs_per_column_tile, V, dev)

    plain9 = sm90_tile(ci.N * HV)
    seg = choose_segment_len(ci, HV, V, _state_bv(K, V, dev), dev, force=segment_chunks, K=K,
                             plain_cost=max(ci.nchunks) * cfg.state_sm90_step_cost if plain9 else None)
    return plan_segments(ci, seg, dev), sm90_tile


def fused_output_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ci: ChunkIndex,
                      segment_chunks: Optional[int] = None, checkpoints: bool = False, states: bool = False):
    """(V tile, segment plan) of the fused Hopper state + output kernel for an ainv-mode forward of these inputs, or
    (0, None) where it does not take the final pass (not sm_90, unsupported dtype / layout / shape, checkpoints, the
    ``chunk_fwd.state_sm90`` / ``state_sm90_fused`` fields off, no Gluon tile chosen). Both go to
    :func:`chunk_state_pass` in its ``output`` dict, which then plans nothing itself. V tile 128 means the
    register-state kernel (``hopper._chunk_fused_t_sm90_kernel``; only where the caller keeps no h / v_new,
    ``states`` false)."""
    dev = k.device
    cfg = tuning.chunk_fwd(dev)
    if not (cfg.state_sm90 and cfg.state_sm90_fused) or cfg.state_split_h or ci.N == 0 or v.shape[2] == 0:
        return 0, None
    # memoised per (shapes, strides, dtypes, 16-byte alignment, chunk table, tuning row): the answer is a pure
    # function of those, and working it out costs ~60 us of host time per call (bench/NOTES.md, host overhead)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, id(ci), segment_chunks, bool(checkpoints), dev,
           id(cfg), bool(states))
    hit = _FUSED_PLANS.get(key)
    if hit is not None and hit[0] is ci and hit[1] is cfg:
        return hit[2]
    out = _fused_output_plan(q, k, v, ci, segment_chunks, checkpoints, cfg, states)
    if len(_FUSED_PLANS) >= 64:
        _FUSED_PLANS.pop(next(iter(_FUSED_PLANS)))
    _FUSED_PLANS[key] = (ci, cfg, out)    # ci and cfg kept alive so that their ids stay theirs
    return out


_FUSED_PLANS: dict = {}


def _fused_output_plan(q, k, v, ci, segment_chunks, checkpoints, cfg, states):
    K = k.shape[3]
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    dt = _dot_dtype(k, v)
    if not hopper.supported(k, v, _ainv_like(k, v, dt), None, None, dt, K, V, 1, False, checkpoints=checkpoints):
        return 0, None
    plan, sm90_tile = _pass_plan(ci, HV, K, V, dev, True, segment_chunks)
    # unsegmented grids larger than one wave at every V tile (batches of several sequences): still the fused kernel,
    # at V tile 64 (H200 kernel sums against the portable pass + output kernel: 4x4096 16/32 0.696 -> 0.572 ms,
    # 8x2048 0.700 -> 0.573, 64x256 0.778 -> 0.658; bench/NOTES.md)
    bv = sm90_tile(plan.S * HV) or (64 if V % 64 == 0 and not plan.segmented else 0)
    if bv == 64 and not sm90_tile(plan.S * HV) and cfg.state_sm90_fused_t and not states \
            and hopper.transposed_ok(K, V, 128, None, None):
        # more than one wave even at V tile 64: the register-state kernel on whole 128-column tiles (two warpgroups
        # of 64 rows of S^T sharing one TMA ring), half the CTAs at ~1.85x the step (H200 fused kernel 4x4096 16/32
        # 271 -> 242 us, 8x2048 275 -> 247, 4x4096 16/64 564 -> 506; bench/NOTES.md)
        bv = 128
    forced = (segment_chunks if segment_chunks is not None else cfg.segment_chunks) or cfg.state_sm90_BV
    wide = bool(cfg.state_sm90_fused_t and not states and hopper.transposed_ok(K, V, 128, None, None))
    # the one-CTA segment pass (hopper_segments) is cheaper than the portable planner's model of a segment pass, so
    # where it runs, one long sequence over many heads is offered to the cost model too (H200 kernel sums, segments
    # forced / plain, bench/results/fwd_segment_plan_16_32_h200.json: 1x32768 16/32 915 -> 881 us, 1x65536 1795 ->
    # 1718; 1x16384 470 / 467, taken for its peak; 1x8192 242 -> 256 and 16/64 436 -> 467, which the model keeps
    # plain)
    offer = (not plan.segmented and wide and _segment_t_pass(cfg, K, V) and sm90_tile(ci.N * HV)
             and max(ci.nchunks) >= int(cfg.segment_min_chunks))
    if (plan.segmented or offer) and cfg.state_sm90_fused_segmented and not forced:
        # segmented plans (long sequences, few heads): segments re-planned so that the fused final pass fits one wave
        # (with the planner's segments its grid took several: gdn bench 1x8192 8/16 0.63 -> 1.15 ms, H200), at the
        # V tile the cost model prefers, or no segments where they do not pay; offered ones: the register-state
        # candidate alone, below state_sm90_segment_t_gain x the plain pass
        bv, plan = _fused_segments(ci, HV, K, V, dev, plan, cfg, sm90_tile(ci.N * HV), wide=wide,
                                   offered=bool(offer))
    gva_t = int(cfg.state_sm90_t_gva_min)
    if (bv == 64 and wide and not forced and not plan.segmented and gva_t and HV >= gva_t * k.shape[2]
            and plan.S * HV <= _num_sms(dev)):
        # one wave at V tile 64 (33 - 66 sequences x value heads) with key heads shared: the register-state kernel on
        # whole 128-column tiles at half the CTAs (P formed there from q's row scalings, which cost the prepare a q
        # read per key head; chunk_fwd.state_sm90_t_gva_min)
        bv = 128
    narrow = int(cfg.state_sm90_narrow_bv)
    if (bv == 32 and not states and not forced and not plan.segmented and 0 < narrow < bv and K == 128
            and one_wave_tile(plan.S * HV, V, dev, (narrow,))):
        # few heads (an inference forward): the narrower tile still fits one wave and its chain step is shorter
        # (built and checked on the GPU at K = 128 only: gdn.aot, gdn check sm90_vs_portable / target_shapes)
        bv = narrow
    if bv == 128:   # the register-state kernel (also where a forced state_sm90_BV asks for 128)
        ok = not states and hopper.transposed_ok(K, V, bv, None, None) and hopper.fused_supported(q, k, 64)
    else:
        ok = bool(bv) and hopper.fused_supported(q, k, bv)
    return (bv, plan) if ok else (0, None)


def _fused_segments(ci: ChunkIndex, HV: int, K: int, V: int, dev, plan, cfg, plain_bv: int, wide: bool = False,
                    offered: bool = False):
    """(V tile, segment plan) of the fused forward where the planner segments: the cheapest of the plain fused pass
    over whole sequences (V tile ``plain_bv``; 0: its grid does not fit one wave, not a candidate) and, at V tile 32
    and 64 (and 128, the register-state kernel, when ``wide``: the caller keeps no h / v_new), the segmented run whose
    final pass fits one wave (:func:`_one_wave_len`), by :func:`_segmented_cost`; segments only below
    ``segment_gain`` x the plain pass (:func:`_plain_cost`). ``offered`` (the planner keeps the sequences whole, the
    segment pass is hopper_segments'): the register-state candidate alone, below ``state_sm90_segment_t_gain`` x
    the plain pass. (0, plan) where there is no candidate."""
    gain = float(cfg.state_sm90_segment_t_gain if offered else cfg.segment_gain)
    best = (gain * _plain_cost(ci, HV, plain_bv, cfg), plain_bv, plan_segments(ci, None, dev)) if plain_bv else None
    for bv in (128,) if offered else (32, 64, 128) if wide else (32, 64):
        L = _one_wave_len(ci, HV, V, bv, dev, plan.seg_len or int(cfg.segment_min_len))
        if not L:
            continue
        seg_plan = plan_segments(ci, L, dev)
        cost = _segmented_cost(ci, seg_plan, HV, K, V, bv, dev, cfg)
        if best is None or cost < best[0]:
            best = (cost, bv, seg_plan)
    return (best[1], best[2]) if best is not None else (0, plan)


def _segment_t_pass(cfg, K: int, V: int) -> bool:
    """Whether a segmented run's segment pass is the one-CTA-per-(value head, segment) kernel (hopper_segments)."""
    return bool(cfg.state_sm90_segment_t and cfg.state_sm90_segment_pass and K == V == 128)


def _plain_cost(ci: ChunkIndex, HV: int, bv: int, cfg) -> float:
    """Modelled time of the plain fused pass over whole sequences at V tile ``bv`` (one wave), in the units of
    :func:`_segmented_cost`: a step per chunk of the longest sequence (``state_sm90_wide_step_cost`` at V tile 64),
    plus, below V tile ``state_sm90_p_in_kernel_bv``, the prepare's writing P (``state_sm90_prepare_p_cost`` per
    chunk and value head; a segmented run's register-state pass forms P itself)."""
    step = float(cfg.state_sm90_wide_step_cost) if bv >= 64 else 1.0
    p = float(cfg.state_sm90_prepare_p_cost) * sum(ci.nchunks) * HV if bv < int(cfg.state_sm90_p_in_kernel_bv) else 0.0
    return max(ci.nchunks) * step + p


def _segmented_cost(ci: ChunkIndex, plan, HV: int, K: int, V: int, bv: int, dev, cfg) -> float:
    """Modelled time of a segmented fused forward, in steps of the plain fused pass at V tile 32 (one CTA per SM):
    per chunk of a segment one step of the segment pass (local states and transitions: ``(V + K) / tile``
    programs per segment and head; ``state_sm90_segment_pass_cost`` alone on an SM, ``..._cost2`` two per SM, more in
    proportion) and one of the fused final pass (``state_sm90_wide_step_cost`` at V tile 64,
    ``state_sm90_t_step_cost`` at 128), plus
    ``state_sm90_merge_cost`` per segment of the longest sequence and ``state_sm90_segment_fixed_cost`` (its two
    launches more)."""
    longest, L = max(ci.nchunks), max(1, plan.seg_len)
    if _segment_t_pass(cfg, K, V):
        # one CTA per (value head, segment) (hopper_segments), one per SM
        seg_step = float(cfg.state_sm90_segment_t_cost) * (-(-plan.S * HV // _num_sms(dev)))
    else:
        bvp = int(cfg.state_sm90_segment_BV) if cfg.state_sm90_segment_pass else _state_bv(K, V, dev)
        per_sm = -(-plan.S * HV * (cdiv(V, bvp) + cdiv(K, bvp)) // _num_sms(dev))
        seg_step = (float(cfg.state_sm90_segment_pass_cost) if per_sm <= 1
                    else float(cfg.state_sm90_segment_pass_cost2) * (-(-per_sm // 2)))
    fused_step = (1.0 if bv == 32 else float(cfg.state_sm90_wide_step_cost) if bv == 64
                  else float(cfg.state_sm90_t_step_cost))
    return (min(L, longest) * (seg_step + fused_step) + float(cfg.state_sm90_merge_cost) * (-(-longest // L))
            + float(cfg.state_sm90_segment_fixed_cost))


def _one_wave_len(ci: ChunkIndex, HV: int, V: int, bv: int, dev, min_len: int) -> int:
    """Chunks per segment of the shortest segments (a power-of-two multiple of ``min_len``, the planner's) whose fused
    final pass at V tile ``bv`` (grid V / bv x HV x segments) fits one wave (:func:`plan.one_wave_segment_len`); 0
    where no such split cuts a sequence in two (or bv does not divide V)."""
    return 0 if V % bv else one_wave_segment_len(ci, HV * (V // bv), dev, min_len)


def chunk_state_pass(k: torch.Tensor, w: Optional[torch.Tensor], u: Optional[torch.Tensor], g_cum: torch.Tensor,
                     initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                     cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                     use_qk_l2norm_in_kernel: bool = False, *, v: Optional[torch.Tensor] = None,
                     beta: Optional[torch.Tensor] = None, ainv: Optional[torch.Tensor] = None,
                     h_dtype: torch.dtype = torch.float32, vnew_dtype: Optional[torch.dtype] = None,
                     store_h: bool = True, store_vnew: bool = True, state_layout: str = "v_last",
                     final_state: Optional[torch.Tensor] = None, state_indices: Optional[torch.Tensor] = None,
                     segment_chunks: Optional[int] = None, chunk_index: Optional[ChunkIndex] = None,
                     dot_dtype: Optional[torch.dtype] = None, split_h: Optional[bool] = None,
                     rk: Optional[torch.Tensor] = None, final_indices: Optional[torch.Tensor] = None,
                     checkpoint_indices: Optional[torch.Tensor] = None, checkpoint_every: int = 0,
                     checkpoint_pool: Optional[torch.Tensor] = None, output: Optional[dict] = None,
                     buffers: Optional[tuple] = None):
    """The sequential inter-chunk pass.

    k [B, T, H, K] (raw; L2-normalised in-kernel when asked), g_cum [B, T, HV] fp32, and either
    w [B, T, HV, K] + u [B, T, HV, V] (``v_new = u - w h``), or (pass w = u = None) ``v`` [B, T, HV, V] (strided ok),
    ``beta`` [B, T, HV] and ``ainv`` [B, T, HV, 64] (from :func:`chunk_fwd_prepare`; any float dtype):
    ``v_new = Ainv @ (beta * (v - (exp(g_cum) k_hat) @ h))``, which skips the w/u round trip and is more accurate.
    initial_state: None or [N, HV, K, V] ("v_last") / [N, HV, V, K] ("k_last"), any float dtype, any strides; with
    ``state_indices`` ([N] int, -1 = padding) it is a pool [P, HV, ...] read at rows ``state_indices[n]``.
    Returns ``(h [NT, HV, K, V] h_dtype (start state of every chunk, v_last), v_new [B, T, HV, V], final)`` where
    final is None unless ``output_final_state`` or ``final_state`` is given: fp32 [N, HV, ...] in ``state_layout``,
    or written into ``final_state`` (e.g. the pool itself, rows ``state_indices[n]``, its dtype).
    ``final_indices`` ([N] int, with ``state_indices``): the final state goes to rows ``final_indices[n]`` of
    ``final_state`` instead (separate write rows; -1 = not written; a padding sequence writes nothing).
    ``checkpoint_indices`` ([N, C] int) with ``checkpoint_every`` (a multiple of 64) and ``checkpoint_pool``
    ([P, HV, ...] in ``state_layout``, default ``final_state``): the state of sequence n after its
    ``(c + 1) * checkpoint_every``-th token -> pool row ``checkpoint_indices[n, c]`` (-1 / past the end: skipped;
    padding sequences write nothing), in the same pass (the portable kernel: the Hopper pass says unsupported).
    ``output``: dict(q=, p=, qf=, o=, o_idx=, PO=, BV=, plan=) computes the output in the same pass with the fused
    Hopper kernel (``hopper._chunk_fused_sm90_kernel``; BV and plan from :func:`fused_output_plan`): o [B, T, HV, V]
    (contiguous) is written from P / qf of the prepare kernel, and h / v_new are None (never in memory) unless
    ``output["states"]`` (then the fused kernel stores them too; h in the tensor-core dtype).
    ``output["row_scalars"]``: (VP, VB) where g_cum and rk are o's fp32 view holding them in o's rows
    (``hopper.row_scalar_pack``; the fused kernel forms P and qf itself there).
    ``output["beta_in_ainv"]``: ``ainv`` holds Ainv diag(beta) (``chunk_fwd_prepare``'s form of that name; only where
    :func:`beta_in_ainv_ok` says the plan's kernels take it).
    v_new dtype: ``vnew_dtype``, default the tensor-core dtype (bf16 for bf16 inputs).
    ``buffers``: (h, v_new) tensors of those shapes and dtypes to write instead of new ones (the backward allocates
    them on the stream that consumes them before running this pass on a side stream).
    ``segment_chunks``: None = heuristic / tuning table, -1 = never segment, n > 0 = segments of n chunks.
    ``split_h``: compute the h product of v_new as hi + lo half-precision parts (default: ``chunk_fwd.state_split_h``).
    ``rk``: the L2 row scalings of k (fp32 [B, T, H], from :func:`l2_rnorm` or the prepare kernel); computed here
    when the L2 norm is on and none is given.
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    from_ainv = ainv is not None
    if from_ainv:
        if v is None or beta is None:
            raise ValueError("chunk_state_pass: ainv needs v and beta")
        HV, V = v.shape[2], v.shape[3]
    else:
        HV, V = u.shape[2], u.shape[3]
    dev = k.device
    cfg = tuning.chunk_fwd(dev)
    ci = get_chunk_index(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = dot_dtype or (_dot_dtype(k, v) if from_ainv else _dot_dtype(k, w))
    split_h = bool(cfg.state_split_h if split_h is None else split_h) and dt != torch.float32
    vnew_dtype = vnew_dtype or (dt if from_ainv else u.dtype)
    ht = final_state
    if ht is None and output_final_state:
        shape = (ci.N, HV, K, V) if state_layout == "v_last" else (ci.N, HV, V, K)
        ht = _empty(*shape, device=dev, dtype=torch.float32)
    if ci.N == 0 or HV == 0:
        return (_empty(ci.NT, HV, K, V, device=dev, dtype=h_dtype) if store_h else None,
                _empty(B, T, HV, V, device=dev, dtype=vnew_dtype) if store_vnew else None, ht)
    KP = _pow2(K)
    BV = _state_bv(K, V, dev)
    xs, mats = (v, ainv) if from_ainv else (u, w)
    ckpt = checkpoint_indices is not None and checkpoint_indices.shape[1] > 0
    # the final pass (from the true starts) with the output fused in: tile and plan decided by fused_output_plan
    fused = output is not None
    beta_in_ainv = fused and bool(output.get("beta_in_ainv"))
    if fused:
        if not from_ainv:
            raise ValueError("chunk_state_pass: output= needs the ainv mode (v, beta, ainv)")
        plan, bv_fused = output["plan"], output["BV"]
        if beta_in_ainv and not (bv_fused == 128 and beta_in_ainv_ok(k, v, ainv, dt, plan, split_h)):
            raise ValueError("chunk_state_pass: an Ainv diag(beta) needs the register-state kernel and, segmented, "
                             "the one-CTA segment pass (beta_in_ainv_ok)")
    else:
        sm90 = (cfg.state_sm90 and xs is not None and not split_h
                and hopper.supported(k, xs, mats, None, None, dt, K, V, 1, False, checkpoints=ckpt))
        plan, sm90_tile = _pass_plan(ci, HV, K, V, dev, sm90, segment_chunks)
    keep = not fused or bool(output.get("states"))
    if buffers is not None:
        h, v_new = buffers
    else:
        h = _empty(ci.NT, HV, K, V, device=dev, dtype=h_dtype) if (store_h and keep) else None
        v_new = _empty(B, T, HV, V, device=dev, dtype=vnew_dtype) if (store_vnew and keep) else None
    dummy = g_cum
    idx = state_indices
    out_idx = idx if final_indices is None else _written_rows(final_indices, idx, P_read=(
        initial_state.shape[0] if initial_state is not None else 0))
    cu = _cu_arg(cu_seqlens, ci.chunk_offsets)
    packed = False
    if from_ainv:
        # (the register-state kernel and the Gluon segment pass read an Ainv packed into o's rows as it is:
        # hopper.launch_fused_pass / launch_state_pass)
        packed = fused and bv_fused == 128 and ainv.stride(2) != ainv.shape[3]
        mats = ainv if packed else ainv.contiguous()
        vv, bb, aa, ww, uu = v, beta, mats, dummy, dummy
        sv, sb = _strides3(v), _strides3(beta)
    else:
        vv, bb, aa, ww, uu = dummy, dummy, dummy, w, (u if u is not None else dummy)
        sv, sb = (0, 0, 0), (0, 0, 0)
    l2 = bool(use_qk_l2norm_in_kernel)
    if l2 and rk is None:
        rk = l2_rnorm(k)
    rk_arg = rk if l2 else dummy

    ck_kw = {}
    if ckpt:
        ck_pool = final_state if checkpoint_pool is None else checkpoint_pool
        ck_idx = _written_rows(checkpoint_indices, idx, initial_state.shape[0] if initial_state is not None else 0)
        ck_kw = dict(ck_pool=ck_pool, ck_idx=ck_idx, P2=ck_pool.shape[0], CK_E=int(checkpoint_every) // chunk_size,
                     CK_C=ck_idx.shape[1], s_ckn=ck_idx.stride(0), CKPT=True)
        ck_kw.update(zip(("s2n", "s2h", "s2k", "s2v"), _state_strides(ck_pool, state_layout)))

    def launch(Vd, bv, S, h_out, vn_out, h0, ht_, h0_idx, ht_idx, P0, P1, s0, s1, n_extra=0, ck=None, **flags):
        if fused and n_extra == 0:
            # Hopper: state pass and output in one warp-specialized kernel (hopper.py)
            hopper.launch_fused_pass(
                (cdiv(V, bv_fused), HV, S), output["q"], k, xs, bb, mats, output["p"],
                output["qf"], g_cum, rk_arg, output["o"], h0, ht_, h0_idx if h0_idx is not None else ci.chunk_offsets,
                ht_idx if ht_idx is not None else ci.chunk_offsets, output["o_idx"], plan.segments, cu, T, P0, P1,
                output["PO"], sb, s0, s1, H=H, HV=HV, K=K, V=V, use_l2=l2,
                is_varlen=ci.is_varlen, INIT=flags["INIT"], H0_BY_SEG=flags["H0_BY_SEG"],
                H0_INDEXED=flags["H0_INDEXED"], HT_BY_SEG=flags["HT_BY_SEG"], HT_INDEXED=flags["HT_INDEXED"],
                BV=bv_fused, stages=cfg.state_sm90_stages, h_out=h_out, vnew=vn_out, chunk_offsets=ci.chunk_offsets,
                transposed=bv_fused == 128, load_warp=bv_fused <= int(cfg.state_sm90_load_warp_bv),
                scale=output.get("scale", 1.0), pdl=cfg.pdl, row_scalars=output.get("row_scalars"),
                beta_in_ainv=beta_in_ainv)
            return
        bv9 = sm90_tile(S * HV) if (not fused and n_extra == 0 and Vd == V) else 0
        if bv9 and hopper.supported(k, xs, mats, h_out, vn_out, dt, K, V, flags["INIT"], split_h,
                                    checkpoints=bool(ck)):
            # Hopper: the Gluon form of this pass (TMA ring, asynchronous wgmma; hopper.py)
            hopper.launch_state_pass(
                (cdiv(V, bv9), HV, S), k, xs, bb, mats.contiguous(), g_cum, rk_arg, h_out, vn_out, h0, ht_,
                h0_idx if h0_idx is not None else ci.chunk_offsets, ht_idx if ht_idx is not None else ci.chunk_offsets,
                plan.segments, cu, ci.chunk_offsets, T, P0, P1, sb, s0, s1, H=H, HV=HV, K=K, V=V,
                use_l2=l2, is_varlen=ci.is_varlen, INIT=flags["INIT"], H0_BY_SEG=flags["H0_BY_SEG"],
                H0_INDEXED=flags["H0_INDEXED"], HT_BY_SEG=flags["HT_BY_SEG"], HT_INDEXED=flags["HT_INDEXED"],
                from_ainv=from_ainv, BV=bv9, stages=cfg.state_sm90_stages, pdl=cfg.pdl)
            return
        _launch(_chunk_state_kernel, (cdiv(Vd, bv) + n_extra, HV, S),
                k, vv, bb, aa, ww, uu, g_cum, rk_arg, h_out if h_out is not None else dummy,
                vn_out if vn_out is not None else dummy, h0 if h0 is not None else dummy,
                ht_ if ht_ is not None else dummy, h0_idx if h0_idx is not None else ci.chunk_offsets,
                ht_idx if ht_idx is not None else ci.chunk_offsets, plan.segments, ci.chunk_offsets, cu,
                T, P0, P1, cdiv(Vd, bv), *_strides3(k), *sv, *sb, *s0, *s1,
                H=H, HV=HV, K=K, V=Vd, KP=KP, BV=bv, USE_L2=l2, IS_VARLEN=ci.is_varlen,
                FROM_AINV=from_ainv, DT=_TL[dt], PREC=cfg.fp32_dot_precision, SPLIT_H=split_h,
                STORE_H=h_out is not None, STORE_VNEW=vn_out is not None, STORE_FINAL=ht_ is not None,
                num_warps=int(cfg.state_warps), num_stages=int(cfg.state_stages), maxnreg=cfg.state_maxnreg,
                **(ck or {}), **flags)

    s0 = _state_strides(initial_state, state_layout)
    s1 = _state_strides(ht, state_layout)
    P = initial_state.shape[0] if initial_state is not None else 0
    P1 = ht.shape[0] if ht is not None else 0
    has_u = from_ainv or u is not None
    if not plan.segmented:
        launch(V, BV, plan.S, h, v_new, initial_state, ht, idx, out_idx, P, P1, s0, s1,
               INIT=1 if initial_state is not None else 0, H0_BY_SEG=False, H0_INDEXED=idx is not None, HAS_U=has_u,
               HT_BY_SEG=False, HT_INDEXED=idx is not None, ck=ck_kw)
        return h, v_new, ht
    # ---- segmented: local states from zero, transition matrices, merge, then the pass from the true starts
    S = plan.S
    hloc = _empty(S, HV, K, V, device=dev, dtype=torch.float32)
    trans = _empty(S, HV, K, K, device=dev, dtype=torch.float32)
    vl = _state_strides(hloc, "v_last")
    st = _state_strides(trans, "v_last")
    # one launch: local states (programs 0 .. NV-1) and transition matrices (programs NV .. NV+NK-1)
    if _segment_t(cfg, k, xs, mats, dt, K, V, split_h, from_ainv):
        # Hopper, K = V = 128: both in one CTA per (value head, segment), transposed in registers (hopper_segments)
        hopper_segments.launch_segment_pass_t(
            k, xs, bb, mats, g_cum, rk_arg, trans, hloc, plan.segments, cu, T, S, sb, st, vl, H=H, HV=HV, K=K, V=V,
            use_l2=l2, is_varlen=ci.is_varlen, stages=cfg.state_sm90_stages, pdl=cfg.pdl,
            beta_in_ainv=beta_in_ainv)
    elif _segment_sm90(cfg, k, xs, mats, dt, K, V, split_h):
        # Hopper: as the Gluon state pass (INIT 3)
        bvs = int(cfg.state_sm90_segment_BV)
        hopper.launch_state_pass(
            (cdiv(V, bvs) + cdiv(K, bvs), HV, S), k, xs, bb, mats if packed else mats.contiguous(), g_cum, rk_arg,
            None, None, trans, hloc, ci.chunk_offsets, ci.chunk_offsets, plan.segments, cu, ci.chunk_offsets, T, 0,
            S, sb, st, vl,
            H=H, HV=HV, K=K, V=V, use_l2=l2, is_varlen=ci.is_varlen, INIT=3, H0_BY_SEG=False, H0_INDEXED=False,
            HT_BY_SEG=True, HT_INDEXED=False, from_ainv=from_ainv, BV=bvs, stages=cfg.state_sm90_stages,
            pdl=cfg.pdl)
    else:
        if packed:      # (forward.py packs only where the segment pass is Gluon: segment_pass_sm90_ok)
            aa = ainv.contiguous()
        launch(V, BV, S, None, None, trans, hloc, None, None, 0, S, st, vl, n_extra=cdiv(K, BV), INIT=3,
               H0_BY_SEG=False, H0_INDEXED=False, HAS_U=has_u, HT_BY_SEG=True, HT_INDEXED=False)
    hs = merge_segment_states(trans, hloc, plan, ci, initial_state, ht, idx, s0, s1, dummy, out_idx,
                              half=dt != torch.float32)
    launch(V, BV, S, h, v_new, hs, None, None, None, S, 0, vl, (0, 0, 0, 0), INIT=1,
           H0_BY_SEG=True, H0_INDEXED=False, HAS_U=has_u, HT_BY_SEG=False, HT_INDEXED=False, ck=ck_kw)
    return h, v_new, ht


__all__ = ["chunk_state_pass", "segment_pass_sm90_ok", "beta_in_ainv_ok"]
