"""Pieces every chunk kernel shares: Triton device helpers (products that are exact under the interpreter, rounding,
sequence spans, pool rows) and the host launch helpers (dtypes, poisoned allocation, launch with a shared-memory
fallback).

Chunk size ``C`` is 64 everywhere (``CHUNK_SIZE``); every kernel's docstring states its tensors' layouts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import triton_interpret
from .. import tuning
from ..common import next_pow2
from ..launch import launch

CHUNK_SIZE = 64


def _dot_dtype(*tensors) -> torch.dtype:
    """dtype of the tensor-core operands: the common half dtype of the inputs, else fp32."""
    dts = {t.dtype for t in tensors if t is not None}
    if len(dts) == 1 and next(iter(dts)) in (torch.bfloat16, torch.float16):
        return next(iter(dts))
    return torch.float32


def _state_dtype(device, dot_dtype: torch.dtype) -> torch.dtype:
    """dtype of the per-chunk states h the forward keeps (and the backward's state gradients): fp32 with the tuning
    field ``chunk_fwd.h_dtype`` = "fp32", else the tensor-core dtype."""
    return torch.float32 if tuning.chunk_fwd(device).h_dtype == "fp32" else dot_dtype


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _empty(*shape, device, dtype) -> torch.Tensor:
    x = torch.empty(*shape, device=device, dtype=dtype)
    if tuning.chunk_fwd(x.device).debug_poison and x.is_floating_point():
        x.fill_(float("nan"))
    return x


def _launch(kernel, grid, *args, maxnreg=0, **kwargs):
    """``launch(kernel, grid, *args, **kwargs)`` (:mod:`gdn.kernels.launch`); when the config asks for more shared
    memory than the GPU has (e.g. fp32 operands with K = 256), retry with fewer pipeline stages (nothing has run when
    that error is raised).
    ``maxnreg`` > 0 caps registers per thread (more resident CTAs for the throughput kernels)."""
    if maxnreg and int(maxnreg) > 0:
        kwargs["maxnreg"] = int(maxnreg)
    try:
        return launch(kernel, grid, *args, **kwargs)
    except triton.runtime.errors.OutOfResources:
        if kwargs.get("num_stages", 2) <= 1:
            raise
        kwargs["num_stages"] = 1
        return launch(kernel, grid, *args, **kwargs)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, next_pow2(int(x)))


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _cu_arg(cu_seqlens, dummy):
    return cu_seqlens if cu_seqlens is not None else dummy


def _check_chunk_size(chunk_size):
    if int(chunk_size) != CHUNK_SIZE:
        raise ValueError(f"chunk_size: the Triton kernels support chunk_size = {CHUNK_SIZE}, got {chunk_size}")

# Triton's interpreter multiplies the raw bits of bfloat16 dot operands (it stores bf16 as uint16); there the half
# precision operands (already rounded) are widened to fp32 first, which gives the tensor-core result exactly.
_INTERP = tl.constexpr(triton_interpret())


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; ``PREC`` is the input precision for fp32 operands."""
    if a.dtype == tl.float32:
        r = tl.dot(a, b, input_precision=PREC)
    else:
        if _INTERP:
            r = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            r = tl.dot(a, b)
    return r


@triton.jit
def _rn(x, DST: tl.constexpr):
    """x converted to DST, rounding to nearest even when narrowing (what the GPU does; Triton's interpreter truncates
    fp32 -> bf16, so there the rounding is done on the bits first)."""
    if x.dtype == DST:
        r = x
    elif DST == tl.float32:
        r = x.to(tl.float32)
    else:
        xf = x.to(tl.float32)
        if _INTERP:
            if DST == tl.bfloat16:
                b = xf.to(tl.uint32, bitcast=True)
                b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
                xf = b.to(tl.float32, bitcast=True)
        r = xf.to(DST)
    return r


@triton.jit
def _seq_span(n, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """(batch row, first token, end token) of sequence n, as int64."""
    if IS_VARLEN:
        i_b = n.to(tl.int64) * 0
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    else:
        i_b = n.to(tl.int64)
        bos = n.to(tl.int64) * 0
        eos = bos + T
    return i_b, bos, eos


@triton.jit
def _state_row(idx, i_s, n, P, BY_SEG: tl.constexpr, INDEXED: tl.constexpr):
    """(row, valid) of a state in a [rows, HV, ...] buffer: row = segment i_s (BY_SEG) or sequence n, mapped through
    the pool index ``idx`` when INDEXED (a negative or >= P entry is invalid: nothing read or written)."""
    if BY_SEG:
        row = i_s.to(tl.int64)
    else:
        row = n.to(tl.int64)
    ok = row >= 0
    if INDEXED:
        row = tl.load(idx + row).to(tl.int64)
        ok = (row >= 0) & (row < P)
    return row, ok


@triton.jit
def _load_tile(ptr, rows, m, cols, mc, s_t):
    return tl.load(ptr + rows[:, None] * s_t + cols[None, :], mask=m[:, None] & mc[None, :], other=0.0)
