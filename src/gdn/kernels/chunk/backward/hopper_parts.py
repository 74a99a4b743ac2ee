"""Hopper (sm_90) form of the backward's parallel per-chunk gradients: parts A and B of ``parts.py``
(``chunk_bwd_out_kernel`` + ``chunk_bwd_wy_kernel``) in one Gluon kernel, one CTA (8 warps) per (chunk, value head).

Every operand tile of the chunk comes by TMA into shared memory once (q, k [64, K]; dO, v_new, dVn, v [64, V];
Ainv [64, 64]; H and Gm [K, V]: ~170 KB at K = V = 128), in two groups so that the dQ side computes while the
second group lands; the products are asynchronous warpgroup MMAs on shared-memory operands (computed operands go
through small shared-memory tiles); the two warpgroups split every product's N columns. The portable kernels read
most of these tiles twice (two sides, two kernels) with synchronous loads in front of each product.

Math (notation of :mod:`gdn.kernels.chunk.backward`, ``Gam`` causal, ``SL`` strictly lower)::

    dPm = (dO Vn^T) * Gam,  dQ = diag(e^c) dO H^T + (dPm diag(r_k)) k                    -> dq_v (per value head)
    dVb = Ainv^T dVn,  dv = diag(b) dVb,
    db  = rowsum(dVb * v) - e^c r_k k.(dVb H^T) - rowsum(SL * (dVb Vn^T) * Gam * (kn kn^T))     (kn = r_k k)
    dK  = -diag(b e^c) dVb H^T + diag(e^(cL - c)) Vn Gm^T + ((Vn dO^T) * Gam^T diag(r_q scale)) q
          - (diag(b) (SL * dVb Vn^T * Gam) + (SL^T * Vn dVn^T Ainv * Gam^T) diag(b)) kn          -> dk_v (fp32)
    dg  = the reverse cumulative sum of the gate terms of both (``parts.py``), + e^cL <H, Gm> at every row

Outputs: dv [B*T, HV, V], dbeta, dg [B*T, HV] as the portable pair's, and the final dq, dk [B*T, H, K]: the kernel
also does the portable path's q/k kernel's work (the sum over a key head's value heads, in value-head order through
per-value-head slots and an arrival count with HV > H; the scale; the L2-norm backward). Inputs: q, k,
v, dO as 2-D views [B*T, heads*D] (strided rows allowed); v_new, dVn [B*T, HV*V] and Ainv [B*T, HV*64] contiguous;
H (``h``) and Gm (``gs``) [NT*HV*K, V]. Rows of a partial chunk past its sequence are zeroed in shared memory before
use (they hold the next sequence's tokens), as the portable kernels load zeros there.
"""
from __future__ import annotations

import torch

from ... import _gluon_api as G
from ...launch import launch
from ...tuning import capability
from ..hopper import CHUNK, _GL_DT, _desc, _rows2d, _rows2d_ok, token_rows_ok

if G.AVAILABLE:
    from ..hopper import cta_barrier, fence_async_shared, gl, gluon, mbarrier, tma_load, warpgroup_mma, \
        warpgroup_mma_wait

    @gluon.jit
    def _zero_rows(buf, nv, R: gl.constexpr, D: gl.constexpr, COLS_TOO: gl.constexpr, layout: gl.constexpr):
        """Zero rows >= nv (and columns >= nv when COLS_TOO) of a [R, D] shared-memory tile."""
        x = buf.load(layout)
        r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        keep = (r < nv)[:, None]
        if COLS_TOO:
            cc = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
            keep = keep & (cc < nv)[None, :]
        buf.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _gam(g_r, g_c, o_r, o_c, STRICT: gl.constexpr, TRANS: gl.constexpr):
        """Gam of a C x C tile, ``e^(c_t - c_s)`` at row t, column s where t >= s (STRICT: t > s), else 0; TRANS:
        its transpose (``e^(c_s - c_t)`` at row t, column s where s >= t). Row vectors in the tile's row slice
        layout, column vectors in its column slice layout."""
        if TRANS:
            lo = o_c[None, :]
            hi = o_r[:, None]
            d = g_c[None, :] - g_r[:, None]
        else:
            lo = o_r[:, None]
            hi = o_c[None, :]
            d = g_r[:, None] - g_c[None, :]
        if STRICT:
            m = lo > hi
        else:
            m = lo >= hi
        return gl.where(m, gl.exp(gl.where(m, d, 0.0)), 0.0)

    @gluon.jit
    def _fill_row_vecs(rv_s, gcum, beta, rq_in, rk_in, row0, nv, g_last, i_h, i_hv, scale, H: gl.constexpr,
                       HV: gl.constexpr, USE_L2: gl.constexpr, num_warps: gl.constexpr):
        """The chunk's per-row vectors into rv_s [4 * 64] fp32 (four rows of 64): c (padding rows: cL =
        ``g_last``), b (padding 0), r_k, r_q scale (1 and scale without the L2 norm). Read back in the layout each
        use needs (``_vec``), so that no copy of them is held in registers through the kernel."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        to = gl.arange(0, 64, layout=lay)
        m = to < nv
        tok = (row0 + to).to(gl.int64)
        g = gl.load(gcum + tok * HV + i_hv, mask=m, other=0.0)
        rv_s.slice(0, 64).store(gl.where(m, g, g_last))
        rv_s.slice(64, 64).store(gl.load(beta + tok * HV + i_hv, mask=m, other=0.0).to(gl.float32))
        if USE_L2:
            rv_s.slice(128, 64).store(gl.load(rk_in + tok * H + i_h, mask=m, other=0.0))
            rv_s.slice(192, 64).store(gl.load(rq_in + tok * H + i_h, mask=m, other=0.0) * scale)
        else:
            rv_s.slice(128, 64).store(gl.where(m, 1.0, 1.0))
            rv_s.slice(192, 64).store(gl.where(m, scale, scale))

    @gluon.jit
    def _vec(rv_s, i: gl.constexpr, layout: gl.constexpr):
        """Row vector i of ``_fill_row_vecs`` (0 c, 1 b, 2 r_k, 3 r_q scale) in ``layout``."""
        return rv_s.slice(i * 64, 64).load(layout)

    @gluon.jit
    def _l2_backward(dy, x_s, r_in, tok, m, i_h, scale, H: gl.constexpr, layout: gl.constexpr, USE_L2: gl.constexpr):
        """The q/k kernel's step for one head's [64, D] gradient dy: with the L2 norm ``r scale (dy - x (x.dy) r^2)``
        (x the raw rows in shared memory, r their inverse norms), else ``scale dy``."""
        if USE_L2:
            r = gl.load(r_in + tok * H + i_h, mask=m, other=0.0)
            x = x_s.load(layout).to(gl.float32)
            dy = (r * scale)[:, None] * (dy - x * (gl.sum(x * dy, axis=1) * r * r)[:, None])
        else:
            dy = dy * scale
        return dy

    @gluon.jit
    def _bwd_parts_sm90_kernel(
        q_desc, k_desc, do_desc, vn_desc, dvn_desc, v_desc, ai_desc, h_desc, gs_desc,
        gcum, beta, rq_in, rk_in, dq_v, dk_v, dq_o, dk_o, counts, slot_head, n_groups, dv, dbeta, dg, cu_seqlens,
        chunk_indices, scale, one, T, s_dq, s_dk, s_dv, H: gl.constexpr, HV: gl.constexpr, D: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Parts A and B of one (chunk, value head) (module docstring); D = K = V; program id = chunk * HV + value
        head (a key head's value heads side by side). The final dq, dk [B*T, H, K] (token rows s_dq / s_dk elements
        apart, heads dense; dv's rows s_dv apart: views of one packed gradient allowed) go to dq_o, dk_o (the GVA sum,
        the scale and the L2-norm backward done here): with HV = H straight from the fp32 dQ, dK; with HV > H
        through GR - 1 slots per (chunk, key head) group in dq_v, dk_v [B*T, H * (GR - 1), K], taken by tickets:
        ``counts`` (int32, zero at launch) holds the tickets of the n_groups = NT * H groups, then their done counts;
        ``slot_head`` [n_groups * (GR - 1)] the value head (in its group) of each written slot; the last of a group
        sums its value heads in value-head order (so the result does not depend on which one is last)."""
        C: gl.constexpr = 64
        GR: gl.constexpr = HV // H
        pid = gl.program_id(0)
        i_t = pid // HV
        i_hv = pid % HV
        i_h = i_hv // GR
        if IS_VARLEN:
            n = gl.load(chunk_indices + 2 * i_t)
            c = gl.load(chunk_indices + 2 * i_t + 1)
            bos = gl.load(cu_seqlens + n)
            eos = gl.load(cu_seqlens + n + 1)
        else:
            NTs = gl.cdiv(T, C)
            n = i_t // NTs
            c = i_t % NTs
            bos = n * T
            eos = bos + T
        row0 = bos + c * C                       # flat token row of the chunk's first row
        nv = gl.minimum(eos - row0, C)           # valid rows

        dt: gl.constexpr = q_desc.dtype
        q_s = gl.allocate_shared_memory(dt, [C, D], q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, [C, D], k_desc.layout)
        do_s = gl.allocate_shared_memory(dt, [C, D], do_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [C, D], vn_desc.layout)
        h_s = gl.allocate_shared_memory(dt, [D, D], h_desc.layout)
        dvn_s = gl.allocate_shared_memory(dt, [C, D], dvn_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [C, D], v_desc.layout)
        ai_s = gl.allocate_shared_memory(dt, [C, C], ai_desc.layout)
        gs_s = gl.allocate_shared_memory(dt, [D, D], gs_desc.layout)
        lay_cd: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, D], dt)
        lay_cc: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], dt)
        x_s = gl.allocate_shared_memory(dt, [C, D], lay_cd)     # dVb, then diag(e^(cL - c)) Vn
        a_s = gl.allocate_shared_memory(dt, [C, C], lay_cc)     # dPm diag(r_k), then Vn dVn^T
        p_s = gl.allocate_shared_memory(dt, [C, C], lay_cc)     # (Vn dO^T) * Gam^T diag(r_q scale)
        m_s = gl.allocate_shared_memory(dt, [C, C], lay_cc)     # -(M + M^T) diag(r_k)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)

        eb: gl.constexpr = dt.primitive_bitwidth // 8
        hrow = (i_t * HV + i_hv) * D
        mbarrier.expect(bars.index(0), (4 * C * D + D * D) * eb)
        tma_load(q_desc, [row0, i_h * D], bars.index(0), q_s)
        tma_load(k_desc, [row0, i_h * D], bars.index(0), k_s)
        tma_load(do_desc, [row0, i_hv * D], bars.index(0), do_s)
        tma_load(vn_desc, [row0, i_hv * D], bars.index(0), vn_s)
        tma_load(h_desc, [hrow, 0], bars.index(0), h_s)
        mbarrier.expect(bars.index(1), (2 * C * D + C * C + D * D) * eb)
        tma_load(dvn_desc, [row0, i_hv * D], bars.index(1), dvn_s)
        tma_load(v_desc, [row0, i_hv * D], bars.index(1), v_s)
        tma_load(ai_desc, [row0, i_hv * C], bars.index(1), ai_s)
        tma_load(gs_desc, [hrow, 0], bars.index(1), gs_s)

        LC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        LD: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                     instr_shape=[16, D // 2, 16])
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        rc: gl.constexpr = gl.SliceLayout(1, LC)
        cc: gl.constexpr = gl.SliceLayout(0, LC)
        rd: gl.constexpr = gl.SliceLayout(1, LD)
        g_last = gl.load(gcum + (row0 + nv - 1).to(gl.int64) * HV + i_hv)
        rv_s = gl.allocate_shared_memory(gl.float32, [4 * C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        _fill_row_vecs(rv_s, gcum, beta, rq_in, rk_in, row0, nv, g_last, i_h, i_hv, scale, H, HV, USE_L2,
                       num_warps)
        cta_barrier()
        o_r = gl.arange(0, C, layout=rc)
        o_c = gl.arange(0, C, layout=cc)
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        tok_d = (row0 + gl.arange(0, C, layout=rd)).to(gl.int64)
        m_d = gl.arange(0, C, layout=rd) < nv
        m_dd = m_d[:, None] & (o_d[None, :] < D)
        m_r = o_r < nv
        zc = gl.zeros([C, C], gl.float32, layout=LC)
        zd = gl.zeros([C, D], gl.float32, layout=LD)

        # ---------------- group 0: q, k, dO, Vn, H -> dQ (side 0 of part A)
        mbarrier.wait(bars.index(0), 0)
        if nv < C:
            _zero_rows(q_s, nv, C, D, False, BL)
            _zero_rows(k_s, nv, C, D, False, BL)
            _zero_rows(do_s, nv, C, D, False, BL)
            _zero_rows(vn_s, nv, C, D, False, BL)
            fence_async_shared()
            cta_barrier()
        t_dpm = warpgroup_mma(do_s, vn_s.permute((1, 0)), zc, use_acc=False, is_async=True)     # dO Vn^T
        t_qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zc, use_acc=False, is_async=True)        # q k^T
        t_dqs = warpgroup_mma(do_s, h_s.permute((1, 0)), zd, use_acc=False, is_async=True)      # dO H^T
        dpm, qk = warpgroup_mma_wait(1, deps=[t_dpm, t_qk])
        t_pt = warpgroup_mma(vn_s, do_s.permute((1, 0)), zc, use_acc=False, is_async=True)      # Vn dO^T
        # per-row vectors read from rv_s at each use (held in registers through the kernel they cost 128 B of
        # spills at 255 registers; read this way: 223 registers, none spilled, parts kernel -13 to -19%)
        dpm = dpm * _gam(_vec(rv_s, 0, rc), _vec(rv_s, 0, cc), o_r, o_c, False, False)
        # strictly lower: the diagonal cancels exactly
        pm = gl.where(o_r[:, None] > o_c[None, :],
                      dpm * qk * _vec(rv_s, 3, rc)[:, None] * _vec(rv_s, 2, cc)[None, :], 0.0)
        dc0 = gl.sum(pm, axis=1) - gl.convert_layout(gl.sum(pm, axis=0), rc)
        a_s.store((dpm * _vec(rv_s, 2, cc)[None, :]).to(dt))
        fence_async_shared()
        cta_barrier()
        # (a wait names the shared tiles its products read where nothing later keeps them live, or reduction /
        # conversion scratch may take their bytes before the product is done; gdn.aot.async_operand_problem)
        dqs, dpmt, _ = warpgroup_mma_wait(0, deps=[t_dqs, t_pt, do_s])
        eg_d = gl.exp(_vec(rv_s, 0, rd))
        dqs = dqs * eg_d[:, None]
        q_d = q_s.load(LD).to(gl.float32)
        dc0 += gl.convert_layout(gl.sum(q_d * dqs, axis=1) * _vec(rv_s, 3, rd), rc)
        t_dq = warpgroup_mma(a_s, k_s, dqs, is_async=True)                                      # + dPm' k
        # (Vn dO^T) * Gam^T diag(r_q scale): Gam^T[s, t] = e^(c_t - c_s) for t >= s
        p_s.store((dpmt * _gam(_vec(rv_s, 0, rc), _vec(rv_s, 0, cc), o_r, o_c, False, True)
                    * _vec(rv_s, 3, cc)[None, :]).to(dt))

        # ---------------- group 1: dVn, v, Ainv, Gm -> part B and side 1 of part A
        mbarrier.wait(bars.index(1), 0)
        if nv < C:
            _zero_rows(dvn_s, nv, C, D, False, BL)
            _zero_rows(v_s, nv, C, D, False, BL)
            _zero_rows(ai_s, nv, C, C, True, BL)
        fence_async_shared()
        cta_barrier()
        t_dvb = warpgroup_mma(ai_s.permute((1, 0)), dvn_s, zd, use_acc=False, is_async=True)     # Ainv^T dVn
        t_vdv = warpgroup_mma(vn_s, dvn_s.permute((1, 0)), zc, use_acc=False, is_async=True)     # Vn dVn^T
        # <H, Gm> while they run (32 rows at a time, summed elementwise: one cross-warp reduction, not four)
        hg = gl.zeros([32, D], gl.float32, layout=BL)
        for r in gl.static_range(0, D, 32):
            hg += h_s.slice(r, 32).load(BL).to(gl.float32) * gs_s.slice(r, 32).load(BL).to(gl.float32)
        hgs = gl.sum(gl.sum(hg, axis=1), axis=0)
        dq = warpgroup_mma_wait(2, deps=[t_dq])
        if GR == 1:
            dq = _l2_backward(dq, q_s, rq_in, tok_d, m_d, i_h, scale, H, LD, USE_L2)
            gl.store(dq_o + (tok_d * s_dq + i_h * D)[:, None] + o_d[None, :], dq.to(dq_o.dtype.element_ty),
                     mask=m_dd)
        else:
            # kept in dO's tile (its last readers, dO Vn^T / dO H^T / Vn dO^T, were waited for before the barrier
            # above) until the group's fold at the end
            do_s.store(dq.to(dt))
        dvb = warpgroup_mma_wait(1, deps=[t_dvb])
        gl.store(dv + (tok_d * s_dv + i_hv * D)[:, None] + o_d[None, :],
                 (dvb * _vec(rv_s, 1, rd)[:, None]).to(dv.dtype.element_ty), mask=m_dd)
        db = gl.sum(dvb * v_s.load(LD).to(gl.float32), axis=1)
        x_s.store(dvb.to(dt))
        fence_async_shared()
        cta_barrier()
        t_acc = warpgroup_mma(x_s, h_s.permute((1, 0)), zd, use_acc=False, is_async=True)        # dVb H^T = -dKb
        t_nda = warpgroup_mma(x_s, vn_s.permute((1, 0)), zc, use_acc=False, is_async=True)       # dVb Vn^T = -dA
        vdv, _ = warpgroup_mma_wait(2, deps=[t_vdv, dvn_s])
        acc, nda, _ = warpgroup_mma_wait(0, deps=[t_acc, t_nda, h_s])
        cta_barrier()     # every warpgroup is done reading x_s and a_s
        a_s.store(vdv.to(dt))
        fb_d = _vec(rv_s, 1, rd) * eg_d
        kn = gl.sum(k_s.load(LD).to(gl.float32) * acc, axis=1)                                     # k.(-dKb)
        kdkb = kn * _vec(rv_s, 2, rd) * eg_d
        acc = acc * (-fb_d)[:, None]
        x_s.store((vn_s.load(LD).to(gl.float32) * gl.exp(g_last - _vec(rv_s, 0, rd))[:, None]).to(dt))
        fence_async_shared()
        cta_barrier()
        t_ndat = warpgroup_mma(a_s, ai_s, zc, use_acc=False, is_async=True)                      # Vn dVn^T Ainv
        t_kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zc, use_acc=False, is_async=True)        # k k^T
        t_acc = warpgroup_mma(x_s, gs_s.permute((1, 0)), acc, is_async=True)                     # + dKs
        # C x C terms of part B: A = SL * diag(b) (Gam * K K^T) with kn = r_k k
        nda = nda * _gam(_vec(rv_s, 0, rc), _vec(rv_s, 0, cc), o_r, o_c, True, False)
        ndat, kk, _, _ = warpgroup_mma_wait(1, deps=[t_ndat, t_kk, a_s, ai_s])
        dagk = nda * kk * (_vec(rv_s, 2, rc)[:, None] * _vec(rv_s, 2, cc)[None, :])
        dagk_r = gl.sum(dagk, axis=1)
        db -= gl.convert_layout(dagk_r, rd)
        b_r = _vec(rv_s, 1, rc)
        daa = dagk * b_r[:, None]
        dcb = gl.convert_layout(gl.sum(daa, axis=0), rc) - dagk_r * b_r     # rowsum(daa) = b rowsum(dagk)
        msym = (nda * b_r[:, None] + ndat * _gam(_vec(rv_s, 0, rc), _vec(rv_s, 0, cc), o_r, o_c, True, True)
                * _vec(rv_s, 1, cc)[None, :]) * _vec(rv_s, 2, cc)[None, :]
        m_s.store((-msym).to(dt))
        fence_async_shared()
        cta_barrier()
        acc, _, _ = warpgroup_mma_wait(0, deps=[t_acc, x_s, gs_s])
        kdks = (gl.sum(k_s.load(LD).to(gl.float32) * acc, axis=1) + fb_d * kn) * _vec(rv_s, 2, rd)
        t_acc = warpgroup_mma(p_s, q_s, acc, is_async=True)                                      # + dPmT q
        t_acc = warpgroup_mma(m_s, k_s, t_acc, is_async=True)                                    # - (M + M^T) kn
        # gate and beta gradients while the last products run: dg_t = sum_{s >= t} (dc0 + dcb - b kdkb)_s
        # + sum_{s < t} k_s.dKs_s + e^cL <H, Gm> (the cumulative sums as masked row sums of one C x C tile)
        rev = gl.convert_layout(dc0 + dcb - gl.convert_layout(kdkb, rc) * _vec(rv_s, 1, rc), cc)
        fwd = gl.convert_layout(kdks, cc)
        dgv = gl.sum(gl.where(o_r[:, None] > o_c[None, :], fwd[None, :], rev[None, :]), axis=1)
        dgv += hgs * gl.exp(g_last)
        db_r = gl.convert_layout(db - kdkb, rc)
        tok_r = (row0 + o_r).to(gl.int64)
        gl.store(dg + tok_r * HV + i_hv, dgv.to(dg.dtype.element_ty), mask=m_r)
        gl.store(dbeta + tok_r * HV + i_hv, db_r.to(dbeta.dtype.element_ty), mask=m_r)
        dk, _, _, _, _ = warpgroup_mma_wait(0, deps=[t_acc, p_s, q_s, m_s, k_s])
        if GR == 1:
            # ``one``: a runtime 1.0, not the literal: with nothing between the last product's wait and dk's
            # conversion to the output dtype (no L2 norm), ptxas (Triton 3.6's) serializes every wgmma of the kernel
            # (C7514; gdn.aot.wgmma_serialized_problem)
            dk = _l2_backward(dk, k_s, rk_in, tok_d, m_d, i_h, one, H, LD, USE_L2)
            gl.store(dk_o + (tok_d * s_dk + i_h * D)[:, None] + o_d[None, :], dk.to(dk_o.dtype.element_ty),
                     mask=m_dd)
        else:
            # the GVA fold by tickets: the first GR - 1 value heads of the group to get here write their dQ / dK
            # into slot (ticket) and the slot's value head into ``slot_head``, then count themselves done (all
            # threads' stores, bar.sync, one release atomic: the cooperative-groups grid-sync pattern); the last
            # spins on that count (it waits only for CTAs that hold tickets, so are running and wait for nothing),
            # reads the slots past L1 (.cg) and sums the group in value-head order (bitwise the same whichever is
            # last), its own dQ from dO's tile, its own dK from registers. GR - 1 slots per group, not GR.
            SL: gl.constexpr = GR - 1
            grp = i_t * H + i_h
            ticket = gl.atomic_add(counts + grp, 1, sem="relaxed", scope="gpu")
            if ticket < SL:
                p_t = (tok_d * (H * SL) + i_h * SL + ticket)[:, None] * D + o_d[None, :]
                gl.store(dq_v + p_t, do_s.load(LD), mask=m_dd)
                gl.store(dk_v + p_t, dk.to(dk_v.dtype.element_ty), mask=m_dd)
                gl.store(slot_head + grp * SL + ticket, i_hv - i_h * GR)
                cta_barrier()
                gl.atomic_add(counts + n_groups + grp, 1, sem="release", scope="gpu")
            else:
                done = gl.atomic_add(counts + n_groups + grp, 0, sem="acquire", scope="gpu")
                while done < SL:
                    done = gl.atomic_add(counts + n_groups + grp, 0, sem="acquire", scope="gpu")
                cta_barrier()
                sq = zd
                sk = zd
                for j in gl.static_range(GR):
                    if i_hv - i_h * GR == j:
                        lq = gl.where(m_dd, do_s.load(LD).to(gl.float32), 0.0)
                        lk = gl.where(m_dd, dk.to(dk_v.dtype.element_ty).to(gl.float32), 0.0)
                    else:
                        lq = zd
                        lk = zd
                        for t in gl.static_range(SL):
                            m_t = m_dd & (gl.load(slot_head + grp * SL + t, cache_modifier=".cg") == j)
                            p_t = (tok_d * (H * SL) + i_h * SL + t)[:, None] * D + o_d[None, :]
                            lq += gl.load(dq_v + p_t, mask=m_t, other=0.0, cache_modifier=".cg").to(gl.float32)
                            lk += gl.load(dk_v + p_t, mask=m_t, other=0.0, cache_modifier=".cg").to(gl.float32)
                    sq += lq
                    sk += lk
                sq = _l2_backward(sq, q_s, rq_in, tok_d, m_d, i_h, scale, H, LD, USE_L2)
                gl.store(dq_o + (tok_d * s_dq + i_h * D)[:, None] + o_d[None, :], sq.to(dq_o.dtype.element_ty),
                         mask=m_dd)
                sk = _l2_backward(sk, k_s, rk_in, tok_d, m_d, i_h, 1.0, H, LD, USE_L2)
                gl.store(dk_o + (tok_d * s_dk + i_h * D)[:, None] + o_d[None, :], sk.to(dk_o.dtype.element_ty),
                         mask=m_dd)
        mbarrier.invalidate(bars.index(0))
        mbarrier.invalidate(bars.index(1))


def supported(q, k, v, do, v_new, dvn, ainv, h, gs, K: int, V: int) -> bool:
    """Whether the sm_90 parts kernel can take these arguments (else the portable pair runs): Gluon, sm_90, K = V in
    (64, 128), every operand of one 16-bit dtype (q, k, v, dO, v_new, dVn, Ainv, H, Gm), q / k / v / dO as 2-D TMA
    views, the scratch tensors contiguous."""
    if not G.AVAILABLE or K != V or K not in (64, 128) or capability(k.device) != "sm_90":
        return False
    dt = k.dtype
    if dt not in _GL_DT or any(x.dtype != dt for x in (q, v, do, v_new, dvn, ainv, h, gs)):
        return False
    if ainv.shape[-1] != CHUNK or not all(x.is_contiguous() for x in (v_new, dvn, ainv, h, gs)):
        return False
    return _rows2d_ok(q) and _rows2d_ok(k) and _rows2d_ok(v) and _rows2d_ok(do)


def _row_stride(x: torch.Tensor) -> int:
    return x.stride(1) if x.shape[1] > 1 or x.shape[0] == 1 else x.stride(0)


def launch_parts(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, rq, rk, dq, dk, dv, dbeta, dg, cu_seqlens,
                 chunk_indices, NT, scale, *, use_l2):
    """Launch the sm_90 parts kernel over NT x HV programs (``supported`` must have said yes); tensors as
    ``parts.chunk_bwd_main``'s (beta contiguous [B, T, HV]). It writes the final dq, dk (q's and k's dtypes; no
    q/k kernel runs after it; dq, dk, dv may be strided views that pass :func:`token_rows_ok`); with HV > H it
    allocates the slots through which the value heads of a key head are summed (GR - 1 per group)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV > H:   # the GVA fold's slots (GR - 1 per group: dQ in the dot dtype, dK fp32), tickets and done counts
        SL = HV // H - 1
        dq_v = torch.empty(B * T, H * SL, K, dtype=v_new.dtype, device=q.device)
        dk_v = torch.empty(B * T, H * SL, K, dtype=torch.float32, device=q.device)
        counts = torch.zeros(2 * NT * H, dtype=torch.int32, device=q.device)
        slot_head = torch.empty(NT * H * SL, dtype=torch.int32, device=q.device)
    else:        # not read
        dq_v, dk_v, counts, slot_head = dq, dk, g_cum, g_cum
    dn = _GL_DT[k.dtype]
    row = lambda x: _desc(_rows2d(x), (CHUNK, K), dn)   # noqa: E731
    flat = lambda x, w: _desc(x.view(B * T, -1), (CHUNK, w), dn)   # noqa: E731
    ph = g_cum
    launch(_bwd_parts_sm90_kernel, (NT * HV,),
        row(q), row(k), row(do), flat(v_new, K), flat(dvn, K), row(v), flat(ainv, CHUNK),
        _desc(h.view(-1, K), (K, K), dn), _desc(gs.view(-1, K), (K, K), dn),
        g_cum, beta, rq if rq is not None else ph, rk if rk is not None else ph, dq_v, dk_v, dq, dk, counts,
        slot_head, NT * H, dv, dbeta, dg, cu_seqlens if cu_seqlens is not None else chunk_indices, chunk_indices,
        float(scale), 1.0, T, _row_stride(dq), _row_stride(dk), _row_stride(dv), H=H, HV=HV, D=K, USE_L2=use_l2,
        IS_VARLEN=cu_seqlens is not None, num_warps=8)


__all__ = ["supported", "launch_parts", "token_rows_ok"]
