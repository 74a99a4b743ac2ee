"""Hopper (sm_90) form of the backward's reverse pass (``reverse.chunk_bwd_dh_kernel``), written in Gluon on the
design of the forward's state pass (``..hopper``): one CTA per (V tile, value head, segment), the chunks
of the segment last to first; k, w, q, dO (and dv_local, unless the kernel computes it: LOCAL) of chunk c - 1 come
by TMA into a 2-deep shared-memory ring while chunk c computes; the products are asynchronous warpgroup MMAs; G
(the gradient of the state leaving the chunk, fp32 [K, BV]) stays in registers as the accumulator and leaves
through a TMA store. V tiles 32 / 64: one warpgroup; 128 (with LOCAL, K = 128: batches of many sequences, where one
wave of CTAs holds every (sequence, value head) only with the whole V per CTA): two warpgroups, G split by rows and
the [64, *] products by columns, k / q / w read once per value head.

Per chunk (notation of :mod:`gdn.kernels.chunk.backward`; rows past the sequence's end masked, and on a partial last
chunk zeroed in the q, w (W_AINV: Ainv, k) tiles, which hold the next sequence's tokens there)::

    gs[c] = bf16(G)                                                        (TMA store from shared memory)
    dVn   = dv_local + diag(e^(cL - c) r_k) (k @ G)         [64, BV]        k @ G: async wgmma, k and G in smem
    G     = e^cL G + q^T (diag(e^c r_q scale) dO) - w^T dVn [K, BV]         two async wgmma on one accumulator
    dv_local = A dO,  A = (k q^T) * e^(c_j - c_i) scale r_k,i r_q,j  (j >= i, else 0)     (LOCAL: A in bf16 smem,
               the product accumulates onto diag(e^(cL - c) r_k) (k @ G); else read from dvn)

``q^T (f dO)`` (and k q^T) do not depend on G: they are issued together with ``k @ G`` so that only ``k @ G``, the
row update of dVn (with LOCAL: A's scaling, its smem store and ``A dO``) and ``w^T dVn`` are on the chain. The same
flags as the portable kernel: INIT 0 zeros, 1 ``x0[sequence]``, 2 ``x0[segment]``, 3 identity (V = K: a segment's
K x K transition, HAS_R False: no q / dO / dv_local terms); STORE_STEPS (gs and dvn), STORE_END (G entering the
first chunk into ``xend`` by segment or sequence, fp32).

Layouts: k, q [B*T, H*K] and dO [B*T, HV*V] as 2-D views (token rows, strided rows allowed, last dim contiguous);
w [B*T, HV*K], dvn [B, T, HV, V] contiguous (read as dv_local, overwritten with dVn: a chunk's rows are read before
they are written and no other chunk of this program reads them); gs [NT*HV*K, V]; gcum [B*T, HV]; r_q / r_k
[B*T, H].
"""
from __future__ import annotations

import torch

from ... import _gluon_api as G
from ...launch import launch
from ...tuning import capability
from ..hopper import CHUNK, _GL_DT, _desc, _rows2d, _rows2d_ok

if G.AVAILABLE:   # the Gluon names as the forward's module binds them (through the version layer _gluon_api)
    from ..hopper import (_segment_span, _zero_rows_past, cta_barrier, fence_async_shared, gl, gluon, mbarrier, tma,
                          tma_load, tma_store, warpgroup_mma, warpgroup_mma_wait)
    from .hopper_parts import _vec

    @gluon.jit
    def _rev_gates(gcum, rq_in, rk_in, row0, to, eos, tok0, i_h, i_hv, has_chunk, scale,
                   H: gl.constexpr, HV: gl.constexpr, USE_L2: gl.constexpr):
        """Row factors of the chunk whose token rows are ``row0 + to``: ``fk = e^(cL - c) r_k`` (k rows of dVn),
        ``fq = e^c r_q scale`` (dO rows), both 0 past the sequence, and ``e^cL`` (1 when ``has_chunk`` is false)."""
        rows = row0 + to
        m = (rows < eos) & has_chunk     # (the chunk before a segment's first is not read: its rows may precede 0)
        g = gl.load(gcum + (tok0 + rows) * HV + i_hv, mask=m, other=0.0)
        last = gl.minimum(row0 + 64, eos) - 1
        g_last = gl.load(gcum + (tok0 + last) * HV + i_hv, mask=has_chunk, other=0.0)
        fk = gl.where(m, gl.exp(g_last - g), 0.0)
        fq = gl.where(m, gl.exp(g) * scale, 0.0)
        if USE_L2:
            fk = fk * gl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
            fq = fq * gl.load(rq_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        return fk, fq, gl.exp(g_last)

    @gluon.jit
    def _w_factors(gcum, beta, rk_in, row0, tc, eos, tok0, i_h, i_hv, has_chunk,
                   H: gl.constexpr, HV: gl.constexpr, USE_L2: gl.constexpr):
        """W's column factors ``beta e^c r_k`` of the chunk whose token rows are ``row0 + tc`` (0 past the sequence):
        W = Ainv diag(beta e^c r_k) k, as the forward's prepare forms it."""
        rows = row0 + tc
        m = (rows < eos) & has_chunk
        f = gl.load(beta + (tok0 + rows) * HV + i_hv, mask=m, other=0.0).to(gl.float32) * \
            gl.exp(gl.load(gcum + (tok0 + rows) * HV + i_hv, mask=m, other=0.0))
        if USE_L2:
            f = f * gl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        return f

    @gluon.jit
    def _local_vectors(gcum, rq_in, rk_in, row0, eos, tok0, i_h, i_hv, has_chunk, scale,
                       H: gl.constexpr, HV: gl.constexpr, USE_L2: gl.constexpr, num_warps: gl.constexpr):
        """Per-row vectors of dv_local's C x C tile ``(K Q^T)[i, j] e^(c_j - c_i) scale r_k,i r_q,j`` (j >= i) for
        the chunk whose token rows are ``row0 + 0..63``: ``(c, scale r_k, r_q)``, 0 past the sequence, one element
        per thread (they go through shared memory to the layouts of their uses: ``_vec``)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        t = row0 + gl.arange(0, 64, layout=lay)
        m = (t < eos) & has_chunk
        c = gl.load(gcum + (tok0 + t) * HV + i_hv, mask=m, other=0.0)
        fr = gl.where(m, scale, 0.0)
        fc = gl.where(m, 1.0, 0.0)
        if USE_L2:
            fr = fr * gl.load(rk_in + (tok0 + t) * H + i_h, mask=m, other=0.0)
            fc = fc * gl.load(rq_in + (tok0 + t) * H + i_h, mask=m, other=0.0)
        return c, fr, fc

    @gluon.jit
    def _store_vectors(rv, v_c, v_r, v_q, C: gl.constexpr):
        """``_local_vectors``' three vectors into the shared tile ``rv`` (read back by ``_vec`` 0, 1, 2)."""
        rv.slice(0, C).store(v_c)
        rv.slice(C, C).store(v_r)
        rv.slice(2 * C, C).store(v_q)

    @gluon.jit
    def _form_a(kq, rv, n_rows, C: gl.constexpr, lay: gl.constexpr):
        """dv_local's C x C tile from ``kq = k q^T`` (fp32, layout ``lay``) and the chunk's vectors in ``rv`` (c, scale
        r_k, r_q: ``_local_vectors``): ``kq[i, j] e^(c_j - c_i) scale r_k,i r_q,j`` for i <= j < n_rows, else 0."""
        row_l: gl.constexpr = gl.SliceLayout(1, lay)
        col_l: gl.constexpr = gl.SliceLayout(0, lay)
        tr = gl.arange(0, C, layout=row_l)
        tc = gl.arange(0, C, layout=col_l)
        up = (tc[None, :] >= tr[:, None]) & (tc[None, :] < n_rows)
        ed = _vec(rv, 0, col_l)[None, :] - _vec(rv, 0, row_l)[:, None]
        a = gl.where(up, kq * gl.exp(gl.where(up, ed, 0.0)), 0.0)
        return a * _vec(rv, 1, row_l)[:, None] * _vec(rv, 2, col_l)[None, :]

    @gluon.jit
    def _issue_rev_loads(k_desc, w_desc, q_desc, do_desc, dl_desc, bar, k_buf, w_buf, q_buf, do_buf, dl_buf,
                         row, col_k, col_w, col_v, pred, HAS_R: gl.constexpr, LOCAL: gl.constexpr,
                         nbytes: gl.constexpr):
        """TMA copies of one chunk's k, w [64, K] (and q [64, K], dO [64, BV] when HAS_R, and dv_local [64, BV]
        unless LOCAL) into one ring stage, completing on ``bar``; nothing when ``pred`` is false (before the
        segment's first chunk)."""
        mbarrier.expect(bar, nbytes, pred=pred)
        tma_load(k_desc, [row, col_k], bar, k_buf, pred=pred)
        tma_load(w_desc, [row, col_w], bar, w_buf, pred=pred)
        if HAS_R:
            tma_load(q_desc, [row, col_k], bar, q_buf, pred=pred)
            tma_load(do_desc, [row, col_v], bar, do_buf, pred=pred)
            if not LOCAL:
                tma_load(dl_desc, [row, col_v], bar, dl_buf, pred=pred)

    @gluon.jit
    def _dh_pass_sm90_kernel(
        k_desc, w_desc, q_desc, do_desc, dl_desc, gs_desc,
        gcum, rq_in, rk_in, beta, dvn, x0, xend, segments, cu_seqlens, chunk_offsets, scale, T,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, INIT: gl.constexpr, HAS_R: gl.constexpr,
        STORE_STEPS: gl.constexpr, STORE_END: gl.constexpr, END_BY_SEG: gl.constexpr, LOCAL: gl.constexpr,
        W_AINV: gl.constexpr, NS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """The reverse pass of one (V tile, value head, segment) (module docstring); V is the state's column count
        (K for the identity-started transitions). LOCAL (with HAS_R): dv_local is computed here (module docstring)
        instead of read from ``dvn``, A of chunk c formed in step c. W_AINV (with LOCAL): ``w_desc`` is Ainv's
        ([B*T, HV*64], 64 x 64 tiles) and each chunk's W = (Ainv diag(beta e^c r_k)) k is formed here, its product
        issued after ``A dO`` and waited for after dVn's store (no W tensor, no W kernel)."""
        C: gl.constexpr = 64
        i_v = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_s = gl.program_id(2)
        i_h = i_hv // (HV // H)
        n, c_beg, c_end, i_b, bos, eos = _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        choff = gl.load(chunk_offsets + n)
        tok0 = i_b * T
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        if W_AINV:
            w_s = gl.allocate_shared_memory(dt, [NS, C, C], w_desc.layout)      # Ainv ring
            as_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))
            w1_s = gl.allocate_shared_memory(dt, [C, K], gl.NVMMASharedLayout.get_default_for([C, K], dt))
        else:
            w_s = gl.allocate_shared_memory(dt, [NS, C, K], w_desc.layout)
        if HAS_R:
            q_s = gl.allocate_shared_memory(dt, [NS, C, K], q_desc.layout)
            do_s = gl.allocate_shared_memory(dt, [NS, C, BV], do_desc.layout)
            if LOCAL:
                dl_s = k_s
            else:
                dl_s = gl.allocate_shared_memory(dt, [NS, C, BV], dl_desc.layout)
        else:
            q_s = k_s
            do_s = k_s
            dl_s = k_s
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        g_s = gl.allocate_shared_memory(dt, [K, BV], gs_desc.layout)
        op_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, BV], dt)
        fdo_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        ndv_s = gl.allocate_shared_memory(dt, [C, BV], op_layout)
        if LOCAL:
            a_s = gl.allocate_shared_memory(dt, [C, C], gl.NVMMASharedLayout.get_default_for([C, C], dt))
            # per-chunk vectors of A
            rv_s = gl.allocate_shared_memory(gl.float32, [4 * C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=1)

        if num_warps == 8:
            # two warpgroups: G [K, BV] split by rows (64 each), the [C, *] products by columns
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                          instr_shape=[16, BV, 16])
            mma_v: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, BV // 2, 16])
            mma_c: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, C // 2, 16])
            mma_w: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                            instr_shape=[16, K // 2, 16])
        else:
            mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BV, 16])
            mma_v: gl.constexpr = mma
            mma_c: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, C, 16])
            mma_w: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, K, 16])
        ok = gl.arange(0, K, layout=gl.SliceLayout(1, mma))
        ov = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, mma))
        m_kv = (ok[:, None] < K) & (ov[None, :] < V)
        to = gl.arange(0, C, layout=gl.SliceLayout(1, mma_v))          # chunk rows of the [C, BV] tiles
        ov_c = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, mma_v))

        # ---- G entering the last chunk (fp32 registers, the wgmma accumulator layout)
        if INIT == 3:
            gr = gl.where((ok[:, None] == ov[None, :]) & m_kv, 1.0, 0.0)
        else:
            gr = gl.zeros([K, BV], gl.float32, layout=mma)
        if INIT == 1:
            gr += gl.load(x0 + ((n * HV + i_hv) * K + ok[:, None]).to(gl.int64) * V + ov[None, :], mask=m_kv,
                          other=0.0).to(gl.float32)
        if INIT == 2:
            gr += gl.load(x0 + ((i_s * HV + i_hv) * K + ok[:, None]).to(gl.int64) * V + ov[None, :], mask=m_kv,
                          other=0.0).to(gl.float32)

        if HAS_R and LOCAL and W_AINV:
            nbytes: gl.constexpr = (2 * C * K + C * C + C * BV) * (dt.primitive_bitwidth // 8)
        elif HAS_R and LOCAL:
            nbytes: gl.constexpr = (3 * C * K + C * BV) * (dt.primitive_bitwidth // 8)
        elif HAS_R:
            nbytes: gl.constexpr = (3 * C * K + 2 * C * BV) * (dt.primitive_bitwidth // 8)
        else:
            nbytes: gl.constexpr = 2 * C * K * (dt.primitive_bitwidth // 8)
        col_k = i_h * K
        if W_AINV:
            col_w = i_hv * C
        else:
            col_w = i_hv * K
        tc_c = gl.arange(0, C, layout=gl.SliceLayout(0, mma_c))      # Ainv's columns
        col_v = i_hv * V + i_v * BV
        # ---- prologue: chunks c_end - 1 .. c_end - NS + 1 into the ring
        for j in gl.static_range(NS - 1):
            _issue_rev_loads(k_desc, w_desc, q_desc, do_desc, dl_desc, bars.index(j), k_s.index(j), w_s.index(j),
                             q_s.index(j), do_s.index(j), dl_s.index(j), tok0 + bos + (c_end - 1 - j) * C,
                             col_k, col_w, col_v, c_end - 1 - j >= c_beg, HAS_R, LOCAL, nbytes)
        fk_n, fq_n, el_n = _rev_gates(gcum, rq_in, rk_in, bos + (c_end - 1) * C, to, eos, tok0, i_h, i_hv,
                                      c_end > c_beg, scale, H, HV, USE_L2)
        if LOCAL:
            lc_n, lr_n, lq_n = _local_vectors(gcum, rq_in, rk_in, bos + (c_end - 1) * C, eos, tok0, i_h, i_hv,
                                              c_end > c_beg, scale, H, HV, USE_L2, num_warps)
        if W_AINV:
            fw_n = _w_factors(gcum, beta, rk_in, bos + (c_end - 1) * C, tc_c, eos, tok0, i_h, i_hv, c_end > c_beg,
                              H, HV, USE_L2)
        if c_end > c_beg:
            if bos + c_end * C > eos:
                # the segment's first step is its sequence's partial last chunk (chunks run last to first): its
                # tiles' rows past the end hold the next sequence's tokens, and q^T (fq dO), w^T dVn (with W_AINV
                # also W = Ainv' k) sum over rows whose other factor is 0 there, so a non-finite neighbour would
                # give NaN (``gdn check`` chunk_backward_nan_isolation): zeroed here, before the loop (in the loop,
                # a never-taken branch cost the pass 18-29%: bench/NOTES.md), fenced by the loop's first barrier
                nv_e = eos - bos - (c_end - 1) * C
                mbarrier.wait(bars.index(0), 0)
                _zero_rows_past(w_s.index(0), nv_e, num_warps)
                if HAS_R:
                    _zero_rows_past(q_s.index(0), nv_e, num_warps)
                if W_AINV:
                    _zero_rows_past(k_s.index(0), nv_e, num_warps)
        zero = gl.zeros([C, BV], gl.float32, layout=mma_v)
        for it in range(0, c_end - c_beg):
            c = c_end - 1 - it
            s = it % NS
            phase = (it // NS) & 1
            # ---- refill the stage consumed one step ago with chunk c - NS + 1
            sf = (it + NS - 1) % NS
            _issue_rev_loads(k_desc, w_desc, q_desc, do_desc, dl_desc, bars.index(sf), k_s.index(sf),
                             w_s.index(sf), q_s.index(sf), do_s.index(sf), dl_s.index(sf),
                             tok0 + bos + (c - NS + 1) * C, col_k, col_w, col_v, c - NS + 1 >= c_beg, HAS_R,
                             LOCAL, nbytes)
            fk = fk_n
            fq = fq_n
            e_last = el_n
            fk_n, fq_n, el_n = _rev_gates(gcum, rq_in, rk_in, bos + (c - 1) * C, to, eos, tok0, i_h, i_hv,
                                          c > c_beg, scale, H, HV, USE_L2)
            if W_AINV:
                fw = fw_n
                fw_n = _w_factors(gcum, beta, rk_in, bos + (c - 1) * C, tc_c, eos, tok0, i_h, i_hv, c > c_beg,
                                  H, HV, USE_L2)
            if LOCAL:
                # this chunk's vectors into rv_s (its last readers, the previous step's, are past two barriers);
                # visible to every warp after the barrier in front of k @ G
                _store_vectors(rv_s, lc_n, lr_n, lq_n, C)
                lc_n, lr_n, lq_n = _local_vectors(gcum, rq_in, rk_in, bos + (c - 1) * C, eos, tok0, i_h, i_hv,
                                                  c > c_beg, scale, H, HV, USE_L2, num_warps)
            rows = bos + c * C + to
            m = rows < eos

            # ---- G (bf16) into shared memory: operand of k @ G, and gs[c]
            if STORE_STEPS:
                tma.store_wait(0)
            g_s.store(gr.to(dt))
            mbarrier.wait(bars.index(s), phase)
            if HAS_R:
                dov = do_s.index(s).load(mma_v).to(gl.float32)
                fdo_s.store(gl.where(m[:, None], dov * fq[:, None], 0.0).to(dt))
            fence_async_shared()
            cta_barrier()
            if STORE_STEPS:
                tma_store(gs_desc, [((choff + c) * HV + i_hv) * K, i_v * BV], g_s)
            kg = warpgroup_mma(k_s.index(s), g_s, zero, use_acc=False, is_async=True)
            acc = gr * e_last
            if LOCAL:
                # dv_local = A dO with A = (k q^T) * e^(c_j - c_i) scale r_k,i r_q,j for j >= i (0 past the end),
                # accumulated onto the k @ G term; q^T (fq dO) issued after it (not needed before w^T dVn)
                kq = warpgroup_mma(k_s.index(s), q_s.index(s).permute((1, 0)),
                                   gl.zeros([C, C], gl.float32, layout=mma_c), use_acc=False, is_async=True)
                if W_AINV:
                    # Ainv diag(beta e^c r_k), W's A operand, while k @ G and k q^T run (its last reader, the
                    # previous step's W product, was waited for); visible to the async proxy after the next barrier
                    as_s.store((w_s.index(s).load(mma_c).to(gl.float32) * fw[None, :]).to(dt))
                kg, kq = warpgroup_mma_wait(0, deps=[kg, kq])
                a_s.store(_form_a(kq, rv_s, eos - (bos + c * C), C, mma_c).to(dt))
                fence_async_shared()
                cta_barrier()
                dv = warpgroup_mma(a_s, do_s.index(s), kg * fk[:, None], is_async=True)
                acc = warpgroup_mma(q_s.index(s).permute((1, 0)), fdo_s, acc, is_async=True)
                if W_AINV:
                    wm = warpgroup_mma(as_s, k_s.index(s), gl.zeros([C, K], gl.float32, layout=mma_w),
                                       use_acc=False, is_async=True)
                    dv = warpgroup_mma_wait(2, deps=[dv])
                else:
                    dv = warpgroup_mma_wait(1, deps=[dv])
                dv = gl.where(m[:, None], dv, 0.0)
            elif HAS_R:
                acc = warpgroup_mma(q_s.index(s).permute((1, 0)), fdo_s, acc, is_async=True)
                dl = dl_s.index(s).load(mma_v).to(gl.float32)
                kg = warpgroup_mma_wait(1, deps=[kg])
                dv = gl.where(m[:, None], kg * fk[:, None] + dl, 0.0)
            else:
                kg = warpgroup_mma_wait(0, deps=[kg])
                dv = gl.where(m[:, None], kg * fk[:, None], 0.0)
            if STORE_STEPS:
                pv = dvn + ((tok0 + rows) * HV + i_hv).to(gl.int64)[:, None] * V + ov_c[None, :]
                gl.store(pv, dv.to(dvn.dtype.element_ty), mask=m[:, None] & (ov_c[None, :] < V))
            ndv_s.store((-dv).to(dt))
            if W_AINV:
                wm = warpgroup_mma_wait(0, deps=[wm])
                w1_s.store(wm.to(dt))
            fence_async_shared()
            cta_barrier()
            # ---- G = e^cL G + q^T (fq dO) - w^T dVn
            if W_AINV:
                acc = warpgroup_mma(w1_s.permute((1, 0)), ndv_s, acc, is_async=True)
            else:
                acc = warpgroup_mma(w_s.index(s).permute((1, 0)), ndv_s, acc, is_async=True)
            gr = warpgroup_mma_wait(0, deps=[acc])

        if STORE_STEPS:
            tma.store_wait(0)
        if STORE_END:
            if END_BY_SEG:
                row_e = i_s
            else:
                row_e = n
            gl.store(xend + ((row_e * HV + i_hv) * K + ok[:, None]).to(gl.int64) * V + ov[None, :],
                     gr.to(xend.dtype.element_ty), mask=m_kv)
        for j in gl.static_range(NS):
            mbarrier.invalidate(bars.index(j))


def supported(q, k, do, w, state_dtype, K: int, V: int) -> bool:
    """Whether the sm_90 reverse pass can take these arguments (else the portable kernel does): Gluon, sm_90, 16-bit
    operands of one dtype (q, k, dO, w and the gs / dvn it writes: ``state_dtype``, w's dtype), K 64 / 128, V a
    multiple of 32 (its V tiles: 32 / 64), q / k / dO as 2-D TMA views, w contiguous (w None: W formed in the pass
    from Ainv, whose checks are the caller's)."""
    if not G.AVAILABLE or K not in (64, 128) or V % 32 or capability(k.device) != "sm_90":
        return False
    dt = k.dtype
    if dt not in _GL_DT or any(x.dtype != dt for x in (q, do)) or state_dtype != dt:
        return False
    if w is not None and (w.dtype != dt or not w.is_contiguous() or w.shape[-1] != K):
        return False
    return _rows2d_ok(q) and _rows2d_ok(k) and _rows2d_ok(do)


def launch_dh_pass(grid, q, k, w, g_cum, do, rq, rk, x0, xend, gs, dvn, segments, chunk_offsets, cu_seqlens, scale,
                   T, *, H, HV, K, V, BV, use_l2, INIT, HAS_R, STORE_STEPS, STORE_END, END_BY_SEG, local=False,
                   stages=2, w_ainv=False, beta=None):
    """Launch the sm_90 reverse pass over ``grid`` = (V // BV, HV, segments) (``supported`` must have said yes);
    arguments and flags as the portable ``chunk_bwd_dh_kernel``'s (``V`` = K for INIT 3). ``local`` (with HAS_R):
    compute dv_local in the kernel instead of reading it from ``dvn`` (the kernel's LOCAL). Unused tensors may be
    None. V tile 128 (two warpgroups, 206 KB of shared memory at 2 stages) only with ``local``, HAS_R and K = 128.
    ``w_ainv``: ``w`` is Ainv [B, T, HV, 64] (contiguous, the operands' dtype) and W is formed in the pass from it,
    ``beta`` [B, T, HV] (contiguous), g_cum and r_k (V tile 128 only)."""
    if BV == 128 and not (local and HAS_R and K == 128):
        raise ValueError("the reverse pass's V tile 128 needs local, HAS_R and K = 128")
    if w_ainv and (BV != 128 or beta is None or w.shape[-1] != CHUNK or not w.is_contiguous()
                   or not beta.is_contiguous()):
        raise ValueError("the reverse pass forms W from Ainv only at V tile 128, with contiguous Ainv and beta")
    dn = _GL_DT[k.dtype]
    B = k.shape[0]
    k_desc = _desc(_rows2d(k), (CHUNK, K), dn)
    w_desc = _desc(w.view(B * T, -1), (CHUNK, CHUNK if w_ainv else K), dn)
    if HAS_R:
        q_desc = _desc(_rows2d(q), (CHUNK, K), dn)
        do_desc = _desc(_rows2d(do), (CHUNK, BV), dn)
        dl_desc = do_desc if local else _desc(dvn.view(B * T, -1), (CHUNK, BV), dn)
    else:
        q_desc = do_desc = dl_desc = k_desc
    gs_desc = _desc(gs.view(-1, gs.shape[-1]), (K, BV), dn)
    ph = g_cum
    launch(_dh_pass_sm90_kernel, grid,
        k_desc, w_desc, q_desc, do_desc, dl_desc, gs_desc,
        g_cum, rq if rq is not None else ph, rk if rk is not None else ph, beta if w_ainv else ph, dvn,
        x0 if x0 is not None else ph,
        xend if xend is not None else ph, segments, cu_seqlens if cu_seqlens is not None else segments, chunk_offsets, float(scale), T,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=use_l2, IS_VARLEN=cu_seqlens is not None, INIT=INIT, HAS_R=HAS_R,
        STORE_STEPS=STORE_STEPS, STORE_END=STORE_END, END_BY_SEG=END_BY_SEG, LOCAL=bool(local and HAS_R),
        W_AINV=bool(w_ainv), NS=stages, num_warps=8 if BV == 128 else 4)


__all__ = ["supported", "launch_dh_pass"]
