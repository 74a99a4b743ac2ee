"""Hopper (sm_90) form of the forward's prepare kernel (``prepare._chunk_prepare_kernel`` in its forward modes:
g_cum, Ainv in the tensor-core dtype, r_k, and with q the output's P and qf), written in Gluon: one CTA (4 warps)
per (chunk, value head), the grid as the portable kernel's (value heads fastest, so a key head's k / q tiles come
from memory once).

Per CTA (one chunk of C = 64 tokens, one value head; notation of ``prepare.py``)::

    k, q [64, K]          one TMA copy each into shared memory (g and beta loaded while they land)
    c                     cumsum(g) by a scan inside each warp
    K K^T, Q K^T          asynchronous wgmma; r_k the inverse norms read off K K^T's diagonal, r_q q's (row sums
                          of squares on the CUDA cores while the products run)
    A, P, qf              A = strictLower(diag(beta r_k) (Gamma * K K^T) diag(r_k)); P and qf with q
    Ainv = (I + A)^-1     below; Ainv and P of a full chunk leave by TMA stores from a staging tile, a
                          partial chunk's by 16-byte stores of its valid rows

The solve (same math and tf32 products as the portable ``_unit_lower_inverse64``): the four 16 x 16 diagonal
blocks D_b of A are inverted by forward substitution on a [4, 16, 16] stack laid out so that each thread holds
half a column of one block's inverse (the row of D_b it needs comes from shared memory as a broadcast; a step is 8
FMAs, one shuffle and 8 selects per thread); with Dinv the block-diagonal inverse and M = Dinv L (L: A below the
diagonal blocks, M^4 = 0), ``(I + A)^-1 = (I - M + M^2 - M^3) Dinv``: four 64 x 64 tf32 wgmma in a row, the left
operand from registers, the right one stored transposed (K-major, as tf32 wgmma requires). With SOLVE_F16
(``chunk_fwd.solve_sm90_f16``, the default) the blocks are 8 x 8 and the products fp16 (tf32's 10-bit mantissa, half
the bytes, the right operand row-major): each 8 x 8 diagonal block lies in one warp's accumulator registers, so its
inverse is a 7-step forward substitution by warp shuffles with no shared memory (``_diag8_inverse``); then with
N = L Dinv (N^8 = 0), ``(I + A)^-1 = Dinv (I - N)(I + N^2)(I + N^4)`` in four dependent levels of wgmma. A chunk whose
fp16 products overflow (a non-finite result; raw keys of large norm) is flagged (per row), and a second launch
(``prepare._prepare_redo_kernel``: one vector load of a block of items' flags where none is set) redoes it with the
portable tf32 solve.

Rows of a partial chunk past its sequence hold the next sequence's tokens (or TMA zero fill): beta is 0 there, so
they add nothing to A, and nothing is stored for them.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .. import _gluon_api as G
from ..common import pdl_enter
from ..launch import launch, pdl_args
from ..tuning import capability
from .hopper import CHUNK, _GL_DT, _desc, _pitched_rows2d, _rows2d, _rows2d_ok, pitched_rows_ok

if G.AVAILABLE:
    from .hopper import _decay_tile, _gram_rnorm, _row_scalar, _seq_span, _tile_rnorm, _zero_rows_past, \
        cta_barrier, fence_async_shared, gl, gluon, mbarrier, tma, tma_load, tma_store, warpgroup_mma, \
        warpgroup_mma_wait

    _PUBLIC_REINTERPRET: gl.constexpr = gl.constexpr(G.PUBLIC_REINTERPRET)

    @gluon.jit
    def _as_tile(buf, dtype: gl.constexpr, C: gl.constexpr, layout: gl.constexpr):
        """The bytes of a shared-memory tile viewed as ``dtype`` [C, C] in ``layout``."""
        if _PUBLIC_REINTERPRET:
            t = buf.reinterpret(dtype, [C, C], layout)
        else:
            t = buf._reinterpret(dtype, [C, C], layout)
        return t

    @gluon.jit
    def _store_row_scalar(ptr, x, tok0, t0, i, nv, head, i_hv, mask, NHEADS: gl.constexpr, HV: gl.constexpr,
                          VP: gl.constexpr, VB: gl.constexpr, NCOPY: gl.constexpr, FIELD: gl.constexpr):
        """x [64] (a value per token row ``t0 + i`` of the chunk, ``nv`` valid) into its own [B*T, NHEADS] buffer
        (VP = 0), or as field FIELD into each of the NCOPY V tiles' blocks in o's rows (``hopper._row_scalar``)."""
        if VP == 0:
            gl.store(_row_scalar(ptr, tok0, t0, i, nv, head, i_hv, 0, NHEADS, HV, VP, VB, FIELD), x, mask=mask)
        else:
            for j in gl.static_range(NCOPY):
                gl.store(_row_scalar(ptr, tok0, t0, i, nv, head, i_hv, j, NHEADS, HV, VP, VB, FIELD), x, mask=mask)

    @gluon.jit
    def _store_tile(ptr, x, row_off, nv, C: gl.constexpr, num_warps: gl.constexpr, D: gl.constexpr = 64):
        """x [C, D] into rows ``row_off[t]`` (elements) of a row-major buffer, rows t < nv only; 16-byte stores."""
        st: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        y = gl.convert_layout(x, st)
        r = gl.arange(0, C, layout=gl.SliceLayout(1, st))
        cc = gl.arange(0, D, layout=gl.SliceLayout(0, st))
        offs = gl.convert_layout(row_off, gl.SliceLayout(1, st))
        gl.store(ptr + offs[:, None] + cc[None, :], y, mask=(r < nv)[:, None])

    @gluon.jit
    def _store_chunk_tile(desc, stage, ptr, x, row, col, row_off, nv, C: gl.constexpr, num_warps: gl.constexpr):
        """x [C, C] (k's dtype) into rows row .. row + C - 1, columns col .. col + C - 1 of the 2-D view behind
        ``desc``: a full chunk through ``stage`` (shared memory in the descriptor's layout) and one TMA store (the
        caller waits for its read of ``stage`` before reusing it or exiting); a partial one by ``_store_tile``'s masked
        16-byte stores (the rows past the sequence belong to the next one)."""
        if nv == C:
            stage.store(x)
            fence_async_shared()
            cta_barrier()
            tma_store(desc, [row, col], stage)
        else:
            _store_tile(ptr, x, row_off, nv, C, num_warps)

    @gluon.jit
    def _block_inverses(A, d_s, mma: gl.constexpr, num_warps: gl.constexpr):
        """Dinv^T [64, 64] fp32 in registers: the transposed inverses of the four 16 x 16 unit lower diagonal blocks
        I + D_b of A (``mma`` layout), zeros elsewhere (scratch d_s [64, 16] fp32). The diagonal blocks are cut from A
        and Dinv^T is assembled in registers (A viewed as [4, 16, 4, 16] blocks; a select reshaped back to [64, 64]),
        so only the substitution's rows go through shared memory."""
        C: gl.constexpr = 64
        # ---- the diagonal blocks as rows 4 i + b of d_s [64, 16]: D_b[i, :] (A as [b, i, c, k], the c == b slice)
        l4d: gl.constexpr = gl.BlockedLayout([1, 1, 4, 4], [1, 8, 1, 4], [num_warps, 1, 1, 1], [3, 2, 1, 0])
        a4 = gl.convert_layout(gl.reshape(A, [4, 16, 4, 16]), l4d)
        bd = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4d))))
        cd = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4d))))
        d3 = gl.sum(gl.where(bd[:, None, None, None] == cd[None, None, :, None], a4, 0.0), axis=2)
        d_s.store(gl.reshape(gl.permute(d3, (1, 0, 2)), [64, 16]))
        cta_barrier()
        # ---- forward substitution, all four blocks at once: yt[b, j, k] = Y_b[k, j], (I + D_b) Y_b = I
        ly: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 16, 2], [num_warps, 1, 1], [2, 1, 0])
        jj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ly)))
        kk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, ly)))
        yt = gl.where(jj[None, :, None] == kk[None, None, :], 1.0, 0.0) + gl.zeros([4, 16, 16], gl.float32, layout=ly)
        for i in gl.static_range(1, 16):
            a_i = d_s.slice(4 * i, 4, dim=0).load(gl.SliceLayout(1, ly))  # [b, k] = D_b[i, k]
            y = gl.sum(a_i[:, None, :] * yt, axis=2)                     # [b, j] = (D_b Y_b)[i, j]
            e_i = gl.where(jj == i, 1.0, 0.0)
            yt = gl.where(kk[None, None, :] == i, e_i[None, :, None] - y[:, :, None], yt)
        # ---- Dinv^T [64, 64] (diagonal block b: yt[b], zeros elsewhere), built in registers: [b, j, c, k] -> [64, 64]
        l4: gl.constexpr = gl.BlockedLayout([1, 1, 4, 8], [1, 16, 1, 2], [num_warps, 1, 1, 1], [3, 2, 1, 0])
        b4 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
        c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4))))
        y4 = gl.expand_dims(gl.convert_layout(yt, gl.SliceLayout(2, l4)), 2)
        return gl.reshape(gl.where(b4[:, None, None, None] == c4[None, None, :, None], y4, 0.0), [C, C])

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _max_keep_nan(a, b):
        """max(a, b), NaN if either is NaN (a reduction's combine function)."""
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _shfl(x, src):
        """fp32 ``x`` from lane ``src`` (int32, same shape and layout) of the same warp, register by register."""
        y = gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, -1;", "=r,r,r",
                                      [x.to(gl.int32, bitcast=True), src], dtype=gl.int32, is_pure=True, pack=1)
        return y.to(gl.float32, bitcast=True)

    @gluon.jit
    def _diag8_inverse(A, mma: gl.constexpr):
        """Dinv [64, 64] fp32 in ``mma`` (the 4-warp wgmma accumulator layout): the inverses of the eight 8 x 8 unit
        lower diagonal blocks I + D_b of the strictly lower A (same layout), zeros elsewhere. Warp w holds rows
        16 w .. 16 w + 15, so block b lies in warp b // 2: lane 4 r + c holds its row r, columns 2 c and 2 c + 1
        (registers of the column group j = b). A is viewed as [w, h, r, j, c, e] (row 16 w + 8 h + r, column
        8 j + 2 c + e), the j = 2 w + h entries picked; forward substitution Y[r, :] -= D[r, s] Y[s, :], s = 0 .. 6,
        with D[r, s] and Y[s, :] fetched by warp shuffles (no shared memory)."""
        C: gl.constexpr = 64
        L6: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0],
                       [0, 0, 0, 4, 0, 0]],
            lane_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0],
                        [0, 0, 4, 0, 0, 0]],
            warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]], block_bases=[], shape=[4, 2, 8, 8, 4, 2])
        S6: gl.constexpr = [4, 2, 8, 8, 4, 2]
        # each axis' index from an arange in its own slice of L6 (per-register constants, lane and warp bits), so
        # that the compiler folds the register-bit parts of the compares: the diagonal block's j = 2 w + h has its
        # low bit in a register bit
        L5: gl.constexpr = gl.SliceLayout(3, L6)
        x5: gl.constexpr = gl.SliceLayout(5, L6)
        w6 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, x5)))))
        w6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(w6, 1), 2), 3), 4), 5)
        h6 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, x5)))))
        h6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(h6, 0), 2), 3), 4), 5)
        j6 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, x5)))))
        j6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(j6, 0), 1), 2), 4), 5)
        diag6 = j6 == 2 * w6 + h6
        a6 = gl.convert_layout(gl.reshape(A, S6), L6)
        d = gl.sum(gl.where(diag6, a6, 0.0), axis=3)               # [w, h, r, c, e] = D_b[r, 2 c + e]
        rr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
        rr = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(rr, 0), 1), 3), 4)
        c5 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, L5)))))
        e5 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L5)))))
        cc = 2 * gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(c5, 0), 1), 2), 4) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(e5, 0), 1), 2), 3)
        zi5 = gl.zeros([4, 2, 8, 4, 2], gl.int32, layout=L5)
        rr = rr + zi5
        cc = cc + zi5
        y = gl.where(rr == cc, 1.0, 0.0)
        for s in gl.static_range(7):
            dpair = _shfl(d, rr * 4 + s // 2)                         # D[r, 2 (s // 2) + e]
            f = gl.sum(gl.where(cc % 2 == s % 2, dpair, 0.0), axis=4)  # D[r, s]
            y = y - gl.expand_dims(f, 4) * _shfl(y, (cc // 2) + 4 * s)  # Y[s, 2 c + e]
        y6 = gl.where(diag6, gl.expand_dims(y, 3), 0.0)
        return gl.convert_layout(gl.reshape(y6, [C, C]), mma)

    @gluon.jit
    def _neumann8_f16(A, dinv, low, l16, dt16, mma: gl.constexpr):
        """(I + A)^-1 from Dinv (the 8 x 8 diagonal blocks' inverses, registers) and L = A below those blocks
        (``low``), as fp16 wgmma with fp32 accumulators (left operands from registers, right ones row-major in
        ``l16`` / ``dt16``, fp16 [64, 64] NVMMA). With N = L Dinv (N^8 = 0), I + A = (I + N)(I + D), so
        (I + A)^-1 = Dinv (I - N)(I + N^2)(I + N^4): N; N^2 and Dinv N side by side; N^4 and Z + Z N^2
        (Z = Dinv - Dinv N); Z2 + Z2 N^4. Returns fp32 in ``mma``."""
        C: gl.constexpr = 64
        f16: gl.constexpr = gl.float16
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        zero = gl.zeros([C, C], gl.float32, layout=mma)
        dt16.store(dinv.to(f16))
        fence_async_shared()
        cta_barrier()
        la = gl.convert_layout(gl.where(low, A, 0.0).to(f16), dot_a)
        n = warpgroup_mma(la, dt16, zero, use_acc=False)                                     # N = L Dinv
        l16.store(n.to(f16))
        fence_async_shared()
        cta_barrier()
        n2 = warpgroup_mma(gl.convert_layout(n.to(f16), dot_a), l16, zero, use_acc=False, is_async=True)
        dn = warpgroup_mma(gl.convert_layout(dinv.to(f16), dot_a), l16, zero, use_acc=False, is_async=True)
        n2, dn = warpgroup_mma_wait(0, deps=[n2, dn])
        z = dinv - dn                                                                         # Z = Dinv - Dinv N
        cta_barrier()
        l16.store(n2.to(f16))
        fence_async_shared()
        cta_barrier()
        n4 = warpgroup_mma(gl.convert_layout(n2.to(f16), dot_a), l16, zero, use_acc=False, is_async=True)
        z = warpgroup_mma(gl.convert_layout(z.to(f16), dot_a), l16, z, is_async=True)          # Z + Z N^2
        n4, z = warpgroup_mma_wait(0, deps=[n4, z])
        cta_barrier()
        l16.store(n4.to(f16))
        fence_async_shared()
        cta_barrier()
        return warpgroup_mma(gl.convert_layout(z.to(f16), dot_a), l16, z)                    # Z2 + Z2 N^4

    @gluon.jit
    def _neumann_tf32(A, dinv_t, low, tr, tc, l_s, dt_s, mma: gl.constexpr, num_warps: gl.constexpr):
        """(I + A)^-1 from Dinv^T (the 16 x 16 diagonal blocks' inverses, transposed, registers) and L = A below
        those blocks (``low``) as tf32 wgmma: with M = Dinv L (M^4 = 0), (I - M + M^2 - M^3) Dinv; tf32 right operands
        must be K-major, so they are stored transposed in the fp32 scratch ``l_s`` / ``dt_s``."""
        C: gl.constexpr = 64
        # the tf32 products (instruction K = 8); the accumulator layout is ``mma``'s
        mt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, C, 8])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mt, k_width=1)
        dt_s.store(dinv_t)
        fence_async_shared()
        cta_barrier()
        dinv = dt_s.permute((1, 0)).load(dot_a)
        # ---- M = Dinv L, M^2, M^3 = M^2 M, (I - M + M^2 - M^3) Dinv; right operands stored transposed
        l_s.store(gl.permute(gl.where(low, A, 0.0), (1, 0)))
        fence_async_shared()
        cta_barrier()
        zero = gl.zeros([C, C], gl.float32, layout=mt)
        m = warpgroup_mma(dinv, l_s.permute((1, 0)), zero, use_acc=False)
        cta_barrier()
        l_s.store(gl.permute(m, (1, 0)))
        fence_async_shared()
        cta_barrier()
        x = gl.convert_layout(gl.where(tr[:, None] == tc[None, :], 1.0, 0.0), mt) - m
        m = warpgroup_mma(gl.convert_layout(m, dot_a), l_s.permute((1, 0)), zero, use_acc=False)     # M^2
        x += m
        m = warpgroup_mma(gl.convert_layout(m, dot_a), l_s.permute((1, 0)), zero, use_acc=False)     # M^3
        x -= m
        ai = warpgroup_mma(gl.convert_layout(x, dot_a), dt_s.permute((1, 0)), zero, use_acc=False)
        return gl.convert_layout(ai, mma)

    @gluon.jit
    def _chunk_prepare_sm90_kernel(
        k_desc, q_desc, a_desc, p_desc, g, beta, gcum, ainv, rk_out, rq_out, p_out, qf_out, w_out, flags, chunk_indices,
        cu_seqlens, T,
        scale, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, USE_L2: gl.constexpr, IS_VARLEN: gl.constexpr,
        STORE_RK: gl.constexpr, STORE_P: gl.constexpr, STORE_RQ: gl.constexpr, STORE_W: gl.constexpr,
        num_warps: gl.constexpr, SOLVE_F16: gl.constexpr = False, PDL: gl.constexpr = False, AP: gl.constexpr = 64,
        VP: gl.constexpr = 0, VB: gl.constexpr = 0, NCOPY: gl.constexpr = 1, SPANS: gl.constexpr = False,
        A_BETA: gl.constexpr = False,
    ):
        """One (chunk, value head) (module docstring); program id = chunk * HV + value head (a key head's value
        heads side by side: their k / q tiles come from memory once). Outputs as the portable kernel's: g_cum, qf
        [B*T, HV] fp32, Ainv and P [B*T, HV, 64] (k's dtype), r_k and (STORE_RQ, with the L2 norm; without
        P q's tile is loaded for it alone) r_q [B*T, H] fp32 (by the key head's first value head); STORE_W: the
        backward's W = Ainv diag(beta e^c r_k) k [B*T, HV, K] (k's dtype; from the stored, rounded Ainv, as the
        reverse pass's W_AINV form computes it).
        SOLVE_F16: ``flags`` int8 [NT * HV, 64] <- per row of the item's Ainv, 1 where its fp16 products overflowed
        (the item's Ainv / W are then redone by ``prepare._prepare_redo_kernel``), else 0. AP: elements between two
        value heads' Ainv (and P) rows of one token (64: their own buffers; 128: packed into o's rows).
        VP, VB, NCOPY (without P: an inference forward whose fused kernel forms P): g_cum, r_k and the flags are one
        pointer, o's fp32 view, and go into its rows (``hopper.row_scalar_pack``): g_cum and r_k (per value head)
        into every V tile's block, the flags (fp32 0 / 1) into the first tile's. SPANS (varlen): ``cu_seqlens`` is
        the chunk table's span table (``plan.ChunkIndex.chunk_spans``: (bos, eos) per chunk), read beside
        ``chunk_indices`` instead of after it. A_BETA (not with STORE_W): the stored tile is Ainv diag(beta) (its
        columns scaled by the chunk's beta, 0 past the sequence), the register-state kernel's and the segment pass's
        form (``hopper._t_steps``, ``hopper_segments._seg_step``: one row scaling fewer in their chains)."""
        C: gl.constexpr = 64
        pdl_enter(PDL)
        pid = gl.program_id(0)
        i_t = pid // HV
        i_hv = pid % HV
        i_h = i_hv // (HV // H)
        n = gl.load(chunk_indices + 2 * i_t)
        c = gl.load(chunk_indices + 2 * i_t + 1)
        if IS_VARLEN and SPANS:     # the chunk's sequence span beside its chunk_indices row, not after it
            i_b = 0
            bos = gl.load(cu_seqlens + 2 * i_t)
            eos = gl.load(cu_seqlens + 2 * i_t + 1)
        else:
            i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
        t0 = bos + c * C
        nv = gl.minimum(eos - t0, C)
        tok0 = i_b * T

        dt: gl.constexpr = k_desc.dtype
        nvmma: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], gl.float32)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        LOAD_Q: gl.constexpr = STORE_P or STORE_RQ
        # r_q is stored by the key head's first value head; without P the others need no q at all
        first = i_hv % (HV // H) == 0
        k_s = gl.allocate_shared_memory(dt, [C, K], k_desc.layout)
        if LOAD_Q:
            q_s = gl.allocate_shared_memory(dt, [C, K], q_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        if STORE_P:
            mbarrier.expect(bar, 2 * C * K * (dt.primitive_bitwidth // 8))
            tma_load(k_desc, [tok0 + t0, i_h * K], bar, k_s)
            tma_load(q_desc, [tok0 + t0, i_h * K], bar, q_s)
        elif STORE_RQ:
            mbarrier.expect(bar, 2 * C * K * (dt.primitive_bitwidth // 8), pred=first)
            mbarrier.expect(bar, C * K * (dt.primitive_bitwidth // 8), pred=not first)
            tma_load(k_desc, [tok0 + t0, i_h * K], bar, k_s)
            tma_load(q_desc, [tok0 + t0, i_h * K], bar, q_s, pred=first)
        else:
            mbarrier.expect(bar, C * K * (dt.primitive_bitwidth // 8))
            tma_load(k_desc, [tok0 + t0, i_h * K], bar, k_s)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, C, 16])
        rl: gl.constexpr = gl.SliceLayout(1, mma)
        cl: gl.constexpr = gl.SliceLayout(0, mma)
        tr = gl.arange(0, C, layout=rl)
        tc = gl.arange(0, C, layout=cl)
        m_r = tr < nv
        tok_r = (tok0 + t0 + tr).to(gl.int64)
        tr64 = tr.to(gl.int64)
        causal = tc[None, :] <= tr[:, None]

        # ---- gates (while the tiles land): c = chunk-local cumsum of g, beta
        # (a scan inside each warp on a replicated [64] row, then one conversion: a masked row sum over column-
        # layout loads costs ~100 instructions more per item)
        sl: gl.constexpr = gl.BlockedLayout([2], [32], [num_warps], [0])
        ts = gl.arange(0, C, layout=sl)
        g_s = gl.load(g + i_b * s_gb + i_hv * s_gh + (t0 + ts) * s_gt, mask=ts < nv, other=0.0).to(gl.float32)
        b_r = gl.load(beta + i_b * s_bb + i_hv * s_bh + (t0 + tr) * s_bt, mask=m_r, other=0.0).to(gl.float32)
        c_r = gl.convert_layout(gl.associative_scan(g_s, 0, _add), rl)
        _store_row_scalar(gcum, c_r, tok0, t0, tr64, nv, i_hv, i_hv, m_r, HV, HV, VP, VB, NCOPY, 0)

        # ---- K K^T and Q K^T issued first; r_q (q's row norms on the CUDA cores, from q's tile) while they run; r_k
        # from K K^T's diagonal and the gates' factors while Q K^T runs
        zero = gl.zeros([C, C], gl.float32, layout=mma)
        mbarrier.wait(bar, 0)
        diag = tr[:, None] == tc[None, :]
        # (each wait names the shared tiles its products read, or a layout conversion's scratch may take their bytes
        # before the product is done: Q K^T came out wrong without the L2 norm; gdn.aot.async_operand_problem)
        kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        if STORE_P:
            qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=True)
            if USE_L2:
                rq = _tile_rnorm(q_s, rl, num_warps)
                if STORE_RQ:
                    gl.store(rq_out + tok_r * H + i_h, rq, mask=m_r & first)
                rq = rq * scale
            else:
                rq = gl.full([C], 1.0, gl.float32, layout=rl) * scale
            kk = warpgroup_mma_wait(1, deps=[kk])
        elif STORE_RQ:      # r_q alone (the register-state kernel forms P: chunk_fwd.state_sm90_t_p_in_kernel), by
            # the key head's first value head only (~300 instructions per item; a uniform branch)
            if first:
                gl.store(rq_out + tok_r * H + i_h, _tile_rnorm(q_s, rl, num_warps), mask=m_r)
            kk, _, _ = warpgroup_mma_wait(0, deps=[kk, k_s, q_s])
        else:
            kk, _ = warpgroup_mma_wait(0, deps=[kk, k_s])
        if USE_L2:
            rk_r = _gram_rnorm(kk, diag)
        else:
            rk_r = gl.full([C], 1.0, gl.float32, layout=rl)
            rk_c = gl.full([C], 1.0, gl.float32, layout=cl)
        if STORE_RK:
            if VP == 0:
                gl.store(rk_out + tok_r * H + i_h, rk_r, mask=m_r & first)
            else:   # per value head: each V tile CTA of the fused kernel reads its own copy
                _store_row_scalar(rk_out, rk_r, tok0, t0, tr64, nv, i_h, i_hv, m_r, H, HV, VP, VB, NCOPY, 1)
        # gam = Gamma diag(r_k): one exp2 per element, 0 above the diagonal; shared by A and P
        if USE_L2:   # c and r_k row -> column together: one conversion of the packed [C, 2] pair (2 barriers fewer)
            pair_l: gl.constexpr = gl.join(tc.to(gl.float32), tc.to(gl.float32)).type.layout   # [C, 2] over cl
            c_c, rk_c = gl.split(gl.convert_layout(gl.join(c_r, rk_r), pair_l))
            c_c = gl.convert_layout(c_c, cl)      # split's layout is cl's equal: no data movement
            rk_c = gl.convert_layout(rk_c, cl)
        else:
            c_c = gl.convert_layout(c_r, cl)
        gam = _decay_tile(c_r, c_c, causal)
        gam = gam * rk_c[None, :]
        row_off = (tok_r * HV + i_hv) * AP
        if STORE_W:
            # W's column factors beta e^c r_k (0 past the sequence) through shared memory: not live in the solve
            fw_s = gl.allocate_shared_memory(gl.float32, [C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            fw_s.store(gl.where(m_r, b_r * gl.exp(c_r) * rk_r, 0.0))
        if A_BETA:
            # beta along Ainv's columns, through shared memory (not live in the solve: held, it spills at 128)
            fb_s = gl.allocate_shared_memory(gl.float32, [C], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            fb_s.store(b_r)
        if STORE_P:
            qk, _, _ = warpgroup_mma_wait(0, deps=[qk, q_s, k_s])
            # (a where, not Gamma's zeros: a partial chunk's columns past the end are the next sequence's keys)
            att = gl.where(causal, qk * gam, 0.0) * rq[:, None]
            p_st = gl.allocate_shared_memory(dt, [C, C], p_desc.layout)
            _store_chunk_tile(p_desc, p_st, p_out, att.to(dt), tok0 + t0, i_hv * AP, row_off, nv, C, num_warps)
            gl.store(qf_out + tok_r * HV + i_hv, rq * gl.exp(c_r), mask=m_r)
        # A after P: Q K^T's accumulator is dead before A takes registers
        # (A's own mask keeps a non-finite key of a later token out of the rows before it: Gamma's zeros above the
        # diagonal would give NaN there; and rows past the sequence's end, where a partial chunk holds the next
        # sequence's tokens, are empty: the solve's products would carry their NaN into every row)
        a = gl.where(tc[None, :] < gl.where(m_r, tr, 0)[:, None], (kk * gam) * (b_r * rk_r)[:, None], 0.0)
        mbarrier.invalidate(bar)
        # ---- Ainv = (I + A)^-1 (module docstring)
        if SOLVE_F16:
            # fp16 has tf32's 10-bit mantissa but not its range: rows whose products overflow (|entries| > 65504:
            # adversarial gates / keys only) are flagged below and redone by a second launch
            f16t: gl.constexpr = gl.NVMMASharedLayout.get_default_for([C, C], gl.float16)
            l16 = gl.allocate_shared_memory(gl.float16, [C, C], f16t)
            dt16 = gl.allocate_shared_memory(gl.float16, [C, C], f16t)
            low8 = (tr[:, None] // 8) > (tc[None, :] // 8)
            ai = _neumann8_f16(a, _diag8_inverse(a, mma), low8, l16, dt16, mma)
        else:
            # the tf32 solve's two NVMMA scratch tiles in the k / q tiles' bytes where these hold 16 KB (dead once
            # the products are waited for)
            d_s = gl.allocate_shared_memory(gl.float32, [C, 16], plain)
            REUSE: gl.constexpr = K * (dt.primitive_bitwidth // 8) == 4 * C
            if REUSE and not STORE_W:
                l_s = _as_tile(k_s, gl.float32, C, nvmma)
            else:
                l_s = gl.allocate_shared_memory(gl.float32, [C, C], nvmma)
            if STORE_P and REUSE:
                dt_s = _as_tile(q_s, gl.float32, C, nvmma)
            else:
                dt_s = gl.allocate_shared_memory(gl.float32, [C, C], nvmma)
            low = (tr[:, None] // 16) > (tc[None, :] // 16)
            ai = _neumann_tf32(a, _block_inverses(a, d_s, mma, num_warps), low, tr, tc, l_s, dt_s, mma, num_warps)
        if SOLVE_F16:
            # overflowed fp16 products (a non-finite or huge entry, NaN included), flagged per row (a reduction
            # inside each warp, no CTA barrier) for prepare._prepare_redo_kernel, which redoes the item with the
            # tf32 solve (an in-kernel redo cost this kernel 4-5% at 168 registers and kept it from 128, a CTA-wide
            # flag ~7% more: bench/NOTES.md)
            # (the row max of |Ainv| with NaN kept, then one compare: a compare and a select per element cost ~130
            # instructions more per item)
            big = gl.reduce(gl.abs(ai), 1, _max_keep_nan)
            fl = gl.where(big < 1.0e30, 0, 1).to(flags.dtype.element_ty)
            if VP == 0:
                gl.store(flags + pid * C + tr, fl)
            else:
                gl.store(_row_scalar(flags, tok0, t0, tr64, nv, i_hv, i_hv, 0, HV, HV, VP, VB, 2), fl, mask=m_r)
        if A_BETA:
            ai = ai * fb_s.load(cl)[None, :]
        ai = ai.to(dt)
        # Ainv's staging tile in the fp16 products' bytes (dead after the solve) where they exist
        a_lay: gl.constexpr = a_desc.layout
        if SOLVE_F16:
            a_st = _as_tile(l16, dt, C, a_lay)
        else:
            a_st = gl.allocate_shared_memory(dt, [C, C], a_desc.layout)
        cta_barrier()
        _store_chunk_tile(a_desc, a_st, ainv, ai, tok0 + t0, i_hv * AP, row_off, nv, C, num_warps)
        if STORE_W:
            # W = (Ainv diag(beta e^c r_k)) k: one [64, 64] x [64, K] wgmma, the left operand from registers, k still
            # in shared memory (the solve's scratch did not take its bytes). Ainv's staging tile must be read by its
            # TMA store first: the compiler counts it dead once the store is issued and may give its bytes to the
            # layout conversions below
            tma.store_wait(0)
            if nv < C:  # a partial chunk: the next sequence's k rows out of the product (uniform branch)
                _zero_rows_past(k_s, nv, num_warps)
                fence_async_shared()
                cta_barrier()
            mw: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, K, 16])
            opw: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mw, k_width=2)
            aw = (ai.to(gl.float32) * fw_s.load(cl)[None, :]).to(dt)
            wm = warpgroup_mma(gl.convert_layout(aw, opw), k_s, gl.zeros([C, K], gl.float32, layout=mw),
                               use_acc=False)
            _store_tile(w_out, wm.to(dt), (tok_r * HV + i_hv) * K, nv, C, num_warps, K)
        tma.store_wait(0)
        if STORE_P:
            # a use of P's staging tile after its store was read: the compiler's shared-memory allocator frees a
            # buffer after its last use, and the TMA store (an asynchronous reader) does not count as one after it
            # is issued, so without this later shared-memory scratch (the solve's layout conversions) could take the
            # bytes while the store still reads them (seen: one gdn check row in 118 off, not repeatable)
            p_st.store(gl.zeros([C, C], dt, layout=mma))


def supported(k: torch.Tensor, q, K: int, ainv_dtype: torch.dtype, solve_precision: str) -> bool:
    """Whether the sm_90 prepare can take a forward prepare launch (else the portable kernel does): Gluon, sm_90,
    16-bit k (and q of the same dtype and layout), Ainv stored in that dtype from tf32 solve products, K 64 / 128."""
    if not G.AVAILABLE or capability(k.device) != "sm_90" or k.dtype not in _GL_DT:
        return False
    if ainv_dtype != k.dtype or solve_precision != "tf32" or K not in (64, 128) or not _rows2d_ok(k):
        return False
    return q is None or (q.dtype == k.dtype and q.shape == k.shape and _rows2d_ok(q))


def launch_prepare(k, q, g, beta, g_cum, ainv, rk, p, qf, chunk_indices, cu_seqlens, NT, T, scale, s_g, s_beta, *,
                   H, HV, K, use_l2, is_varlen, maxnreg=None, rq=None, w=None, solve_f16=False, flags=None, pdl=False,
                   rq_of=None, row_scalars=None, chunk_spans=None, beta_in_ainv=False):
    """Launch the sm_90 prepare over NT chunks x HV value heads (``supported`` must have said yes). ``q`` None: no
    P / qf; ``rk`` / ``rq`` None: r_k / r_q not stored (``rq`` is written only with the L2 norm, from ``q``, or
    without P from ``rq_of``, the q whose tiles are then loaded for it alone; the caller passes it only then);
    ``w`` [B, T, HV, K] (contiguous, k's dtype): also W. ``solve_f16``: the fp16 solve, which
    writes the overflow flags ``flags`` (int8 [NT * HV, 64], one per row; the caller redoes the flagged items).
    ``pdl``: programmatic dependent launch (:func:`gdn.kernels.launch.pdl_args`). Unused tensors may be None.
    Ainv and P [B, T, HV, 64]: contiguous, or views at one head pitch (``hopper.pitched_rows_ok``: the two halves of
    o's rows, which the register-state kernel reads them from). ``row_scalars``: (VP, VB, NCOPY) where g_cum, rk
    and flags are all o's fp32 view (``hopper.row_scalar_pack``), the kernel packing them into o's rows.
    ``chunk_spans`` (varlen): ``plan.ChunkIndex.chunk_spans``, read instead of ``cu_seqlens`` (SPANS).
    ``beta_in_ainv`` (no W): Ainv is stored as Ainv diag(beta) (A_BETA)."""
    if beta_in_ainv and w is not None:
        raise ValueError("launch_prepare: beta_in_ainv stores Ainv diag(beta), which W = Ainv diag(beta e^c r_k) k "
                         "does not take: not with w")
    if row_scalars is not None and (any(x is not None and x is not g_cum for x in (rk, flags))
                                    or q is not None or rq is not None or w is not None):
        raise ValueError("launch_prepare: row scalars packed into o: g_cum, rk and flags are o's fp32 view; no P, no "
                         "r_q, no W")
    if solve_f16 and row_scalars is None and (flags is None or flags.numel() < NT * HV * CHUNK):
        raise ValueError("launch_prepare: the fp16 solve needs flags, int8 [NT * HV, 64]")
    ap = ainv.stride(2)
    if not pitched_rows_ok(ainv) or (p is not None and (p.stride(2) != ap or not pitched_rows_ok(p))):
        raise ValueError("launch_prepare: Ainv and P must be token rows at one head pitch (16-byte aligned)")
    spans = bool(is_varlen and chunk_spans is not None)
    dn = _GL_DT[k.dtype]
    k_desc = _desc(_rows2d(k), (CHUNK, K), dn)
    qq = q if q is not None else rq_of
    q_desc = _desc(_rows2d(qq), (CHUNK, K), dn) if qq is not None else k_desc
    a_desc = _desc(_pitched_rows2d(ainv), (CHUNK, CHUNK), dn)
    p_desc = _desc(_pitched_rows2d(p), (CHUNK, CHUNK), dn) if p is not None else a_desc
    launch(_chunk_prepare_sm90_kernel, (NT * HV,),
        k_desc, q_desc, a_desc, p_desc, g, beta, g_cum, ainv, rk if rk is not None else g_cum,
        rq if rq is not None else g_cum, p if p is not None else ainv,
        qf if qf is not None else g_cum, w if w is not None else ainv, flags if flags is not None else chunk_indices,
        chunk_indices,
        chunk_spans if spans else cu_seqlens if cu_seqlens is not None else chunk_indices, T, float(scale), *s_g,
        *s_beta,
        H=H, HV=HV, K=K, USE_L2=use_l2, IS_VARLEN=is_varlen, STORE_RK=rk is not None,
        STORE_P=q is not None, STORE_RQ=rq is not None, STORE_W=w is not None, num_warps=4, SOLVE_F16=bool(solve_f16),
        **({"AP": ap} if ap != CHUNK else {}), **({"maxnreg": maxnreg} if maxnreg else {}),
        **(dict(zip(("VP", "VB", "NCOPY"), row_scalars)) if row_scalars is not None else {}),
        **({"SPANS": True} if spans else {}), **({"A_BETA": True} if beta_in_ainv else {}),
        **pdl_args(pdl, k.device))


__all__ = ["supported", "launch_prepare"]
