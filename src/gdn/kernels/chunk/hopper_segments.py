"""Hopper (sm_90) segment pass of the segmented forward with both segment results in one CTA and in registers:
one CTA per (value head, segment) carries the segment's local state S (from zero, with the true v) and its transition
M (from the identity, v = 0) side by side, both transposed ([V, K] and [K, K], K = V = 128), in one 8-warp partition
(each warpgroup's products on its 64 rows of the same tiles: one loop body for both), fed by the register-state
kernel's one-warp load partition (``hopper._t_loader``, MN mode: k, v, Ainv and the gate rows). Per chunk, for X^T
in {S^T (v the chunk's values), M^T (v = 0)}::

    r^T = (v^T - (X^T k^T) diag(e^g r_k)) diag(beta)      X^T k^T: register A operand, k from the ring
    d^T = r^T Ainv^T diag(e^(g_last - g) r_k)
    X^T <- e^(g_last) X^T + d^T k

one after the other (the two warpgroups' products interleave on the SM). At the end S -> ``hloc``
[S, HV, K, V] and M -> ``trans`` [S, HV, K, K] (fp32, as the merge reads them: ``segments._chunk_merge_kernel``).

This is the layout of FlashInfer's sm_90 context-parallel "MN precompute" (one CTA per (chunk of the sequence,
head), both [128, 128] matrices transposed in two math warpgroups' registers): 142 us at 1 x 65536 2/8 on the H200
against 251 us for the Gluon state pass in its segment mode (``hopper._state_steps`` INIT 3: four 64-column
programs per (segment, head), two CTAs per SM, two waves) and 181 us for this one (bench/NOTES.md). Chosen by
``chunk_fwd.state_sm90_segment_t``. FlashInfer's grouping of the same terms (W = diag(beta) Ainv^T diag(e^(g_last -
g) r_k) k once per chunk, two chained products per matrix) was 2-5% slower here, and two 4-warp partitions of 64
rows each (two loop bodies: 3992 SASS instructions against 2192, 11.5% of the chain loop's samples waiting on
instruction fetch) 1-2.4% (bench/NOTES.md, Tried and lost / Kept).
"""
from __future__ import annotations

import torch

from .. import _gluon_api as G
from ..common import pdl_enter
from ..launch import launch, pdl_args
from . import hopper as HP

# the load warp's register claim; the 8-warp chain partition, the default one, gets (3 x 168 - 24) x 128 registers
# over its 256 threads = 240 per thread (a setmaxnreg.inc 240; no spills in the Triton 3.6 and 3.9 builds)
SEG_LOADER_REGS = 24

if G.AVAILABLE:
    gluon, gl = G.gluon, G.gl
    mbarrier = G.mbarrier
    cta_barrier = G.cta_barrier
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait = G.fence_async_shared, G.warpgroup_mma, G.warpgroup_mma_wait

    @gluon.jit
    def _seg_step(za, zt, kt, at, k_t, v_t, gt_s, gts, e_last, valid, partial, zero, WITH_V: gl.constexpr,
                  A_BETA: gl.constexpr):
        """One chunk of one matrix Z^T (S^T with the chunk's values ``v_t``, WITH_V; M^T with v = 0), rows of this
        warpgroup, ``za`` its register A operand: r^T = (v^T - Z^T k^T diag(e^g r_k)) diag(beta), d^T = r^T Ainv^T
        diag(e^(g_last - g) r_k), Z^T <- e^(g_last) Z^T + d^T k; ``kt`` / ``at`` are k^T and Ainv^T of the ring stage,
        ``k_t`` its k tile, ``gts`` its first gate row (``_seg_t_steps``). A_BETA: ``at`` is (Ainv diag(beta))^T,
        r^T takes no beta factor."""
        m64: gl.constexpr = zero.type.layout
        cols: gl.constexpr = gl.SliceLayout(0, m64)
        opA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=m64, k_width=2)
        dt: gl.constexpr = k_t.dtype
        kz = warpgroup_mma(za, kt, zero, use_acc=False, is_async=True)
        if WITH_V:
            vt = v_t.load(m64)
        kz, za = warpgroup_mma_wait(0, deps=[kz, za])
        if WITH_V:
            r = vt.to(gl.float32) - kz * gt_s.index(gts).load(cols)[None, :]
        else:
            r = -(kz * gt_s.index(gts).load(cols)[None, :])
        if not A_BETA:
            r = r * gt_s.index(gts + 1).load(cols)[None, :]
        if partial:
            r = gl.where(valid, r, 0.0)
        ra = gl.convert_layout(r.to(dt), opA)
        vn = warpgroup_mma(ra, at, zero, use_acc=False, is_async=True)
        vn, ra = warpgroup_mma_wait(0, deps=[vn, ra])
        if partial:
            vn = gl.where(valid, vn, 0.0)
        da = gl.convert_layout((vn * gt_s.index(gts + 2).load(cols)[None, :]).to(dt), opA)
        zt = warpgroup_mma(da, k_t, zt * e_last, is_async=True)
        zt, da = warpgroup_mma_wait(0, deps=[zt, da])
        return zt

    @gluon.jit
    def _seg_t_steps(k_s, v_s, a_s, bars, emp, gt_s, hloc, trans, i_s, i_hv, bos, eos, c_beg, c_end,
                     s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                     K: gl.constexpr, V: gl.constexpr, NS: gl.constexpr, A_BETA: gl.constexpr = False):
        """All 128 rows of S^T and of M^T over the segment's chunks (module docstring) in this 8-warp partition,
        each warpgroup's products on its 64 rows of the same tiles; the stage's tiles and gate rows come from
        ``_t_loader`` (rows 0 e^g r_k, 1 beta, 2 e^(g_last - g) r_k, 4 e^(g_last)); the stage is released on ``emp``.
        Then S^T -> hloc[i_s] (strides s1*), M^T -> trans[i_s] (s0*), each as the [K, *] state its transpose is.
        A_BETA: the Ainv tiles are Ainv diag(beta) (``_seg_step``)."""
        C: gl.constexpr = 64
        W: gl.constexpr = 8                          # the partition's warps
        HB: gl.constexpr = 128                       # its rows of S^T and M^T
        dt: gl.constexpr = k_s.dtype
        m64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, C, 16])
        mK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, K, 16])
        opK: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mK, k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, m64)
        to = gl.arange(0, C, layout=cols)
        vr = gl.arange(0, HB, layout=gl.SliceLayout(1, mK))
        kc = gl.arange(0, K, layout=gl.SliceLayout(0, mK))
        st = gl.zeros([HB, K], gl.float32, layout=mK)
        mt = gl.where(vr[:, None] == kc[None, :], 1.0, 0.0)
        zero = gl.zeros([HB, C], gl.float32, layout=m64)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])   # a [1] row: every thread holds the element
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            partial = bos + c * C + C > eos         # only a sequence's last chunk: uniform branches
            sa = gl.convert_layout(st.to(dt), opK)
            mbarrier.wait(bars.index(s), (it // NS) & 1)
            if partial:
                # the next sequence's k rows out of X^T += d^T k
                HP._zero_rows_past(k_s.index(s), eos - bos - c * C, W)
                fence_async_shared()
                cta_barrier()
            gts = s * 8
            kt = k_s.index(s).permute((1, 0))
            at = a_s.index(s).permute((1, 0))
            vt_s = v_s.index(s).permute((1, 0))
            valid = ((bos + c * C + to) < eos)[None, :]
            # (the gate rows are read from shared memory where used, not held: 16 registers each in this layout)
            e_last = gl.sum(gt_s.index(gts + 4).slice(0, 1).load(one), axis=0)
            # S, then M (issuing M's first product before S's update is waited for: equal on the H200, more
            # registers; bench/NOTES.md)
            st = _seg_step(sa, st, kt, at, k_s.index(s), vt_s, gt_s, gts, e_last, valid, partial, zero, True, A_BETA)
            mt = _seg_step(gl.convert_layout(mt.to(dt), opK), mt, kt, at, k_s.index(s), vt_s, gt_s, gts, e_last,
                           valid, partial, zero, False, A_BETA)
            mbarrier.arrive(emp.index(s), count=1)     # the chains are done with stage s and its gate rows
        rs = i_s.to(gl.int64)
        m_vk = (vr[:, None] < V) & (kc[None, :] < K)
        p1 = hloc + rs * s1n + i_hv * s1h + kc[None, :] * s1k + vr[:, None] * s1v
        gl.store(p1, st, mask=m_vk)
        p0 = trans + rs * s0n + i_hv * s0h + kc[None, :] * s0k + vr[:, None] * s0v
        gl.store(p0, mt, mask=m_vk)

    @gluon.jit
    def _segment_t_sm90_kernel(
        k_desc, v_desc, a_desc, beta, gcum, rk_in, hloc, trans, segments, cu_seqlens,
        T, s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, USE_L2: gl.constexpr,
        IS_VARLEN: gl.constexpr, NS: gl.constexpr, LREGS: gl.constexpr,
        num_warps: gl.constexpr, PDL: gl.constexpr = False, AP: gl.constexpr = 64, A_BETA: gl.constexpr = False,
    ):
        """The segment pass, one CTA per (value head ``program_id(0)``, segment ``program_id(1)``; launched with 8
        warps): the chain partition (``_seg_t_steps``, all 128 rows of S^T and M^T) and the load warp
        (``hopper._t_loader`` in MN mode) side by side. AP: the columns between two value heads' Ainv tiles (64: its
        own buffer; 128: packed into o's rows, as the segmented register-state run's prepare writes it). A_BETA: the
        Ainv tiles are Ainv diag(beta) (the prepare's form of that name)."""
        C: gl.constexpr = 64
        pdl_enter(PDL)
        i_hv = gl.program_id(0)
        i_s = gl.program_id(1)
        n, c_beg, c_end, i_b, bos, eos = HP._segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NS, C, V], v_desc.layout)
        a_s = gl.allocate_shared_memory(dt, [NS, C, C], a_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        emp = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        gt_s = gl.allocate_shared_memory(gl.float32, [NS * 8, C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=2)      # the TMA's expect-arrive and the gate rows' arrive
            mbarrier.init(emp.index(j), count=1)       # the chain partition
        gl.warp_specialize([
            (_seg_t_steps, (k_s, v_s, a_s, bars, emp, gt_s, hloc, trans, i_s, i_hv, bos, eos, c_beg, c_end,
                            s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v, K, V, NS, A_BETA)),
            (HP._t_loader, (k_desc, v_desc, a_desc, k_desc, a_desc, k_s, v_s, a_s, k_s, a_s, bars, emp, gt_s,
                            beta, gcum, rk_in, gcum, 0, i_hv, i_b, bos, eos, c_beg, c_end, T, s_bb, s_bt, s_bh,
                            H, HV, K, V, V, USE_L2, NS, AP, False, 1.0, True)),
        ], [1], [LREGS])


def segment_t_ok(k: torch.Tensor, v: torch.Tensor, ainv: torch.Tensor, K: int, V: int) -> bool:
    """Whether ``launch_segment_pass_t`` takes this segment pass (``hopper.supported`` said yes for the Gluon state
    pass in ainv mode): K = V = 128, Ainv [.., 64] contiguous or packed at a 16-byte pitch (``pitched_rows_ok``)."""
    return (G.AVAILABLE and K == 128 and V == 128 and ainv.shape[-1] == HP.CHUNK
            and (ainv.stride(2) == HP.CHUNK or HP.pitched_rows_ok(ainv)))


def launch_segment_pass_t(k, v, beta, ainv, g_cum, rk, trans, hloc, segments, cu_seqlens, T, S, s_beta, s0, s1, *,
                          H, HV, K, V, use_l2, is_varlen, stages=2, pdl=False, beta_in_ainv=False):
    """Launch the segment pass over (HV, S): local states -> ``hloc`` [S, HV, K, V], transitions -> ``trans``
    [S, HV, K, K] (fp32, with their strides ``s1`` / ``s0``), from k, v, beta, Ainv (its own buffer or o's rows at
    pitch 128), g_cum and the L2 row scalings ``rk`` (``segment_t_ok`` must have said yes). ``beta_in_ainv``: ``ainv``
    holds Ainv diag(beta) (``chunk_fwd_prepare``'s form of that name)."""
    dn = HP._GL_DT[k.dtype]
    k_desc = HP._desc(HP._rows2d(k), (HP.CHUNK, K), dn)
    v_desc = HP._desc(HP._rows2d(v), (HP.CHUNK, V), dn)
    a_desc = HP._desc(HP._pitched_rows2d(ainv), (HP.CHUNK, HP.CHUNK), dn)
    ap = ainv.stride(2)
    launch(_segment_t_sm90_kernel, (HV, S),
           k_desc, v_desc, a_desc, beta, g_cum, rk, hloc, trans, segments, cu_seqlens,
           T, *s_beta, *s0, *s1,
           H=H, HV=HV, K=K, V=V, USE_L2=use_l2, IS_VARLEN=is_varlen, NS=stages,
           LREGS=SEG_LOADER_REGS, num_warps=8,
           **({"AP": ap} if ap != HP.CHUNK else {}), **({"A_BETA": True} if beta_in_ainv else {}),
           **pdl_args(pdl, k.device))


__all__ = ["segment_t_ok", "launch_segment_pass_t", "SEG_LOADER_REGS"]
