"""Triton kernel: unpack Qwen3-Next's per-key-head in-projections into the layer's packed order (inference).

``in_proj_qkvz`` gives, per token, H groups ``q_h | k_h | v_h | z_h`` (K, K, r V, r V columns, r = HV / H) and
``in_proj_ba`` H groups ``b_h | a_h`` (r, r). The layer wants ``mixed = Q | K | V`` (head-major; the conv's channel
order), ``z [HV, V]``, ``b [HV]``, ``a [HV]``. One launch writes all four (contiguous) from the two projections,
instead of four copies and a concatenation (or a gather kernel) per decode step. Pure data movement: exact.

Grid: (tokens, column blocks of the ``conv_dim + HV V + 2 HV`` output columns); each output column finds its source
column by integer arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from .common import cdiv
from .launch import launch


@triton.jit
def unpack_qkvz_ba_kernel(qkvz, ba, mixed, z, b, a, s_qkvz, s_ba,
                          H: tl.constexpr, R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    HK: tl.constexpr = H * K
    VD: tl.constexpr = H * R * V           # value_dim = HV V
    G: tl.constexpr = 2 * K + 2 * R * V    # columns of one key head's group in qkvz
    CONV: tl.constexpr = 2 * HK + VD
    TOTAL: tl.constexpr = CONV + VD + 2 * H * R
    # q | k: column j of head j // K
    is_qk = j < 2 * HK
    jq = j % HK
    src = (jq // K) * G + (j // HK) * K + jq % K
    # v | z: value head hv = h r + i, element e
    jv = tl.where(j < CONV, j - 2 * HK, j - CONV)
    hv = jv // V
    src_vz = (hv // R) * G + 2 * K + tl.where(j < CONV, 0, R * V) + (hv % R) * V + jv % V
    src = tl.where(is_qk, src, src_vz)
    in_qkvz = j < CONV + VD
    val = tl.load(qkvz + m * s_qkvz + src, mask=in_qkvz, other=0.0)
    tl.store(mixed + m * CONV + j, val, mask=j < CONV)
    tl.store(z + m * VD + (j - CONV), val, mask=tl.where(j >= CONV, in_qkvz, False))
    # b | a: head hv of b (then a) sits at (hv // R) 2R + (0 | R) + hv % R
    jb = j - (CONV + VD)
    in_ba = tl.where(jb >= 0, j < TOTAL, False)
    hb = jb % (H * R)
    src_ba = (hb // R) * (2 * R) + (jb // (H * R)) * R + hb % R
    vba = tl.load(ba + m * s_ba + src_ba, mask=in_ba, other=0.0)
    tl.store(b + m * (H * R) + jb, vba, mask=tl.where(jb < H * R, in_ba, False))
    tl.store(a + m * (H * R) + (jb - H * R), vba, mask=tl.where(jb >= H * R, in_ba, False))


def unpack_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, H: int, HV: int, K: int, V: int):
    """``qkvz [B, T, H (2K + 2rV)]``, ``ba [B, T, 2 HV]`` (last dims contiguous) -> contiguous ``mixed [B, T, 2HK +
    HV V]``, ``z [B, T, HV, V]``, ``b [B, T, HV]``, ``a [B, T, HV]``."""
    B, T = qkvz.shape[:2]
    M = B * T
    R = HV // H
    conv = 2 * H * K + HV * V
    opts = dict(device=qkvz.device, dtype=qkvz.dtype)
    mixed = torch.empty(B, T, conv, **opts)
    z = torch.empty(B, T, HV, V, **opts)
    b = torch.empty(B, T, HV, device=ba.device, dtype=ba.dtype)
    a = torch.empty_like(b)
    if M:
        q2, ba2 = qkvz.reshape(M, -1), ba.reshape(M, -1)
        total = conv + HV * V + 2 * HV
        BLOCK = 1024
        launch(unpack_qkvz_ba_kernel, (M, cdiv(total, BLOCK)),
            q2, ba2, mixed, z, b, a, q2.stride(0), ba2.stride(0), H=H, R=R, K=K, V=V, BLOCK=BLOCK, num_warps=4)
    return mixed, z, b, a


__all__ = ["unpack_qkvz_ba", "unpack_qkvz_ba_kernel"]
