"""Hopper (sm_90) chunked forward in one kernel: the register-state fused pass of ``hopper.py`` with the prepare
inside it, written in Gluon. One CTA per (value head, sequence), four partitions side by side::

    load    (1 warp)         chunk c's k, q [64, K] and v [64, 128] by TMA into ring stage c % NS; its raw gates g
                             and beta into the stage's gate rows
    aux     (4 warps)        chunk c's prepare (``hopper_prepare``'s math): g_cum = cumsum(g), K K^T, Q Q^T (r_k,
                             r_q off the diagonals), Q K^T -> P, A -> Ainv = (I + A)^-1; Ainv and P into the stage
                             as bf16 NVMMA tiles, g_cum / r_k / qf / g_last into its gate rows
    chain x 2 (4 warps each) ``hopper._t_steps``: 64 rows of the transposed state S^T [128, K] each, in registers

so the prepare of chunk c + 1 runs while the chain partitions run chunk c (FlashInfer's AUX warpgroup), and neither
Ainv nor P goes through global memory. A stage is refilled once both chain partitions and the aux partition have
released it (``emp``, three arrivals); the chains wait for the aux partition's ``auxd`` barrier of the stage only
after issuing ``S^T q^T`` and ``S^T k^T`` (those need the TMA tiles alone).

Registers: 16 warps launch at 128 per thread (512 per thread slot over four warpgroups); the workers claim
``AUX_CHAIN_REGS`` (second chain), ``AUX_REGS`` and ``AUX_LOADER_REGS``, the default partition (first chain) gets
the rest (Triton's AllocateWarpGroups pass; ``gdn.aot.default_partition_regs``).

Same contract as the register-state kernel (pools through indices with -1 padding, both layouts, varlen, GVA, L2
norm or not, initial / final states); taken for unsegmented inference forwards (no h / v_new / Ainv kept, no
checkpoints) where the register-state kernel is (``state._fused_output_plan``) and the tuning field
``chunk_fwd.state_sm90_fused_aux`` is on (default off: it loses).

Measured (H100, ``gdn profile --forward``, 4x4096 16/32): 546-578 us against 425-428 for the register-state kernel
+ the prepare kernel; the aux partition is the bottleneck at ~8.5-9.4 us per chunk (without the solve ~5.2), while
the chain partitions alone run a step in 2.9 us (183 us) when they keep >= 200 registers and 3.9 us (250 us) at 184
(spills). bench/NOTES.md ("One-kernel forward").
"""
from __future__ import annotations

import torch

from .. import _gluon_api as G
from ..launch import launch
from .hopper import CHUNK, _GL_DT, _desc, _rows2d, _rows2d_ok

if G.AVAILABLE:
    from .hopper import (_segment_span, _t_steps, cta_barrier, fence_async_shared, gl, gluon, mbarrier, tma_load,
                         warpgroup_mma, warpgroup_mma_wait)
    from .hopper_prepare import _unit_lower_inverse_sm90

    @gluon.jit
    def _aux_loader(k_desc, v_desc, q_desc, k_s, v_s, q_s, bars, emp, gt_s, g, beta, i_hv, i_b, bos, eos, c_beg,
                    c_end, T, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, NS: gl.constexpr):
        """Load partition (one warp): chunk c's k, q, v tiles by TMA into stage c % NS and its raw gates (g, beta;
        0 past the sequence) into gate rows 5 and 1 of the stage, once the stage is released (``emp``). A stage's
        ``bars`` barrier completes on the TMA bytes and this warp's arrival after the gate stores."""
        C: gl.constexpr = 64
        i_h = i_hv // (HV // H)
        tok0 = i_b * T
        dt: gl.constexpr = k_desc.dtype
        nbytes: gl.constexpr = (2 * C * K + C * V) * (dt.primitive_bitwidth // 8)
        lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        t1 = gl.arange(0, C, layout=lay)
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            row = tok0 + bos + c * C
            mbarrier.wait(emp.index(s), ((it // NS) & 1) ^ 1, pred=it >= NS)
            mbarrier.expect(bars.index(s), nbytes)
            tma_load(k_desc, [row, i_h * K], bars.index(s), k_s.index(s))
            tma_load(q_desc, [row, i_h * K], bars.index(s), q_s.index(s))
            tma_load(v_desc, [row, i_hv * V], bars.index(s), v_s.index(s))
            rows = bos + c * C + t1
            m = rows < eos
            gr = gl.load(g + i_b * s_gb + rows * s_gt + i_hv * s_gh, mask=m, other=0.0).to(gl.float32)
            br = gl.load(beta + i_b * s_bb + rows * s_bt + i_hv * s_bh, mask=m, other=0.0).to(gl.float32)
            gt_s.index(s * 8 + 5).store(gr)
            gt_s.index(s * 8 + 1).store(br)
            cta_barrier()
            mbarrier.arrive(bars.index(s), count=1)

    @gluon.jit
    def _aux_steps(k_s, q_s, a_s, p_s, bars, auxd, emp, gt_s, d_s, l_s, dt_s, bos, eos, c_beg, c_end, scale,
                   USE_L2: gl.constexpr, NS: gl.constexpr):
        """Aux partition (4 warps): the prepare of each chunk into its ring stage (module docstring). Gate rows of
        the stage written here: 0 g_cum, 2 r_k, 3 qf = scale r_q e^g_cum (both 0 past the sequence), 4 g_last
        (repeated); rows past the sequence have beta = g = 0, so they add nothing to A."""
        C: gl.constexpr = 64
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C, 16])
        rl: gl.constexpr = gl.SliceLayout(1, mma)
        cl: gl.constexpr = gl.SliceLayout(0, mma)
        dt: gl.constexpr = k_s.dtype
        tr = gl.arange(0, C, layout=rl)
        tc = gl.arange(0, C, layout=cl)
        causal = tc[None, :] <= tr[:, None]
        diag = tr[:, None] == tc[None, :]
        zero = gl.zeros([C, C], gl.float32, layout=mma)
        for c in range(c_beg, c_end):
            it = c - c_beg
            s = it % NS
            gts = s * 8
            m_r = (bos + c * C + tr) < eos
            mbarrier.wait(bars.index(s), (it // NS) & 1)
            kk = warpgroup_mma(k_s.index(s), k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            if USE_L2:
                qq = warpgroup_mma(q_s.index(s), q_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            g_c = gt_s.index(gts + 5).load(cl)
            b_r = gt_s.index(gts + 1).load(rl)
            c_r = gl.sum(gl.where(causal, g_c[None, :], 0.0), axis=1)
            c_c = gl.convert_layout(c_r, cl)
            if USE_L2:
                kk, qq = warpgroup_mma_wait(0, deps=[kk, qq])
                rk_r = gl.rsqrt(gl.sum(gl.where(diag, kk, 0.0), axis=1) + 1e-6)
                rq = gl.rsqrt(gl.sum(gl.where(diag, qq, 0.0), axis=1) + 1e-6) * scale
                rk_c = gl.convert_layout(rk_r, cl)
            else:
                kk = warpgroup_mma_wait(0, deps=[kk])
                rk_r = gl.full([C], 1.0, gl.float32, layout=rl)
                rq = gl.full([C], 1.0, gl.float32, layout=rl) * scale
                rk_c = gl.full([C], 1.0, gl.float32, layout=cl)
            qk = warpgroup_mma(q_s.index(s), k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            gam = gl.exp(gl.where(causal, c_r[:, None] - c_c[None, :], 0.0))
            a = gl.where(tc[None, :] < tr[:, None], kk * (b_r * rk_r)[:, None] * rk_c[None, :] * gam, 0.0)
            gt_s.index(gts).store(c_r)
            gt_s.index(gts + 2).store(gl.where(m_r, rk_r, 0.0))
            gt_s.index(gts + 3).store(gl.where(m_r, rq * gl.exp(c_r), 0.0))
            gt_s.index(gts + 4).store(gl.zeros([C], gl.float32, layout=cl) + gl.sum(g_c, axis=0))
            qk = warpgroup_mma_wait(0, deps=[qk])
            p_s.index(s).store(gl.where(causal, qk * rq[:, None] * rk_c[None, :] * gam, 0.0).to(dt))
            ai = _unit_lower_inverse_sm90(a, d_s, l_s, dt_s, mma, 4)
            a_s.index(s).store(ai.to(dt))
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(auxd.index(s), count=1)
            mbarrier.arrive(emp.index(s), count=1)

    @gluon.jit
    def _chunk_fused_aux_sm90_kernel(
        k_desc, v_desc, q_desc, g, beta, o, h0, ht, h0_idx, ht_idx, o_idx, segments, cu_seqlens,
        T, P0, P1, PO, scale, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
        USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr, INIT: gl.constexpr,
        H0_BY_SEG: gl.constexpr, H0_INDEXED: gl.constexpr, STORE_FINAL: gl.constexpr, HT_BY_SEG: gl.constexpr,
        HT_INDEXED: gl.constexpr, O_INDEXED: gl.constexpr, NS: gl.constexpr, WREGS: gl.constexpr,
        AREGS: gl.constexpr, LREGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """The whole chunked forward of one (value head, segment) over V = 128 (module docstring); grid (1, HV, S)."""
        C: gl.constexpr = 64
        HB: gl.constexpr = V // 2
        i_v = gl.program_id(0)
        i_hv = gl.program_id(1)
        i_s = gl.program_id(2)
        n, c_beg, c_end, i_b, bos, eos = _segment_span(segments, cu_seqlens, i_s, T, IS_VARLEN)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [NS, C, K], k_desc.layout)
        q_s = gl.allocate_shared_memory(dt, [NS, C, K], q_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NS, C, V], v_desc.layout)
        ab: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], dt)
        a_s = gl.allocate_shared_memory(dt, [NS, C, C], ab)
        p_s = gl.allocate_shared_memory(dt, [NS, C, C], ab)
        gt_s = gl.allocate_shared_memory(gl.float32, [NS * 8, C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # the solve's scratch (aux partition): d_s plain fp32 [64, 16], l_s / dt_s NVMMA fp32 [64, 64]
        d_s = gl.allocate_shared_memory(gl.float32, [C, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        f32t: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], gl.float32)
        l_s = gl.allocate_shared_memory(gl.float32, [C, C], f32t)
        dt_s = gl.allocate_shared_memory(gl.float32, [C, C], f32t)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        emp = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        auxd = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(bars.index(j), count=2)      # the TMA's expect-arrive and the gate rows' arrive
            mbarrier.init(emp.index(j), count=3)       # the two chain partitions and the aux partition
            mbarrier.init(auxd.index(j), count=1)      # the aux partition: Ainv, P and gate rows of the stage
        gl.warp_specialize([
            (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                        n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 0,
                        s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                        HV, K, V, V, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                        O_INDEXED, NS, auxd, True)),
            (_t_steps, (k_s, v_s, a_s, q_s, p_s, bars, emp, gt_s, o, h0, ht, h0_idx, ht_idx, o_idx,
                        n, i_s, i_v, i_hv, i_b, bos, eos, c_beg, c_end, T, P0, P1, PO, 1,
                        s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
                        HV, K, V, V, HB, INIT, H0_BY_SEG, H0_INDEXED, STORE_FINAL, HT_BY_SEG, HT_INDEXED,
                        O_INDEXED, NS, auxd, True)),
            (_aux_steps, (k_s, q_s, a_s, p_s, bars, auxd, emp, gt_s, d_s, l_s, dt_s, bos, eos, c_beg, c_end, scale,
                          USE_L2, NS)),
            (_aux_loader, (k_desc, v_desc, q_desc, k_s, v_s, q_s, bars, emp, gt_s, g, beta, i_hv, i_b, bos, eos,
                           c_beg, c_end, T, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, H, HV, K, V, NS)),
        ], [4, 4, 1], [WREGS, AREGS, LREGS])


# register claims of the workers (second chain, aux, load warp); the default partition (first chain) gets
# 4 x 128 - their sum (gdn.aot.default_partition_regs)
AUX_CHAIN_REGS = 168
AUX_REGS = 152
AUX_LOADER_REGS = 24


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the one-kernel forward can take this call's tensors: Gluon, 16-bit q / k / v of one dtype, K = V = 128,
    q / k / v as TMA rows (token rows, 16-byte aligned)."""
    if not G.AVAILABLE or k.dtype not in _GL_DT or q.dtype != k.dtype or v.dtype != k.dtype:
        return False
    if k.shape[-1] != 128 or v.shape[-1] != 128 or q.shape != k.shape:
        return False
    return _rows2d_ok(q) and _rows2d_ok(k) and _rows2d_ok(v)


def launch_fused_aux_pass(grid, q, k, v, g, beta, o, h0, ht, h0_idx, ht_idx, o_idx, segments, cu_seqlens, T, P0, P1,
                          PO, scale, s_g, s_beta, s0, s1, *, H, HV, use_l2, is_varlen, INIT, H0_BY_SEG, H0_INDEXED,
                          HT_BY_SEG, HT_INDEXED):
    """Launch :func:`_chunk_fused_aux_sm90_kernel` over ``grid`` = (1, HV, segments) (``supported`` said yes): o
    [B, T, HV, 128] (contiguous) and the final states from raw g / beta ([B, T, HV], any strides ``s_g`` /
    ``s_beta``, any float dtype); states and indices as :func:`hopper.launch_fused_pass`."""
    dn = _GL_DT[k.dtype]
    K = V = 128
    k_desc = _desc(_rows2d(k), (CHUNK, K), dn)
    q_desc = _desc(_rows2d(q), (CHUNK, K), dn)
    v_desc = _desc(_rows2d(v), (CHUNK, V), dn)
    dummy = segments
    launch(_chunk_fused_aux_sm90_kernel, grid,
        k_desc, v_desc, q_desc, g, beta, o, h0 if h0 is not None else o, ht if ht is not None else o, h0_idx, ht_idx,
        o_idx if o_idx is not None else dummy, segments, cu_seqlens, T, P0, P1, PO, float(scale), *s_g, *s_beta,
        *s0, *s1,
        H=H, HV=HV, K=K, V=V, USE_L2=use_l2, IS_VARLEN=is_varlen, INIT=INIT, H0_BY_SEG=H0_BY_SEG,
        H0_INDEXED=H0_INDEXED, STORE_FINAL=ht is not None, HT_BY_SEG=HT_BY_SEG, HT_INDEXED=HT_INDEXED,
        O_INDEXED=o_idx is not None, NS=2, WREGS=AUX_CHAIN_REGS, AREGS=AUX_REGS, LREGS=AUX_LOADER_REGS,
        num_warps=4)


__all__ = ["supported", "launch_fused_aux_pass"]
