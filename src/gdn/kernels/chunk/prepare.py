"""Prepare kernel of the chunked forward: per (chunk, value head) the chunk-local gate cumsum, ``K K^T``, the
triangular solve ``Ainv = (I + A)^-1`` and ``W``/``U`` (also: ``W``/``U`` recomputed from a stored Ainv for the
backward, and the gate cumsum alone).

Math (one chunk of C = 64 tokens, one value head; ``k_hat = r_k k`` with ``r_k = rsqrt(|k|^2 + 1e-6)`` when the
in-kernel L2 norm is on, else ``r_k = 1``)::

    1. c       = cumsum(g) inside the chunk                      (fp32, restarts at every chunk / sequence start)
    2. A       = strictLower(diag(beta) (Gamma * K_hat K_hat^T)),  Gamma_ij = exp(c_i - c_j)  (i >= j)
    3. Ainv    = (I + A)^-1      (16x16 diagonal blocks by forward substitution, merged with four 64x64 products)
    4. W       = Ainv diag(beta exp(c)) K_hat,     U = Ainv diag(beta) V

Layouts (``NT`` chunks over all sequences; ``[B, T, ...]`` intermediates are contiguous, inputs may be strided)::

    k [B, T, H, K], v [B, T, HV, V]      last dim contiguous, any other strides
    g, beta [B, T, HV]                   any strides, any float dtype
    g_cum [B, T, HV] fp32                c of step 1
    Ainv [B, T, HV, 64]                  row t = row (t - chunk start) of its chunk's inverse (columns = positions)
    w [B, T, HV, K], u [B, T, HV, V]     tensor-core dtype (bf16 for bf16 inputs)
    rk [B, T, H] fp32                    r_k per key head (optional output)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import tuning
from ..common import cdiv, l2_rnorm, pdl_enter
from ..launch import pdl_args
from .common import (CHUNK_SIZE, _TL, _check_chunk_size, _cu_arg, _dot, _dot_dtype, _empty, _launch, _load_tile,
                     _pow2, _rn, _seq_span, _strides3)
from . import hopper_prepare
from .hopper import pitched_layout_ok
from .plan import ChunkIndex, get_chunk_index


@triton.jit
def _dotp(a, b, PREC: tl.constexpr):
    """fp32 a @ b for the triangular solve: PREC "bf16" rounds both operands to bfloat16, anything else is the
    ``input_precision`` of an fp32 tensor-core product ("tf32", "tf32x3", "ieee")."""
    if PREC == "bf16":
        r = _dot(_rn(a, tl.bfloat16), _rn(b, tl.bfloat16), "ieee")
    else:
        r = tl.dot(a, b, input_precision=PREC)
    return r


@triton.jit
def _unit_lower_inverse64(A, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower triangular fp32 [64, 64] A.

    The four 16x16 diagonal blocks D_b are inverted by forward substitution, all four at once on a [4, 16, 16] stack
    (15 sequential row steps). The stack is cut from A's rows, so each warp of the product's layout holds its own
    block (no replicated work, no cross-warp traffic in the loop), and the inverses are kept transposed
    (``YT[b, j, k] = Y_b[k, j]``) so the row taken out of D in each step already lies along the axis it is multiplied
    over. With Dinv the block-diagonal inverse and L the blocks below the diagonal, I + A = D (I + M) with
    M = Dinv L strictly block-lower (M^4 = 0), so (I + A)^-1 = (I - M + M^2 - M^3) Dinv: four 64x64 products."""
    r16 = tl.arange(0, 16)
    r4 = tl.arange(0, 4)
    same_block = r4[:, None, None, None] == r4[None, None, :, None]
    # A4[b, i, c, k] = A[16 b + i, 16 c + k]; the diagonal blocks are c == b
    D = tl.sum(tl.where(same_block, tl.reshape(A, (4, 16, 4, 16)), 0.0), axis=2)     # [b, i, k] = D_b[i, k]
    YT = tl.zeros([4, 16, 16], tl.float32) + tl.where(r16[:, None] == r16[None, :], 1.0, 0.0)[None, :, :]
    for i in range(1, 16):
        a_i = tl.sum(tl.where(r16[None, :, None] == i, D, 0.0), axis=1)             # [b, k] = D_b[i, k]
        y_i = tl.sum(a_i[:, None, :] * YT, axis=2)                                   # [b, j] = (D_b Y_b)[i, j]
        YT = tl.where(r16[None, None, :] == i, tl.where(r16 == i, 1.0, 0.0)[None, :, None] - y_i[:, :, None], YT)
    # Dinv[16 b + k, 16 c + j] = (b == c) Y_b[k, j]
    Dinv = tl.reshape(tl.where(same_block, tl.permute(YT, (0, 2, 1))[:, :, None, :], 0.0), (64, 64))
    r64 = tl.arange(0, 64)
    L = tl.where((r64[:, None] // 16) > (r64[None, :] // 16), A, 0.0)
    M = _dotp(Dinv, L, PREC)
    M2 = _dotp(M, M, PREC)
    X = tl.where(r64[:, None] == r64[None, :], 1.0, 0.0) - M + M2 - _dotp(M, M2, PREC)
    return _dotp(X, Dinv, PREC)


@triton.jit(do_not_specialize=["T"])
def _chunk_prepare_kernel(
    k, v, g, beta, gcum, ainv, w, u, rk_out, rq_out, q, p_out, qf_out, chunk_indices, cu_seqlens, T, scale,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_qb, s_qt, s_qh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, G_IS_CUM: tl.constexpr, STORE_G: tl.constexpr,
    STORE_A: tl.constexpr, LOAD_A: tl.constexpr, STORE_W: tl.constexpr, STORE_U: tl.constexpr,
    STORE_RK: tl.constexpr, STORE_P: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
    STORE_RQ: tl.constexpr = False,
):
    """One program per (chunk, value head): :func:`_prepare_item` of item ``program_id(0)``."""
    _prepare_item(tl.program_id(0), k, v, g, beta, gcum, ainv, w, u, rk_out, rq_out, q, p_out, qf_out, chunk_indices,
                  cu_seqlens, T, scale, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_qb,
                  s_qt, s_qh, H, HV, K, V, BK, BV, USE_L2, IS_VARLEN, G_IS_CUM, STORE_G, STORE_A, LOAD_A, STORE_W,
                  STORE_U, STORE_RK, STORE_P, DT, PREC, SOLVE_PREC, STORE_RQ)


@triton.jit(do_not_specialize=["T", "n_items"])
def _prepare_redo_kernel(
    flags, n_items, k, beta, gcum, ainv, w, chunk_indices, cu_seqlens, T, s_kb, s_kt, s_kh, s_bb, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, USE_L2: tl.constexpr,
    IS_VARLEN: tl.constexpr, STORE_W: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    AP: tl.constexpr = 64, VP: tl.constexpr = 0, VB: tl.constexpr = 0, A_BETA: tl.constexpr = False,
):
    """Ainv (and with STORE_W, W) of the (chunk, value head) items with a row flag set in ``flags`` (int8
    [n_items, 64], item = chunk * HV + value head), from the stored g_cum, with the tf32 solve: the sm_90 prepare's
    fp16 products overflowed there (raw keys of large norm; adversarial inputs only). One program per BLOCK items:
    one vector load of their flags, nothing more where none is set. AP: Ainv's head pitch (``_prepare_item``).
    VP, VB (> 0): g_cum and the flags (fp32, nonzero = set) packed into o's rows, the first V tile's block of each
    chunk (``hopper.row_scalar_pack``; ``gcum`` = ``flags`` = o's fp32 view; field 0 g_cum, 2 the flags).
    A_BETA: Ainv stored as Ainv diag(beta), as the sm_90 prepare's A_BETA form wrote it."""
    pdl_enter(PDL)
    GP: tl.constexpr = 1 if VP == 0 else VP     # g_cum's pitch per (token, value head)
    base = tl.program_id(0) * BLOCK
    offs = base + tl.arange(0, BLOCK)
    r64 = tl.arange(0, 64)
    ok = offs < n_items
    if VP == 0:
        f = tl.load(flags + offs[:, None] * 64 + r64[None, :], mask=ok[:, None], other=0).to(tl.int32)
    else:
        i_t = offs // HV
        n = tl.load(chunk_indices + 2 * i_t, mask=ok, other=0)      # (sequence 0 past the items: a valid span)
        c = tl.load(chunk_indices + 2 * i_t + 1, mask=ok, other=0).to(tl.int64)
        i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
        tok0 = i_b * T
        t0 = bos + c * 64
        e = 2 * tl.minimum(eos - t0, 64)[:, None] + r64[None, :]      # field 2 of the chunk's nv valid rows
        fp = flags + ((tok0 + t0)[:, None] + e // VB) * (HV * VP) + (offs % HV)[:, None] * VP + e % VB
        f = (tl.load(fp, mask=ok[:, None] & (t0[:, None] + r64[None, :] < eos[:, None]), other=0.0) != 0).to(tl.int32)
    f = tl.max(f, axis=1)       # per item
    if tl.max(f, axis=0) > 0:
        for j in range(BLOCK):
            item = base + j
            if item < n_items:
                if tl.sum(tl.where(tl.arange(0, BLOCK) == j, f, 0), axis=0) != 0:
                    # g_cum read back as a cumulative g ([B, T, HV], or packed at pitch VP); only Ainv (and W)
                    # stored; the inputs no mode here reads (v, u, q, P, qf, r_k / r_q) get placeholders
                    _prepare_item(item, k, k, gcum, beta, gcum, ainv, w, w, gcum, gcum, k, ainv, gcum, chunk_indices,
                                  cu_seqlens, T, 1.0, s_kb, s_kt, s_kh, 0, 0, 0, T.to(tl.int64) * (HV * GP),
                                  HV * GP, GP, s_bb, s_bt, s_bh,
                                  s_kb, s_kt, s_kh, H=H, HV=HV, K=K, V=K, BK=BK, BV=BK, USE_L2=USE_L2,
                                  IS_VARLEN=IS_VARLEN, G_IS_CUM=True, STORE_G=False, STORE_A=True, LOAD_A=False,
                                  STORE_W=STORE_W, STORE_U=False, STORE_RK=False, STORE_P=False, DT=DT, PREC="tf32",
                                  SOLVE_PREC="tf32", STORE_RQ=False, AP=AP, G_VB=VB, A_BETA=A_BETA)


@triton.jit
def _prepare_item(
    pid, k, v, g, beta, gcum, ainv, w, u, rk_out, rq_out, q, p_out, qf_out, chunk_indices, cu_seqlens, T, scale,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_qb, s_qt, s_qh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, G_IS_CUM: tl.constexpr, STORE_G: tl.constexpr,
    STORE_A: tl.constexpr, LOAD_A: tl.constexpr, STORE_W: tl.constexpr, STORE_U: tl.constexpr,
    STORE_RK: tl.constexpr, STORE_P: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
    STORE_RQ: tl.constexpr, AP: tl.constexpr = 64, G_VB: tl.constexpr = 0, A_BETA: tl.constexpr = False,
):
    """Item ``pid`` = chunk * HV + value head: g_cum (chunk-local cumsum), A = strictLower(diag(beta r_k) (Gamma * K K^T)
    diag(r_k)) with r_k the L2 row scalings, Ainv = (I + A)^-1 (stored as [64, 64] rows of the [B, T, HV, 64] buffer),
    W = Ainv diag(beta exp(g) r_k) K, U = Ainv diag(beta) V; r_k stored per key head ([B, T, H] fp32) when asked.
    LOAD_A: Ainv is read instead of computed (recompute of W / U). STORE_P: the output's intra-chunk matrix
    P = causal(scale (r_q r_k^T) * Gamma * Q K^T) (i >= j; [B, T, HV, 64] like Ainv, rounded as the output kernel
    rounds it) and the row factors of its inter-chunk part, qf = scale r_q exp(g_cum) ([B, T, HV] fp32); with
    STORE_RQ (and the L2 norm) also r_q per key head ([B, T, H] fp32, as r_k), which the backward then reads instead
    of computing it again. AP: elements between two value heads' Ainv rows of one token (64 but for the redo of
    an Ainv packed into o's rows, 128). G_VB (> 0, with G_IS_CUM): g_cum packed into o's rows, G_VB entries per
    token row (``hopper.row_scalar_pack``; s_gt / s_gh its token / head pitch). A_BETA (with STORE_A): Ainv is
    stored as Ainv diag(beta) (W and U still from Ainv itself)."""
    # one flat grid, value heads fastest: the HV // H programs sharing a key head's k (and q) tiles run side by side
    # and read them once from memory (grid order (NT, HV) was 4-5% slower on the H200)
    i_t = pid // HV
    i_hv = pid % HV
    n = tl.load(chunk_indices + 2 * i_t)
    c = tl.load(chunk_indices + 2 * i_t + 1)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    i_h = i_hv // (HV // H)
    t0 = bos + c.to(tl.int64) * 64
    to = tl.arange(0, 64)
    rows = t0 + to
    m = rows < eos
    tok0 = i_b * T  # row offset of this batch row in the [B, T, HV, ...] intermediates
    trow = (tok0 + rows) * HV + i_hv

    # ---- gates: chunk-local cumulative sum (fp32) and beta
    if G_VB == 0:
        b_g = tl.load(g + i_b * s_gb + i_hv * s_gh + rows * s_gt, mask=m, other=0.0).to(tl.float32)
    else:   # (g_cum packed densely into o's rows, G_VB fp32 per row: hopper.row_scalar_pack)
        b_g = tl.load(g + i_b * s_gb + i_hv * s_gh + (t0 + to // G_VB) * s_gt + to % G_VB, mask=m, other=0.0)
    if not G_IS_CUM:
        b_g = tl.cumsum(b_g, axis=0)
    if STORE_G:
        tl.store(gcum + trow, b_g, mask=m)
    b_beta = tl.load(beta + i_b * s_bb + i_hv * s_bh + rows * s_bt, mask=m, other=0.0).to(tl.float32)

    k_base = k + i_b * s_kb + i_h * s_kh
    a_ptr = ainv + trow[:, None] * AP + to[None, :]
    if LOAD_A:
        b_ai = tl.load(a_ptr, mask=m[:, None], other=0.0).to(tl.float32)
        rk = tl.full([64], 1.0, tl.float32)
        if USE_L2:
            ss = tl.zeros([64], tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                ok = i_k * BK + tl.arange(0, BK)
                kf = _load_tile(k_base, rows, m, ok, ok < K, s_kt).to(tl.float32)
                ss += tl.sum(kf * kf, axis=1)
            rk = tl.rsqrt(ss + 1e-6)
    else:
        # ---- K K^T (one 64 x 64 product over K tiles) and the squared row norms
        acc = tl.zeros([64, 64], tl.float32)
        ss = tl.zeros([64], tl.float32)
        if STORE_P:
            acc_q = tl.zeros([64, 64], tl.float32)
            ss_q = tl.zeros([64], tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            ok = i_k * BK + tl.arange(0, BK)
            b_k = _load_tile(k_base, rows, m, ok, ok < K, s_kt)
            if USE_L2:
                kf = b_k.to(tl.float32)
                ss += tl.sum(kf * kf, axis=1)
            b_k = _rn(b_k, DT)
            acc += _dot(b_k, tl.trans(b_k), PREC)
            if STORE_P:
                b_q = _load_tile(q + i_b * s_qb + i_h * s_qh, rows, m, ok, ok < K, s_qt)
                if USE_L2:
                    qf = b_q.to(tl.float32)
                    ss_q += tl.sum(qf * qf, axis=1)
                acc_q += _dot(_rn(b_q, DT), tl.trans(b_k), PREC)
        if USE_L2:
            rk = tl.rsqrt(ss + 1e-6)
        else:
            rk = tl.full([64], 1.0, tl.float32)
        # Gamma_ij = exp(c_i - c_j) on and below the diagonal (exponents <= 0), shared by P and A
        causal = to[:, None] >= to[None, :]
        gamma = tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0))
        if STORE_P:
            if USE_L2:
                rq = tl.rsqrt(ss_q + 1e-6)
                if STORE_RQ:
                    tl.store(rq_out + (tok0 + rows) * H + i_h, rq, mask=tl.where(i_hv % (HV // H) == 0, m, False))
                rq = rq * scale
            else:
                rq = tl.full([64], 1.0, tl.float32) * scale
            att = tl.where(causal, acc_q * rq[:, None] * rk[None, :] * gamma, 0.0)
            tl.store(p_out + trow[:, None] * 64 + to[None, :], _rn(att, p_out.dtype.element_ty), mask=m[:, None])
            tl.store(qf_out + trow, rq * tl.exp(b_g), mask=m)
        A = tl.where(to[:, None] > to[None, :], acc * (b_beta * rk)[:, None] * rk[None, :] * gamma, 0.0)
        b_ai = _unit_lower_inverse64(A, SOLVE_PREC)
        if STORE_A:
            if A_BETA:
                tl.store(a_ptr, _rn(b_ai * b_beta[None, :], ainv.dtype.element_ty), mask=m[:, None])
            else:
                tl.store(a_ptr, _rn(b_ai, ainv.dtype.element_ty), mask=m[:, None])
    if STORE_RK:
        tl.store(rk_out + (tok0 + rows) * H + i_h, rk, mask=tl.where(i_hv % (HV // H) == 0, m, False))

    if STORE_W or STORE_U:
        b_j = _rn(b_ai, DT)
    if STORE_W:
        # W = Ainv @ (beta * exp(g_cum) * k_hat)
        f = b_beta * tl.exp(b_g) * rk
        for i_k in range(0, tl.cdiv(K, BK)):
            ok = i_k * BK + tl.arange(0, BK)
            mk = ok < K
            x = _rn(_load_tile(k_base, rows, m, ok, mk, s_kt).to(tl.float32) * f[:, None], DT)
            tl.store(w + trow[:, None] * K + ok[None, :], _rn(_dot(b_j, x, PREC), w.dtype.element_ty),
                     mask=m[:, None] & mk[None, :])
    if STORE_U:
        # U = Ainv @ (beta * v)
        v_base = v + i_b * s_vb + i_hv * s_vh
        for i_v in range(0, tl.cdiv(V, BV)):
            ov = i_v * BV + tl.arange(0, BV)
            mv = ov < V
            x = _rn(_load_tile(v_base, rows, m, ov, mv, s_vt).to(tl.float32) * b_beta[:, None], DT)
            tl.store(u + trow[:, None] * V + ov[None, :], _rn(_dot(b_j, x, PREC), u.dtype.element_ty),
                     mask=m[:, None] & mv[None, :])


def _sm90_prepare_cap(cfg, with_p: bool, with_w: bool = False, gva: bool = False):
    """The sm_90 prepare's register cap (None: uncapped): the fp16 solve's P build at ``prepare_sm90_maxnreg_gva``
    where value heads share key heads (``gva``: HV > H), the other P / W builds at ``prepare_sm90_maxnreg``; without
    P and W the fp16 solve's build at ``prepare_sm90_maxnreg_nop``, the tf32 one uncapped (~138 registers)."""
    f16 = bool(cfg.solve_sm90_f16)
    if with_p and not with_w and gva and f16:
        return int(cfg.prepare_sm90_maxnreg_gva) or None
    if with_p or with_w:
        return int(cfg.prepare_sm90_maxnreg) or None
    return (int(cfg.prepare_sm90_maxnreg_nop) or None) if f16 else None


def _solve_precision(cfg, dt: torch.dtype, store_dtype: torch.dtype) -> str:
    """Precision of the 64x64 products of the triangular solve: the ``chunk_fwd.solve_precision`` field, where "auto" means tf32
    when the result is stored in half precision from half inputs (the forward), else tf32x3 (~fp32)."""
    p = cfg.solve_precision
    if p != "auto":
        return p
    half = (torch.bfloat16, torch.float16)
    return "tf32" if (dt in half and store_dtype in half) else "tf32x3"


def sm90_prepare_taken(k: torch.Tensor, q: Optional[torch.Tensor], dt: torch.dtype, *, store_ainv: bool,
                       store_wu: bool, g_is_cumsum: bool, ainv_dtype: torch.dtype) -> bool:
    """Whether :func:`chunk_fwd_prepare` with these arguments (``dt``: the tensor-core dtype of k and v) runs the
    sm_90 Gluon prepare (else the portable kernel)."""
    cfg = tuning.chunk_fwd(k.device)
    if not (cfg.prepare_sm90 and store_ainv and not store_wu and not g_is_cumsum):
        return False
    return hopper_prepare.supported(k, q, k.shape[3], ainv_dtype, _solve_precision(cfg, dt, ainv_dtype))


def chunk_fwd_prepare(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                      use_qk_l2norm_in_kernel: bool = False, *, store_ainv: bool = True, store_wu: bool = True,
                      g_is_cumsum: bool = False, out_dtype: Optional[torch.dtype] = None,
                      chunk_index: Optional[ChunkIndex] = None, ainv_dtype: torch.dtype = torch.float32,
                      rk: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None, scale: float = 1.0,
                      rq: Optional[torch.Tensor] = None, keep_w: bool = False,
                      ainv_out: Optional[torch.Tensor] = None, p_out: Optional[torch.Tensor] = None,
                      rq_of: Optional[torch.Tensor] = None, row_scalars: Optional[tuple] = None,
                      beta_in_ainv: bool = False):
    """Fused cumsum + K K^T + triangular solve + W/U.

    k [B, T, H, K], v [B, T, HV, V] (strided, last dim contiguous), g, beta [B, T, HV] (any float dtype; g log-space,
    or already the chunk-local cumsum when ``g_is_cumsum``).
    Returns ``(g_cum [B, T, HV] fp32, Ainv [B, T, HV, 64] (``ainv_dtype``, default fp32) or None,
    w [B, T, HV, K] or None, u [B, T, HV, V] or None)``; w/u in ``out_dtype`` (default: the tensor-core dtype of k/v,
    i.e. bf16 for bf16 inputs). Ainv row t holds row (t - chunk start) of its chunk's (I + A)^-1 (no beta factor but
    with ``beta_in_ainv``, below).
    ``rk``: optional fp32 [B, T, H] buffer that receives the L2 row scalings 1 / |k_t| (with the L2 norm on).
    ``q`` [B, T, H, K] (strided) with ``scale``: also the output's intra-chunk matrix P [B, T, HV, 64] (tensor-core
    dtype) and row factors qf [B, T, HV] fp32 (kernel docstring), returned as a 5th and 6th value; ``rq``: with
    ``q`` and the L2 norm, an fp32 [B, T, H] buffer that receives q's L2 row scalings too (as ``rk`` k's).
    On sm_90 the forward's launches (Ainv in k's 16-bit dtype, no W / U) run as the Gluon kernel of
    :mod:`.hopper_prepare` (``chunk_fwd.prepare_sm90``), followed by :func:`redo_overflowed` for its fp16 solve;
    there ``keep_w`` has it store the backward's W too (returned as w; elsewhere ``keep_w`` is ignored and w is
    None). ``ainv_out`` / ``p_out``: where that sm_90 launch writes Ainv / P instead of new buffers ([B, T, HV, 64]
    views at one head pitch, e.g. the two halves of o's rows; only where :func:`sm90_prepare_taken` says so).
    ``rq_of`` (q [B, T, H, K], without ``q``; with ``rq`` and the L2 norm): q's L2 row scalings into ``rq`` without P
    (the sm_90 prepare loads q's tiles for them; elsewhere :func:`gdn.kernels.common.l2_rnorm`).
    ``row_scalars`` (the sm_90 launch only, no P / W / U / r_q): (o's fp32 view, VP, VB, copies) of
    ``hopper.row_scalar_pack``: g_cum, r_k and the overflow flags go into o's rows instead of buffers of their own
    (``rk`` must then be that view or None); the g_cum returned is that view.
    ``beta_in_ainv`` (the sm_90 launch only, without W): Ainv is stored as Ainv diag(beta), its columns scaled by
    their tokens' beta, the form the register-state kernel and the one-CTA segment pass take (one row scaling
    fewer in their chains; ``hopper.launch_fused_pass`` / ``hopper_segments.launch_segment_pass_t``).
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    cfg = tuning.chunk_fwd(dev)
    ci = get_chunk_index(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = _dot_dtype(k, v)
    out_dtype = out_dtype or dt
    sm90 = sm90_prepare_taken(k, q, dt, store_ainv=store_ainv, store_wu=store_wu, g_is_cumsum=g_is_cumsum,
                              ainv_dtype=ainv_dtype)
    packed_rs = row_scalars[0] if row_scalars is not None else None
    if row_scalars is not None and (not sm90 or keep_w or q is not None or rq is not None or rq_of is not None
                                    or (rk is not None and rk is not packed_rs)):
        raise ValueError("chunk_fwd_prepare: row_scalars are for the sm_90 prepare without P / W / r_q, with rk None "
                         "or the packed view")
    if beta_in_ainv and (not sm90 or keep_w):
        raise ValueError("chunk_fwd_prepare: beta_in_ainv is for the sm_90 prepare without W")
    g_cum = packed_rs if packed_rs is not None else \
        g if (g_is_cumsum and g.dtype == torch.float32 and g.is_contiguous()) else \
        _empty(B, T, HV, device=dev, dtype=torch.float32)
    store_g = g_cum is not g
    if (ainv_out is not None or p_out is not None) and (not sm90 or ainv_out is None or (p_out is None) != (q is None)):
        raise ValueError("chunk_fwd_prepare: ainv_out / p_out are for the sm_90 prepare's Ainv and (with q) P")
    ainv = ainv_out if ainv_out is not None else (
        _empty(B, T, HV, CHUNK_SIZE, device=dev, dtype=ainv_dtype) if store_ainv else None)
    w = _empty(B, T, HV, K, device=dev, dtype=out_dtype) if store_wu else None
    u = _empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_wu else None
    p = p_out if p_out is not None else (_empty(B, T, HV, CHUNK_SIZE, device=dev, dtype=dt) if q is not None else None)
    qf = _empty(B, T, HV, device=dev, dtype=torch.float32) if q is not None else None
    extra = (p, qf) if q is not None else ()
    if ci.NT == 0 or HV == 0:
        return (g_cum, ainv, w, u) + extra
    dummy = g_cum
    store_rk = rk is not None and bool(use_qk_l2norm_in_kernel)
    store_rq = rq is not None and q is not None and bool(use_qk_l2norm_in_kernel)
    rq_alone = rq is not None and q is None and rq_of is not None and bool(use_qk_l2norm_in_kernel)
    solve_prec = _solve_precision(cfg, dt, ainv_dtype if store_ainv else out_dtype)
    if rq_alone and not (sm90 and hopper_prepare.supported(k, rq_of, K, ainv_dtype, solve_prec)):
        rq.copy_(l2_rnorm(rq_of))       # (the portable prepare, or a q the sm_90 one cannot load)
        rq_alone = False
    if sm90:
        w = _empty(B, T, HV, K, device=dev, dtype=dt) if keep_w else None
        f16 = bool(cfg.solve_sm90_f16)
        flags = (packed_rs if packed_rs is not None else
                 torch.empty(ci.NT * HV, CHUNK_SIZE, device=dev, dtype=torch.int8)) if f16 else None
        hopper_prepare.launch_prepare(
            k, q, g, beta, g_cum, ainv, rk if store_rk else None, p, qf, ci.chunk_indices,
            cu_seqlens, ci.NT, T, scale, _strides3(g), _strides3(beta), H=H, HV=HV, K=K,
            use_l2=bool(use_qk_l2norm_in_kernel), is_varlen=ci.is_varlen,
            maxnreg=_sm90_prepare_cap(cfg, q is not None, keep_w, HV > H),
            rq=rq if (store_rq or rq_alone) else None, w=w, solve_f16=f16, flags=flags, pdl=cfg.pdl,
            rq_of=rq_of if rq_alone else None, row_scalars=row_scalars[1:] if row_scalars is not None else None,
            chunk_spans=ci.chunk_spans,   # (built where chunk_fwd.prepare_sm90_chunk_spans asks for it)
            beta_in_ainv=beta_in_ainv)
        if f16:
            redo_overflowed(flags, k, beta, g_cum, ainv, w, ci, cu_seqlens, T, use_qk_l2norm_in_kernel,
                            pdl=cfg.pdl, packed_pitch=row_scalars[1:3] if row_scalars is not None else None,
                            beta_in_ainv=beta_in_ainv)
        return (g_cum, ainv, w, u) + extra
    BK = min(int(cfg.prepare_BK), _pow2(K))
    BV = min(int(cfg.prepare_BV), _pow2(V))
    _launch(_chunk_prepare_kernel, (ci.NT * HV,),
        k, v, g, beta, g_cum, ainv if ainv is not None else dummy, w if w is not None else dummy,
        u if u is not None else dummy, rk if store_rk else dummy, rq if store_rq else dummy,
        q if q is not None else k,
        p if p is not None else dummy, qf if qf is not None else dummy, ci.chunk_indices,
        _cu_arg(cu_seqlens, ci.chunk_offsets), T, float(scale),
        *_strides3(k), *_strides3(v), *_strides3(g), *_strides3(beta), *_strides3(q if q is not None else k),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
        G_IS_CUM=bool(g_is_cumsum), STORE_G=store_g, STORE_A=store_ainv, LOAD_A=False, STORE_W=store_wu,
        STORE_U=store_wu, STORE_RK=store_rk, STORE_P=q is not None, DT=_TL[dt], PREC=cfg.fp32_dot_precision,
        SOLVE_PREC=solve_prec, STORE_RQ=store_rq,
        num_warps=int(cfg.prepare_warps),
        # never software-pipelined: with the K loop pipelined 2 stages deep, Triton 3.6 on the H200 gave wrong,
        # run-to-run different Ainv (~0.02% of the elements off by up to 0.13) and P (bench/NOTES.md)
        num_stages=1,
        maxnreg=cfg.prepare_maxnreg,
    )
    return (g_cum, ainv, w, u) + extra


def redo_overflowed(flags: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor,
                    ainv: torch.Tensor, w: Optional[torch.Tensor], ci: ChunkIndex, cu_seqlens, T: int,
                    use_qk_l2norm_in_kernel: bool, pdl: bool = False, packed_pitch: Optional[tuple] = None,
                    beta_in_ainv: bool = False) -> None:
    """Ainv (and W when given) of the items flagged in ``flags`` (int8 [NT * HV, 64], a flag per row; item =
    chunk * HV + value head) recomputed in place with the tf32 solve from k, beta and the stored g_cum
    (:func:`_prepare_redo_kernel`): the sm_90 prepare's fp16 products overflowed there. One program per
    ``chunk_fwd.redo_block`` items; ``pdl``: programmatic dependent launch (:func:`.launch.pdl_args`). Ainv
    [B, T, HV, 64]: contiguous or at a head pitch of its own (packed into o's rows: ``chunk_fwd_prepare``'s
    ``ainv_out``). ``packed_pitch``: (VP, VB) where ``flags`` and ``g_cum`` are o's fp32 view holding them in its
    rows (``hopper.row_scalar_pack``). ``beta_in_ainv``: Ainv is stored as Ainv diag(beta) (the prepare's
    ``beta_in_ainv`` form)."""
    H, K = k.shape[2], k.shape[3]
    HV = beta.shape[2]
    ap = ainv.stride(2)
    if not pitched_layout_ok(ainv):
        raise ValueError("redo_overflowed: ainv must be token rows at one head pitch")
    n = ci.NT * HV
    cfg = tuning.chunk_fwd(k.device)
    block = int(cfg.redo_block_row_scalars if packed_pitch else cfg.redo_block)
    _launch(_prepare_redo_kernel, (cdiv(n, block),),
            flags, n, k, beta, g_cum, ainv, w if w is not None else ainv, ci.chunk_indices,
            _cu_arg(cu_seqlens, ci.chunk_offsets), T, *_strides3(k), *_strides3(beta),
            H=H, HV=HV, K=K, BK=min(64, _pow2(K)), USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
            STORE_W=w is not None, DT=_TL[_dot_dtype(k, k)], BLOCK=block, num_warps=4, num_stages=1,
            **({"AP": ap} if ap != CHUNK_SIZE else {}),
            **(dict(VP=int(packed_pitch[0]), VB=int(packed_pitch[1])) if packed_pitch else {}),
            **({"A_BETA": True} if beta_in_ainv else {}), **pdl_args(pdl, k.device))


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = CHUNK_SIZE, cu_seqlens: Optional[torch.Tensor] = None,
                       chunk_index: Optional[ChunkIndex] = None) -> torch.Tensor:
    """Chunk-local cumulative sum of g [B, T, HV] (any float dtype, any strides) -> fp32 [B, T, HV]; restarts at
    every chunk of ``chunk_size`` tokens counted from each sequence start."""
    _check_chunk_size(chunk_size)
    B, T, HV = g.shape
    dev = g.device
    ci = get_chunk_index(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    out = _empty(B, T, HV, device=dev, dtype=torch.float32)
    if ci.NT == 0 or HV == 0:
        return out
    _launch(_chunk_cumsum_kernel, (ci.NT, HV), g, out, ci.chunk_indices, _cu_arg(cu_seqlens, ci.chunk_offsets), T,
                                      *_strides3(g), HV=HV, IS_VARLEN=ci.is_varlen)
    return out


@triton.jit(do_not_specialize=["T"])
def _chunk_cumsum_kernel(g, out, chunk_indices, cu_seqlens, T, s_gb, s_gt, s_gh, HV: tl.constexpr,
                         IS_VARLEN: tl.constexpr):
    i_t = tl.program_id(0)
    i_hv = tl.program_id(1)
    n = tl.load(chunk_indices + 2 * i_t)
    c = tl.load(chunk_indices + 2 * i_t + 1)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    rows = bos + c.to(tl.int64) * 64 + tl.arange(0, 64)
    m = rows < eos
    x = tl.load(g + i_b * s_gb + rows * s_gt + i_hv * s_gh, mask=m, other=0.0).to(tl.float32)
    tl.store(out + (i_b * T + rows) * HV + i_hv, tl.cumsum(x, axis=0), mask=m)


def chunk_scaled_dot_kkt_solve(k: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor,
                               cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                               use_qk_l2norm_in_kernel: bool = False, *, HV: Optional[int] = None,
                               chunk_index: Optional[ChunkIndex] = None) -> torch.Tensor:
    """Ainv = (I + strictLower(diag(beta) (Gamma * K_hat K_hat^T)))^-1 per chunk, fp32 [B, T, HV, 64].

    k [B, T, H, K]; g_cum [B, T, HV] (chunk-local cumsum, e.g. from :func:`chunk_local_cumsum`); beta [B, T, HV].
    Row t holds row (t - chunk start) of its chunk's inverse; columns beyond the chunk's end are zero.
    """
    B, T, H, K = k.shape
    HV = g_cum.shape[2]
    v_dummy = k.new_empty(1).expand(B, T, HV, 16)  # not read
    _, ainv, _, _ = chunk_fwd_prepare(k, v_dummy, g_cum, beta, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel,
                                      store_ainv=True, store_wu=False, g_is_cumsum=True, chunk_index=chunk_index)
    return ainv


def recompute_w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, ainv: torch.Tensor, g_cum: torch.Tensor,
                  cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                  use_qk_l2norm_in_kernel: bool = False, *, out_dtype: Optional[torch.dtype] = None,
                  chunk_index: Optional[ChunkIndex] = None, store_u: bool = True):
    """w = Ainv @ (beta * exp(g_cum) * k_hat) [B, T, HV, K], u = Ainv @ (beta * v) [B, T, HV, V] from a stored Ainv
    (fp32 [B, T, HV, 64], as returned by :func:`chunk_scaled_dot_kkt_solve`). Output dtype: ``out_dtype`` or the
    tensor-core dtype of k/v. ``store_u=False``: only w (u is returned as None)."""
    _check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    cfg = tuning.chunk_fwd(dev)
    ci = get_chunk_index(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = _dot_dtype(k, v)
    out_dtype = out_dtype or dt
    w = _empty(B, T, HV, K, device=dev, dtype=out_dtype)
    u = _empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_u else None
    if ci.NT == 0 or HV == 0:
        return w, u
    ainv = ainv.contiguous()
    g_cum = g_cum.float().contiguous()
    BK = min(int(cfg.prepare_BK), _pow2(K))
    BV = min(int(cfg.prepare_BV), _pow2(V))
    _launch(_chunk_prepare_kernel, (ci.NT * HV,),
        k, v, g_cum, beta, g_cum, ainv, w, u if store_u else w, g_cum, g_cum, k, g_cum, g_cum, ci.chunk_indices,
        _cu_arg(cu_seqlens, ci.chunk_offsets), T, 1.0, *_strides3(k), *_strides3(v), *_strides3(g_cum),
        *_strides3(beta), *_strides3(k),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
        G_IS_CUM=True, STORE_G=False, STORE_A=False, LOAD_A=True, STORE_W=True, STORE_U=store_u, STORE_RK=False,
        STORE_P=False,
        DT=_TL[dt], PREC=cfg.fp32_dot_precision, SOLVE_PREC="ieee",
        num_warps=int(cfg.prepare_warps), num_stages=int(cfg.prepare_stages),
        maxnreg=cfg.prepare_maxnreg,
    )
    return w, u
