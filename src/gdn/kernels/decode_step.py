"""Triton kernel: one cached decode step of the GDN block after its in-projections, in one launch.

For each sequence n (one token) and key head h, with r = HV / H value heads hv = h r + i per key head::

    q, k   = silu(conv(window_q/k)) of the key head's 2 K channels        (conv window from the conv pool row)
    v_hv   = silu(conv(window_v)) of the value head's V channels
    q, k   = q / |q| * scale, k / |k|                                      (L2 norm)
    g      = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)
    S      = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q  (state row of the ssm pool, in place)
    y_hv   = o * rsqrt(mean(o^2) + eps) * w * silu(z_hv)                   (gated RMS norm over V)

which the unfused step runs as the conv update, the recurrent decode and the gated norm (plus an unpacking of the
projections): here the projections are read where the in-projection GEMM left them (strided row views, so Qwen3-Next's
per-key-head ``q_h | k_h | v_h | z_h`` groups need no unpacking), q / k / v / o never leave the chip, and the conv
windows and recurrent states are read and written once. Bound by the recurrent state's bytes.

Program = (sequence, value head). It reads the conv rows of its key head's 2 K channels and of its V value channels,
and the value head's state row; it writes the shifted conv window of its value channels (the window loads come
before a CTA barrier, the stores after it), the q / k window only if it is the last of the key head's programs to
arrive (an atomic count per slot and key head), and its state row. The V columns of the state are walked in TILES
tiles of BV columns (one straight-line tile, its load issued first; or a software-pipelined loop), the head's V
outputs kept in a [TILES, BV] register tile until the norm. A pool row out of range (slot -1: padding) reads
nothing, writes zeros to y and touches no pool row.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tuning
from .common import cdiv, gdn_gate_value, next_pow2, sigmoid
from .recurrent import _delta_rule, _l2_normalize, _state_offsets, state_tile_BV
from .launch import launch


@triton.jit
def _conv_load(src, pool_row, conv_w, chan, m, valid, s_cd, s_cw, s_wd, s_ww, W: tl.constexpr):
    """One token's depthwise conv over the channels ``chan`` before bias and activation: ``x w[:, W-1] + sum_j
    window[:, j] w[:, j]`` (the pool row's W - 1 window columns, zeros unless ``valid``; x read at ``src``, same
    shape as ``chan``). Returns (accumulator, x) fp32."""
    b_x = tl.load(src, mask=m, other=0.0).to(tl.float32)
    acc = b_x * tl.load(conv_w + chan * s_wd + (W - 1) * s_ww, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s_j = tl.load(pool_row + chan * s_cd + j * s_cw, mask=tl.where(valid, m, False), other=0.0).to(tl.float32)
        acc += s_j * tl.load(conv_w + chan * s_wd + j * s_ww, mask=m, other=0.0).to(tl.float32)
    return acc, b_x


@triton.jit
def _conv_shift(pool_row, chan, b_x, m, ok, s_cd, s_cw, W: tl.constexpr):
    """Store the shifted window (columns 1 .. W - 2 of the old window, then x) into the pool row where ``ok``. Must
    follow a CTA barrier after every load of the old window (the columns are re-read here, then overwritten)."""
    m_ok = tl.where(ok, m, False)
    for j in tl.static_range(W - 2):
        s_n = tl.load(pool_row + chan * s_cd + (j + 1) * s_cw, mask=m_ok, other=0.0)
        tl.debug_barrier()
        tl.store(pool_row + chan * s_cd + j * s_cw, s_n, mask=m_ok)
    tl.store(pool_row + chan * s_cd + (W - 2) * s_cw, b_x.to(pool_row.dtype.element_ty), mask=m_ok)


@triton.jit
def _conv_out(acc, conv_b, chan, m, HAS_BIAS: tl.constexpr):
    """silu(acc + bias) fp32."""
    if HAS_BIAS:
        acc += tl.load(conv_b + chan, mask=m, other=0.0).to(tl.float32)
    return acc * sigmoid(acc)


@triton.jit
def _state_tile(p_s, o_k, m_k, v0, valid, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, K_LAST: tl.constexpr):
    """(offsets, mask, fp32 values) of the state tile of value columns v0 .. v0 + BV - 1 (zeros unless valid)."""
    o_v = v0 + tl.arange(0, BV)
    m_s = tl.where(valid, m_k[:, None] & (o_v < V)[None, :], False)
    offs = _state_offsets(o_k, o_v, K, V, K_LAST)
    return offs, m_s, tl.load(p_s + offs, mask=m_s, other=0.0).to(tl.float32)


@triton.jit
def layer_decode_step_kernel(
    x_q, x_k, x_v, x_z, x_b, x_a, s_xq, s_xk, s_xv, s_xz, s_xb, s_xa, s_hq, s_hk, s_hv, s_hz, s_hb, s_ha,
    conv_w, conv_b, conv_pool, s_cp, s_cd, s_cw, s_wd, s_ww,
    A_log, dt_bias, norm_w, slots, state, y, counters,
    scale, eps, P_conv, P_ssm,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, K_LAST: tl.constexpr,
):
    """Program (n, hv) of the grid N * HV. ``x_q`` .. ``x_a``: the projections of this step, element ``[n, h, i]``
    at ``x + n * s_x + h * s_h + i`` (q, k: i < K; v, z: i = r V + e with r = hv % (HV / H); b, a: i = r). Conv
    channels are the layer's packed order (q: h K + i, k: H K + h K + i, v: 2 H K + hv V + e) of the conv weight
    [D, W] and the conv pool [P_conv, D, W - 1]; the ssm pool is [P_ssm, HV, K, V] (or [.., V, K] with K_LAST); y
    is [N, HV, V]. The R = HV / H programs of a key head all read its q / k conv window; the last of them to arrive
    writes the shifted window back, so no program reads a window already shifted: ``counters[slot HV + h]`` (int64)
    counts arrivals with release / acquire atomics, and the program that finds it at R - 1 modulo R is the last
    (each step adds R, so the count needs no reset and a stale count cannot shift the phase)."""
    R: tl.constexpr = HV // H
    HK: tl.constexpr = H * K
    pid = tl.program_id(0)
    i_n = (pid // HV).to(tl.int64)
    i_hv = pid % HV
    i_h = i_hv // R
    i_r = i_hv % R
    slot = tl.load(slots + i_n).to(tl.int64)
    valid = (slot >= 0) & (slot < P_conv) & (slot < P_ssm)
    row_c = conv_pool + tl.where(valid, slot, 0) * s_cp
    p_s = state + (tl.where(valid, slot, 0) * HV + i_hv) * (K * V)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if TILES == 1:   # the state load is issued first; the conv and gates are computed while it is in flight
        offs, m_s, b_s = _state_tile(p_s, o_k, m_k, 0, valid, K, V, BV, K_LAST)
    # conv of q, k (the key head's 2 K channels) and v (this value head's V channels as a [TILES, BV] tile)
    o_t = tl.arange(0, TILES)
    e2 = o_t[:, None] * BV + tl.arange(0, BV)[None, :]
    m_e = e2 < V
    ch_q = i_h * K + o_k
    ch_v = 2 * HK + i_hv * V + e2
    acc_q, x_qv = _conv_load(x_q + i_n * s_xq + i_h * s_hq + o_k, row_c, conv_w, ch_q, m_k, valid,
                             s_cd, s_cw, s_wd, s_ww, W)
    acc_k, x_kv = _conv_load(x_k + i_n * s_xk + i_h * s_hk + o_k, row_c, conv_w, HK + ch_q, m_k, valid,
                             s_cd, s_cw, s_wd, s_ww, W)
    acc_v, x_vv = _conv_load(x_v + i_n * s_xv + i_h * s_hv + i_r * V + e2, row_c, conv_w, ch_v, m_e, valid,
                             s_cd, s_cw, s_wd, s_ww, W)
    b_g = gdn_gate_value(tl.load(x_a + i_n * s_xa + i_h * s_ha + i_r).to(tl.float32),
                         tl.load(A_log + i_hv).to(tl.float32), tl.load(dt_bias + i_hv).to(tl.float32))
    b_beta = sigmoid(tl.load(x_b + i_n * s_xb + i_h * s_hb + i_r).to(tl.float32))
    b_q = _conv_out(acc_q, conv_b, ch_q, m_k, HAS_BIAS)
    b_k = _conv_out(acc_k, conv_b, HK + ch_q, m_k, HAS_BIAS)
    v_all = _conv_out(acc_v, conv_b, ch_v, m_e, HAS_BIAS)
    b_q = _l2_normalize(b_q) * scale
    b_k = _l2_normalize(b_k)
    tl.debug_barrier()   # every window load of this program is done before any window store (and the count)
    _conv_shift(row_c, ch_v, x_vv, m_e, valid, s_cd, s_cw, W)
    last = valid
    if R > 1:
        arrived = tl.atomic_add(counters + tl.where(valid, slot, 0) * HV + i_h, 1, mask=valid, sem="acq_rel")
        last = valid & (arrived % R == R - 1)
    _conv_shift(row_c, ch_q, x_qv, m_k, last, s_cd, s_cw, W)
    _conv_shift(row_c, HK + ch_q, x_kv, m_k, last, s_cd, s_cw, W)
    # the recurrent update, tile by tile; the head's V outputs gathered in o_all for the norm
    if TILES == 1:
        b_s, b_o = _delta_rule(b_s, b_k, b_q, tl.sum(v_all, axis=0), b_g, b_beta)
        tl.store(p_s + offs, b_s.to(state.dtype.element_ty), mask=m_s)
        o_all = b_o[None, :]
    else:
        o_all = tl.zeros([TILES, BV], dtype=tl.float32)
        for j in tl.range(0, TILES, num_stages=STAGES):
            offs, m_s, b_s = _state_tile(p_s, o_k, m_k, j * BV, valid, K, V, BV, K_LAST)
            b_v = tl.sum(tl.where(o_t[:, None] == j, v_all, 0.0), axis=0)
            b_s, b_o = _delta_rule(b_s, b_k, b_q, b_v, b_g, b_beta)
            tl.store(p_s + offs, b_s.to(state.dtype.element_ty), mask=m_s)
            o_all = tl.where(o_t[:, None] == j, b_o[None, :], o_all)
    # gated RMS norm over the head's V outputs
    rstd = tl.rsqrt(tl.sum(tl.sum(o_all * o_all, axis=1), axis=0) / V + eps)
    b_z = tl.load(x_z + i_n * s_xz + i_h * s_hz + i_r * V + e2, mask=m_e, other=0.0).to(tl.float32)
    b_w = tl.load(norm_w + e2, mask=m_e, other=0.0).to(tl.float32)
    b_y = o_all * rstd * b_w * (b_z * sigmoid(b_z))
    tl.store(y + (i_n * HV + i_hv) * V + e2, tl.where(valid, b_y, 0.0).to(y.dtype.element_ty), mask=m_e)


def shape_class(state_bytes: int, k_last: bool) -> str:
    """The ``decode_step`` table's shape class: the state's storage (fp32 or half) and layout."""
    return ("fp32" if state_bytes >= 4 else "half") + ("_klast" if k_last else "_vlast")


def _config(K: int, V: int, state_bytes: int, k_last: bool, device) -> tuple:
    """(BV, TILES, num_warps, num_stages) from the ``decode_step`` tuning table; BV capped as in the decode kernel."""
    row = tuning.lookup("decode_step", device, shape_class(state_bytes, k_last))
    BV = state_tile_BV(row.BV, K, V)
    return BV, cdiv(next_pow2(V), BV), row.warps, row.stages


def layer_decode_step(q, k, v, z, b, a, conv_weight, conv_bias, conv_pool, A_log, dt_bias, norm_weight, slots,
                      ssm_pool, y, counters, *, scale: float, eps: float, k_last: bool):
    """Launch :func:`layer_decode_step_kernel`. ``q``, ``k`` ``[N, H, K]``, ``v``, ``z`` ``[N, H, r V]``, ``b``, ``a``
    ``[N, H, r]`` (views with contiguous last dims: element strides 1), ``conv_weight [D, W]``, ``conv_pool
    [P, D, W - 1]``, ``slots [N]`` int, ``ssm_pool [P', HV, K, V]`` (``[P', HV, V, K]`` with ``k_last``), contiguous
    rows, ``y [N, HV, V]`` preallocated (contiguous), ``counters``: int64, ``P' HV`` of them (the cache's
    ``step_counters``). Everything validated by the caller."""
    N, H, K = q.shape
    HV, V = ssm_pool.shape[1], (ssm_pool.shape[3] if not k_last else ssm_pool.shape[2])
    W = conv_weight.shape[1]
    if N == 0:
        return y
    BV, tiles, warps, stages = _config(K, V, ssm_pool.element_size(), k_last, q.device)
    xs = (q, k, v, z, b, a)
    launch(layer_decode_step_kernel, (N * HV,),
        *xs, *(t.stride(0) for t in xs), *(t.stride(1) for t in xs),
        conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_pool, conv_pool.stride(0),
        conv_pool.stride(1), conv_pool.stride(2), conv_weight.stride(0), conv_weight.stride(1),
        A_log, dt_bias, norm_weight, slots, ssm_pool, y, counters, float(scale), float(eps), conv_pool.shape[0],
        ssm_pool.shape[0],
        H=H, HV=HV, K=K, V=V, W=W, BK=next_pow2(K), BV=BV, TILES=tiles, STAGES=stages,
        HAS_BIAS=conv_bias is not None, K_LAST=bool(k_last), num_warps=warps, num_stages=stages)
    return y


__all__ = ["layer_decode_step", "layer_decode_step_kernel", "shape_class"]
