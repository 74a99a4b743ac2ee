"""Triton kernels: depthwise causal conv1d over time, channels last (forward with conv-state pools, backward).

Decomposition. One program owns ``BD`` channels of one *chunk* of ``BT`` consecutive tokens of one sequence; it walks
over the chunk in groups of 4 tokens with a sliding register window of the previous 3 inputs, so every input row is
read from HBM once (plus a 3-row halo per chunk) and every output row written once. The 4 row loads of a group are
issued before any arithmetic to keep 4 x 16 B per thread in flight. Widths ``W`` from 1 to 4 are handled by padding the
taps to 4 (taps beyond ``W`` are compiled out).

Tap notation: ``k_l = weight[:, W - 1 - l]`` multiplies the input ``l`` steps back (``k_0`` the current token).

Sequences. Dense batches: sequence ``n`` = batch row ``n``, ``NCH`` chunks each. Varlen (``cu_seqlens``): program ``p``
finds its (sequence, chunk) by a vectorised prefix sum of per-sequence chunk counts over ``cu_seqlens`` (no host sync;
the grid has ``cdiv(T, BT) + N`` programs, an upper bound of the number of chunks; extra programs exit at once).

Conv state pools (``[P, D, W-1]``, oldest first, any strides): chunk 0 of sequence ``n`` reads the window from pool
row ``slot = idx[n]`` and, after its chunk, writes the new state (the last ``W-1`` inputs of the concatenation
``old state | x``) back in place. Only that program touches the row, so reading and writing it cannot race. A slot out
of ``[0, P)`` (``-1`` = padding, or any out-of-range index when host-side checks were skipped) makes the sequence a
padding sequence: its outputs are zeros and no pool row is read or written.

Decode step (one token per sequence with a state pool, :func:`causal_conv1d_update_kernel`): one program per
(sequence, BD channels) loads the whole window (state columns and the token) as one [BD, 4] tile, so the pool row is
read in contiguous W-1 element pieces once, and writes the shifted window back; no chunk walk.

Backward (no state written; an optional *copy* of the initial states is read): each program walks its chunk
backwards, recomputing the pre-activation from ``x``, with a register window of the 3 later ``dpre`` values and of the
3 later inputs; the 3 rows after the chunk (halo) are recomputed first. ``dx`` is written directly; per-program partial
sums of ``dweight``/``dbias`` (``[G, 4, D]``, ``[G, D]``) are reduced on the host side with ``torch.sum``
(deterministic).
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from .. import config
from .common import cdiv, next_pow2
from .launch import launch

GROUP = 4  # rows per inner-loop step; chunk sizes are multiples of it
# decode-step kernel: channels and warps per program on the GPU (H200, N = 256, D = 8192, W = 4, 8 rotated pool sets:
# 23.0 us fp32 pool (best, 4 warps: 22.3), 18.8 us bf16 (best); BD 64-1024 x 1-8 warps swept, bench/NOTES.md)
UPDATE_BD, UPDATE_WARPS = 128, 2


def _device_fn(fn):
    """``triton.jit`` for device helpers; plain Python under Triton's interpreter, which re-patches the language
    module on every call of a jitted helper (milliseconds each). Decided at import, like ``triton.jit`` itself."""
    return fn if config.triton_interpret() else triton.jit(fn)


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------
@_device_fn
def _locate(cu_ptr, pid, N, BT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(sequence, chunk) of program ``pid`` in a varlen batch; sequence == N when ``pid`` has no chunk."""
    acc_n = pid * 0
    acc_c = pid * 0
    found = pid * 0
    base = pid * 0
    for start in range(0, N, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        m = offs < N
        s = tl.load(cu_ptr + offs, mask=m, other=0).to(tl.int32)
        e = tl.load(cu_ptr + offs + 1, mask=m, other=0).to(tl.int32)
        nch = tl.where(m & (e > s), (e - s + BT - 1) // BT, 0)
        inc = tl.cumsum(nch, 0) + base
        exc = inc - nch
        hit = (exc <= pid) & (pid < inc)
        acc_n += tl.sum(tl.where(hit, offs, 0), 0)
        acc_c += tl.sum(tl.where(hit, pid - exc, 0), 0)
        found += tl.sum(hit.to(tl.int32), 0)
        base += tl.sum(nch, 0)
    n = tl.where(found > 0, acc_n, N)
    return n, acc_c


@_device_fn
def _tap(w_ptr, offs_d, md, swd, sww, L: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, CD: tl.constexpr):
    """k_L = weight[:, W - 1 - L] (zeros when L >= W)."""
    if L < W:
        k = tl.load(w_ptr + offs_d * swd + (W - 1 - L) * sww, mask=md, other=0.0).to(CD)
    else:
        k = tl.zeros([BD], dtype=CD)
    return k


@_device_fn
def _lin(a0, a1, a2, a3, k0, k1, k2, k3, bias, W: tl.constexpr):
    """bias + sum_l k_l * a_l over the taps that exist (a_l = input l steps back)."""
    acc = bias + k0 * a0
    if W >= 2:
        acc += k1 * a1
    if W >= 3:
        acc += k2 * a2
    if W >= 4:
        acc += k3 * a3
    return acc


@_device_fn
def _act(p, ACT: tl.constexpr):
    if ACT:
        p = p / (1.0 + tl.exp(-p))
    return p


@_device_fn
def _dact(p, g, ACT: tl.constexpr):
    """d act(p) * g."""
    if ACT:
        s = 1.0 / (1.0 + tl.exp(-p))
        g = g * (s * (1.0 + p * (1.0 - s)))
    return g


@_device_fn
def _ld_row(base, t, lo, hi, st, offs_d, md, CD: tl.constexpr):
    """Row ``t`` (masked to lo <= t < hi, else 0) of a [T, D] slab at ``base`` with token stride ``st``."""
    m = tl.where((t >= lo) & (t < hi), md, False)
    return tl.load(base + t.to(tl.int64) * st + offs_d, mask=m, other=0.0).to(CD)


@_device_fn
def _ld_hist(x_b, t, s, e, sxt, st_row, ssd, ssw, offs_d, md, ACTIVE: tl.constexpr, HAS_STATE: tl.constexpr,
             W: tl.constexpr, BD: tl.constexpr, CD: tl.constexpr):
    """Input at position ``t`` of sequence [s, e): x when s <= t < e; the state column ``t - s + W - 1`` when
    s - (W - 1) <= t < s (with a state); else 0."""
    if ACTIVE:
        v = _ld_row(x_b, t, s, e, sxt, offs_d, md, CD)
        if HAS_STATE:
            col = t - s + (W - 1)
            ms = tl.where((t < s) & (col >= 0), md, False)
            v += tl.load(st_row + offs_d * ssd + col.to(tl.int64) * ssw, mask=ms, other=0.0).to(CD)
    else:
        v = tl.zeros([BD], dtype=CD)
    return v


@_device_fn
def _sequence(pid_p, cu_ptr, N, T, NCH, BT: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr):
    """(n, chunk, batch row, start, end) of the program; n >= N means nothing to do."""
    if VARLEN:
        n, c = _locate(cu_ptr, pid_p, N, BT, BLOCK_N)
        nn = tl.minimum(n, N - 1)
        s = tl.load(cu_ptr + nn).to(tl.int64)
        e = tl.load(cu_ptr + nn + 1).to(tl.int64)
        bi = nn * 0
    else:
        n = pid_p // NCH
        c = pid_p - n * NCH
        s = (n * 0).to(tl.int64)
        e = s + T
        bi = n
    return n, c, bi, s, e


# ----------------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, st_ptr, idx_ptr, cu_ptr,
    N, T, D, P, NCH,
    sxb, sxt, syb, syt, swd, sww, ssp, ssd, ssw,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_STATE: tl.constexpr, HAS_IDX: tl.constexpr,
    WRITE_STATE: tl.constexpr, VARLEN: tl.constexpr, CD: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_d = tl.program_id(1)
    n, c, bi, s, e = _sequence(pid_p, cu_ptr, N, T, NCH, BT, BLOCK_N, VARLEN)
    if n >= N:
        return
    c0 = s + c * BT
    c1 = tl.minimum(c0 + BT, e)
    offs_d = pid_d * BD + tl.arange(0, BD)
    md = offs_d < D
    x_b = x_ptr + bi.to(tl.int64) * sxb
    y_b = y_ptr + bi.to(tl.int64) * syb

    st_row = st_ptr
    if HAS_STATE:
        if HAS_IDX:
            slot = tl.load(idx_ptr + n).to(tl.int64)
        else:
            slot = n.to(tl.int64)
        if (slot < 0) | (slot >= P):  # padding sequence: zeros out, pool untouched
            zpad = tl.zeros([BD], dtype=y_ptr.dtype.element_ty)
            for i in range(0, c1 - c0):
                tl.store(y_b + (c0 + i) * syt + offs_d, zpad, mask=md)
            return
        st_row = st_ptr + slot * ssp

    k0 = _tap(w_ptr, offs_d, md, swd, sww, 0, W, BD, CD)
    k1 = _tap(w_ptr, offs_d, md, swd, sww, 1, W, BD, CD)
    k2 = _tap(w_ptr, offs_d, md, swd, sww, 2, W, BD, CD)
    k3 = _tap(w_ptr, offs_d, md, swd, sww, 3, W, BD, CD)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_d, mask=md, other=0.0).to(CD)
    else:
        bias = tl.zeros([BD], dtype=CD)

    # sliding window: p1 = x[t-1], p2 = x[t-2], p3 = x[t-3]
    p1 = _ld_hist(x_b, c0 - 1, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 2, HAS_STATE, W, BD, CD)
    p2 = _ld_hist(x_b, c0 - 2, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 3, HAS_STATE, W, BD, CD)
    p3 = _ld_hist(x_b, c0 - 3, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 4, HAS_STATE, W, BD, CD)

    for i in range(0, (c1 - c0 + 3) // 4):
        u = c0 + 4 * i  # int64 (c0 is)
        r0 = _ld_row(x_b, u, c0, c1, sxt, offs_d, md, CD)
        r1 = _ld_row(x_b, u + 1, c0, c1, sxt, offs_d, md, CD)
        r2 = _ld_row(x_b, u + 2, c0, c1, sxt, offs_d, md, CD)
        r3 = _ld_row(x_b, u + 3, c0, c1, sxt, offs_d, md, CD)
        o0 = _act(_lin(r0, p1, p2, p3, k0, k1, k2, k3, bias, W), ACT)
        o1 = _act(_lin(r1, r0, p1, p2, k0, k1, k2, k3, bias, W), ACT)
        o2 = _act(_lin(r2, r1, r0, p1, k0, k1, k2, k3, bias, W), ACT)
        o3 = _act(_lin(r3, r2, r1, r0, k0, k1, k2, k3, bias, W), ACT)
        yt = y_b + u * syt + offs_d
        tl.store(yt, o0.to(y_ptr.dtype.element_ty), mask=md)
        tl.store(yt + syt, o1.to(y_ptr.dtype.element_ty), mask=tl.where(u + 1 < c1, md, False))
        tl.store(yt + 2 * syt, o2.to(y_ptr.dtype.element_ty), mask=tl.where(u + 2 < c1, md, False))
        tl.store(yt + 3 * syt, o3.to(y_ptr.dtype.element_ty), mask=tl.where(u + 3 < c1, md, False))
        p1 = r3
        p2 = r2
        p3 = r1

    if WRITE_STATE:
        if c == 0:
            # new state column j = input at position e - (W - 1) + j (from the old state for short sequences);
            # every value is loaded before any store (in place), the barrier orders the CTA's loads and stores.
            v0 = _ld_hist(x_b, e - (W - 1), s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 2, HAS_STATE, W, BD, CD)
            v1 = _ld_hist(x_b, e - (W - 2), s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 3, HAS_STATE, W, BD, CD)
            v2 = _ld_hist(x_b, e - (W - 3), s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 4, HAS_STATE, W, BD, CD)
            tl.debug_barrier()
            sp = st_row + offs_d * ssd
            if W >= 2:
                tl.store(sp, v0.to(st_ptr.dtype.element_ty), mask=md)
            if W >= 3:
                tl.store(sp + ssw, v1.to(st_ptr.dtype.element_ty), mask=md)
            if W >= 4:
                tl.store(sp + 2 * ssw, v2.to(st_ptr.dtype.element_ty), mask=md)


@triton.jit
def causal_conv1d_update_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, st_ptr, idx_ptr,
    D, P, sxn, syn, swd, sww, ssp, ssd, ssw,
    W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_IDX: tl.constexpr, WRITE_STATE: tl.constexpr,
    CD: tl.constexpr,
):
    """Decode step (one token per sequence, state pool): program = (sequence n, BD channels). The window
    ``win [BD, WP]`` (columns 0..W-2: the pool row's state, oldest first; column W-1: the token) is one 2-D tile
    load, ``y = act(bias + sum_j win[:, j] weight[:, j])``, and the new state is the window shifted left by one
    column (loaded shifted up front; the barrier orders every load of the CTA before its in-place stores)."""
    n = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BD + tl.arange(0, BD)
    md = offs_d < D
    cols = tl.arange(0, WP)
    if HAS_IDX:
        slot = tl.load(idx_ptr + n).to(tl.int64)
    else:
        slot = n
    if (slot < 0) | (slot >= P):  # padding sequence: zeros out, pool untouched
        tl.store(y_ptr + n * syn + offs_d, tl.zeros([BD], dtype=y_ptr.dtype.element_ty), mask=md)
        return
    row = st_ptr + slot * ssp + offs_d[:, None] * ssd
    b_x = tl.load(x_ptr + n * sxn + offs_d, mask=md, other=0.0).to(CD)
    m_st = md[:, None] & (cols[None, :] < W - 1)
    win = tl.load(row + cols[None, :] * ssw, mask=m_st, other=0.0).to(CD)
    win = tl.where(cols[None, :] == W - 1, b_x[:, None], win)
    m_nx = md[:, None] & (cols[None, :] + 1 < W - 1)
    nxt = tl.load(row + (cols[None, :] + 1) * ssw, mask=m_nx, other=0.0).to(CD)
    nxt = tl.where(cols[None, :] == W - 2, b_x[:, None], nxt)
    wt = tl.load(w_ptr + offs_d[:, None] * swd + cols[None, :] * sww, mask=md[:, None] & (cols[None, :] < W),
                 other=0.0).to(CD)
    acc = tl.sum(win * wt, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=md, other=0.0).to(CD)
    tl.store(y_ptr + n * syn + offs_d, _act(acc, ACT).to(y_ptr.dtype.element_ty), mask=md)
    if WRITE_STATE:
        tl.debug_barrier()
        tl.store(row + cols[None, :] * ssw, nxt.to(st_ptr.dtype.element_ty), mask=m_st)


# ----------------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def causal_conv1d_bwd_kernel(
    x_ptr, w_ptr, b_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, st_ptr, idx_ptr, cu_ptr,
    N, T, D, P, NCH,
    sxb, sxt, sdyb, sdyt, sdxb, sdxt, swd, sww, ssp, ssd, ssw,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_STATE: tl.constexpr, HAS_IDX: tl.constexpr,
    VARLEN: tl.constexpr, CD: tl.constexpr,
):
    """dw_ptr: [G, W, D] partial sums of every program (the tap of lag l in row W - 1 - l: the weight's column
    order); db_ptr: [G, D]. Every program writes its rows, zeros where it has no tokens."""
    pid_p = tl.program_id(0)
    pid_d = tl.program_id(1)
    n, c, bi, s, e = _sequence(pid_p, cu_ptr, N, T, NCH, BT, BLOCK_N, VARLEN)
    offs_d = pid_d * BD + tl.arange(0, BD)
    md = offs_d < D
    dwp = dw_ptr + pid_p.to(tl.int64) * (W * D) + offs_d
    zero = tl.zeros([BD], dtype=CD)
    if n >= N:
        for l in tl.static_range(W):
            tl.store(dwp + l * D, zero, mask=md)
        if HAS_BIAS:
            tl.store(db_ptr + pid_p.to(tl.int64) * D + offs_d, zero, mask=md)
        return
    c0 = s + c * BT
    c1 = tl.minimum(c0 + BT, e)
    x_b = x_ptr + bi.to(tl.int64) * sxb
    dy_b = dy_ptr + bi.to(tl.int64) * sdyb
    dx_b = dx_ptr + bi.to(tl.int64) * sdxb

    st_row = st_ptr
    if HAS_STATE:
        if HAS_IDX:
            slot = tl.load(idx_ptr + n).to(tl.int64)
        else:
            slot = n.to(tl.int64)
        if (slot < 0) | (slot >= P):  # padding sequence: constant zero output, zero gradients
            zpad = tl.zeros([BD], dtype=dx_ptr.dtype.element_ty)
            for i in range(0, c1 - c0):
                tl.store(dx_b + (c0 + i) * sdxt + offs_d, zpad, mask=md)
            for l in tl.static_range(W):
                tl.store(dwp + l * D, zero, mask=md)
            if HAS_BIAS:
                tl.store(db_ptr + pid_p.to(tl.int64) * D + offs_d, zero, mask=md)
            return
        st_row = st_ptr + slot * ssp

    k0 = _tap(w_ptr, offs_d, md, swd, sww, 0, W, BD, CD)
    k1 = _tap(w_ptr, offs_d, md, swd, sww, 1, W, BD, CD)
    k2 = _tap(w_ptr, offs_d, md, swd, sww, 2, W, BD, CD)
    k3 = _tap(w_ptr, offs_d, md, swd, sww, 3, W, BD, CD)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_d, mask=md, other=0.0).to(CD)
    else:
        bias = tl.zeros([BD], dtype=CD)

    # halo: the group of rows [c1, c1 + 4) gives dpre of the 3 rows after the chunk (rows >= e have dy = 0)
    x1 = _ld_hist(x_b, c1 + 1, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 3, HAS_STATE, W, BD, CD)
    x2 = _ld_hist(x_b, c1 + 2, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 4, HAS_STATE, W, BD, CD)
    # x[c1-3], x[c1-2], x[c1-1] are rows of the chunk (carried into the loop), always loaded
    xa = _ld_hist(x_b, c1 - 3, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
    xb = _ld_hist(x_b, c1 - 2, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
    xc = _ld_hist(x_b, c1 - 1, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
    xd = _ld_hist(x_b, c1, s, e, sxt, st_row, ssd, ssw, offs_d, md, W >= 2, HAS_STATE, W, BD, CD)
    g0 = _ld_row(dy_b, c1, c1, e, sdyt, offs_d, md, CD)
    g1 = _ld_row(dy_b, c1 + 1, c1, e, sdyt, offs_d, md, CD)
    g2 = _ld_row(dy_b, c1 + 2, c1, e, sdyt, offs_d, md, CD)
    q4 = _dact(_lin(xd, xc, xb, xa, k0, k1, k2, k3, bias, W), g0, ACT)   # dpre[c1]
    q5 = _dact(_lin(x1, xd, xc, xb, k0, k1, k2, k3, bias, W), g1, ACT)   # dpre[c1 + 1]
    q6 = _dact(_lin(x2, x1, xd, xc, k0, k1, k2, k3, bias, W), g2, ACT)   # dpre[c1 + 2]
    # carried inputs x[u+1], x[u+2], x[u+3] for u = c1 - 4
    x1 = xa
    x2 = xb
    x3 = xc

    dk0 = tl.zeros([BD], dtype=CD)
    dk1 = tl.zeros([BD], dtype=CD)
    dk2 = tl.zeros([BD], dtype=CD)
    dk3 = tl.zeros([BD], dtype=CD)
    dbs = tl.zeros([BD], dtype=CD)
    ngroups = (c1 - c0 + 3) // 4
    for i in range(0, ngroups):
        u = c1 - 4 * (i + 1)
        xa = _ld_hist(x_b, u - 3, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
        xb = _ld_hist(x_b, u - 2, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
        xc = _ld_hist(x_b, u - 1, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
        xd = _ld_hist(x_b, u, s, e, sxt, st_row, ssd, ssw, offs_d, md, True, HAS_STATE, W, BD, CD)
        g0 = _ld_row(dy_b, u, c0, c1, sdyt, offs_d, md, CD)
        g1 = _ld_row(dy_b, u + 1, c0, c1, sdyt, offs_d, md, CD)
        g2 = _ld_row(dy_b, u + 2, c0, c1, sdyt, offs_d, md, CD)
        g3 = _ld_row(dy_b, u + 3, c0, c1, sdyt, offs_d, md, CD)
        d0 = _dact(_lin(xd, xc, xb, xa, k0, k1, k2, k3, bias, W), g0, ACT)
        d1 = _dact(_lin(x1, xd, xc, xb, k0, k1, k2, k3, bias, W), g1, ACT)
        d2 = _dact(_lin(x2, x1, xd, xc, k0, k1, k2, k3, bias, W), g2, ACT)
        d3 = _dact(_lin(x3, x2, x1, xd, k0, k1, k2, k3, bias, W), g3, ACT)
        e0 = _lin(d0, d1, d2, d3, k0, k1, k2, k3, zero, W)
        e1 = _lin(d1, d2, d3, q4, k0, k1, k2, k3, zero, W)
        e2 = _lin(d2, d3, q4, q5, k0, k1, k2, k3, zero, W)
        e3 = _lin(d3, q4, q5, q6, k0, k1, k2, k3, zero, W)
        dxt = dx_b + u * sdxt + offs_d
        tl.store(dxt, e0.to(dx_ptr.dtype.element_ty), mask=tl.where(u >= c0, md, False))
        tl.store(dxt + sdxt, e1.to(dx_ptr.dtype.element_ty), mask=tl.where(u + 1 >= c0, md, False))
        tl.store(dxt + 2 * sdxt, e2.to(dx_ptr.dtype.element_ty), mask=tl.where(u + 2 >= c0, md, False))
        tl.store(dxt + 3 * sdxt, e3.to(dx_ptr.dtype.element_ty), mask=tl.where(u + 3 >= c0, md, False))
        # rows below c0 have dy = 0 (masked load), so they add nothing here
        dk0 += d0 * xd + d1 * x1 + d2 * x2 + d3 * x3
        if W >= 2:
            dk1 += d0 * xc + d1 * xd + d2 * x1 + d3 * x2
        if W >= 3:
            dk2 += d0 * xb + d1 * xc + d2 * xd + d3 * x1
        if W >= 4:
            dk3 += d0 * xa + d1 * xb + d2 * xc + d3 * xd
        if HAS_BIAS:
            dbs += d0 + d1 + d2 + d3
        x1 = xa
        x2 = xb
        x3 = xc
        q4 = d0
        q5 = d1
        q6 = d2

    tl.store(dwp + (W - 1) * D, dk0, mask=md)
    if W >= 2:
        tl.store(dwp + (W - 2) * D, dk1, mask=md)
    if W >= 3:
        tl.store(dwp + (W - 3) * D, dk2, mask=md)
    if W >= 4:
        tl.store(dwp + (W - 4) * D, dk3, mask=md)
    if HAS_BIAS:
        tl.store(db_ptr + pid_p.to(tl.int64) * D + offs_d, dbs, mask=md)


# ----------------------------------------------------------------------------------------------------------------------
# launchers (tensors and plain scalars in, outputs allocated here)
# ----------------------------------------------------------------------------------------------------------------------
def _compute_dtype(x):
    import torch

    return tl.float64 if x.dtype == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device) -> int:
    import torch

    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _block_d(D: int, elem_size: int, device, vec_bytes: int = 16, warps: int = 2) -> tuple:
    """(BD, num_warps): ``vec_bytes`` per thread and row along D on the GPU (16 B vectors in the forward; 8 B in the
    backward, which keeps ~7 input rows, 7 dpre rows and 5 accumulators in registers)."""
    if device.type != "cuda":  # interpreter: small blocks exercise the masks and the multi-block paths
        return min(128, next_pow2(max(D, 1))), 1
    vec = max(1, vec_bytes // elem_size)
    bd = min(vec * 32 * warps, next_pow2(max(D, 1)))
    bd = max(bd, 16)
    num_warps = max(1, min(warps, bd // (vec * 32)))
    return bd, num_warps


def _block_t(T_hint: int, device, n_seq: int = 1, n_dblocks: int = 1, backward: bool = False) -> int:
    """Chunk length along time (a multiple of GROUP): 64 (256 in the backward), halved down to 16 while the grid
    would have fewer than 16 (backward: 8) programs per SM (small D or few tokens: more, shorter chunks keep HBM
    busy). The backward's pair from an H100 sweep (``bench/NOTES.md``): faster than 128 / 16 on every shape measured,
    e.g. 4 x 4096 x 8192 channels 370 -> 353 us, 1 x 8192 210 -> 191, 1 x 32768 679 -> 662."""
    if device.type != "cuda":
        bt = 16
    else:
        bt = 256 if backward else 64
        target = (8 if backward else 16) * _num_sms(device)
        while bt > 16 and n_seq * cdiv(max(T_hint, 1), bt) * n_dblocks < target:
            bt //= 2
    return max(GROUP, min(bt, -(-max(T_hint, 1) // GROUP) * GROUP))


def _grid_time(N: int, T: int, BT: int, varlen: bool, T_per_seq: int) -> tuple:
    """(number of time programs G, chunks per sequence NCH)."""
    if varlen:
        return cdiv(T, BT) + N, 0
    nch = cdiv(T_per_seq, BT)
    return N * nch, nch


def conv_fwd(x, weight, bias, activation: bool, cu_seqlens=None, conv_state=None, state_indices=None,
             write_state: bool = True, BT: int = None):
    """y = act(causal_conv(x)); x [B, T, D] (last dim contiguous), weight [D, W]; optional pool state (in place).

    Returns y [B, T, D] contiguous in x's dtype.
    """
    import torch

    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    if B * T * D == 0 or N == 0:
        return y
    if conv_state is not None and not varlen and T == 1 and 2 <= W <= 4:
        return _conv_update(x, weight, bias, activation, y, conv_state, state_indices, write_state)
    BD, num_warps = _block_d(D, x.element_size(), x.device)
    if BT is None:
        BT = _block_t(T, x.device, 1 if varlen else N, cdiv(D, BD))
    G, NCH = _grid_time(N, T, BT, varlen, T)
    has_state = conv_state is not None
    st = conv_state if has_state else x
    sst = conv_state.stride() if has_state else (0, 0, 0)
    P = conv_state.shape[0] if has_state else 0
    BLOCK_N = min(1024, next_pow2(max(N, 1)))
    grid = (G, cdiv(D, BD))
    launch(causal_conv1d_fwd_kernel, grid,
        x, weight, bias if bias is not None else x, y, st,
        state_indices if state_indices is not None else x, cu_seqlens if varlen else x,
        N, T, D, P, NCH,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), weight.stride(0), weight.stride(1),
        sst[0], sst[1], sst[2],
        W=W, BT=BT, BD=BD, BLOCK_N=BLOCK_N, HAS_BIAS=bias is not None, ACT=bool(activation),
        HAS_STATE=has_state, HAS_IDX=state_indices is not None, WRITE_STATE=has_state and write_state,
        VARLEN=varlen, CD=_compute_dtype(x), num_warps=num_warps,
    )
    return y


def _conv_update(x, weight, bias, activation: bool, y, conv_state, state_indices, write_state: bool):
    """One token per sequence with a state pool: :func:`causal_conv1d_update_kernel` (x [N, 1, D], y preallocated).
    UPDATE_BD channels and UPDATE_WARPS warps per program on the GPU (one [BD, 4] window tile)."""
    N, _, D = x.shape
    W = weight.shape[1]
    BD = min(UPDATE_BD, next_pow2(D))
    warps = UPDATE_WARPS if x.device.type == "cuda" else 1
    ss = conv_state.stride()
    launch(causal_conv1d_update_kernel, (N, cdiv(D, BD)),
        x, weight, bias if bias is not None else x, y, conv_state,
        state_indices if state_indices is not None else x,
        D, conv_state.shape[0], x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), ss[0], ss[1], ss[2],
        W=W, WP=4, BD=BD, HAS_BIAS=bias is not None, ACT=bool(activation), HAS_IDX=state_indices is not None,
        WRITE_STATE=write_state, CD=_compute_dtype(x), num_warps=warps,
    )
    return y


def conv_bwd(x, weight, bias, dy, activation: bool, cu_seqlens=None, init_state=None, state_indices=None,
             BT: int = None):
    """Gradients (dx, dweight, dbias) of ``conv_fwd`` (no state written; ``init_state`` rows are read when given).

    dy: [B, T, D] with contiguous last dim. dbias is None without a bias.
    """
    import torch

    B, T, D = x.shape
    W = weight.shape[1]
    dx = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    acc_dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if B * T * D == 0 or N == 0:
        dx.zero_()
        dw = torch.zeros((D, W), dtype=weight.dtype, device=x.device)
        db = torch.zeros((D,), dtype=bias.dtype, device=x.device) if bias is not None else None
        return dx, dw, db
    BD, num_warps = _block_d(D, x.element_size(), x.device, vec_bytes=8, warps=4)
    if BT is None:
        BT = _block_t(T, x.device, 1 if varlen else N, cdiv(D, BD), backward=True)
    G, NCH = _grid_time(N, T, BT, varlen, T)
    dw_part = torch.empty((G, W, D), dtype=acc_dt, device=x.device)     # every program writes its rows
    db_part = torch.empty((G, D), dtype=acc_dt, device=x.device) if bias is not None else dw_part
    has_state = init_state is not None
    st = init_state if has_state else x
    sst = init_state.stride() if has_state else (0, 0, 0)
    P = init_state.shape[0] if has_state else 0
    BLOCK_N = min(1024, next_pow2(max(N, 1)))
    grid = (G, cdiv(D, BD))
    launch(causal_conv1d_bwd_kernel, grid,
        x, weight, bias if bias is not None else x, dy, dx, dw_part, db_part, st,
        state_indices if state_indices is not None else x, cu_seqlens if varlen else x,
        N, T, D, P, NCH,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1),
        weight.stride(0), weight.stride(1), sst[0], sst[1], sst[2],
        W=W, BT=BT, BD=BD, BLOCK_N=BLOCK_N, HAS_BIAS=bias is not None, ACT=bool(activation),
        HAS_STATE=has_state, HAS_IDX=state_indices is not None, VARLEN=varlen, CD=_compute_dtype(x),
        num_warps=num_warps,
    )
    # [W, D] -> the weight's [D, W] (weight[:, W - 1 - l] <- lag l) and dtype in one copy
    dw = dw_part.sum(0).t().to(weight.dtype, memory_format=torch.contiguous_format)
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db
