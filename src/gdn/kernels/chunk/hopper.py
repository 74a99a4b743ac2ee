"""Hopper (sm_90) forms of the chunked forward's sequential state pass (``state.py``), written in Gluon: the state
pass alone (``_state_pass_sm90_kernel``: h per chunk and v_new to memory, for the backward and ``return_states``;
also the segment pass of segmented runs, INIT 3: local states from zero and transition matrices in one launch),
and the state pass with the output fused in (``_chunk_fused_sm90_kernel``: a second warpgroup computes
``o = diag(qf) (q @ h_c) + P @ v_new_c`` of chunk c from hand-off slots in shared memory while the first runs chunk
c + 1; P and qf come from the prepare kernel; no h / v_new in memory; at V tile 32 a one-warp load partition fills
its TMA ring); and that fused pass with the state transposed
and held in registers on 128-column tiles (``_chunk_fused_t_sm90_kernel``, for grids past one wave; a one-warp load
partition fills its TMA ring and the chunks' gate rows).

Same math, inputs and outputs as the portable ``_chunk_state_kernel`` in its default mode (``v_new`` from Ainv,
no fused output), for one program per (V tile, value head, segment)::

    for every chunk c of the segment (64 tokens, rows past the sequence's end masked):
      1. h_out[c] = bf16(h)                                   (TMA store from shared memory)
      2. r        = beta * (v - diag(exp(g_cum) r_k) (k @ h))   [64, BV]   k @ h: async wgmma, k and h in smem
      3. v_new    = Ainv @ r                                   [64, BV]   async wgmma, Ainv in smem
      4. h        = exp(g_last) h + k^T @ (diag(exp(g_last - g_cum) r_k) v_new)   [K, BV] fp32 accumulator

What Triton's ``tl`` cannot express and this form does (bench/NOTES.md, "Hopper state pass"):

* k, v and Ainv of chunk c + NS - 1 are copied by TMA into an NS-deep shared-memory ring while chunk c computes
  (one mbarrier per stage), so no chunk step waits for global memory; the per-row gates (g_cum, beta, r_k, g_last)
  of chunk c + 1 are loaded into registers one step ahead;
* the products are asynchronous warpgroup MMAs whose waits sit right before the first use of their result (the
  v tile is read from shared memory while k @ h runs);
* the per-chunk state leaves through a TMA store that overlaps the next products.

Layouts: k, v are read as 2-D views [B*T, H*K] / [B*T, HV*V] (token rows, strided rows allowed, last dim contiguous);
Ainv [B*T, HV*64]; h_out [NT*HV*K, V] (v_last); v_new [B, T, HV, V] contiguous; initial / final states through
their 4 strides (v_last or k_last, pool rows through an index). Rows of a chunk past the sequence's end are read
(they belong to the next sequence or are TMA zero fill) and masked out of every result.

The Gluon API moves between Triton releases: everything version-dependent is imported through ``_gluon_api``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _gluon_api as G
from ..common import pdl_enter
from ..tuning import capability
from ..launch import launch, pdl_args

CHUNK = 64

if G.AVAILABLE:
    gluon, gl = G.gluon, G.gl
    tma, mbarrier, tma_load, tma_store = G.tma, G.mbarrier, G.tma_load, G.tma_store
    cta_barrier = G.cta_barrier
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait = G.fence_async_shared, G.warpgroup_mma, G.warpgroup_mma_wait

    @gluon.jit
    def _gram_rnorm(gram, diag):
        """The L2 row scalings 1 / |x_i| (eps 1e-6 under the root) of a tile x from its Gram matrix x x^T (fp32;
        ``diag`` its diagonal mask); a row vector in the Gram matrix's row layout."""
        return gl.rsqrt(gl.sum(gl.where(diag, gram, 0.0), axis=1) + 1e-6)

    @gluon.jit
    def _tile_rnorm(buf, out: gl.constexpr, num_warps: gl.constexpr):
        """The L2 row scalings 1 / |x_i| (eps 1e-6 under the root) of a [64, K] tile x in shared memory (K a multiple
        of 64), by row sums of squares on the CUDA cores, 64 columns at a time (as the Gram matrix's diagonal, where
        that product is not otherwise needed); a row vector in layout ``out``."""
        C: gl.constexpr = 64
        K: gl.constexpr = buf.type.shape[1]
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        ss = gl.zeros([C], gl.float32, layout=gl.SliceLayout(1, lay))
        for j in gl.static_range(K // C):
            x = buf.slice(j * C, C, dim=1).load(lay).to(gl.float32)
            ss += gl.sum(x * x, axis=1)
        return gl.convert_layout(gl.rsqrt(ss + 1e-6), out)

    @gluon.jit
    def _zero_rows_past(buf, nv, num_warps: gl.constexpr):
        """Zeros rows nv.. of a [64, W] tile in shared memory (W a multiple of 64), 64 columns at a time. A partial
        chunk's TMA copy brings the next sequence's tokens into those rows; a product that sums over tokens (S +=
        k^T d, Q K^T under Gamma's zeros) would turn a non-finite neighbour into NaN through 0 * inf: one bad request
        would poison its neighbours (``gdn check`` chunk_nan_isolation). The caller runs it on a sequence's partial
        last chunk only (a uniform branch) and fences before the tile's asynchronous readers; bench/NOTES.md prices
        where each kernel does it."""
        C: gl.constexpr = 64
        W: gl.constexpr = buf.type.shape[1]
        gl.static_assert(W % C == 0, "_zero_rows_past: a tile of 64-column blocks")
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        keep = (gl.arange(0, C, layout=gl.SliceLayout(1, lay)) < nv)[:, None]
        for j in gl.static_range(W // C):
            blk = buf.slice(j * C, C, dim=1)
            x = blk.load(lay)
            blk.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _decay_tile(c_r, c_c, mask):
        """Gamma[i, j] = exp(c_i - c_j) where ``mask`` (the causal part), else 0, from a chunk's cumulative gates as
        a row vector ``c_r`` and a column vector ``c_c``: one exp2 per element."""
        LOG2E: gl.constexpr = 1.4426950408889634
        return gl.exp2(gl.where(mask, (c_r * LOG2E)[:, None] - (c_c * LOG2E)[None, :], float("-inf")))

    @gluon.jit
    def _state_row(idx, i_s, n, P, BY_SEG: gl.constexpr, INDEXED: gl.constexpr):
        """(row, valid) of a state in a [rows, HV, ...] buffer: segment i_s (BY_SEG) or sequence n, mapped through the
        pool index ``idx`` when INDEXED (negative or >= P: invalid, nothing read or written)."""
        if BY_SEG:
            row = i_s.to(gl.int64)
        else:
            row = n.to(gl.int64)
        ok = row >= 0
        if INDEXED:
            row = gl.load(idx + row).to(gl.int64)
            ok = (row >= 0) & (row < P)
        return row, ok

    @gluon.jit
    def _issue_chunk_loads(k_desc, v_desc, a_desc, bar, k_buf, v_buf, a_buf, row, col_k, col_v, col_a, pred,
                           nbytes: gl.constexpr, with_v=True):
        """TMA copies of one chunk's k [64, K], v (or u) [64, BV] and Ainv [64, 64] (or w [64, K]) into one ring stage,
        completing on ``bar``; nothing when ``pred`` is false (past the segment); v only where ``with_v`` (a
        transition tile of the segment pass reads none: one of two complementary expects arms the barrier)."""
        vbytes: gl.constexpr = v_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes, pred=pred & with_v)
        mbarrier.expect(bar, nbytes - vbytes, pred=pred & (not with_v))
        tma_load(k_desc, [row, col_k], bar, k_buf, pred=pred)
        tma_load(v_desc, [row, col_v], bar, v_buf, pred=pred & with_v)
        tma_load(a_desc, [row, col_a], bar, a_buf, pred=pred)

    @gluon.jit
    def _row_scalar(ptr, tok0, row0, i, nv, head, i_hv, i_v, NHEADS: gl.constexpr, HV: gl.constexpr,
                    VP: gl.constexpr, VB: gl.constexpr, FIELD: gl.constexpr):
        """Address of a per-token fp32 scalar (g_cum, r_k, flag) of token ``row0 + i`` of a chunk starting at
        token row ``row0`` with ``nv`` valid rows (batch row offset ``tok0``): ``ptr[tok, head]`` of its own
        [B*T, NHEADS] buffer (VP = 0; ``head`` the key or the value head), or (VP > 0; ``ptr`` o's fp32 view) entry
        e = FIELD nv + i of V tile ``i_v``'s block of the chunk in o's rows: the block's rows (VP fp32 apart per
        token row and value head) hold VB fp32 each, filled row after row, so a chunk's scalars lie densely in its
        first rows (3 nv entries in nv rows where VB >= 3: never past the chunk's last valid row) and only that tile's
        CTA stores o there (:data:`ROW_SCALAR_FIELDS`)."""
        if VP == 0:
            p = ptr + (tok0 + row0 + i) * NHEADS + head
        else:
            e = FIELD * nv + i
            p = ptr + ((tok0 + row0 + e // VB).to(gl.int64) * HV + i_hv) * VP + (i_v * VB + e % VB)
        return p

    @gluon.jit
    def _chunk_gates(gcum, beta, rk_in, row0, to, eos, tok0, i_b, i_h, i_hv, has_chunk, s_bb, s_bt, s_bh,
                     H: gl.constexpr, HV: gl.constexpr, USE_L2: gl.constexpr, i_v=0, VP: gl.constexpr = 0,
                     VB: gl.constexpr = 0):
        """Per-row inputs of the chunk whose token rows are ``row0 + to`` (to = 0..63): g_cum, beta (fp32), r_k (1
        without the L2 norm; 0 past the sequence) and g_cum of its last valid row (0 when ``has_chunk`` is false).
        VP, VB: g_cum and r_k packed into o's rows (:func:`_row_scalar`)."""
        rows = row0 + to
        m = rows < eos
        nv = gl.minimum(eos - row0, 64)
        g = gl.load(_row_scalar(gcum, tok0, row0, to, nv, i_hv, i_hv, i_v, HV, HV, VP, VB, 0), mask=m, other=0.0)
        b = gl.load(beta + i_b * s_bb + rows * s_bt + i_hv * s_bh, mask=m, other=0.0).to(gl.float32)
        if USE_L2:
            rk = gl.load(_row_scalar(rk_in, tok0, row0, to, nv, i_h, i_hv, i_v, H, HV, VP, VB, 1), mask=m,
                         other=0.0)
        else:
            rk = gl.where(m, 1.0, 0.0)
        last = nv - 1
        g_last = gl.load(_row_scalar(gcum, tok0, row0, last, nv, i_hv, i_hv, i_v, HV, HV, VP, VB, 0),
                         mask=has_chunk, other=0.0)
        return g, b, rk, g_last

    @gluon.jit
    def _seq_span(n, cu_seqlens, T, IS_VARLEN: gl.constexpr):
        """Batch row i_b and token span [bos, eos) of sequence n (varlen: one row, spans from cu_seqlens)."""
        if IS_VARLEN:
            i_b = 0
            bos = gl.load(cu_seqlens + n)
            eos = gl.load(cu_seqlens + n + 1)
        else:
            i_b = n
            bos = 0
            eos = T
        return i_b, bos, eos

    @gluon.jit
    def _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN: gl.constexpr):
        """Sequence n, chunk range [c_beg, c_end), batch row i_b and token span [bos, eos) of segment i_s."""
        n = gl.load(segments + 3 * i_s)
        c_beg = gl.load(segments + 3 * i_s + 1)
        c_end = gl.load(segments + 3 * i_s + 2)
        i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
        return n, c_beg, c_end, i_b, bos, eos

    @gluon.jit
    def _state_steps(
        k_desc, v_desc, a_desc, h_desc, beta, gcum, rk_in, vnew, h0, ht, h0_idx, ht_idx,
        k_s, v_s, a_s, bars, emp, h_s, r_s, d_s, vn_s, ready, free,
        n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, choff, T, P0, P1,
        s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, INIT: gl.constexpr, H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr,
        STORE_H: gl.constexpr, STORE_VNEW: gl.constexpr, STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr,
        HT_INDEXED: gl.constexpr, NS: gl.constexpr, FROM_AINV: gl.constexpr, FUSED: gl.constexpr,
        TMA_WARP: gl.constexpr, AP: gl.constexpr = 0, VP: gl.constexpr = 0, VB: gl.constexpr = 0,
    ):
        """The sequential chain of one (V tile, value head, segment), 4 warps (module docstring, steps 1-4). FUSED:
        the chunk's start state and v_new are handed to the output partition through the 2-deep rings ``h_s`` /
        ``vn_s`` (``ready`` arrives when a slot is full, ``free`` when the output partition has read it). TMA_WARP:
        the ring is filled by a load warp (:func:`_tma_loader`); the chain releases each stage on ``emp``. AP: the
        columns between two value heads' Ainv tiles in ``a_desc``'s rows (0: the tile width, its own buffer; 128:
        packed into o's rows, which the segment pass of a segmented register-state run reads). VP, VB: g_cum and r_k
        packed into o's rows (:func:`_row_scalar`)."""
        C: gl.constexpr = 64
        NH: gl.constexpr = h_s.type.shape[0]
        i_h = i_hv // (HV // H)
        tok0 = i_b * T                      # first token row of this batch row in the [B*T, ...] views
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BV, 16])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)
        dt: gl.constexpr = k_desc.dtype
        ok = gl.arange(0, K, layout=rows_l)
        if INIT == 3:   # tiles i_v >= V / BV: a transition tile (columns of the K x K matrix, no v)
            NV: gl.constexpr = V // BV
            is_t = i_v >= NV
            i_c = i_v - is_t.to(gl.int32) * NV
            ov = i_c * BV + gl.arange(0, BV, layout=cols_l)
            m_kv = (ok[:, None] < K) & (ov[None, :] < V + is_t.to(gl.int32) * (K - V))
        else:
            is_t = False
            i_c = i_v
            ov = i_v * BV + gl.arange(0, BV, layout=cols_l)
            m_kv = (ok[:, None] < K) & (ov[None, :] < V)
        to = gl.arange(0, C, layout=rows_l)

        # ---- initial state (fp32 registers, the wgmma accumulator layout)
        if INIT == 1:
            row0, ok0 = _state_row(h0_idx, i_s, n, P0, H0_BY_SEG, H0_INDEXED)
            p0 = h0 + row0 * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v
            h = gl.load(p0, mask=m_kv & ok0, other=0.0).to(gl.float32)
        elif INIT == 3:     # identity on a transition tile, zeros on a local-state tile
            h = gl.where((ok[:, None] == ov[None, :]) & is_t, 1.0, 0.0)
        else:
            h = gl.zeros([K, BV], gl.float32, layout=mma)

        AC: gl.constexpr = a_desc.block_type.shape[1]          # Ainv: 64 columns; w: K
        nbytes: gl.constexpr = (C * K + C * BV + C * AC) * (dt.primitive_bitwidth // 8)
        col_k = i_h * K
        col_v = i_hv * V + i_c * BV
        if AP == 0:
            col_a = i_hv * AC
        else:
            col_a = i_hv * AP
        with_v = not is_t
        # ---- prologue: chunks c_beg .. c_beg + NS - 2 into the ring
        if not TMA_WARP:
            for j in gl.static_range(NS - 1):
                _issue_chunk_loads(k_desc, v_desc, a_desc, bars.index(j), k_s.index(j), v_s.index(j), a_s.index(j),
                                   tok0 + bos + (c_beg + j) * C, col_k, col_v, col_a, c_beg + j < c_end, nbytes,
                                   with_v)
        # per-row gates of the first chunk
        g_n, b_n, rk_n, gl_n = _chunk_gates(gcum, beta, rk_in, bos + c_beg * C, to, eos, tok0, i_b, i_h, i_hv,
                                            c_beg < c_end, s_bb, s_bt, s_bh, H, HV, USE_L2, i_v, VP, VB)
        if VP > 0:  # (g_cum and r_k in o's rows: two chunks ahead, their latency under a whole step)
            g_nn, b_nn, rk_nn, gl_nn = _chunk_gates(gcum, beta, rk_in, bos + (c_beg + 1) * C, to, eos, tok0, i_b, i_h,
                                                    i_hv, c_beg + 1 < c_end, s_bb, s_bt, s_bh, H, HV, USE_L2, i_v, VP,
                                                    VB)

        zero = gl.zeros([C, BV], gl.float32, layout=mma)
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            phase = (it // NS) & 1
            slot = it % NH
            # ---- refill the stage consumed one step ago with chunk c + NS - 1
            if not TMA_WARP:
                sf = (it + NS - 1) % NS
                _issue_chunk_loads(k_desc, v_desc, a_desc, bars.index(sf), k_s.index(sf), v_s.index(sf),
                                   a_s.index(sf), tok0 + bos + (c + NS - 1) * C, col_k, col_v, col_a,
                                   c + NS - 1 < c_end, nbytes, with_v)
            # ---- this chunk's gates (loaded one step ahead), then the next chunk's
            rows = bos + c * C + to
            m = rows < eos
            b_g = g_n
            b_beta = b_n
            rk = rk_n
            g_last = gl_n
            if VP > 0:
                g_n, b_n, rk_n, gl_n = g_nn, b_nn, rk_nn, gl_nn
                g_nn, b_nn, rk_nn, gl_nn = _chunk_gates(gcum, beta, rk_in, bos + (c + 2) * C, to, eos, tok0, i_b, i_h,
                                                        i_hv, c + 2 < c_end, s_bb, s_bt, s_bh, H, HV, USE_L2, i_v, VP,
                                                        VB)
            else:
                g_n, b_n, rk_n, gl_n = _chunk_gates(gcum, beta, rk_in, bos + (c + 1) * C, to, eos, tok0, i_b, i_h,
                                                    i_hv, c + 1 < c_end, s_bb, s_bt, s_bh, H, HV, USE_L2, i_v, VP, VB)

            # ---- 1. the chunk's start state: bf16 copy in shared memory (operand of k @ h, and h_out[c])
            hs = h_s.index(slot)
            if STORE_H:
                tma.store_wait(0)
            if FUSED:   # the output partition has read this slot (chunk c - NH)
                mbarrier.wait(free.index(slot), ((it // NH) & 1) ^ 1)
            hs.store(h.to(dt))
            fence_async_shared()
            cta_barrier()
            if STORE_H:
                tma_store(h_desc, [((choff + c) * HV + i_hv) * K, i_v * BV], hs)
            mbarrier.wait(bars.index(s), phase)
            if FUSED:
                if bos + c * C + C > eos:
                    # a sequence's partial last chunk: the next sequence's k rows out of step 4 (S += k^T d; k @ h
                    # reads them under a where). The fused kernels zero them here with a fence of their own, the
                    # state pass before d's store below under d's fence: each the cheaper placement for its kernel
                    # (bench/NOTES.md). A uniform branch
                    _zero_rows_past(k_s.index(s), eos - bos - c * C, 4)
                    fence_async_shared()
                    cta_barrier()
            dec = gl.where(m, gl.exp(g_last - b_g) * rk, 0.0)
            if FROM_AINV:
                # ---- 2. r = beta * (v - diag(exp(g) r_k) (k @ h))
                kh = warpgroup_mma(k_s.index(s), hs, zero, use_acc=False, is_async=True)
                vt = v_s.index(s).load(mma).to(gl.float32)
                if INIT == 3:
                    vt = gl.where(is_t, 0.0, vt)
                fk = gl.exp(b_g) * rk
                kh = warpgroup_mma_wait(0, deps=[kh])
                r = gl.where(m[:, None], (vt - kh * fk[:, None]) * b_beta[:, None], 0.0)
                r_s.store(r.to(dt))
                fence_async_shared()
                cta_barrier()
                # ---- 3. v_new = Ainv @ r
                vn = warpgroup_mma(a_s.index(s), r_s, zero, use_acc=False, is_async=True)
                vn = warpgroup_mma_wait(0, deps=[vn])
            else:
                # ---- 2-3. v_new = u - w @ h (w, u from the prepare kernel, in the ring's a / v slots)
                wh = warpgroup_mma(a_s.index(s), hs, zero, use_acc=False, is_async=True)
                ut = v_s.index(s).load(mma).to(gl.float32)
                if INIT == 3:
                    ut = gl.where(is_t, 0.0, ut)
                wh = warpgroup_mma_wait(0, deps=[wh])
                vn = ut - wh
            if STORE_VNEW:
                pv = vnew + ((tok0 + rows) * HV + i_hv)[:, None] * V + ov[None, :]
                gl.store(pv, vn.to(vnew.dtype.element_ty), mask=m[:, None] & (ov[None, :] < V))
            if FUSED:
                vn_s.index(slot).store(gl.where(m[:, None], vn, 0.0).to(dt))
            d = gl.where(m[:, None], vn * dec[:, None], 0.0)
            if not FUSED:
                if bos + c * C + C > eos:   # the state pass's placement of the zeroing above, fenced with d
                    _zero_rows_past(k_s.index(s), eos - bos - c * C, 4)
            d_s.store(d.to(dt))
            fence_async_shared()
            cta_barrier()
            if FUSED:
                mbarrier.arrive(ready.index(slot), count=1)
            # ---- 4. h = exp(g_last) h + k^T d
            h = warpgroup_mma(k_s.index(s).permute((1, 0)), d_s, h * gl.exp(g_last), is_async=True)
            h = warpgroup_mma_wait(0, deps=[h])
            if TMA_WARP:
                mbarrier.arrive(emp.index(s), count=1)      # stage s free for chunk c + NS

        if STORE_H:
            tma.store_wait(0)
        if INIT == 3:   # local state -> ht[segment], transition -> h0[segment] (both with their strides)
            rs = i_s.to(gl.int64)
            p1 = ht + rs * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v
            gl.store(p1, h.to(ht.dtype.element_ty), mask=m_kv & (not is_t))
            p0 = h0 + rs * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v
            gl.store(p0, h.to(h0.dtype.element_ty), mask=m_kv & is_t)
        elif STORE_FINAL:
            row1, ok1 = _state_row(ht_idx, i_s, n, P1, HT_BY_SEG, HT_INDEXED)
            p1 = ht + row1 * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v
            gl.store(p1, h.to(ht.dtype.element_ty), mask=m_kv & ok1)

    @gluon.jit
    def _tma_loader(k_desc, v_desc, a_desc, k_s, v_s, a_s, bars, emp, i_v, i_hv, i_b, bos, c_beg, c_end, T,
                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                    NS: gl.constexpr):
        """Load warp of the fused kernel (TMA_WARP): chunk c's k, v and Ainv into ring stage c % NS once the chain
        has released it (``emp``: chunk c - NS done)."""
        C: gl.constexpr = 64
        dt: gl.constexpr = k_desc.dtype
        AC: gl.constexpr = a_desc.block_type.shape[1]
        nbytes: gl.constexpr = (C * K + C * BV + C * AC) * (dt.primitive_bitwidth // 8)
        tok0 = i_b * T
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            mbarrier.wait(emp.index(s), ((it // NS) & 1) ^ 1, pred=it >= NS)
            _issue_chunk_loads(k_desc, v_desc, a_desc, bars.index(s), k_s.index(s), v_s.index(s), a_s.index(s),
                               tok0 + bos + c * C, (i_hv // (HV // H)) * K, i_hv * V + i_v * BV, i_hv * AC,
                               c < c_end, nbytes)

    @gluon.jit
    def _output_steps(
        q_desc, p_desc, q_s, p_s, qbars, h_s, vn_s, ready, free, qf, o, o_idx, gcum, rk_in, scale,
        n, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, PO,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        O_INDEXED: gl.constexpr, PK: gl.constexpr, USE_L2: gl.constexpr, VP: gl.constexpr = 0,
        VB: gl.constexpr = 0,
    ):
        """Output partition of the fused kernel (4 warps), chunk by chunk behind the state partition::

            o[chunk, V tile] = diag(qf) (q @ h_c) + P @ v_new_c

        with P = causal(scale (r_q r_k^T) Gamma Q K^T) and qf = scale r_q exp(g_cum) from the prepare kernel. q and P
        come by TMA into a 2-deep ring (``q_s`` / ``p_s``, one mbarrier per stage); h_c and v_new_c from the state
        partition's hand-off slots. PK: P and qf formed here instead (``p_desc`` is then k's descriptor and ``p_s``
        holds k tiles; Q K^T and, with the L2 norm, Q Q^T for r_q issued before the hand-off is waited for (Q Q^T on
        the tensor cores here: r_q by row sums on the CUDA cores, as the prepare kernel takes it, made the V tile 64
        kernel at 64/64 4% slower); r_k and g_cum from the prepare kernel). Rows past the sequence's end are not
        stored; a sequence whose pool row is invalid (O_INDEXED) gets zeros, as the output kernel writes. VP, VB
        (PK): g_cum and r_k packed into o's rows (:func:`_row_scalar`); a chunk's are read before this partition
        stores that chunk's o rows, which hold them (the chain reads them before it hands the chunk over)."""
        C: gl.constexpr = 64
        NQ: gl.constexpr = q_s.type.shape[0]
        NH: gl.constexpr = h_s.type.shape[0]
        i_h = i_hv // (HV // H)
        tok0 = i_b * T
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BV, 16])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        dt: gl.constexpr = q_desc.dtype
        keep = n >= 0
        if O_INDEXED:
            idx = gl.load(o_idx + n)
            keep = (idx >= 0) & (idx < PO)
        if PK:
            nbytes: gl.constexpr = 2 * C * K * (dt.primitive_bitwidth // 8)
            col_p = i_h * K
        else:
            nbytes: gl.constexpr = (C * K + C * C) * (dt.primitive_bitwidth // 8)
            col_p = i_hv * C
        col_q = i_h * K
        for j in gl.static_range(NQ - 1):
            pred = c_beg + j < c_end
            mbarrier.expect(qbars.index(j), nbytes, pred=pred)
            tma_load(q_desc, [tok0 + bos + (c_beg + j) * C, col_q], qbars.index(j), q_s.index(j), pred=pred)
            tma_load(p_desc, [tok0 + bos + (c_beg + j) * C, col_p], qbars.index(j), p_s.index(j), pred=pred)
        to = gl.arange(0, C, layout=rows_l)
        ov = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, mma))
        zero = gl.zeros([C, BV], gl.float32, layout=mma)
        if PK:      # the [C, C] products Q K^T / Q Q^T and P as the register A operand of P @ v_new
            mma_p: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, C, 16])
            prow_l: gl.constexpr = gl.SliceLayout(1, mma_p)
            dot_p: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            zero_p = gl.zeros([C, C], gl.float32, layout=mma_p)
            tcol = gl.arange(0, C, layout=gl.SliceLayout(0, mma_p))
            trow = gl.arange(0, C, layout=prow_l)
            causal_p = tcol[None, :] <= trow[:, None]
            diag_p = tcol[None, :] == trow[:, None]
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NQ
            sf = (it + NQ - 1) % NQ
            pred = c + NQ - 1 < c_end
            mbarrier.expect(qbars.index(sf), nbytes, pred=pred)
            tma_load(q_desc, [tok0 + bos + (c + NQ - 1) * C, col_q], qbars.index(sf), q_s.index(sf), pred=pred)
            tma_load(p_desc, [tok0 + bos + (c + NQ - 1) * C, col_p], qbars.index(sf), p_s.index(sf), pred=pred)
            rows = bos + c * C + to
            m = rows < eos
            slot = it % NH
            if PK:
                # P = causal(scale r_q r_k^T Gamma Q K^T) and qf = scale r_q e^c, as the prepare kernel forms them
                cols = bos + c * C + tcol
                mc = cols < eos
                rows_p = bos + c * C + trow
                m_p = rows_p < eos
                r0 = bos + c * C
                nv = gl.minimum(eos - r0, C)
                c_r = gl.load(_row_scalar(gcum, tok0, r0, trow, nv, i_hv, i_hv, i_v, HV, HV, VP, VB, 0), mask=m_p,
                              other=0.0)
                c_c = gl.load(_row_scalar(gcum, tok0, r0, tcol, nv, i_hv, i_hv, i_v, HV, HV, VP, VB, 0), mask=mc,
                              other=0.0)
                if USE_L2:
                    rk_c = gl.load(_row_scalar(rk_in, tok0, r0, tcol, nv, i_h, i_hv, i_v, H, HV, VP, VB, 1), mask=mc,
                                   other=0.0)
                mbarrier.wait(qbars.index(s), (it // NQ) & 1)
                if bos + c * C + C > eos:
                    # a sequence's partial last chunk: the next sequence's keys out of Q K^T, whose columns past the
                    # end Gamma's zeros would turn into NaN (a where per element cost this partition 8% at 64/64)
                    _zero_rows_past(p_s.index(s), eos - bos - c * C, 4)
                    fence_async_shared()
                    cta_barrier()
                qk = warpgroup_mma(q_s.index(s), p_s.index(s).permute((1, 0)), zero_p, use_acc=False, is_async=True)
                if USE_L2:
                    qq = warpgroup_mma(q_s.index(s), q_s.index(s).permute((1, 0)), zero_p, use_acc=False,
                                       is_async=True)
                    qk, qq = warpgroup_mma_wait(0, deps=[qk, qq])
                    rq = _gram_rnorm(qq, diag_p) * scale
                else:
                    qk = warpgroup_mma_wait(0, deps=[qk])
                    rq = gl.full([C], 1.0, gl.float32, layout=prow_l) * scale
                gam = _decay_tile(c_r, c_c, causal_p & m_p[:, None])
                if USE_L2:
                    gam = gam * rk_c[None, :]
                pa = gl.convert_layout(((qk * gam) * rq[:, None]).to(dt), dot_p)
                f = gl.convert_layout(rq * gl.exp(c_r), rows_l)     # (rows of both products alike: no data movement)
                mbarrier.wait(ready.index(slot), (it // NH) & 1)
                acc = warpgroup_mma(q_s.index(s), h_s.index(slot), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                acc = warpgroup_mma(pa, vn_s.index(slot), acc * f[:, None], is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            else:
                f = gl.load(qf + (tok0 + rows) * HV + i_hv, mask=m, other=0.0)
                mbarrier.wait(qbars.index(s), (it // NQ) & 1)
                mbarrier.wait(ready.index(slot), (it // NH) & 1)
                acc = warpgroup_mma(q_s.index(s), h_s.index(slot), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                acc = warpgroup_mma(p_s.index(s), vn_s.index(slot), acc * f[:, None], is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            cta_barrier()
            mbarrier.arrive(free.index(slot), count=1)
            po = o + ((tok0 + rows) * HV + i_hv)[:, None] * V + ov[None, :]
            acc = gl.where(keep, acc, 0.0)
            gl.store(po, acc.to(o.dtype.element_ty), mask=m[:, None] & (ov[None, :] < V))

    @gluon.jit
    def _state_pass_sm90_kernel(
        k_desc, v_desc, a_desc, h_desc,
        beta, gcum, rk_in, vnew, h0, ht, h0_idx, ht_idx, segments, cu_seqlens, chunk_offsets,
        T, P0, P1, s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, INIT: gl.constexpr,
        H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr, STORE_H: gl.constexpr, STORE_VNEW: gl.constexpr,
        STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr, HT_INDEXED: gl.constexpr, NS: gl.constexpr,
        FROM_AINV: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False, AP: gl.constexpr = 0,
    ):
        """The state pass: h per chunk (TMA store), v_new, the final state; one program per (V tile, value head,
        segment), 4 warps. AP: Ainv's head pitch where it is not its tile width (:func:`_state_steps`)."""
        C: gl.constexpr = 64
        pdl_enter(PDL)
        i_v = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_s = gl.program_id(2)
        n, c_beg, c_end, i_b, bos, eos = _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        choff = gl.load(chunk_offsets + n)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NS, C, BV], v_desc.layout)
        AC: gl.constexpr = a_desc.block_type.shape[1]
        a_s = gl.allocate_shared_memory(dt, [NS, C, AC], a_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        h_s = gl.allocate_shared_memory(dt, [1, K, BV], h_desc.layout)
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        r_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        d_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=1)
        _state_steps(k_desc, v_desc, a_desc, h_desc, beta, gcum, rk_in, vnew, h0, ht, h0_idx, ht_idx,
                     k_s, v_s, a_s, bars, bars, h_s, r_s, d_s, d_s, bars, bars,
                     n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, choff, T, P0, P1,
                     s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                     H, HV, K, V, BV, USE_L2, INIT, H0_BY_SEG, H0_INDEXED, STORE_H, STORE_VNEW, STORE_FINAL,
                     HT_BY_SEG, HT_INDEXED, NS, FROM_AINV, False, False, AP)
        for j in gl.static_range(NS):
            mbarrier.invalidate(bars.index(j))

    @gluon.jit
    def _chunk_fused_sm90_kernel(
        k_desc, v_desc, a_desc, q_desc, p_desc, h_desc,
        beta, gcum, rk_in, qf, o, vnew, h0, ht, h0_idx, ht_idx, o_idx, segments, cu_seqlens, chunk_offsets,
        T, P0, P1, PO, scale, s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, INIT: gl.constexpr,
        H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr, STORE_H: gl.constexpr, STORE_VNEW: gl.constexpr,
        STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr, HT_INDEXED: gl.constexpr, O_INDEXED: gl.constexpr,
        NS: gl.constexpr, OUT_REGS: gl.constexpr, LREGS: gl.constexpr, TMA_WARP: gl.constexpr,
        num_warps: gl.constexpr, PK: gl.constexpr = False, PDL: gl.constexpr = False, VP: gl.constexpr = 0,
        VB: gl.constexpr = 0,
    ):
        """State pass and output in one kernel: per (V tile, value head, segment) a state partition (the default 4
        warps, :func:`_state_steps`) and an output partition (4 more warps, :func:`_output_steps`) that computes the
        output of chunk c while the state partition runs chunk c + 1. STORE_H / STORE_VNEW: the chain also stores
        h per chunk (TMA, from its hand-off slot) and v_new, as the state pass does (else neither is in memory).
        PK: the output partition forms P and qf itself from q, k (``p_desc`` is k's descriptor), g_cum, r_k and
        ``scale`` (``qf`` unused). VP, VB (PK): g_cum and r_k are one pointer, o's fp32 view, where the prepare kernel
        packed them into o's rows, a copy per V tile (:func:`_row_scalar`)."""
        C: gl.constexpr = 64
        NH: gl.constexpr = 2                # hand-off slots: the chain runs at most one chunk ahead of the output
        pdl_enter(PDL)
        i_v = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_s = gl.program_id(2)
        n, c_beg, c_end, i_b, bos, eos = _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        if STORE_H:
            choff = gl.load(chunk_offsets + n)
        else:
            choff = 0
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NS, C, BV], v_desc.layout)
        a_s = gl.allocate_shared_memory(dt, [NS, C, C], a_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        emp = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        q_s = gl.allocate_shared_memory(dt, [2, C, K], q_desc.layout)
        if PK:
            p_s = gl.allocate_shared_memory(dt, [2, C, K], p_desc.layout)
        else:
            p_s = gl.allocate_shared_memory(dt, [2, C, C], p_desc.layout)
        qbars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dt)
        h_s = gl.allocate_shared_memory(dt, [NH, K, BV], h_layout)
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        vn_s = gl.allocate_shared_memory(dt, [NH, C, BV], op_layout)
        r_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        d_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        ready = gl.allocate_shared_memory(gl.int64, [NH, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [NH, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=1)
            mbarrier.init(emp.index(j), count=1)
        for j in gl.static_range(2):
            mbarrier.init(qbars.index(j), count=1)
        for j in gl.static_range(NH):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(free.index(j), count=1)
        # TMA_WARP (V tile 32: tuning.chunk_fwd.state_sm90_load_warp_bv): a third partition, one warp, fills the ring
        # (two calls: Gluon 3.6 builds no partition tuple outside the call)
        if TMA_WARP:
            gl.warp_specialize([
                (_state_steps, (k_desc, v_desc, a_desc, h_desc, beta, gcum, rk_in, vnew, h0, ht, h0_idx, ht_idx,
                                k_s, v_s, a_s, bars, emp, h_s, r_s, d_s, vn_s, ready, free,
                                n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, choff, T, P0, P1,
                                s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                                H, HV, K, V, BV, USE_L2, INIT, H0_BY_SEG, H0_INDEXED, STORE_H, STORE_VNEW,
                                STORE_FINAL, HT_BY_SEG, HT_INDEXED, NS, True, True, True, 0, VP, VB)),
                (_output_steps, (q_desc, p_desc, q_s, p_s, qbars, h_s, vn_s, ready, free, qf, o, o_idx, gcum,
                                 rk_in, scale, n, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, PO, H, HV, K, V, BV,
                                 O_INDEXED, PK, USE_L2, VP, VB)),
                (_tma_loader, (k_desc, v_desc, a_desc, k_s, v_s, a_s, bars, emp, i_v, i_hv, i_b, bos, c_beg, c_end,
                               T, H, HV, K, V, BV, NS)),
            ], [4, 1], [OUT_REGS, LREGS])
        else:
            gl.warp_specialize([
                (_state_steps, (k_desc, v_desc, a_desc, h_desc, beta, gcum, rk_in, vnew, h0, ht, h0_idx, ht_idx,
                                k_s, v_s, a_s, bars, emp, h_s, r_s, d_s, vn_s, ready, free,
                                n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, choff, T, P0, P1,
                                s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                                H, HV, K, V, BV, USE_L2, INIT, H0_BY_SEG, H0_INDEXED, STORE_H, STORE_VNEW,
                                STORE_FINAL, HT_BY_SEG, HT_INDEXED, NS, True, True, False, 0, VP, VB)),
                (_output_steps, (q_desc, p_desc, q_s, p_s, qbars, h_s, vn_s, ready, free, qf, o, o_idx, gcum,
                                 rk_in, scale, n, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, PO, H, HV, K, V, BV,
                                 O_INDEXED, PK, USE_L2, VP, VB)),
            ], [4], [OUT_REGS])


    @gluon.jit
    def _t_loader(
        k_desc, v_desc, a_desc, q_desc, p_desc, k_s, v_s, a_s, q_s, p_s, bars, emp, gt_s,
        beta, gcum, rk_in, qf, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, s_bb, s_bt, s_bh,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, NS: gl.constexpr, AP: gl.constexpr, PA: gl.constexpr = False, scale=1.0,
        MN: gl.constexpr = False,
    ):
        """The register-state kernel's load partition (one warp): chunk c's k, v, Ainv, q and P tiles by TMA into ring
        stage c % NS, and its per-row gates into the stage's gate rows ``gt_s[8 (c % NS) + j]`` (fp32 [64] each;
        j = 0 e^c r_k, 1 beta, 2 e^(c_L - c) r_k, 3 qf, 4 e^(c_L) repeated (c the rows' g_cum, c_L the last valid
        row's, r_k 0 past the sequence: the chains' factors formed here, off their issue slots; PA: 5, 6 below), once
        both chain partitions have released the stage (``emp``: chunk c - NS done). A stage's ``bars`` barrier completes
        on two arrivals, the TMA's (with its bytes) and this warp's after the gate stores: the chain partitions
        neither issue copies nor wait on global loads. AP: the columns between two value heads' Ainv (and P) tiles
        in their descriptors' rows (64: their own buffers; 128: packed into o's rows, ``launch_fused_pass``). PA: no P
        tile; ``qf`` holds q's L2 row scalings r_q (fp32 [B, T, H]; 1 without the L2 norm), from which this warp
        writes the qf row (scale r_q e^c) and the P partition's exponent rows 5 (w) and 6 (u) of ``_t_p_steps``. MN:
        the segment pass's loads (``hopper_segments``): k, v and Ainv, gate rows 0, 1, 2 and 4; no q, P or qf."""
        C: gl.constexpr = 64
        i_h = i_hv // (HV // H)
        tok0 = i_b * T
        dt: gl.constexpr = k_desc.dtype
        if MN:
            nbytes: gl.constexpr = (C * K + C * BV + C * C) * (dt.primitive_bitwidth // 8)
        elif PA:
            nbytes: gl.constexpr = (2 * C * K + C * BV + C * C) * (dt.primitive_bitwidth // 8)
        else:
            nbytes: gl.constexpr = (2 * C * K + C * BV + 2 * C * C) * (dt.primitive_bitwidth // 8)
        col_k = i_h * K
        col_v = i_hv * V + i_v * BV
        col_a = i_hv * AP
        lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        t1 = gl.arange(0, C, layout=lay)
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            row = tok0 + bos + c * C
            mbarrier.wait(emp.index(s), ((it // NS) & 1) ^ 1, pred=it >= NS)
            _issue_chunk_loads(k_desc, v_desc, a_desc, bars.index(s), k_s.index(s), v_s.index(s), a_s.index(s), row,
                               col_k, col_v, col_a, c < c_end, nbytes)
            if not MN:
                tma_load(q_desc, [row, col_k], bars.index(s), q_s.index(s))
                if not PA:
                    tma_load(p_desc, [row, col_a], bars.index(s), p_s.index(s))
            # every global load of the chunk's rows issued before any is used: one L2 round trip per chunk on this
            # warp's path, which paces the ring (with the qf / r_q row loaded after the gate rows' stores, two:
            # H200 register-state kernel 4x4096 16/32 184 -> 169 us; bench/NOTES.md)
            g, b, rk, g_last = _chunk_gates(gcum, beta, rk_in, bos + c * C, t1, eos, tok0, i_b, i_h, i_hv, c < c_end,
                                            s_bb, s_bt, s_bh, H, HV, USE_L2)
            rows = bos + c * C + t1
            if MN:
                pass
            elif PA:
                if USE_L2:
                    rq = gl.load(qf + (tok0 + rows) * H + i_h, mask=rows < eos, other=0.0) * scale
                else:
                    rq = gl.where(rows < eos, scale, 0.0)
            else:
                qfr = gl.load(qf + (tok0 + rows) * HV + i_hv, mask=rows < eos, other=0.0)
            gts = s * 8
            gt_s.index(gts).store(gl.exp(g) * rk)
            gt_s.index(gts + 1).store(b)
            gt_s.index(gts + 2).store(gl.exp(g_last - g) * rk)
            if MN:
                pass
            elif PA:
                LOG2E: gl.constexpr = 1.4426950408889634
                gt_s.index(gts + 3).store(rq * gl.exp(g))
                gt_s.index(gts + 5).store(gl.where(rows < eos, g * LOG2E + gl.log2(rq), float("-inf")))
                gt_s.index(gts + 6).store(gl.log2(rk) - g * LOG2E)
            else:
                gt_s.index(gts + 3).store(qfr)
            gt_s.index(gts + 4).store(gl.zeros([C], gl.float32, layout=lay) + gl.exp(g_last))
            cta_barrier()
            mbarrier.arrive(bars.index(s), count=1)

    @gluon.jit
    def _t_steps(
        k_s, v_s, a_s, q_s, p_s, bars, emp, prdy, kz, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
        n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, half,
        s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, HB: gl.constexpr,
        INIT: gl.constexpr, H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr,
        STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr, HT_INDEXED: gl.constexpr, O_INDEXED: gl.constexpr,
        NS: gl.constexpr, PA: gl.constexpr = False, A_BETA: gl.constexpr = False,
    ):
        """One warpgroup's 64 rows (V columns i_v BV + half HB ..) of the register-state chain; the tiles and gates
        of chunk c come from ring stage c % NS (filled by ``_t_loader``), released on ``emp`` when done. PA: the
        stage's P tile is the P partition's (``_t_p_steps``), waited for on ``prdy`` before use. A_BETA: the Ainv
        tiles are Ainv diag(beta) (the prepare's A_BETA form), so r^T takes no beta factor here."""
        C: gl.constexpr = 64
        tok0 = i_b * T
        dt: gl.constexpr = k_s.dtype
        m64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        mK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
        opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=m64, k_width=2)
        opK: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mK, k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, m64)
        to = gl.arange(0, C, layout=cols)
        v0 = i_v * BV + half * HB
        vr = v0 + gl.arange(0, HB, layout=gl.SliceLayout(1, mK))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, mK))
        m_vk = (vr[:, None] < V) & (kc[None, :] < K)
        if INIT == 1:
            row0, ok0 = _state_row(h0_idx, i_s, n, P0, H0_BY_SEG, H0_INDEXED)
            p0 = h0 + row0 * s0n + i_hv * s0h + kc[None, :] * s0k + vr[:, None] * s0v
            st = gl.load(p0, mask=m_vk & ok0, other=0.0).to(gl.float32)
        else:
            st = gl.zeros([HB, K], gl.float32, layout=mK)
        keep = n >= 0
        if O_INDEXED:
            oi = gl.load(o_idx + n)
            keep = (oi >= 0) & (oi < PO)
        ol: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        o_t = gl.arange(0, C, layout=gl.SliceLayout(1, ol))
        o_v = v0 + gl.arange(0, HB, layout=gl.SliceLayout(0, ol))
        zero = gl.zeros([HB, C], gl.float32, layout=m64)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])   # a [1] row: every thread holds the element
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            # only a sequence's last chunk can be partial: the masks below run there alone (uniform branches)
            partial = bos + c * C + C > eos
            sa = gl.convert_layout(st.to(dt), opK)
            mbarrier.wait(bars.index(s), (it // NS) & 1)
            if not PA:
                if partial:
                    # the next sequence's k rows out of S^T += d^T k (with PA the P partition zeros them before P
                    # is ready): each chain partition zeros its half of the columns, then waits for the other's
                    # (``kz``, once per program: only its last chunk can be partial)
                    _zero_rows_past(k_s.index(s).slice(half * (K // 2), K // 2, dim=1), eos - bos - c * C, 4)
                    fence_async_shared()
                    cta_barrier()
                    mbarrier.arrive(kz, count=1)
                    mbarrier.wait(kz, 0)
            gts = s * 8                     # this stage's gate rows
            qst = warpgroup_mma(sa, q_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            kst = warpgroup_mma(sa, k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            vt = v_s.index(s).slice(half * HB, HB, dim=1).permute((1, 0)).load(m64)
            qst, kst, sa = warpgroup_mma_wait(0, deps=[qst, kst, sa])
            # the token vectors are read from the gate rows where used, not held: in this layout each costs 16
            # registers per thread; the load warp formed them (fewer chain instructions: bench/NOTES.md)
            fk = gt_s.index(gts).load(cols)
            if A_BETA:
                rt = vt.to(gl.float32) - kst * fk[None, :]
            else:
                rt = (vt.to(gl.float32) - kst * fk[None, :]) * gt_s.index(gts + 1).load(cols)[None, :]
            # past the sequence: r_k and beta are 0 there, the where keeps non-finite rows of a neighbour out
            if partial:
                rt = gl.where(((bos + c * C + to) < eos)[None, :], rt, 0.0)
            ra = gl.convert_layout(rt.to(dt), opA)
            vnt = warpgroup_mma(ra, a_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            vnt, ra = warpgroup_mma_wait(0, deps=[vnt, ra])
            if partial:
                vnt = gl.where(((bos + c * C + to) < eos)[None, :], vnt, 0.0)
            # e^(c_L): one element of gate row 4 broadcast to every thread (a row load and a max cost ~27 instructions)
            e_last = gl.sum(gt_s.index(gts + 4).slice(0, 1).load(one), axis=0)
            dec = gt_s.index(gts + 2).load(cols)
            da = gl.convert_layout((vnt * dec[None, :]).to(dt), opA)
            va = gl.convert_layout(vnt.to(dt), opA)
            if PA:
                mbarrier.wait(prdy.index(s), (it // NS) & 1)
            st = warpgroup_mma(da, k_s.index(s), st * e_last, is_async=True)
            ot = warpgroup_mma(va, p_s.index(s).permute((1, 0)), qst * gt_s.index(gts + 3).load(cols)[None, :],
                               is_async=True)
            st, ot, da, va = warpgroup_mma_wait(0, deps=[st, ot, da, va])
            mbarrier.arrive(emp.index(s), count=1)     # this partition is done with stage s and its gate rows
            # o^T -> o: rounded to o's dtype before the transposing layout conversion (half its shared-memory bytes)
            if not keep:
                ot = zero
            ot = ot.to(o.dtype.element_ty)
            oo = gl.convert_layout(gl.permute(ot, (1, 0)), ol)
            po = o + ((tok0 + bos + c * C + o_t) * HV + i_hv)[:, None] * V + o_v[None, :]
            gl.store(po, oo, mask=((bos + c * C + o_t) < eos)[:, None] & (o_v[None, :] < V))
        if STORE_FINAL:
            row1, ok1 = _state_row(ht_idx, i_s, n, P1, HT_BY_SEG, HT_INDEXED)
            p1 = ht + row1 * s1n + i_hv * s1h + kc[None, :] * s1k + vr[:, None] * s1v
            gl.store(p1, st.to(ht.dtype.element_ty), mask=m_vk & ok1)

    @gluon.jit
    def _t_p_steps(k_s, q_s, p_s, bars, emp, prdy, gt_s, bos, eos, c_beg, c_end, NS: gl.constexpr):
        """The register-state kernel's P partition (4 warps, PA): per chunk c, once stage c % NS has landed, P =
        causal(Q K^T (x) 2^(w_i + u_j)) into the stage's P tile, w and u being the stage's gate rows 5 and 6 (the load
        warp's: w = c log2 e + log2(scale r_q), -inf past the sequence; u = log2 r_k - c log2 e), so that
        2^(w_i + u_j) = scale r_q,i r_k,j e^(c_i - c_j), as the prepare kernel forms P; then ``prdy`` for the chain
        partitions and ``emp`` for the load warp. Its instructions share the SM's issue slots with the chains'
        (measured: each one per chunk cost the kernel ~0.1 us, bench/NOTES.md, though the chains' own are cheaper:
        the kernel is bound by its bytes), hence the scalings folded into one exponent per element and the row
        vectors formed by the load warp. On a sequence's partial last chunk it first zeros the k tile's rows past the
        end (the next sequence's keys), for P and for the chains' S^T += d^T k, which waits for ``prdy``."""
        C: gl.constexpr = 64
        dt: gl.constexpr = k_s.dtype
        mma_p: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        trow = gl.arange(0, C, layout=gl.SliceLayout(1, mma_p))
        tcol = gl.arange(0, C, layout=gl.SliceLayout(0, mma_p))
        zero_p = gl.zeros([C, C], gl.float32, layout=mma_p)
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            gts = s * 8
            mbarrier.wait(bars.index(s), (it // NS) & 1)
            if bos + c * C + C > eos:
                _zero_rows_past(k_s.index(s), eos - bos - c * C, 4)
                fence_async_shared()
                cta_barrier()
            qk = warpgroup_mma(q_s.index(s), k_s.index(s).permute((1, 0)), zero_p, use_acc=False, is_async=True)
            w = gt_s.index(gts + 5).load(gl.SliceLayout(1, mma_p))
            u = gt_s.index(gts + 6).load(gl.SliceLayout(0, mma_p))
            qk, _, _ = warpgroup_mma_wait(0, deps=[qk, q_s, k_s])
            pt = gl.where(tcol[None, :] <= trow[:, None], qk * gl.exp2(w[:, None] + u[None, :]), 0.0)
            p_s.index(s).store(pt.to(dt))
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(prdy.index(s), count=1)
            mbarrier.arrive(emp.index(s), count=1)

    @gluon.jit
    def _chunk_fused_t_sm90_kernel(
        k_desc, v_desc, a_desc, q_desc, p_desc,
        beta, gcum, rk_in, qf, o, h0, ht, h0_idx, ht_idx, o_idx, segments, cu_seqlens,
        T, P0, P1, PO, s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, INIT: gl.constexpr,
        H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr, STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr,
        HT_INDEXED: gl.constexpr, O_INDEXED: gl.constexpr, NS: gl.constexpr, WREGS: gl.constexpr,
        LREGS: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False, AP: gl.constexpr = 64,
        PA: gl.constexpr = False, AREGS: gl.constexpr = 0, scale=1.0, A_BETA: gl.constexpr = False,
    ):
        """The fused state + output pass with the state transposed and held in registers, over V tile BV = 128 as two
        warpgroup partitions (``_t_steps``, 64 rows of S^T [BV, K] each) fed by a one-warp load partition
        (``_t_loader``: TMA ring of k, v, Ainv, q, P and the gate rows; a stage is refilled once both chain
        partitions have arrived on its ``emp`` barrier), all three running side by side. S^T is the fp32 accumulator
        of ``S^T += d^T k`` and, rounded, the register A operand of ``S^T k^T`` and ``S^T q^T``; every chained operand
        is a register A operand, so the chain has no shared-memory round trip, fence or barrier (FlashInfer's sm_90
        layout; bench/NOTES.md)::

            (k S)^T = S^T k^T;   r^T = (v^T - (k S)^T diag(e^g r_k)) diag(beta);   v_new^T = r^T Ainv^T
            o^T     = (S^T q^T) diag(qf) + v_new^T P^T;   S^T <- e^(g_last) S^T + (v_new^T diag(dec)) k

        Same inputs and outputs as ``_chunk_fused_sm90_kernel`` without STORE_H / STORE_VNEW. AP 128: Ainv and P of
        (token, value head) are the two halves of o's row there (``launch_fused_pass``): a chunk's tiles are in shared
        memory before either partition stores the chunk's o over them, and no other CTA reads those rows but as the
        masked tail of a partial chunk. PA: P formed in the kernel by a fourth partition (``_t_p_steps``, 4 warps at
        AREGS registers, from the stage's q and k tiles), qf by the load warp from q's L2 row scalings in ``qf``
        (fp32 [B, T, H]) and ``scale``; ``p_desc`` unused, a stage released on three arrivals. A_BETA: Ainv's
        tiles are Ainv diag(beta), r^T = v^T - (k S)^T diag(e^g r_k) (``_t_steps``)."""
        C: gl.constexpr = 64
        HB: gl.constexpr = BV // 2
        pdl_enter(PDL)
        i_v = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_s = gl.program_id(2)
        n, c_beg, c_end, i_b, bos, eos = _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NS, C, BV], v_desc.layout)
        a_s = gl.allocate_shared_memory(dt, [NS, C, C], a_desc.layout)
        q_s = gl.allocate_shared_memory(dt, [NS, C, K], q_desc.layout)
        if PA:
            p_s = gl.allocate_shared_memory(dt, [NS, C, C], a_desc.layout)
        else:
            p_s = gl.allocate_shared_memory(dt, [NS, C, C], p_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        emp = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        prdy = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        gt_s = gl.allocate_shared_memory(gl.float32, [NS * 8, C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        kz = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kz, count=2)      # without PA: both chains have zeroed their half of a partial chunk's k tile
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=2)      # the TMA's expect-arrive and the gate rows' arrive
            mbarrier.init(emp.index(j), count=3 if PA else 2)   # the two chain partitions (and the P partition)
            mbarrier.init(prdy.index(j), count=1)      # PA: the stage's P tile is written
        # (two calls: Gluon 3.6 builds no partition tuple outside the call)
        if PA:
            gl.warp_specialize([
                (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, prdy, kz, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                            n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 0,
                            s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                            HV, K, V, BV, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                            O_INDEXED, NS, True, A_BETA)),
                (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, prdy, kz, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                            n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 1,
                            s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                            HV, K, V, BV, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                            O_INDEXED, NS, True, A_BETA)),
                (_t_p_steps, (k_s, q_s, p_s, bars, emp, prdy, gt_s, bos, eos, c_beg, c_end, NS)),
                (_t_loader, (k_desc, v_desc, a_desc, q_desc, p_desc, k_s, v_s, a_s, q_s, p_s, bars, emp, gt_s,
                             beta, gcum, rk_in, qf, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, s_bb, s_bt, s_bh,
                             H, HV, K, V, BV, USE_L2, NS, AP, True, scale)),
            ], [4, 4, 1], [WREGS, AREGS, LREGS])
        else:
            gl.warp_specialize([
                (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, prdy, kz, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                            n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 0,
                            s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                            HV, K, V, BV, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                            O_INDEXED, NS, False, A_BETA)),
                (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, prdy, kz, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                            n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 1,
                            s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                            HV, K, V, BV, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                            O_INDEXED, NS, False, A_BETA)),
                (_t_loader, (k_desc, v_desc, a_desc, q_desc, p_desc, k_s, v_s, a_s, q_s, p_s, bars, emp, gt_s,
                             beta, gcum, rk_in, qf, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, s_bb, s_bt, s_bh,
                             H, HV, K, V, BV, USE_L2, NS, AP)),
            ], [4, 1], [WREGS, LREGS])


_GL_DT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# register budgets (``gl.warp_specialize``'s worker_num_regs; no spills in the Triton 3.6 sm_90 builds; on 3.9 the
# register-state kernel spills 16 B, 72 B with the P partition, mostly outside its loops): the fused kernel's output
# partition; the register-state kernel's second chain partition; the load warp of both (the fused kernel's at V tile
# 32). Nine warps launch as three warpgroups (the load warp's padded to four) at
# 65536 / 384 -> 168 registers each (504 per thread slot); the workers claim theirs inside the region and the default
# partition gets the rest, at most 256 (Triton's AllocateWarpGroups pass; gdn.aot.default_partition_regs checks the
# PTX): 504 - 216 - 32 = 256 for the register-state kernel's first chain partition
OUTPUT_PARTITION_REGS = 160
T_CHAIN_REGS = 216
T_LOADER_REGS = 32
# ... and with the P partition (PA: four warpgroups, 512 per thread slot): chain 200 / 200 (the default partition
# gets 512 - 200 - 88 - 24), P partition 88, load warp 24
T_PA_CHAIN_REGS = 200
T_PA_AUX_REGS = 88
T_PA_LOADER_REGS = 24


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def token_rows_ok(x: torch.Tensor) -> bool:
    """Whether x [B, T, heads, D] is rows of tokens: heads dense and contiguous within a token, token rows at one
    stride across the batch (a view of a packed [B, T, channels] tensor qualifies)."""
    B, T, Hh, D = x.shape
    st = x.stride()
    return st[3] == 1 and st[2] == D and (B == 1 or st[0] == T * st[1])


def _rows2d_ok(x: torch.Tensor) -> bool:
    """Whether :func:`_rows2d` can view x as TMA rows (the ``supported`` checks: no view is built): token rows
    (:func:`token_rows_ok`) with a 16-byte aligned base and row pitch."""
    if not token_rows_ok(x):
        return False
    return (x.stride(1) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


def pitched_layout_ok(x: torch.Tensor) -> bool:
    """Whether x [B, T, heads, D] (last dim contiguous) has its heads at one pitch P >= D within a token and its token
    rows at one stride heads * P: a column slice of a contiguous [B, T, heads, P] buffer (Ainv and P packed into o's
    rows; P = D for a contiguous x)."""
    B, T, Hh, D = x.shape
    st = x.stride()
    return st[3] == 1 and st[2] >= D and st[1] == Hh * st[2] and (B == 1 or st[0] == T * st[1])


def pitched_rows_ok(x: torch.Tensor) -> bool:
    """:func:`pitched_layout_ok` with a 16-byte aligned base, pitch and row pitch: the form :func:`_pitched_rows2d`
    views as TMA rows."""
    return pitched_layout_ok(x) and (x.stride(2) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


def _pitched_rows2d(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] (``pitched_rows_ok``) as the 2-D [B*T, (heads - 1) P + D] view whose row t holds head h's D
    elements at columns h P ..; head pitch P = x.stride(2) (D for a contiguous x: :func:`_rows2d`'s view)."""
    B, T, Hh, D = x.shape
    return x.as_strided((B * T, (Hh - 1) * x.stride(2) + D), (x.stride(1), 1))


def _rows2d(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [B, T, heads, D] (last dim contiguous, heads dense) as a 2-D [B*T, heads*D] strided view, or None."""
    if not _rows2d_ok(x):
        return None
    B, T, Hh, D = x.shape
    return x.as_strided((B * T, Hh * D), (x.stride(1), 1))


def supported(k, v, ainv, h_out, vnew, dt, K: int, V: int, init: int, split_h: bool,
              checkpoints: bool = False) -> bool:
    """Whether the sm_90 pass can run this launch (else the portable kernel does). ``v``/``ainv``: v [B, T, HV, V]
    and Ainv [B, T, HV, 64], or u [B, T, HV, V] and w [B, T, HV, K] (w/u mode). ``checkpoints``: prefix-cache
    checkpoint stores asked (the portable kernel's CKPT mode; not in this pass yet). ``init`` 3: the segment pass
    (local states and transitions in one launch; V tiles past V / BV are transition tiles)."""
    if not G.AVAILABLE or split_h or checkpoints or init not in (0, 1, 3) or capability(k.device) != "sm_90":
        return False
    if dt not in _GL_DT or k.dtype != dt or v.dtype != dt or ainv is None or ainv.dtype != dt:
        return False
    if K not in (64, 128) or V % 64 != 0:
        return False
    if h_out is not None and (h_out.dtype != dt or not h_out.is_contiguous()):
        return False
    if vnew is not None and not vnew.is_contiguous():
        return False
    if ainv.shape[-1] not in (64, K):   # (launched on ainv.contiguous())
        return False
    return _rows2d_ok(k) and _rows2d_ok(v)


@functools.lru_cache(maxsize=None)
def _smem_layout(shape, dt_name):
    return gl.NVMMASharedLayout.get_default_for(list(shape), getattr(gl, dt_name))


def _desc(x2d: torch.Tensor, block, dt_name):
    """A TMA descriptor of the 2-D view x2d (16-byte aligned base and row pitch, last dim contiguous: the callers'
    ``supported`` / ``_rows2d`` checks) with the NVMMA layout of ``block``. Built without the dataclass's
    ``__init__`` / ``__post_init__``, which re-validate what those checks established (~3 us of host time each,
    ~20 per training step); ``tests/kernels`` compares it field by field with the checked constructor."""
    d = object.__new__(G.TensorDescriptor)
    d.__dict__.update(_desc_defaults())
    d.__dict__.update(base=x2d, shape=list(x2d.shape), strides=list(x2d.stride()), block_shape=list(block),
                      layout=_smem_layout(tuple(block), dt_name))
    return d


@functools.lru_cache(maxsize=None)
def _desc_defaults() -> dict:
    """The descriptor dataclass's fields that have defaults (padding; round_f32_to_tf32 from Triton 3.9 on)."""
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(G.TensorDescriptor) if f.default is not dataclasses.MISSING}


def launch_state_pass(grid, k, v, beta, ainv, g_cum, rk, h_out, vnew, h0, ht, h0_idx, ht_idx, segments,
                      cu_seqlens, chunk_offsets, T, P0, P1, s_beta, s0, s1, *, H, HV, K, V, use_l2, is_varlen,
                      INIT, H0_BY_SEG, H0_INDEXED, HT_BY_SEG, HT_INDEXED, from_ainv=True, BV=64, stages=2,
                      num_warps=4, pdl=False):
    """Launch the sm_90 state pass over ``grid`` = (V // BV, HV, segments) (INIT 3: (V // BV + K // BV, HV,
    segments), local states to ``ht`` and transitions to ``h0``, row = segment); arguments as the portable kernel's
    (``supported`` must have said yes). ``from_ainv=False``: ``v`` is u and ``ainv`` is w (``v_new = u - w h``).
    Tensors that a mode does not use may be any placeholder tensor. ``pdl``: programmatic dependent launch
    (:func:`gdn.kernels.launch.pdl_args`; False: an ordinary launch)."""
    dn = _GL_DT[k.dtype]
    k_desc = _desc(_rows2d(k), (CHUNK, K), dn)
    v_desc = _desc(_rows2d(v), (CHUNK, BV), dn)
    AC = ainv.shape[-1]
    # Ainv contiguous, or (segment pass of a segmented register-state run) the first half of o's rows, pitch 128
    ap = ainv.stride(2)
    if ap != AC and not (from_ainv and pitched_rows_ok(ainv)):
        raise ValueError("launch_state_pass: Ainv at a head pitch other than its width needs the ainv mode and the "
                         "pitched row form (hopper.pitched_rows_ok)")
    a_desc = _desc(_pitched_rows2d(ainv), (CHUNK, AC), dn)
    if h_out is not None:
        h_desc = _desc(h_out.view(-1, V), (K, BV), dn)
    else:   # a descriptor is still needed for the operand layout; nothing is stored through it
        dummy = torch.empty(K, BV, device=k.device, dtype=k.dtype)
        h_desc = _desc(dummy, (K, BV), dn)
    launch(_state_pass_sm90_kernel, grid,
        k_desc, v_desc, a_desc, h_desc,
        beta, g_cum, rk, vnew if vnew is not None else g_cum, h0 if h0 is not None else g_cum,
        ht if ht is not None else g_cum, h0_idx, ht_idx, segments, cu_seqlens, chunk_offsets,
        T, P0, P1, *s_beta, *s0, *s1,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=use_l2, IS_VARLEN=is_varlen, INIT=INIT, H0_BY_SEG=H0_BY_SEG,
        H0_INDEXED=H0_INDEXED, STORE_H=h_out is not None, STORE_VNEW=vnew is not None, STORE_FINAL=ht is not None,
        HT_BY_SEG=HT_BY_SEG, HT_INDEXED=HT_INDEXED, NS=stages, FROM_AINV=from_ainv, num_warps=num_warps,
        **({"AP": ap} if ap != AC else {}), **pdl_args(pdl, k.device))


def transposed_ok(K: int, V: int, BV: int, h_out, vnew) -> bool:
    """Whether the register-state fused kernel (``_chunk_fused_t_sm90_kernel``) takes a fused launch: V tile 128 (two
    warpgroups of 64 rows of S^T) dividing V, K = 128, no per-chunk h / v_new stores."""
    return BV == 128 and V % BV == 0 and K == 128 and h_out is None and vnew is None


def fused_supported(q: torch.Tensor, k: torch.Tensor, BV: int) -> bool:
    """Whether the fused state + output kernel can take a launch that the state pass (``supported``) takes in ainv
    mode: q laid out like k (2-D TMA view) and V tile 16, 32 or 64 (shared memory of the two partitions: ~120 KB at
    BV 16, ~140 KB at 32, ~180 KB at 64, K = 128); V tile 128 is the register-state kernel's (:func:`transposed_ok`)."""
    return G.AVAILABLE and q.dtype == k.dtype and q.shape == k.shape and BV in (16, 32, 64) and _rows2d_ok(q)


# the per-token fp32 scalars of an inference forward that the prepare kernel can pack into o's rows (a copy per V tile
# of the fused kernel that forms P itself, in this field order), so that the call holds none beside o and Ainv
ROW_SCALAR_FIELDS = ("g_cum", "r_k", "overflow flag")


def row_scalar_pack(o: torch.Tensor, BV: int):
    """(o's fp32 view, VP, VB) where the V tile ``BV`` fused kernel's output o [B, T, HV, V] (contiguous, 16-bit) can
    hold the per-token scalars :data:`ROW_SCALAR_FIELDS`: for V tile j of a chunk of nv valid token rows, field f of
    its token i is entry e = f nv + i of the tile's block, at fp32 element (t HV + h) VP + j VB + e mod VB of the
    view with t the chunk's token row e div VB and h the value head (VP = V / 2, VB = BV / 2: the block lies in the o
    columns that only that tile's CTA writes, which reads it before it writes them). None where o cannot."""
    V = o.shape[-1]
    if o.dim() != 4 or o.element_size() != 2 or not o.is_contiguous() or V % BV or BV // 2 < len(ROW_SCALAR_FIELDS) \
            or o.data_ptr() % 4:
        return None
    return o.view(-1).view(torch.float32), V // 2, BV // 2


def launch_fused_pass(grid, q, k, v, beta, ainv, p, qf, g_cum, rk, o, h0, ht, h0_idx, ht_idx, o_idx, segments,
                      cu_seqlens, T, P0, P1, PO, s_beta, s0, s1, *, H, HV, K, V, use_l2, is_varlen, INIT, H0_BY_SEG,
                      H0_INDEXED, HT_BY_SEG, HT_INDEXED, BV, stages=2, h_out=None, vnew=None, chunk_offsets=None,
                      transposed=False, load_warp=False, scale=1.0, pdl=False, row_scalars=None,
                      beta_in_ainv=False):
    """Launch the fused state + output kernel over ``grid`` = (V // BV, HV, segments): writes o [B, T, HV, V]
    (contiguous) from P [B, T, HV, 64] and qf [B, T, HV] (the prepare kernel's STORE_P outputs; both None at V
    tile 32 / 64: the kernel forms them from q, k, g_cum, rk and ``scale``) and the final state;
    h [NT, HV, K, V] (k's dtype, with ``chunk_offsets``) and v_new [B, T, HV, V] only when given. ``o_idx``: the
    pool index whose invalid rows give zero outputs (None: every sequence is valid). Other arguments as
    :func:`launch_state_pass` (ainv mode). ``transposed`` (V tile 128, no h / v_new stores: :func:`transposed_ok`):
    the register-state kernel ``_chunk_fused_t_sm90_kernel`` instead; there Ainv and P may be the two column halves of
    o's own [B, T, HV, 128] rows (views at head pitch 128, written by the prepare kernel: a call's peak then holds
    no Ainv / P beside o), and with ``p`` None it forms P and qf itself (its P partition, PA; Ainv alone may then be
    the first half of o's rows). ``load_warp``: the V tile 32 / 64 kernel's ring
    filled by a load warp (``_tma_loader``) instead of its chain partition. ``pdl`` as :func:`launch_state_pass`'s.
    ``row_scalars``: (VP, VB) of :func:`row_scalar_pack` where g_cum and rk are o's fp32 view holding them (the V
    tile 32 / 64 kernel forming P itself, no h / v_new). ``beta_in_ainv`` (the register-state kernel only): ``ainv``
    holds Ainv diag(beta) (``chunk_fwd_prepare``'s form of that name)."""
    if beta_in_ainv and not transposed:
        raise ValueError("launch_fused_pass: beta_in_ainv is for the register-state kernel (transposed)")
    dn = _GL_DT[k.dtype]
    k_desc = _desc(_rows2d(k), (CHUNK, K), dn)
    q_desc = _desc(_rows2d(q), (CHUNK, K), dn)
    v_desc = _desc(_rows2d(v), (CHUNK, BV), dn)
    # Ainv / P: their own contiguous buffers, or (register-state kernel) packed as the two halves of o's rows
    ap = ainv.stride(2)
    if ap != CHUNK and not (transposed and (p is None or p.stride(2) == ap) and pitched_rows_ok(ainv)
                            and (p is None or pitched_rows_ok(p))):
        raise ValueError("launch_fused_pass: Ainv / P at a head pitch other than 64 need the register-state kernel "
                         "(V tile 128) and P at the same pitch")
    a_desc = _desc(_pitched_rows2d(ainv), (CHUNK, CHUNK), dn)
    # p None: the kernel forms P and qf itself from q, k tiles (k's descriptor here, unused by the register-state one)
    p_desc = _desc(_pitched_rows2d(p), (CHUNK, CHUNK), dn) if p is not None else k_desc
    if p is None and rk is None and use_l2:
        raise ValueError("launch_fused_pass: P formed in the kernel needs, with the L2 norm, rk")
    if transposed:
        if not transposed_ok(K, V, BV, h_out, vnew):
            raise ValueError(f"launch_fused_pass: the register-state kernel takes V tile 128 dividing V, K = 128, no "
                             f"h / v_new (got BV={BV}, V={V}, K={K}, h_out={h_out is not None}, "
                             f"vnew={vnew is not None})")
        launch(_chunk_fused_t_sm90_kernel, grid,
            k_desc, v_desc, a_desc, q_desc, p_desc,
            beta, g_cum, rk, qf if qf is not None else g_cum, o, h0 if h0 is not None else g_cum,
            ht if ht is not None else g_cum, h0_idx, ht_idx,
            o_idx if o_idx is not None else h0_idx, segments, cu_seqlens, T, P0, P1, PO, *s_beta, *s0, *s1,
            H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=use_l2, IS_VARLEN=is_varlen, INIT=INIT, H0_BY_SEG=H0_BY_SEG,
            H0_INDEXED=H0_INDEXED, STORE_FINAL=ht is not None, HT_BY_SEG=HT_BY_SEG, HT_INDEXED=HT_INDEXED,
            O_INDEXED=o_idx is not None, NS=2, num_warps=4, **({"AP": ap} if ap != CHUNK else {}),
            **(dict(PA=True, scale=float(scale), WREGS=T_PA_CHAIN_REGS, AREGS=T_PA_AUX_REGS, LREGS=T_PA_LOADER_REGS)
               if p is None else dict(WREGS=T_CHAIN_REGS, LREGS=T_LOADER_REGS)),
            **({"A_BETA": True} if beta_in_ainv else {}), **pdl_args(pdl, k.device))
        return
    if row_scalars is not None and (transposed or p is not None or h_out is not None or vnew is not None):
        raise ValueError("launch_fused_pass: row scalars packed into o need the V tile 32 / 64 kernel forming P "
                         "itself, without h / v_new")
    # no h store: a descriptor is still an argument (never stored through)
    h_desc = _desc(h_out.view(-1, V), (K, BV), dn) if h_out is not None else q_desc
    launch(_chunk_fused_sm90_kernel, grid,
        k_desc, v_desc, a_desc, q_desc, p_desc, h_desc,
        beta, g_cum, rk, qf if qf is not None else g_cum, o, vnew if vnew is not None else o,
        h0 if h0 is not None else g_cum, ht if ht is not None else g_cum, h0_idx, ht_idx,
        o_idx if o_idx is not None else h0_idx, segments, cu_seqlens,
        chunk_offsets if chunk_offsets is not None else segments, T, P0, P1, PO, float(scale), *s_beta, *s0, *s1,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=use_l2, IS_VARLEN=is_varlen, INIT=INIT, H0_BY_SEG=H0_BY_SEG,
        H0_INDEXED=H0_INDEXED, STORE_H=h_out is not None, STORE_VNEW=vnew is not None, STORE_FINAL=ht is not None,
        HT_BY_SEG=HT_BY_SEG, HT_INDEXED=HT_INDEXED, O_INDEXED=o_idx is not None, NS=stages,
        OUT_REGS=OUTPUT_PARTITION_REGS, LREGS=T_LOADER_REGS, TMA_WARP=bool(load_warp), num_warps=4, PK=p is None,
        **(dict(VP=row_scalars[0], VB=row_scalars[1]) if row_scalars is not None else {}), **pdl_args(pdl, k.device))
