"""Token-by-token gated delta rule: decode (T = 1) and short multi-token steps (speculative verification).

One program owns the state tile ``S[:, v0:v0+BV]`` (all K rows, BV value columns) of one (sequence, value head) pair,
keeps it in registers in fp32 and walks the sequence's tokens::

    S = exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S = S + k_t u^T;   o_t = scale S^T q_t

Two kernels share the step (:func:`_delta_rule`) and the modes below: :func:`decode_kernel` for one token per
sequence (grid: one program per (sequence, value head, group of tiles); the tiles of a program are a
software-pipelined loop) and :func:`recurrent_gdn_fwd_kernel` for several tokens (grid ``(N * HV, V / BV)``). The
state is read once and written once per launch (per token in per-token mode), so both are bound by state bytes / copy
bandwidth. Pool rows, sequence offsets and token offsets are 64-bit.

Constexpr switches:
- ``GATE_RAW``: g from (A_log, a, dt_bias) in the kernel, else g read (log-space).
- ``BETA_MODE``: 0 beta = 1, 1 beta read, 2 beta = sigmoid(b) from raw b.
- ``READ_MODE``: 0 zero start, 1 row n of ``state_in``, 2 pool row ``idx[n]`` (1-D) or ``idx[n, col]`` (2-D; col =
  ``num_accepted[n] - 1`` with ``SPEC``, else 0).
- ``WRITE_MODE``: 0 none, 1 row n of ``state_out`` (a new [N, ...] tensor), 2 the row that was read (in place),
  3 per token: the state after token t goes to pool row ``idx[n, t]`` (2-D indices).
- ``OUT_IDX`` (write modes 2 / 3): a separate write index ``out_idx`` of the read index's shape (serving state: read
  slot != write slot): the state goes to pool row ``out_idx[n]`` (mode 2) / ``out_idx[n, t]`` (mode 3) instead of
  the read row / ``idx[n, t]``; -1 or out of range = not written (a padding sequence writes nothing either).
- ``K_LAST``: state rows stored ``[V, K]`` instead of ``[K, V]``.
- ``CACHE`` (multi-token kernel only): the state after token t of sequence n also goes to the per-token buffer
  ``cache`` at ``cache_idx[n] * s_cache + t * HV*K*V`` (state layout as above; slot < 0 = not cached).
- ``TREE`` (needs ``CACHE``; tree verification as SGLang's EAGLE target-verify): token t > 0 of a sequence with a
  cache slot starts from the state after its parent token ``parent[n, t]`` (read back from ``cache``; a negative
  parent = the sequence's start state) instead of the state after token t - 1; the final state is the one after the
  last token.
A negative or out-of-range pool row marks a padding sequence: its outputs are zeros and no state row is touched.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import tuning
from .common import cdiv, gdn_gate_value, next_pow2, sigmoid
from .launch import launch


@triton.jit
def _delta_rule(b_s, b_k, b_q, b_v, b_g, b_beta):
    """One token on an fp32 state tile ``S`` [BK, BV]: ``S = exp(g) S; u = beta (v - S^T k); S = S + k u^T``.
    Returns (S, S^T q) (q already scaled)."""
    b_s = b_s * tl.exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))
    b_s = b_s + b_k[:, None] * b_u[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], axis=0)


@triton.jit
def _l2_normalize(x):
    """``x * rsqrt(sum(x^2) + 1e-6)`` of a [BK] fp32 vector (``use_qk_l2norm_in_kernel``)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _step_inputs(p_q, p_k, gate, g, beta, a, b, b_A, b_dtb, scale, m_k, GATE_RAW: tl.constexpr,
                 BETA_MODE: tl.constexpr, L2NORM: tl.constexpr, gate_ab=None):
    """One token's (q * scale, k) [BK] fp32 (L2-normalised with L2NORM) from the pointer vectors p_q / p_k, and its
    g, beta at element ``gate`` of the [.., HV] gate tensors (g from a and the head's A_log / dt_bias with GATE_RAW);
    the raw gates a / b at element ``gate_ab`` instead when given (strided a / b rows)."""
    if gate_ab is None:
        gate_ab = gate
    b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
    if L2NORM:
        b_q = _l2_normalize(b_q)
        b_k = _l2_normalize(b_k)
    if GATE_RAW:
        b_g = gdn_gate_value(tl.load(a + gate_ab).to(tl.float32), b_A, b_dtb)
    else:
        b_g = tl.load(g + gate).to(tl.float32)
    if BETA_MODE == 0:
        b_beta = 1.0
    elif BETA_MODE == 1:
        b_beta = tl.load(beta + gate).to(tl.float32)
    else:
        b_beta = sigmoid(tl.load(b + gate_ab).to(tl.float32))
    return b_q * scale, b_k, b_g, b_beta


@triton.jit
def _state_offsets(o_k, o_v, K: tl.constexpr, V: tl.constexpr, K_LAST: tl.constexpr):
    """Offsets [BK, BV] of a state tile (rows k, columns v) within one head's [K, V] (v_last) / [V, K] (k_last)."""
    if K_LAST:
        o_s = o_v[None, :] * K + o_k[:, None]
    else:
        o_s = o_k[:, None] * V + o_v[None, :]
    return o_s


@triton.jit
def _token_step(b_s, q, k, v, g, beta, a, b, o, t, p_q, p_k, p_v, p_o, p_gate, s_qt, s_kt, s_vt, b_A, b_dtb, scale,
                m_k, m_v, HV: tl.constexpr, V: tl.constexpr, GATE_RAW: tl.constexpr, BETA_MODE: tl.constexpr,
                L2NORM: tl.constexpr):
    """One token: decay, delta-rule write, read-out (stored). Returns the new fp32 state tile [BK, BV]."""
    b_v = tl.load(p_v + t * s_vt, mask=m_v, other=0.0).to(tl.float32)
    b_q, b_k, b_g, b_beta = _step_inputs(p_q + t * s_qt, p_k + t * s_kt, p_gate + t * HV, g, beta, a, b, b_A, b_dtb,
                                         scale, m_k, GATE_RAW, BETA_MODE, L2NORM)
    b_s, b_o = _delta_rule(b_s, b_k, b_q, b_v, b_g, b_beta)
    tl.store(p_o + t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def _start_row(idx, num_accepted, i_n, s_idx, n_cols, P_in, READ_MODE: tl.constexpr, IDX_2D: tl.constexpr,
               SPEC: tl.constexpr):
    """(row, valid) of the state that starts sequence ``i_n`` (int64): row n (READ_MODE 0 / 1), or pool row idx[n]
    (1-D) / idx[n, col] (2-D, col = num_accepted[n] - 1 with SPEC, else 0); out of range [0, P_in) = padding."""
    if READ_MODE == 2:
        if IDX_2D:
            col = 0
            if SPEC:
                col = tl.load(num_accepted + i_n).to(tl.int64) - 1
                col = tl.minimum(tl.maximum(col, 0), n_cols - 1)
            row = tl.load(idx + i_n * s_idx + col).to(tl.int64)
        else:
            row = tl.load(idx + i_n).to(tl.int64)
        valid = (row >= 0) & (row < P_in)
    else:
        row = i_n
        valid = row >= 0
    return row, valid


@triton.jit
def _write_row(idx, out_idx, i_n, t, s_idx, s_oidx, n_cols, row_in, valid, P_out, WRITE_MODE: tl.constexpr,
               OUT_IDX: tl.constexpr):
    """(row, ok) of the pool row that takes the state after token ``t`` (mode 3) or the final state (mode 2):
    ``out_idx[n, t]`` / ``out_idx[n]`` with OUT_IDX, else ``idx[n, t]`` / the row that was read; rows out of
    [0, P_out) and padding sequences (not ``valid``) are not written."""
    if WRITE_MODE == 3:
        tc = tl.minimum(t, n_cols - 1)
        if OUT_IDX:
            row = tl.load(out_idx + i_n * s_oidx + tc).to(tl.int64)
        else:
            row = tl.load(idx + i_n * s_idx + tc).to(tl.int64)
        ok = valid & (t < n_cols) & (row >= 0) & (row < P_out)
    elif OUT_IDX:
        row = tl.load(out_idx + i_n).to(tl.int64)
        ok = valid & (row >= 0) & (row < P_out)
    else:
        row = row_in
        ok = valid
    return row, ok


@triton.jit
def recurrent_gdn_fwd_kernel(
    q, k, v, g, beta, A_log, a, dt_bias, b,
    o, state_in, state_out, idx, num_accepted, cu_seqlens,
    scale, T, P_in, P_out, n_cols,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_idx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, GATE_RAW: tl.constexpr, BETA_MODE: tl.constexpr,
    L2NORM: tl.constexpr, READ_MODE: tl.constexpr, IDX_2D: tl.constexpr, SPEC: tl.constexpr,
    WRITE_MODE: tl.constexpr, K_LAST: tl.constexpr, STAGES: tl.constexpr,
    cache=None, cache_idx=None, parent=None, s_cache=0, s_par_n=0, s_par_t=0,
    CACHE: tl.constexpr = False, TREE: tl.constexpr = False, out_idx=None, s_oidx=0, OUT_IDX: tl.constexpr = False,
):
    """Several tokens per sequence (varlen, speculative verification); single-token decode is :func:`decode_kernel`.
    Program = (sequence, value head) x BV value columns."""
    i_nh = tl.program_id(0)  # N * HV can pass 65535: keep it on the first grid axis
    i_vb = tl.program_id(1)  # this program's tile of BV value columns
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)

    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        seq_len = eos - bos
        tok0 = bos                              # flat token index of the first token (gates, output)
        row_b = tl.zeros([], dtype=tl.int64)    # q/k/v batch row (B == 1)
    else:
        seq_len = T
        tok0 = i_n.to(tl.int64) * T
        bos = tl.zeros([], dtype=tl.int64)
        row_b = i_n.to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    head_off = i_hv.to(tl.int64) * (K * V)

    row_in, valid = _start_row(idx, num_accepted, i_n.to(tl.int64), s_idx, n_cols, P_in, READ_MODE, IDX_2D, SPEC)

    p_q = q + row_b * s_qb + bos * s_qt + i_h * s_qh + o_k
    p_k = k + row_b * s_kb + bos * s_kt + i_h * s_kh + o_k
    p_gate = tok0 * HV + i_hv
    b_A = 0.0
    b_dtb = 0.0
    if GATE_RAW:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
        b_dtb = tl.load(dt_bias + i_hv).to(tl.float32)

    o_v = i_vb * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_o = o + (tok0 * HV + i_hv) * V + o_v
    if valid:
        m_s = m_k[:, None] & m_v[None, :]
        o_s = _state_offsets(o_k, o_v, K, V, K_LAST)
        p_v = v + row_b * s_vb + bos * s_vt + i_hv * s_vh + o_v
        if READ_MODE == 0:
            b_s = tl.zeros([BK, BV], dtype=tl.float32)
        else:
            b_s = tl.load(state_in + row_in * (HV * K * V) + head_off + o_s, mask=m_s, other=0.0).to(tl.float32)
        slot = tl.zeros([], dtype=tl.int64) - 1
        if CACHE:
            slot = tl.load(cache_idx + i_n).to(tl.int64)
        b_s0 = b_s  # the start state (a tree token whose parent is negative starts from it)
        for t in tl.range(0, seq_len, num_stages=STAGES):  # STAGES > 1: the next tokens' q/k/v load ahead
            if TREE:
                if (t > 0) & (slot >= 0):  # start from the state after the parent token, read back from the cache
                    par = tl.load(parent + i_n.to(tl.int64) * s_par_n + t * s_par_t).to(tl.int64)
                    tl.debug_barrier()  # this program's earlier cache stores are visible to all its threads
                    b_p = tl.load(cache + slot * s_cache + tl.maximum(par, 0) * (HV * K * V) + head_off + o_s,
                                  mask=tl.where(par >= 0, m_s, False), other=0.0).to(tl.float32)
                    b_s = tl.where(par >= 0, b_p, b_s0)
            b_s = _token_step(b_s, q, k, v, g, beta, a, b, o, t, p_q, p_k, p_v, p_o, p_gate, s_qt, s_kt,
                              s_vt, b_A, b_dtb, scale, m_k, m_v, HV, V, GATE_RAW, BETA_MODE, L2NORM)
            if CACHE:  # the state after token t goes to the per-token buffer
                tl.store(cache + tl.maximum(slot, 0) * s_cache + t * (HV * K * V) + head_off + o_s,
                         b_s.to(cache.dtype.element_ty), mask=tl.where(slot >= 0, m_s, False))
            if WRITE_MODE == 3:  # the state after token t goes to pool row idx[n, t] (out_idx[n, t])
                row_t, ok_t = _write_row(idx, out_idx, i_n.to(tl.int64), t, s_idx, s_oidx, n_cols, row_in, valid,
                                         P_out, WRITE_MODE, OUT_IDX)
                tl.store(state_out + row_t * (HV * K * V) + head_off + o_s, b_s.to(state_out.dtype.element_ty),
                         mask=tl.where(ok_t, m_s, False))
        if WRITE_MODE == 1:
            tl.store(state_out + i_n.to(tl.int64) * (HV * K * V) + head_off + o_s,
                     b_s.to(state_out.dtype.element_ty), mask=m_s)
        elif WRITE_MODE == 2:
            row_w, ok_w = _write_row(idx, out_idx, i_n.to(tl.int64), 0, s_idx, s_oidx, n_cols, row_in, valid, P_out,
                                     WRITE_MODE, OUT_IDX)
            tl.store(state_out + row_w * (HV * K * V) + head_off + o_s, b_s.to(state_out.dtype.element_ty),
                     mask=tl.where(ok_w, m_s, False))
    else:
        # padding sequence: zeros out, no state row read or written
        for t in range(0, seq_len):
            tl.store(p_o + t * (HV * V), tl.zeros([BV], dtype=tl.float32).to(o.dtype.element_ty), mask=m_v)


@triton.jit
def _decode_load(p_in, v, i_n, i_hv, v0, valid, s_vb, s_vh, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, READ_MODE: tl.constexpr, K_LAST: tl.constexpr):
    """State tile [BK, BV] fp32 of columns v0 .. v0 + BV - 1 (zeros unless ``valid``), and v of those columns."""
    o_k = tl.arange(0, BK)
    o_v = v0 + tl.arange(0, BV)
    m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
    if READ_MODE == 0:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    else:
        b_s = tl.load(p_in + _state_offsets(o_k, o_v, K, V, K_LAST), mask=tl.where(valid, m_s, False),
                      other=0.0).to(tl.float32)
    b_v = tl.load(v + i_n * s_vb + i_hv * s_vh + o_v, mask=o_v < V, other=0.0).to(tl.float32)
    return b_s, b_v


@triton.jit
def _decode_finish(b_s, b_v, p_out, o, b_q, b_k, b_g, b_beta, i_n, i_hv, v0, valid, ok_out,
                   HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   WRITE_MODE: tl.constexpr, K_LAST: tl.constexpr, STORE_CACHE: tl.constexpr):
    """One delta-rule step on a loaded tile; store o (zeros unless valid) and the state (where ``ok_out``)."""
    o_k = tl.arange(0, BK)
    o_v = v0 + tl.arange(0, BV)
    m_v = o_v < V
    b_s, b_o = _delta_rule(b_s, b_k, b_q, b_v, b_g, b_beta)
    tl.store(o + (i_n * HV + i_hv) * V + o_v, tl.where(valid, b_o, 0.0).to(o.dtype.element_ty), mask=m_v)
    if WRITE_MODE != 0:
        tl.store(p_out + _state_offsets(o_k, o_v, K, V, K_LAST), b_s.to(p_out.dtype.element_ty),
                 mask=tl.where(ok_out, (o_k < K)[:, None] & m_v[None, :], False), cache_modifier=STORE_CACHE)


@triton.jit
def decode_kernel(
    q, k, v, g, beta, A_log, a, dt_bias, b,
    o, state_in, state_out, idx, num_accepted,
    scale, P_in, P_out, n_cols,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_idx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE_RAW: tl.constexpr, BETA_MODE: tl.constexpr, L2NORM: tl.constexpr, READ_MODE: tl.constexpr,
    IDX_2D: tl.constexpr, SPEC: tl.constexpr, WRITE_MODE: tl.constexpr, K_LAST: tl.constexpr,
    TILES: tl.constexpr, STAGES: tl.constexpr, STORE_CACHE: tl.constexpr,
    out_idx=None, s_oidx=0, OUT_IDX: tl.constexpr = False, s_ab=0,
):
    """Single-token decode (T = 1, N = B sequences). The raw gates a / b are read at ``n * s_ab + hv`` (``s_ab``:
    their sequence stride; both share it). Program = (sequence, value head, TILES consecutive tiles of BV
    value columns; the host makes TILES divide the head's tiles). TILES == 1: straight-line code, the state load
    issued before the per-head inputs (q, k, their norms, gates) are computed. TILES > 1: the per-head inputs once,
    then a loop over the tiles software-pipelined ``STAGES`` deep (the next tiles' state loads go to shared memory
    while this one is computed and stored). Branch-free: a padding sequence (pool row out of range) reads nothing
    (masked), writes zeros to o and no state. Modes as in :func:`recurrent_gdn_fwd_kernel`."""
    GROUPS: tl.constexpr = (V + BV * TILES - 1) // (BV * TILES)
    pid = tl.program_id(0)
    i_nh = pid // GROUPS
    v0 = (pid % GROUPS) * (BV * TILES)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    row_in, valid = _start_row(idx, num_accepted, i_n, s_idx, n_cols, P_in, READ_MODE, IDX_2D, SPEC)
    if WRITE_MODE == 1:
        row_out = i_n
        ok_out = valid
    else:  # mode 3: pool row idx[n, 0] (out_idx[n, 0]); mode 2: the row read (out_idx[n])
        row_out, ok_out = _write_row(idx, out_idx, i_n, 0, s_idx, s_oidx, n_cols, row_in, valid, P_out, WRITE_MODE,
                                     OUT_IDX)
    head = i_hv.to(tl.int64) * (K * V)
    p_in = state_in + row_in * (HV * K * V) + head
    p_out = state_out + row_out * (HV * K * V) + head
    o_k = tl.arange(0, BK)
    p_q = q + i_n * s_qb + i_h * s_qh + o_k
    p_k = k + i_n * s_kb + i_h * s_kh + o_k
    b_A = 0.0
    b_dtb = 0.0
    if GATE_RAW:
        b_A = tl.load(A_log + i_hv).to(tl.float32)
        b_dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    if TILES == 1:  # the state load is issued first, the per-head inputs are computed while it is in flight
        b_s, b_v = _decode_load(p_in, v, i_n, i_hv, v0, valid, s_vb, s_vh, K, V, BK, BV, READ_MODE, K_LAST)
        b_q, b_k, b_g, b_beta = _step_inputs(p_q, p_k, i_n * HV + i_hv, g, beta, a, b, b_A, b_dtb, scale, o_k < K,
                                             GATE_RAW, BETA_MODE, L2NORM, i_n * s_ab + i_hv)
        _decode_finish(b_s, b_v, p_out, o, b_q, b_k, b_g, b_beta, i_n, i_hv, v0, valid, ok_out, HV, K, V, BK, BV,
                       WRITE_MODE, K_LAST, STORE_CACHE)
    else:
        b_q, b_k, b_g, b_beta = _step_inputs(p_q, p_k, i_n * HV + i_hv, g, beta, a, b, b_A, b_dtb, scale, o_k < K,
                                             GATE_RAW, BETA_MODE, L2NORM, i_n * s_ab + i_hv)
        for j in tl.range(0, TILES, num_stages=STAGES):
            b_s, b_v = _decode_load(p_in, v, i_n, i_hv, v0 + j * BV, valid, s_vb, s_vh, K, V, BK, BV, READ_MODE,
                                    K_LAST)
            _decode_finish(b_s, b_v, p_out, o, b_q, b_k, b_g, b_beta, i_n, i_hv, v0 + j * BV, valid, ok_out, HV, K, V,
                           BK, BV, WRITE_MODE, K_LAST, STORE_CACHE)


def state_tile_BV(BV: int, K: int, V: int) -> int:
    """A table's V tile ``BV`` capped by V and by the register budget of an fp32 [K, BV] state tile (128 x 128)."""
    BV = min(BV, next_pow2(V))
    while BV > 8 and BV * next_pow2(K) > 128 * 128:
        BV //= 2
    return BV


def _recurrent_config(N: int, HV: int, K: int, V: int, device=None) -> tuple:
    """(BV, num_warps, num_stages of the token loop) of the multi-token kernel: the ``recurrent`` tuning table
    (:mod:`gdn.kernels.tuning`; shape class by N * HV), BV capped by V and the register budget."""
    row = tuning.lookup("recurrent", device, "few_heads" if N * HV < 2048 else "many_heads")
    return state_tile_BV(row.BV, K, V), row.warps, row.stages


def _decode_config(N: int, HV: int, K: int, V: int, state_bytes: int, device=None, k_last: bool = True) -> tuple:
    """(BV, num_warps, num_stages, tiles per program, maxnreg, store cache modifier) of :func:`decode_kernel`: the
    ``decode`` tuning table (:mod:`gdn.kernels.tuning`; shape class by N * HV, the state's bytes per element and its
    layout: ``v_last`` classes end in ``_vlast``), BV capped by V and the register budget, tiles a divisor of the V
    tiles."""
    nhv = N * HV
    if nhv < 2048:
        shape_class = "few_heads"
    elif state_bytes >= 4:
        shape_class = "fp32_state"
    elif nhv < 8192:
        shape_class = "half_state"
    else:
        shape_class = "half_state_many"
    row = tuning.lookup("decode", device, shape_class if k_last else shape_class + "_vlast")
    BV, warps, stages, tiles = state_tile_BV(row.BV, K, V), row.warps, row.stages, row.tiles
    nvb = cdiv(V, BV)
    tiles = max(1, min(tiles, nvb))
    while nvb % tiles:
        tiles -= 1
    return BV, warps, stages, tiles, row.maxnreg, row.store_cache


def _common_args(o, g, beta, A_log, a, dt_bias, b, state_in, state_out, idx, num_accepted):
    """The arguments both kernels share: the optional pointers in order (absent tensors replaced by ``o``, never read:
    their constexpr modes are off), (P_in, P_out, n_cols, s_idx) of the pools and slot indices, and the mode
    constexprs that follow from which tensors are given."""
    ptrs = tuple(o if x is None else x for x in (g, beta, A_log, a, dt_bias, b))
    ptrs += (o,) + tuple(o if x is None else x for x in (state_in, state_out, idx, num_accepted))
    idx_2d = idx is not None and idx.dim() == 2
    pool = (state_in.shape[0] if state_in is not None else 0, state_out.shape[0] if state_out is not None else 0,
            idx.shape[1] if idx_2d else 1, idx.stride(0) if idx_2d else 1)
    modes = dict(GATE_RAW=g is None, BETA_MODE=1 if beta is not None else (2 if b is not None else 0),
                 IDX_2D=idx_2d, SPEC=num_accepted is not None)
    return ptrs, pool, modes


def _out_idx_args(out_idx) -> dict:
    """Kernel keywords of the separate write index (serving state), none without one."""
    if out_idx is None:
        return {}
    return dict(out_idx=out_idx, s_oidx=out_idx.stride(0) if out_idx.dim() == 2 else 1, OUT_IDX=True)


def _raw_gate_stride(a, b, HV: int) -> int:
    """Sequence stride of the raw gates a / b (they share their strides; HV when neither is given)."""
    x = a if a is not None else b
    return HV if x is None else x.stride(0)


def _decode(q, k, v, o, g, beta, A_log, a, dt_bias, b, scale, state_in, state_out, idx, num_accepted, read_mode,
            write_mode, l2norm, k_last, N, out_idx=None):
    st = state_in if state_in is not None else state_out
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    BV, warps, stages, tiles, maxnreg, store_cache = _decode_config(N, HV, K, V,
                                                                    st.element_size() if st is not None else 4,
                                                                    q.device, k_last)
    kw = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    ptrs, (P_in, P_out, n_cols, s_idx), modes = _common_args(o, g, beta, A_log, a, dt_bias, b, state_in, state_out,
                                                             idx, num_accepted)
    launch(decode_kernel, (N * HV * (cdiv(V, BV) // tiles),),
        q, k, v, *ptrs, float(scale), P_in, P_out, n_cols,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), s_idx,
        H=H, HV=HV, K=K, V=V, BK=next_pow2(K), BV=BV, L2NORM=bool(l2norm), READ_MODE=read_mode, WRITE_MODE=write_mode,
        K_LAST=bool(k_last), TILES=tiles, STAGES=stages, STORE_CACHE=store_cache, **modes, **_out_idx_args(out_idx),
        s_ab=_raw_gate_stride(a, b, HV), **kw)
    return o


def recurrent_gdn_fwd(q, k, v, o, *, g=None, beta=None, A_log=None, a=None, dt_bias=None, b=None, scale: float,
                      state_in=None, state_out=None, idx=None, num_accepted=None, cu_seqlens=None,
                      read_mode: int, write_mode: int, l2norm: bool, k_last: bool, seqlen: int, num_seqs: int,
                      cache=None, cache_idx=None, parent=None, out_idx=None):
    """Launch :func:`decode_kernel` (one token per sequence, no cu_seqlens) or the multi-token kernel. All tensors
    validated by the caller; ``o`` preallocated [B, T, HV, V]. ``cache`` (per-token states, slot ``cache_idx[n]``,
    slot pitch ``cache.stride(0)``, token pitch HV*K*V) and ``parent`` ([N, T_max] parent token per token, tree
    verification) switch on the kernel's CACHE / TREE modes; ``out_idx`` (the read index's shape, contiguous last
    dim) the separate write rows of write modes 2 / 3."""
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N = num_seqs
    if N == 0 or o.numel() == 0 and write_mode == 0 and cache is None:
        return o
    tree = {}
    if cache is not None:
        tree = dict(cache=cache, cache_idx=cache_idx, parent=cache if parent is None else parent,
                    s_cache=cache.stride(0), s_par_n=0 if parent is None else parent.stride(0),
                    s_par_t=0 if parent is None else parent.stride(1), CACHE=True, TREE=parent is not None)
    elif cu_seqlens is None and seqlen == 1:
        return _decode(q, k, v, o, g, beta, A_log, a, dt_bias, b, scale, state_in, state_out, idx, num_accepted,
                       read_mode, write_mode, l2norm, k_last, N, out_idx)
    a = a if a is None else a.contiguous()   # the multi-token kernel reads gates at (token, head) of [B, T, HV]
    b = b if b is None else b.contiguous()
    BV, warps, stages = _recurrent_config(N, HV, K, V, q.device)
    if parent is not None:  # no software pipelining: a parent's state is read back after this program stored it
        stages = 1
    ptrs, (P_in, P_out, n_cols, s_idx), modes = _common_args(o, g, beta, A_log, a, dt_bias, b, state_in, state_out,
                                                             idx, num_accepted)
    launch(recurrent_gdn_fwd_kernel, (N * HV, cdiv(V, BV)),
        q, k, v, *ptrs, o if cu_seqlens is None else cu_seqlens, float(scale), seqlen, P_in, P_out, n_cols,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), s_idx,
        H=H, HV=HV, K=K, V=V, BK=next_pow2(K), BV=BV, VARLEN=cu_seqlens is not None, L2NORM=bool(l2norm),
        READ_MODE=read_mode, WRITE_MODE=write_mode, K_LAST=bool(k_last), STAGES=stages, **modes, **tree,
        **_out_idx_args(out_idx),
        num_warps=warps, num_stages=stages,
    )
    return o
