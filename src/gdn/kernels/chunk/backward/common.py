"""Pieces the backward kernels share: the token rows and gates of a chunk (device), dtypes and precisions (host).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....config import triton_interpret
from ... import tuning
from ...common import cdiv, next_pow2


@triton.jit
def _chunk_rows(i_t, cu_seqlens, chunk_indices, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """The C token rows of global chunk i_t: (batch row of strided inputs, flat token index [C] for contiguous
    [B*T, ...] tensors, token index inside the batch row [C] (both int64), row mask [C], valid rows n_valid)."""
    if VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t).to(tl.int64)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        L = (eos - bos).to(tl.int32)
        row = tl.zeros([], dtype=tl.int64)
        tok0 = bos
    else:
        NTs = tl.cdiv(T, C)
        i_n = (i_t // NTs).to(tl.int64)
        i_c = i_t % NTs
        bos = tl.zeros([], dtype=tl.int64)
        L = T
        row = i_n
        tok0 = i_n * T
    t = i_c * C + tl.arange(0, C)
    return row, tok0 + t, (bos + t).to(tl.int64), t < L, tl.minimum(L - i_c * C, C)


@triton.jit
def _chunk_gates(gcum, tok, i_hv, m_t, n_valid, HV: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr):
    """(chunk-local cumulative gates c [C], c at the last valid row cL); padding rows of a partial chunk carry cL."""
    b_gc = tl.load(gcum + tok * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    b_gl = tl.sum(tl.where(tl.arange(0, C) == n_valid - 1, b_gc, 0.0), axis=0)
    return tl.where(m_t, b_gc, b_gl), b_gl


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _mm_dtype(dtype: torch.dtype):
    """tl.dot operand dtype: the input dtype, except that Triton's CPU interpreter (3.6) computes bf16 dots wrongly,
    so there the operands are rounded to bf16 and then multiplied in fp32."""
    if dtype == torch.bfloat16 and triton_interpret():
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


def _dot_precision(dtype: torch.dtype, device) -> str:
    """tl.dot input precision for fp32/fp64 operands (bf16/fp16 operands ignore it): ``chunk_bwd.fp32_dot``."""
    if dtype == torch.float32:
        return tuning.chunk_bwd(device).fp32_dot
    return "ieee"


def _v_tile(V: int, device) -> int:
    """V tile of the parallel backward kernels (dv_local, parts A and B): ``chunk_bwd.BV``."""
    return min(int(tuning.chunk_bwd(device).BV), max(16, next_pow2(V)))


def _strides(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)
