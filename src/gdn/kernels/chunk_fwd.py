"""Forward kernels of the chunked (WY / UT transform) gated delta rule.

Shapes (``C`` = chunk size = 64, ``NT`` = total number of chunks over all sequences, ``S`` = number of segments)::

    q, k        [B, T, H, K]     strided views allowed (last dim contiguous)
    v           [B, T, HV, V]    strided views allowed (last dim contiguous)
    g, beta     [B, T, HV]       any strides, any float dtype; g is log-space (<= 0)
    g_cum       [B, T, HV] fp32  chunk-local cumulative sum of g (restarts at every chunk / sequence start)
    Ainv        [B, T, HV, C] fp32  row t holds row (t mod C) of (I + A)^-1 of its chunk (columns = chunk positions)
    w           [B, T, HV, K]    Ainv @ (beta * exp(g_cum) * k_hat)       (k_hat = k, or L2-normalised k)
    u           [B, T, HV, V]    Ainv @ (beta * v)
    h           [NT, HV, K, V]   state at the START of every chunk (v_last order)
    v_new       [B, T, HV, V]    u - w @ h(chunk)
    o           [B, T, HV, V]    scale * ((exp(g_cum) q_hat) @ h + ((q_hat k_hat^T) * Gamma, causal) @ v_new)

with ``A = strictLower(diag(beta) (Gamma * K_hat K_hat^T))``, ``Gamma_ij = exp(g_cum_i - g_cum_j)`` (i >= j). Every
exponent is the exp of a non-positive difference of cumulative gates. State arithmetic is fp32.

Kernels (all run unchanged in Triton's interpreter):

* ``_chunk_prepare_kernel``  one program per (chunk, value head): cumsum of g, K K^T on 16-row tiles, the 16x16
  diagonal-block inverses by forward substitution, the block merge to the full 64x64 inverse; stores Ainv and/or
  W and U (and recomputes W/U from a stored Ainv for the backward).
* ``_chunk_state_kernel``    one program per (V tile, value head, segment): the sequential pass over chunks, with
  v_new either from Ainv / v / beta (``CONFIG["state_mode"] = "ainv"``, default) or from W / U (``"wu"``); also
  computes a segment's K x K transition matrix (identity start, v = 0) and, with ``fuse_output``, the output.
* ``_chunk_merge_kernel``    sequential merge of segment states ``S_{s+1} = P_s S_s + H_s`` (long sequences split over
  SMs).
* ``_chunk_output_kernel``   one program per (V tile, chunk, value head): the output.

Functions for reuse (backward recompute): :func:`prepare_chunk_indices`, :func:`chunk_local_cumsum`,
:func:`chunk_fwd_prepare`, :func:`chunk_scaled_dot_kkt_solve`, :func:`recompute_w_u`, :func:`chunk_state_pass`,
:func:`chunk_output`, :func:`chunk_state_output`, :func:`chunk_gated_delta_rule_fwd`. Design notes, floors and the
GPU sweep: ``bench/chunk_notes.md`` and ``python -m gdn.kernels.chunk_fwd --help``.

Configuration lives in :data:`CONFIG` (change it with :func:`set_config`, :func:`config_override` or the environment
variable ``GDN_CHUNK_CONFIG`` holding JSON, e.g. ``'{"state_BV": 32, "segment_chunks": 8}'``);
:func:`bench_configs` lists the variants worth sweeping on a GPU.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .common import l2_rnorm, value_heads_per_program

CHUNK_SIZE = 64
L2_EPS = 1e-6

# ----------------------------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------------------------
_DEFAULT_CONFIG = {
    # prepare kernel (cumsum + KK^T + solve + W/U)
    "prepare_BK": 64, "prepare_BV": 64, "prepare_warps": 4, "prepare_stages": 2, "prepare_maxnreg": 168,
    # precision of the 64x64 products of the triangular solve ("auto": tf32 for a half-precision Ainv from half
    # inputs, else tf32x3; or "ieee", "tf32x3", "tf32", "bf16")
    "solve_precision": "auto",
    # precision of dots whose operands are fp32 (fp32 inputs / fp32 intermediates)
    "fp32_dot_precision": "tf32x3",
    # sequential state pass: BV tile of the state (0 = automatic: 64 for K <= 128, else 32)
    "state_BV": 0, "state_warps": 4, "state_stages": 2, "state_maxnreg": 0,
    # output kernel
    "output_BK": 128, "output_BV": 64, "output_warps": 4, "output_stages": 1, "output_maxnreg": 0,
    # value heads per output program (they share q, k and q k^T; 0 = all HV / H of a q/k head)
    "output_heads": 1,
    # merge kernel of the segmented state pass
    "merge_BK": 64, "merge_BV": 64, "merge_warps": 4, "merge_precision": "tf32x3",
    # storage dtype of the per-chunk states h in the forward: "input" (bf16 for bf16 inputs) or "fp32"
    "h_dtype": "input",
    # forward state pass: v_new from Ainv/v/beta ("ainv", no w/u round trip) or from stored w/u ("wu")
    "state_mode": "ainv",
    # h in the v_new product as two half-precision parts (accuracy; costs one more tensor-core product per chunk)
    "state_split_h": False,
    # storage dtype of Ainv in the forward ("input" = tensor-core dtype, or "fp32")
    "ainv_dtype": "input",
    # training: keep the forward's per-chunk states h and v_new for the backward instead of recomputing them there
    # (costs their memory from forward to backward: at 1x32768 16/32 bf16, h 0.54 GB + v_new 0.27 GB; fla recomputes)
    "bwd_save_states": False,
    # compute o inside the state pass (no h / v_new in memory; no output kernel). Off by default: on an H200 the
    # fused pass is latency-bound (5.5 us per chunk step vs 2.4 us without the output work), and the parallel output
    # kernel costs less than the longer sequential chain on every target shape (bench/results/chunk_sweep_h200.json).
    # The output kernel runs unpipelined with one K tile: a 2-stage pipelined K loop there gave run-to-run different,
    # wrong outputs on an H200 with Triton 3.6 (o error 2.7e-2; bench/debug_chunk_det.py).
    "fuse_output": False,
    # segmented state pass: 0 = heuristic, -1 = never, n > 0 = always, with n chunks per segment
    "segment_chunks": 0,
    # heuristic (see choose_segment_len): resident state-pass CTAs per SM, cost of one merge step in chunk steps,
    # segment only when the modelled cost is below `segment_gain` x the plain pass; segments are powers of two
    # >= `segment_min_len` chunks; never for sequences of fewer than `segment_min_chunks` chunks
    "state_ctas_per_sm": 2, "segment_merge_cost": 0.5, "segment_gain": 0.8, "segment_min_chunks": 16,
    "segment_min_len": 8,
    # testing: fill every buffer these launch functions allocate with NaN first (catches unwritten elements)
    "debug_poison": False,
    # timing experiments: skip the triangular solve in the prepare kernel (wrong results; shows the solve's share)
    "debug_skip_solve": False,
}
CONFIG = dict(_DEFAULT_CONFIG)


def _apply_env_config():
    raw = os.environ.get("GDN_CHUNK_CONFIG", "").strip()
    if raw:
        set_config(**json.loads(raw))
    seg = os.environ.get("GDN_CHUNK_SEGMENT", "").strip()
    if seg:
        CONFIG["segment_chunks"] = int(seg)


def set_config(**kw):
    """Change entries of :data:`CONFIG` (unknown keys raise KeyError)."""
    for key, val in kw.items():
        if key not in _DEFAULT_CONFIG:
            raise KeyError(f"unknown chunk config key {key!r}; known: {sorted(_DEFAULT_CONFIG)}")
        CONFIG[key] = val


@contextlib.contextmanager
def config_override(**kw):
    """``with config_override(state_BV=32): ...`` runs with changed config and restores it afterwards."""
    old = dict(CONFIG)
    try:
        set_config(**kw)
        yield CONFIG
    finally:
        CONFIG.clear()
        CONFIG.update(old)


def bench_configs() -> List[dict]:
    """Variants for a GPU sweep (each a dict for :func:`config_override`); the first is the default."""
    out = [{}]
    for bv in (32, 64, 128):
        out.append({"state_BV": bv})
    for w in (4, 8):
        for st in (1, 2, 3):
            out.append({"state_warps": w, "state_stages": st})
            out.append({"output_warps": w, "output_stages": st})
            out.append({"prepare_warps": w, "prepare_stages": st})
    out += [{"output_BV": 128}, {"output_BV": 32}, {"output_BK": 128}, {"prepare_BK": 128}, {"prepare_BV": 128},
            {"h_dtype": "fp32"}, {"solve_precision": "tf32x3"},
            {"segment_chunks": -1}, {"segment_chunks": 8}, {"segment_chunks": 16}, {"segment_chunks": 32},
            {"segment_chunks": 64}, {"state_ctas_per_sm": 1}, {"segment_gain": 1.0},
            {"state_mode": "wu"}, {"state_split_h": True}, {"ainv_dtype": "fp32"},
            {"fuse_output": True}, {"fuse_output": True, "state_BV": 128}, {"fuse_output": True, "state_warps": 8},
            {"prepare_maxnreg": 0}, {"prepare_maxnreg": 168}, {"output_maxnreg": 0}, {"output_maxnreg": 168},
            {"state_maxnreg": 168}]
    return out


_apply_env_config()


# ----------------------------------------------------------------------------------------------------------------------
# indices
# ----------------------------------------------------------------------------------------------------------------------
class ChunkIndex(NamedTuple):
    """Chunk bookkeeping shared by all kernels.

    N: number of sequences; NT: total number of chunks; nchunks: chunks per sequence (host list);
    chunk_indices: int32 [NT, 2] = (sequence n, chunk c within the sequence) on the device;
    chunk_offsets: int32 [N + 1] global index of the first chunk of every sequence (host list ``offsets`` too);
    is_varlen: whether ``cu_seqlens`` was given (then B == 1).
    """
    N: int
    NT: int
    chunk_size: int
    nchunks: List[int]
    offsets: List[int]
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    is_varlen: bool


_TABLE_CACHE: dict = {}
_TABLE_CACHE_MAX = 64


def _cached(key, build):
    """Small cache of device-side index tables (saves the host-to-device copies when shapes repeat, e.g. per layer)."""
    hit = _TABLE_CACHE.get(key)
    if hit is None:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_MAX:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        hit = _TABLE_CACHE[key] = build()
    return hit


def prepare_chunk_indices(cu_seqlens: Optional[torch.Tensor], T: int, chunk_size: int = CHUNK_SIZE, B: int = 1,
                          device=None) -> ChunkIndex:
    """Chunk tables for ``cu_seqlens`` (varlen, B == 1) or B sequences of length T. Reads cu_seqlens on the host."""
    if cu_seqlens is not None:
        device = cu_seqlens.device
        cu = tuple(int(x) for x in cu_seqlens.detach().cpu().tolist())
        key = ("varlen", cu, chunk_size, str(device))
    else:
        device = torch.device(device) if device is not None else torch.device("cpu")
        cu = None
        key = ("batch", B, T, chunk_size, str(device))
    return _cached(key, lambda: _build_chunk_indices(cu, T, chunk_size, B, device))


def _build_chunk_indices(cu, T, chunk_size, B, device) -> ChunkIndex:
    if cu is not None:
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        is_varlen = True
    else:
        lens = [T] * B
        is_varlen = False
    nchunks = [-(-L // chunk_size) for L in lens]
    offsets = [0]
    for nc in nchunks:
        offsets.append(offsets[-1] + nc)
    NT = offsets[-1]
    seq = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(nchunks, dtype=torch.int64))
    off = torch.tensor(offsets[:-1], dtype=torch.int32)
    within = torch.arange(NT, dtype=torch.int32) - off[seq.long()] if NT else torch.zeros(0, dtype=torch.int32)
    ci = torch.stack([seq, within], 1).contiguous() if NT else torch.zeros(0, 2, dtype=torch.int32)
    return ChunkIndex(len(lens), NT, chunk_size, nchunks, offsets, ci.to(device),
                      torch.tensor(offsets, dtype=torch.int32).to(device), is_varlen)


class SegmentPlan(NamedTuple):
    """Segments of the state pass: int32 [S, 3] rows (sequence n, first chunk, end chunk) on the device, plus
    ``seg_offsets`` int32 [N + 1] (first segment of every sequence). Unsegmented: one segment per sequence."""
    S: int
    segments: torch.Tensor
    seg_offsets: torch.Tensor
    segmented: bool
    seg_len: int


def plan_segments(ci: ChunkIndex, seg_len: Optional[int], device) -> SegmentPlan:
    return _cached(("segments", tuple(ci.nchunks), seg_len, str(device)),
                   lambda: _build_segments(ci, seg_len, device))


def _build_segments(ci: ChunkIndex, seg_len: Optional[int], device) -> SegmentPlan:
    rows, offs = [], [0]
    for n, nc in enumerate(ci.nchunks):
        if seg_len is None or nc <= seg_len:
            rows.append((n, 0, nc))
        else:
            for c0 in range(0, nc, seg_len):
                rows.append((n, c0, min(nc, c0 + seg_len)))
        offs.append(len(rows))
    segs = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)
    return SegmentPlan(len(rows), segs.to(device), torch.tensor(offs, dtype=torch.int32).to(device),
                       seg_len is not None, seg_len or 0)


_SM_COUNT = {}


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_segment_len(ci: ChunkIndex, HV: int, V: int, BV: int, device, force: Optional[int] = None,
                       K: Optional[int] = None) -> Optional[int]:
    """Chunks per segment for the segmented state pass, or None for the plain sequential pass.

    Cost model (in "chunk steps" of one state-pass program): the plain pass takes ``waves(N*HV*nV) * max_chunks``;
    segments of L chunks take ``waves(S*HV*(nV+nK)) * L`` (local states + transition matrices, one launch) +
    ``waves(S*HV*nV) * L`` (the pass from the true starts) + the merge, with ``waves(p) = ceil(p / slots)`` and
    ``slots = SMs * CONFIG["state_ctas_per_sm"]``. Segmenting triples the work, so it only pays when the plain
    pass leaves most SMs idle (few sequences x heads, many chunks).
    """
    seg = CONFIG["segment_chunks"] if force is None else force
    if seg is None or seg < 0:
        return None
    if seg > 0:
        return int(seg)
    if device.type != "cuda" or ci.NT == 0:
        return None
    maxc = max(ci.nchunks)
    if maxc < int(CONFIG["segment_min_chunks"]):
        return None
    slots = max(1, int(_num_sms(device) * float(CONFIG["state_ctas_per_sm"])))
    nv = triton.cdiv(V, BV)
    nk = triton.cdiv(K if K is not None else V, BV)

    def waves(p):
        return -(-p // slots)

    base = waves(ci.N * HV * nv) * maxc
    best, best_cost = None, None
    L = max(1, int(CONFIG["segment_min_len"]))
    while L * 2 <= maxc:
        S = sum(-(-nc // L) if nc else 1 for nc in ci.nchunks)
        per_seq = -(-maxc // L)
        cost = (waves(S * HV * (nv + nk)) + waves(S * HV * nv)) * L + float(CONFIG["segment_merge_cost"]) * per_seq
        if best_cost is None or cost < best_cost:
            best, best_cost = L, cost
        L *= 2
    if best is None or best_cost > float(CONFIG["segment_gain"]) * base:
        return None
    return best


# ----------------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------------
def _dot_dtype(*tensors) -> torch.dtype:
    """dtype of the tensor-core operands: the common half dtype of the inputs, else fp32."""
    dts = {t.dtype for t in tensors if t is not None}
    if len(dts) == 1 and next(iter(dts)) in (torch.bfloat16, torch.float16):
        return next(iter(dts))
    return torch.float32


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _empty(*shape, device, dtype) -> torch.Tensor:
    x = torch.empty(*shape, device=device, dtype=dtype)
    if CONFIG["debug_poison"] and x.is_floating_point():
        x.fill_(float("nan"))
    return x


def _launch(kernel, grid, *args, maxnreg=0, **kwargs):
    """kernel[grid](*args, **kwargs); when the config asks for more shared memory than the GPU has (e.g. fp32
    operands with K = 256), retry with fewer pipeline stages (nothing has run when that error is raised).
    ``maxnreg`` > 0 caps registers per thread (more resident CTAs for the throughput kernels)."""
    if maxnreg and int(maxnreg) > 0:
        kwargs["maxnreg"] = int(maxnreg)
    try:
        return kernel[grid](*args, **kwargs)
    except triton.runtime.errors.OutOfResources:
        if kwargs.get("num_stages", 2) <= 1:
            raise
        kwargs["num_stages"] = 1
        return kernel[grid](*args, **kwargs)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def _state_bv(K: int, V: int, fused: bool = False) -> int:
    """V tile of the state pass: CONFIG["state_BV"], or automatic: 32 with the output fused in or K > 128 (register
    budget: no spills at 4 warps on sm_90), else 64."""
    bv = int(CONFIG["state_BV"]) or (32 if (fused or K > 128) else 64)
    return max(16, min(bv, _pow2(V)))


# Triton's interpreter multiplies the raw bits of bfloat16 dot operands (it stores bf16 as uint16); there the half
# precision operands (already rounded) are widened to fp32 first, which gives the tensor-core result exactly.
_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


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


@triton.jit
def _load_tile(ptr, rows, m, cols, mc, s_t):
    return tl.load(ptr + rows[:, None] * s_t + cols[None, :], mask=m[:, None] & mc[None, :], other=0.0)


# ----------------------------------------------------------------------------------------------------------------------
# kernel 1: cumsum + KK^T + solve + W/U
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _chunk_prepare_kernel(
    k, v, g, beta, gcum, ainv, w, u, rk_out, chunk_indices, cu_seqlens, T,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, G_IS_CUM: tl.constexpr, STORE_G: tl.constexpr,
    STORE_A: tl.constexpr, LOAD_A: tl.constexpr, STORE_W: tl.constexpr, STORE_U: tl.constexpr,
    STORE_RK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
    SKIP_SOLVE: tl.constexpr = False,
):
    """One program per (chunk, value head): g_cum (chunk-local cumsum), A = strictLower(diag(beta r_k) (Gamma * K K^T)
    diag(r_k)) with r_k the L2 row scalings, Ainv = (I + A)^-1 (stored as [64, 64] rows of the [B, T, HV, 64] buffer),
    W = Ainv diag(beta exp(g) r_k) K, U = Ainv diag(beta) V; r_k stored per key head ([B, T, H] fp32) when asked.
    LOAD_A: Ainv is read instead of computed (recompute of W / U)."""
    i_t = tl.program_id(0)
    i_hv = tl.program_id(1)
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
    b_g = tl.load(g + i_b * s_gb + i_hv * s_gh + rows * s_gt, mask=m, other=0.0).to(tl.float32)
    if not G_IS_CUM:
        b_g = tl.cumsum(b_g, axis=0)
    if STORE_G:
        tl.store(gcum + trow, b_g, mask=m)
    b_beta = tl.load(beta + i_b * s_bb + i_hv * s_bh + rows * s_bt, mask=m, other=0.0).to(tl.float32)

    k_base = k + i_b * s_kb + i_h * s_kh
    a_ptr = ainv + trow[:, None] * 64 + to[None, :]
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
        for i_k in range(0, tl.cdiv(K, BK)):
            ok = i_k * BK + tl.arange(0, BK)
            b_k = _load_tile(k_base, rows, m, ok, ok < K, s_kt)
            if USE_L2:
                kf = b_k.to(tl.float32)
                ss += tl.sum(kf * kf, axis=1)
            b_k = _rn(b_k, DT)
            acc += _dot(b_k, tl.trans(b_k), PREC)
        if USE_L2:
            rk = tl.rsqrt(ss + 1e-6)
        else:
            rk = tl.full([64], 1.0, tl.float32)
        low = to[:, None] > to[None, :]
        A = tl.where(low, acc * (b_beta * rk)[:, None] * rk[None, :] *
                     tl.exp(tl.where(low, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        if SKIP_SOLVE:  # timing experiments only (CONFIG["debug_skip_solve"]): wrong results
            b_ai = A + tl.where(to[:, None] == to[None, :], 1.0, 0.0)
        else:
            b_ai = _unit_lower_inverse64(A, SOLVE_PREC)
        if STORE_A:
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


@triton.jit
def _dot_h(a, h, h_dt, DT: tl.constexpr, PREC: tl.constexpr, SPLIT_H: tl.constexpr):
    """a @ h for an fp32 state h (``h_dt`` = h rounded to DT): with SPLIT_H (half-precision DT), h = hi + lo in two
    half-precision parts, so the product is nearly fp32-exact at twice the tensor-core work (this product is
    subtracted from v: cancellation)."""
    r = _dot(a, h_dt, PREC)
    if SPLIT_H:
        r += _dot(a, _rn((h - h_dt.to(tl.float32)), DT), PREC)
    return r


@triton.jit(do_not_specialize=["T", "P0", "P1"])
def _chunk_state_kernel(
    k, v, beta, ainv, w, u, gcum, rk_in, h_out, vnew, h0, ht, h0_idx, ht_idx, segments, chunk_offsets, cu_seqlens,
    q, rq_in, o, o_idx, T, P0, P1, NV, PO, scale,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bb, s_bt, s_bh,
    s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v, s_qb, s_qt, s_qh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, FROM_AINV: tl.constexpr,
    INIT: tl.constexpr, H0_BY_SEG: tl.constexpr, H0_INDEXED: tl.constexpr,
    HAS_U: tl.constexpr, STORE_H: tl.constexpr, STORE_VNEW: tl.constexpr,
    STORE_FINAL: tl.constexpr, HT_BY_SEG: tl.constexpr, HT_INDEXED: tl.constexpr,
    FUSE_OUT: tl.constexpr, O_INDEXED: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, SPLIT_H: tl.constexpr,
):
    """State h [K, V-tile] of one (segment, value head), fp32 in registers, over the segment's chunks.

    Per chunk (r_k = L2 row scalings of k, read from ``rk_in`` [B, T, H]; k itself goes into the products raw, the
    row factors are applied to the [64, BV] sides):
    v_new = U - W h from stored w/u (FROM_AINV=False), or with FROM_AINV
    v_new = Ainv @ (beta * (v - diag(exp(g_cum) r_k) (k @ h))) (no w/u round trip, better precision);
    h = exp(g_last) h + k^T (diag(exp(g_last - g_cum) r_k) v_new).
    INIT: 0 = zeros, 1 = from h0 (row = segment or sequence, optionally through h0_idx with -1/out-of-range = zeros),
    2 = identity (transition matrix; then V == K and HAS_U is False: v / u are taken as zero),
    3 = both passes of a segmented run in one launch: programs i_v < NV run the local pass from zero (final -> ht,
    row = segment), programs i_v >= NV the transition matrix from the identity without v (final -> h0, row =
    segment, with h0's strides).
    FUSE_OUT: also write the output o of every chunk (as the output kernel does) from the state in registers, so
    that neither h nor v_new goes through memory (O_INDEXED: zeros for sequences whose o_idx row is invalid);
    r_q is read from ``rq_in`` [B, T, H].
    """
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_s = tl.program_id(2)
    n = tl.load(segments + 3 * i_s)
    c_beg = tl.load(segments + 3 * i_s + 1)
    c_end = tl.load(segments + 3 * i_s + 2)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    i_h = i_hv // (HV // H)
    tok0 = i_b * T
    ok = tl.arange(0, KP)
    mk = ok < K
    if INIT == 3:
        is_t = i_v >= NV
        not_t = i_v < NV
        ov = tl.where(is_t, i_v - NV, i_v) * BV + tl.arange(0, BV)
        mv = ov < tl.where(is_t, K, V)
    else:
        not_t = True
        ov = i_v * BV + tl.arange(0, BV)
        mv = ov < V
    m_kv = mk[:, None] & mv[None, :]

    if INIT == 1:
        row, ok0 = _state_row(h0_idx, i_s, n, P0, H0_BY_SEG, H0_INDEXED)
        p0 = h0 + row * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v
        h = tl.load(p0, mask=tl.where(ok0, m_kv, False), other=0.0).to(tl.float32)
    elif INIT == 2:
        h = tl.where((ok[:, None] == ov[None, :]) & m_kv, 1.0, 0.0)
    elif INIT == 3:
        h = tl.where((ok[:, None] == ov[None, :]) & m_kv & is_t, 1.0, 0.0)
    else:
        h = tl.zeros([KP, BV], tl.float32)
    if O_INDEXED:
        oi = tl.load(o_idx + n)
        o_ok = (oi >= 0) & (oi < PO)

    choff = tl.load(chunk_offsets + n).to(tl.int64)
    k_base = k + i_b * s_kb + i_h * s_kh
    v_base = v + i_b * s_vb + i_hv * s_vh
    b_base = beta + i_b * s_bb + i_hv * s_bh
    to = tl.arange(0, 64)
    causal = to[:, None] >= to[None, :]
    if FROM_AINV:
        # beta (16-bit, strided: not copied asynchronously by the pipeliner) is loaded one chunk ahead, at the top of
        # the previous chunk, so its latency is off the chain of products
        rows_n = bos + c_beg.to(tl.int64) * 64 + to
        beta_next = tl.load(b_base + rows_n * s_bt, mask=rows_n < eos, other=0.0)
    for c in range(c_beg.to(tl.int64), c_end.to(tl.int64)):
        t0 = bos + c * 64
        rows = t0 + to
        m = rows < eos
        trow = (tok0 + rows) * HV + i_hv
        if FROM_AINV:
            b_beta = beta_next.to(tl.float32)
            rows_n = rows + 64
            beta_next = tl.load(b_base + rows_n * s_bt, mask=tl.where(c + 1 < c_end, rows_n < eos, False), other=0.0)
        if STORE_H:
            hp = h_out + ((choff + c) * HV + i_hv) * (K * V) + ok[:, None] * V + ov[None, :]
            tl.store(hp, _rn(h, h_out.dtype.element_ty), mask=m_kv)
        b_g = tl.load(gcum + trow, mask=m, other=0.0)
        last = tl.minimum(t0 + 64, eos) - 1
        g_last = tl.load(gcum + (tok0 + last) * HV + i_hv)
        b_k = _rn(tl.load(k_base + rows[:, None] * s_kt + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
        if USE_L2:
            rk = tl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        else:
            rk = tl.where(m, 1.0, 0.0)
        h_dt = _rn(h, DT)
        if FROM_AINV:
            b_r = -_dot_h(b_k, h, h_dt, DT, PREC, SPLIT_H) * (tl.exp(b_g) * rk)[:, None]
            if HAS_U:
                b_r += tl.load(v_base + rows[:, None] * s_vt + ov[None, :],
                               mask=tl.where(not_t, m[:, None] & mv[None, :], False), other=0.0).to(tl.float32)
            b_a = _rn(tl.load(ainv + trow[:, None] * 64 + to[None, :], mask=m[:, None], other=0.0), DT)
            b_v = _dot(b_a, _rn(b_r * b_beta[:, None], DT), PREC)
        else:
            b_w = _rn(tl.load(w + trow[:, None] * K + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            b_v = -_dot_h(b_w, h, h_dt, DT, PREC, SPLIT_H)
            if HAS_U:
                b_v += tl.load(u + trow[:, None] * V + ov[None, :],
                               mask=tl.where(not_t, m[:, None] & mv[None, :], False), other=0.0).to(tl.float32)
        if STORE_VNEW:
            tl.store(vnew + trow[:, None] * V + ov[None, :], _rn(b_v, vnew.dtype.element_ty),
                     mask=m[:, None] & mv[None, :])
        b_vd = _rn(b_v, DT)
        if FUSE_OUT:
            # o = scale * (diag(exp(g) r_q) (q @ h) + ((q k^T) * r_q r_k^T * Gamma, causal) @ v_new)
            b_q = _rn(tl.load(q + i_b * s_qb + i_h * s_qh + rows[:, None] * s_qt + ok[None, :],
                              mask=m[:, None] & mk[None, :], other=0.0), DT)
            if USE_L2:
                rq = tl.load(rq_in + (tok0 + rows) * H + i_h, mask=m, other=0.0) * scale
            else:
                rq = tl.full([64], 1.0, tl.float32) * scale
            b_o = _dot(b_q, h_dt, PREC) * (rq * tl.exp(b_g))[:, None]
            qk = _dot(b_q, tl.trans(b_k), PREC)
            att = tl.where(causal, qk * tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)) *
                           rq[:, None] * rk[None, :], 0.0)
            b_o += _dot(_rn(att, DT), b_vd, PREC)
            if O_INDEXED:
                b_o = tl.where(o_ok, b_o, 0.0)
            tl.store(o + i_b * s_ob + i_hv * s_oh + rows[:, None] * s_ot + ov[None, :], _rn(b_o, o.dtype.element_ty),
                     mask=m[:, None] & mv[None, :])
        dec = tl.where(m, tl.exp(g_last - b_g), 0.0) * rk
        h = h * tl.exp(g_last) + _dot(tl.trans(b_k), _rn(b_v * dec[:, None], DT), PREC)

    if INIT == 3:
        rs = i_s.to(tl.int64)
        tl.store(ht + rs * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v, _rn(h, ht.dtype.element_ty),
                 mask=tl.where(not_t, m_kv, False))
        tl.store(h0 + rs * s0n + i_hv * s0h + ok[:, None] * s0k + ov[None, :] * s0v, _rn(h, h0.dtype.element_ty),
                 mask=tl.where(is_t, m_kv, False))
    elif STORE_FINAL:
        row1, ok1 = _state_row(ht_idx, i_s, n, P1, HT_BY_SEG, HT_INDEXED)
        p1 = ht + row1 * s1n + i_hv * s1h + ok[:, None] * s1k + ov[None, :] * s1v
        tl.store(p1, _rn(h, ht.dtype.element_ty), mask=tl.where(ok1, m_kv, False))


# ----------------------------------------------------------------------------------------------------------------------
# kernel 3: merge of segment states (long sequences)
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["P0", "P1"])
def _chunk_merge_kernel(
    h0, ht, h0_idx, ht_idx, trans, hloc, hs, seg_offsets, P0, P1,
    s0n, s0h, s0k, s0v, s1n, s1h, s1k, s1v,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, H0_INDEXED: tl.constexpr, STORE_FINAL: tl.constexpr, HT_INDEXED: tl.constexpr,
    PREC: tl.constexpr,
):
    """hs[s0] = h0; hs[s + 1] = trans[s] @ hs[s] + hloc[s] (fp32, [S, HV, K, V] / [S, HV, K, K]); last -> ht."""
    i_v = tl.program_id(0)
    i_hv = tl.program_id(1)
    n = tl.program_id(2)
    s0 = tl.load(seg_offsets + n)
    s1 = tl.load(seg_offsets + n + 1)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < V
    ob = tl.arange(0, BK)
    # rows of the sequence's start state (h0) and final state (ht)
    row, ok0 = _state_row(h0_idx, n, n, P0, False, H0_INDEXED)
    row1, ok1 = _state_row(ht_idx, n, n, P1, False, HT_INDEXED)
    for i_k in range(0, tl.cdiv(K, BK)):
        okk = i_k * BK + ob
        m = (okk < K)[:, None] & mv[None, :]
        if HAS_H0:
            x = tl.load(h0 + row * s0n + i_hv * s0h + okk[:, None] * s0k + ov[None, :] * s0v,
                        mask=tl.where(ok0, m, False), other=0.0).to(tl.float32)
        else:
            x = tl.zeros([BK, BV], tl.float32)
        tl.store(hs + ((s0.to(tl.int64) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], x, mask=m)
    tl.debug_barrier()
    for s64 in range(s0.to(tl.int64), s1.to(tl.int64)):
        for i_k in range(0, tl.cdiv(K, BK)):
            okk = i_k * BK + ob
            m = (okk < K)[:, None] & mv[None, :]
            acc = tl.load(hloc + ((s64 * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], mask=m, other=0.0)
            for j_k in range(0, tl.cdiv(K, BK)):
                ojj = j_k * BK + ob
                mj = ojj < K
                pm = tl.load(trans + ((s64 * HV + i_hv) * K + okk[:, None]) * K + ojj[None, :],
                             mask=(okk < K)[:, None] & mj[None, :], other=0.0)
                # written by this program in the previous step (barrier in between): read through L2
                xs = tl.load(hs + ((s64 * HV + i_hv) * K + ojj[:, None]) * V + ov[None, :],
                             mask=mj[:, None] & mv[None, :], other=0.0, cache_modifier=".cg")
                acc = tl.dot(pm, xs, acc, input_precision=PREC)
            tl.store(hs + (((s64 + 1) * HV + i_hv) * K + okk[:, None]) * V + ov[None, :], acc,
                     mask=tl.where(s64 + 1 < s1, m, False))
            if STORE_FINAL:
                tl.store(ht + row1 * s1n + i_hv * s1h + okk[:, None] * s1k + ov[None, :] * s1v,
                         _rn(acc, ht.dtype.element_ty), mask=tl.where(ok1 & (s64 + 1 == s1), m, False))
        tl.debug_barrier()


# ----------------------------------------------------------------------------------------------------------------------
# kernel 4: output
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T", "P0"])
def _chunk_output_kernel(
    q, k, vnew, h, gcum, rq_in, rk_in, o, chunk_indices, chunk_offsets, cu_seqlens, seq_idx, T, P0, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HPP: tl.constexpr,
    USE_L2: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_IDX: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """o[chunk, V tile] = scale * (diag(exp(g) r_q) (q @ h) + ((q k^T) * r_q r_k^T * Gamma, causal) @ v_new), with
    the K dimension in BK tiles; the L2 row scalings r_q, r_k come from ``rq_in`` / ``rk_in`` [B, T, H] fp32 and are
    applied after the products. One program handles HPP consecutive value heads (HPP divides HV / H, so they share
    one q/k head): q k^T is computed once for them."""
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_g = tl.program_id(2)
    n = tl.load(chunk_indices + 2 * i_t)
    c = tl.load(chunk_indices + 2 * i_t + 1)
    i_b, bos, eos = _seq_span(n, cu_seqlens, T, IS_VARLEN)
    i_h = (i_g * HPP) // (HV // H)
    tok0 = i_b * T
    t0 = bos + c.to(tl.int64) * 64
    to = tl.arange(0, 64)
    rows = t0 + to
    m = rows < eos
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < V
    m_o = m[:, None] & mv[None, :]
    valid = n >= 0
    if HAS_IDX:
        idx = tl.load(seq_idx + n)
        valid = (idx >= 0) & (idx < P0)
    o_base = o + i_b * s_ob + rows[:, None] * s_ot + ov[None, :]
    if valid:
        q_base = q + i_b * s_qb + i_h * s_qh + rows[:, None] * s_qt
        k_base = k + i_b * s_kb + i_h * s_kh + rows[:, None] * s_kt
        h_chunk = (tl.load(chunk_offsets + n).to(tl.int64) + c) * HV
        # first K tile of q kept for every value head of the program (the only one when BK >= K)
        ok0 = tl.arange(0, BK)
        m_q0 = m[:, None] & (ok0 < K)[None, :]
        q0 = _rn(tl.load(q_base + ok0[None, :], mask=m_q0, other=0.0), DT)
        qk = _dot(q0, tl.trans(_rn(tl.load(k_base + ok0[None, :], mask=m_q0, other=0.0), DT)), PREC)
        for i_k in range(1, tl.cdiv(K, BK)):
            ok = i_k * BK + tl.arange(0, BK)
            mk = ok < K
            b_q = _rn(tl.load(q_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            b_k = _rn(tl.load(k_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
            qk += _dot(b_q, tl.trans(b_k), PREC)
        if USE_L2:
            rq = tl.load(rq_in + (tok0 + rows) * H + i_h, mask=m, other=0.0) * scale
            rk = tl.load(rk_in + (tok0 + rows) * H + i_h, mask=m, other=0.0)
        else:
            rq = tl.full([64], 1.0, tl.float32) * scale
            rk = tl.full([64], 1.0, tl.float32)
        qk = qk * rq[:, None] * rk[None, :]
        causal = (to[:, None] >= to[None, :]) & m[:, None]
        for j in tl.static_range(HPP):
            i_hv = i_g * HPP + j
            h_base = h + (h_chunk + i_hv) * (K * V) + ov[None, :]
            acc = _dot(q0, _rn(tl.load(h_base + ok0[:, None] * V, mask=(ok0 < K)[:, None] & mv[None, :], other=0.0),
                               DT), PREC)
            for i_k in range(1, tl.cdiv(K, BK)):
                ok = i_k * BK + tl.arange(0, BK)
                mk = ok < K
                b_q = _rn(tl.load(q_base + ok[None, :], mask=m[:, None] & mk[None, :], other=0.0), DT)
                b_h = _rn(tl.load(h_base + ok[:, None] * V, mask=mk[:, None] & mv[None, :], other=0.0), DT)
                acc += _dot(b_q, b_h, PREC)
            trow = (tok0 + rows) * HV + i_hv
            b_g = tl.load(gcum + trow, mask=m, other=0.0)
            # inter-chunk part: (scale * exp(g) * q_hat) @ h
            acc = acc * (rq * tl.exp(b_g))[:, None]
            # intra-chunk part: ((q_hat k_hat^T) * Gamma, causal) @ v_new
            d = tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)
            att = tl.where(causal, qk * tl.exp(d), 0.0)
            b_vn = _rn(tl.load(vnew + trow[:, None] * V + ov[None, :], mask=m_o, other=0.0), DT)
            acc += _dot(_rn(att, DT), b_vn, PREC)
            tl.store(o_base + i_hv * s_oh, _rn(acc, o.dtype.element_ty), mask=m_o)
    else:
        for j in tl.static_range(HPP):
            tl.store(o_base + (i_g * HPP + j) * s_oh, _rn(tl.zeros([64, BV], tl.float32), o.dtype.element_ty),
                     mask=m_o)


# ----------------------------------------------------------------------------------------------------------------------
# launch functions (tensors and plain scalars in, outputs allocated here)
# ----------------------------------------------------------------------------------------------------------------------
def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _ci(cu_seqlens, T, B, chunk_size, chunk_index, device):
    if chunk_index is not None:
        return chunk_index
    return prepare_chunk_indices(cu_seqlens, T, chunk_size, B, device=device)


def _cu_arg(cu_seqlens, dummy):
    return cu_seqlens if cu_seqlens is not None else dummy


def _check_chunk_size(chunk_size):
    if int(chunk_size) != CHUNK_SIZE:
        raise ValueError(f"chunk_size: the Triton kernels support chunk_size = {CHUNK_SIZE}, got {chunk_size}")


def _solve_precision(dt: torch.dtype, store_dtype: torch.dtype) -> str:
    """Precision of the 64x64 products of the triangular solve: CONFIG["solve_precision"], where "auto" means tf32
    when the result is stored in half precision from half inputs (the forward), else tf32x3 (~fp32)."""
    p = CONFIG["solve_precision"]
    if p != "auto":
        return p
    half = (torch.bfloat16, torch.float16)
    return "tf32" if (dt in half and store_dtype in half) else "tf32x3"


def chunk_fwd_prepare(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                      use_qk_l2norm_in_kernel: bool = False, *, store_ainv: bool = True, store_wu: bool = True,
                      g_is_cumsum: bool = False, out_dtype: Optional[torch.dtype] = None,
                      chunk_index: Optional[ChunkIndex] = None, ainv_dtype: torch.dtype = torch.float32,
                      rk: Optional[torch.Tensor] = None):
    """Fused cumsum + K K^T + triangular solve + W/U.

    k [B, T, H, K], v [B, T, HV, V] (strided, last dim contiguous), g, beta [B, T, HV] (any float dtype; g log-space,
    or already the chunk-local cumsum when ``g_is_cumsum``).
    Returns ``(g_cum [B, T, HV] fp32, Ainv [B, T, HV, 64] (``ainv_dtype``, default fp32) or None,
    w [B, T, HV, K] or None, u [B, T, HV, V] or None)``; w/u in ``out_dtype`` (default: the tensor-core dtype of k/v,
    i.e. bf16 for bf16 inputs). Ainv row t holds row (t - chunk start) of its chunk's (I + A)^-1 (no beta factor).
    ``rk``: optional fp32 [B, T, H] buffer that receives the L2 row scalings 1 / |k_t| (with the L2 norm on).
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    ci = _ci(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = _dot_dtype(k, v)
    out_dtype = out_dtype or dt
    g_cum = g if (g_is_cumsum and g.dtype == torch.float32 and g.is_contiguous()) else \
        _empty(B, T, HV, device=dev, dtype=torch.float32)
    store_g = g_cum is not g
    ainv = _empty(B, T, HV, CHUNK_SIZE, device=dev, dtype=ainv_dtype) if store_ainv else None
    w = _empty(B, T, HV, K, device=dev, dtype=out_dtype) if store_wu else None
    u = _empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_wu else None
    if ci.NT == 0 or HV == 0:
        return g_cum, ainv, w, u
    dummy = g_cum
    BK = min(int(CONFIG["prepare_BK"]), _pow2(K))
    BV = min(int(CONFIG["prepare_BV"]), _pow2(V))
    store_rk = rk is not None and bool(use_qk_l2norm_in_kernel)
    _launch(_chunk_prepare_kernel, (ci.NT, HV),
        k, v, g, beta, g_cum, ainv if ainv is not None else dummy, w if w is not None else dummy,
        u if u is not None else dummy, rk if store_rk else dummy, ci.chunk_indices,
        _cu_arg(cu_seqlens, ci.chunk_offsets), T,
        *_strides3(k), *_strides3(v), *_strides3(g), *_strides3(beta),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
        G_IS_CUM=bool(g_is_cumsum), STORE_G=store_g, STORE_A=store_ainv, LOAD_A=False, STORE_W=store_wu,
        STORE_U=store_wu, STORE_RK=store_rk, DT=_TL[dt], PREC=CONFIG["fp32_dot_precision"],
        SOLVE_PREC=_solve_precision(dt, ainv_dtype if store_ainv else out_dtype),
        SKIP_SOLVE=bool(CONFIG["debug_skip_solve"]),
        num_warps=int(CONFIG["prepare_warps"]), num_stages=int(CONFIG["prepare_stages"]),
        maxnreg=CONFIG["prepare_maxnreg"],
    )
    return g_cum, ainv, w, u


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = CHUNK_SIZE, cu_seqlens: Optional[torch.Tensor] = None,
                       chunk_index: Optional[ChunkIndex] = None) -> torch.Tensor:
    """Chunk-local cumulative sum of g [B, T, HV] (any float dtype, any strides) -> fp32 [B, T, HV]; restarts at
    every chunk of ``chunk_size`` tokens counted from each sequence start."""
    _check_chunk_size(chunk_size)
    B, T, HV = g.shape
    dev = g.device
    ci = _ci(cu_seqlens, T, B, chunk_size, chunk_index, dev)
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
    ci = _ci(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = _dot_dtype(k, v)
    out_dtype = out_dtype or dt
    w = _empty(B, T, HV, K, device=dev, dtype=out_dtype)
    u = _empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_u else None
    if ci.NT == 0 or HV == 0:
        return w, u
    ainv = ainv.contiguous()
    g_cum = g_cum.float().contiguous()
    BK = min(int(CONFIG["prepare_BK"]), _pow2(K))
    BV = min(int(CONFIG["prepare_BV"]), _pow2(V))
    _launch(_chunk_prepare_kernel, (ci.NT, HV),
        k, v, g_cum, beta, g_cum, ainv, w, u if store_u else w, g_cum, ci.chunk_indices,
        _cu_arg(cu_seqlens, ci.chunk_offsets), T, *_strides3(k), *_strides3(v), *_strides3(g_cum), *_strides3(beta),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
        G_IS_CUM=True, STORE_G=False, STORE_A=False, LOAD_A=True, STORE_W=True, STORE_U=store_u, STORE_RK=False,
        DT=_TL[dt], PREC=CONFIG["fp32_dot_precision"], SOLVE_PREC="ieee",
        num_warps=int(CONFIG["prepare_warps"]), num_stages=int(CONFIG["prepare_stages"]),
        maxnreg=CONFIG["prepare_maxnreg"],
    )
    return w, u


def _state_strides(x: Optional[torch.Tensor], layout: str):
    if x is None:
        return (0, 0, 0, 0)
    if layout == "v_last":
        return x.stride(0), x.stride(1), x.stride(2), x.stride(3)
    return x.stride(0), x.stride(1), x.stride(3), x.stride(2)


def chunk_state_pass(k: torch.Tensor, w: Optional[torch.Tensor], u: Optional[torch.Tensor], g_cum: torch.Tensor,
                     initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                     cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                     use_qk_l2norm_in_kernel: bool = False, *, v: Optional[torch.Tensor] = None,
                     beta: Optional[torch.Tensor] = None, ainv: Optional[torch.Tensor] = None,
                     h_dtype: torch.dtype = torch.float32, vnew_dtype: Optional[torch.dtype] = None,
                     store_h: bool = True, store_vnew: bool = True, state_layout: str = "v_last",
                     final_state: Optional[torch.Tensor] = None, state_indices: Optional[torch.Tensor] = None,
                     segment_chunks: Optional[int] = None, chunk_index: Optional[ChunkIndex] = None,
                     dot_dtype: Optional[torch.dtype] = None, split_h: Optional[bool] = None,
                     rk: Optional[torch.Tensor] = None, _fuse=None):
    """The sequential inter-chunk pass.

    k [B, T, H, K] (raw; L2-normalised in-kernel when asked), g_cum [B, T, HV] fp32, and either
    w [B, T, HV, K] + u [B, T, HV, V] (``v_new = u - w h``), or (pass w = u = None) ``v`` [B, T, HV, V] (strided ok),
    ``beta`` [B, T, HV] and ``ainv`` [B, T, HV, 64] (from :func:`chunk_fwd_prepare`; any float dtype):
    ``v_new = Ainv @ (beta * (v - (exp(g_cum) k_hat) @ h))``, which skips the w/u round trip and is more accurate.
    initial_state: None or [N, HV, K, V] ("v_last") / [N, HV, V, K] ("k_last"), any float dtype, any strides; with
    ``state_indices`` ([N] int, -1 = padding) it is a pool [P, HV, ...] read at rows ``state_indices[n]``.
    Returns ``(h [NT, HV, K, V] h_dtype (start state of every chunk, v_last), v_new [B, T, HV, V], final)`` where
    final is None unless ``output_final_state`` or ``final_state`` is given: fp32 [N, HV, ...] in ``state_layout``,
    or written into ``final_state`` (e.g. the pool itself, rows ``state_indices[n]``, its dtype).
    v_new dtype: ``vnew_dtype``, default the tensor-core dtype (bf16 for bf16 inputs).
    ``segment_chunks``: None = heuristic / CONFIG, -1 = never segment, n > 0 = segments of n chunks.
    ``split_h``: compute the h product of v_new as hi + lo half-precision parts (default: CONFIG["state_split_h"]).
    ``rk``: the L2 row scalings of k (fp32 [B, T, H], from :func:`l2_rnorm` or the prepare kernel); computed here
    when the L2 norm is on and none is given.
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    from_ainv = ainv is not None
    if from_ainv:
        if v is None or beta is None:
            raise ValueError("chunk_state_pass: ainv needs v and beta")
        HV, V = v.shape[2], v.shape[3]
    else:
        HV, V = u.shape[2], u.shape[3]
    dev = k.device
    ci = _ci(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    dt = dot_dtype or (_dot_dtype(k, v) if from_ainv else _dot_dtype(k, w))
    split_h = bool(CONFIG["state_split_h"] if split_h is None else split_h) and dt != torch.float32
    vnew_dtype = vnew_dtype or (dt if from_ainv else u.dtype)
    h = _empty(ci.NT, HV, K, V, device=dev, dtype=h_dtype) if store_h else None
    v_new = _empty(B, T, HV, V, device=dev, dtype=vnew_dtype) if store_vnew else None
    ht = final_state
    if ht is None and output_final_state:
        shape = (ci.N, HV, K, V) if state_layout == "v_last" else (ci.N, HV, V, K)
        ht = _empty(*shape, device=dev, dtype=torch.float32)
    if ci.N == 0 or HV == 0:
        return h, v_new, ht
    KP = _pow2(K)
    BV = _state_bv(K, V, fused=_fuse is not None)
    seg = choose_segment_len(ci, HV, V, BV, dev, force=segment_chunks, K=K)
    plan = plan_segments(ci, seg, dev)
    dummy = g_cum
    idx = state_indices
    cu = _cu_arg(cu_seqlens, ci.chunk_offsets)
    if from_ainv:
        vv, bb, aa, ww, uu = v, beta, ainv.contiguous(), dummy, dummy
        sv, sb = _strides3(v), _strides3(beta)
    else:
        vv, bb, aa, ww, uu = dummy, dummy, dummy, w, (u if u is not None else dummy)
        sv, sb = (0, 0, 0), (0, 0, 0)

    fz = _fuse or {}
    if _fuse is not None:
        dt = _dot_dtype(fz["q"], k, v) if from_ainv else _dot_dtype(fz["q"], k, w)
    l2 = bool(use_qk_l2norm_in_kernel)
    if l2 and rk is None:
        rk = l2_rnorm(k)
    rk_arg = rk if l2 else dummy
    rq_arg = dummy
    if _fuse is not None and l2:
        rq_arg = fz.get("rq")
        if rq_arg is None:
            rq_arg = l2_rnorm(fz["q"])

    def launch(Vd, bv, S, h_out, vn_out, h0, ht_, h0_idx, ht_idx, P0, P1, s0, s1, n_extra=0, fuse=False, **flags):
        fq, fo = (fz["q"], fz["o"]) if fuse else (k, dummy)
        fidx = fz.get("o_idx") if fuse else None
        _launch(_chunk_state_kernel, (triton.cdiv(Vd, bv) + n_extra, HV, S),
                k, vv, bb, aa, ww, uu, g_cum, rk_arg, h_out if h_out is not None else dummy,
                vn_out if vn_out is not None else dummy, h0 if h0 is not None else dummy,
                ht_ if ht_ is not None else dummy, h0_idx if h0_idx is not None else ci.chunk_offsets,
                ht_idx if ht_idx is not None else ci.chunk_offsets, plan.segments, ci.chunk_offsets, cu,
                fq, rq_arg, fo, fidx if fidx is not None else ci.chunk_offsets, T, P0, P1, triton.cdiv(Vd, bv),
                int(fz.get("pool_size", 0)), float(fz.get("scale", 1.0)),
                *_strides3(k), *sv, *sb, *s0, *s1, *_strides3(fq), *(_strides3(fo) if fuse else (0, 0, 0)),
                H=H, HV=HV, K=K, V=Vd, KP=KP, BV=bv, USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen,
                FROM_AINV=from_ainv, DT=_TL[dt], PREC=CONFIG["fp32_dot_precision"], SPLIT_H=split_h,
                STORE_H=h_out is not None, STORE_VNEW=vn_out is not None, STORE_FINAL=ht_ is not None,
                FUSE_OUT=fuse, O_INDEXED=fidx is not None,
                num_warps=int(CONFIG["state_warps"]), num_stages=int(CONFIG["state_stages"]),
                maxnreg=CONFIG["state_maxnreg"], **flags)

    s0 = _state_strides(initial_state, state_layout)
    s1 = _state_strides(ht, state_layout)
    P = initial_state.shape[0] if initial_state is not None else 0
    P1 = ht.shape[0] if ht is not None else 0
    has_u = from_ainv or u is not None
    if not plan.segmented:
        launch(V, BV, plan.S, h, v_new, initial_state, ht, idx, idx, P, P1, s0, s1, fuse=_fuse is not None,
               INIT=1 if initial_state is not None else 0, H0_BY_SEG=False, H0_INDEXED=idx is not None, HAS_U=has_u,
               HT_BY_SEG=False, HT_INDEXED=idx is not None)
        return h, v_new, ht
    # ---- segmented: local states from zero, transition matrices, merge, then the pass from the true starts
    S = plan.S
    hloc = _empty(S, HV, K, V, device=dev, dtype=torch.float32)
    trans = _empty(S, HV, K, K, device=dev, dtype=torch.float32)
    hs = _empty(S, HV, K, V, device=dev, dtype=torch.float32)
    vl = _state_strides(hloc, "v_last")
    zero4 = (0, 0, 0, 0)
    # one launch: local states (programs 0 .. NV-1) and transition matrices (programs NV .. NV+NK-1)
    launch(V, BV, S, None, None, trans, hloc, None, None, 0, S, _state_strides(trans, "v_last"), vl,
           n_extra=triton.cdiv(K, BV), INIT=3, H0_BY_SEG=False, H0_INDEXED=False, HAS_U=has_u, HT_BY_SEG=True,
           HT_INDEXED=False)
    BKM = min(int(CONFIG["merge_BK"]), _pow2(K))
    BVM = min(int(CONFIG["merge_BV"]), _pow2(V))
    _launch(_chunk_merge_kernel, (triton.cdiv(V, BVM), HV, ci.N),
        initial_state if initial_state is not None else dummy, ht if ht is not None else dummy,
        idx if idx is not None else ci.chunk_offsets, idx if idx is not None else ci.chunk_offsets,
        trans, hloc, hs, plan.seg_offsets, P, P1, *s0, *s1, HV=HV, K=K, V=V, BK=BKM, BV=BVM,
        HAS_H0=initial_state is not None, H0_INDEXED=idx is not None, STORE_FINAL=ht is not None,
        HT_INDEXED=idx is not None, PREC=CONFIG["merge_precision"], num_warps=int(CONFIG["merge_warps"]))
    launch(V, BV, S, h, v_new, hs, None, None, None, S, 0, vl, zero4, fuse=_fuse is not None, INIT=1,
           H0_BY_SEG=True, H0_INDEXED=False, HAS_U=has_u, HT_BY_SEG=False, HT_INDEXED=False)
    return h, v_new, ht


def chunk_state_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, ainv: torch.Tensor,
                       g_cum: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor] = None,
                       output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                       chunk_size: int = CHUNK_SIZE, use_qk_l2norm_in_kernel: bool = False, *,
                       w: Optional[torch.Tensor] = None, u: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None, state_layout: str = "v_last",
                       final_state: Optional[torch.Tensor] = None, state_indices: Optional[torch.Tensor] = None,
                       segment_chunks: Optional[int] = None, chunk_index: Optional[ChunkIndex] = None,
                       rq: Optional[torch.Tensor] = None, rk: Optional[torch.Tensor] = None):
    """State pass with the output fused in (``CONFIG["fuse_output"]``): returns ``(o [B, T, HV, V], final)``;
    neither h nor v_new is written to memory. Arguments as :func:`chunk_state_pass` / :func:`chunk_output`
    (``ainv``/``v``/``beta``, or ``w``/``u`` with ``ainv=None``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = _empty(B, T, HV, V, device=q.device, dtype=out_dtype or v.dtype)
    P = initial_state.shape[0] if (state_indices is not None and initial_state is not None) else 0
    fuse = dict(q=q, o=o, scale=scale, o_idx=state_indices, pool_size=P, rq=rq)
    from_ainv = ainv is not None
    _, _, ht = chunk_state_pass(k, w, u, g_cum, initial_state, output_final_state, cu_seqlens, chunk_size,
                                use_qk_l2norm_in_kernel, v=v if from_ainv else None, beta=beta if from_ainv else None,
                                ainv=ainv, store_h=False, store_vnew=False, state_layout=state_layout,
                                final_state=final_state, state_indices=state_indices, segment_chunks=segment_chunks,
                                chunk_index=chunk_index, rk=rk, _fuse=fuse)
    return o, ht


def _output_heads(H: int, HV: int) -> int:
    """Value heads per output program: CONFIG["output_heads"] (1, or 0 = every value head of a q/k head)."""
    return value_heads_per_program(H, HV, int(CONFIG["output_heads"]), 'CONFIG["output_heads"]')


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, g_cum: torch.Tensor,
                 scale: float, cu_seqlens: Optional[torch.Tensor] = None, chunk_size: int = CHUNK_SIZE,
                 use_qk_l2norm_in_kernel: bool = False, *, out_dtype: Optional[torch.dtype] = None,
                 state_indices: Optional[torch.Tensor] = None, pool_size: int = 0,
                 chunk_index: Optional[ChunkIndex] = None, rq: Optional[torch.Tensor] = None,
                 rk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """o = scale * ((exp(g_cum) q_hat) @ h + ((q_hat k_hat^T) * Gamma, causal) @ v_new), [B, T, HV, V].

    q, k [B, T, H, K] raw (strided ok); v_new [B, T, HV, V]; h [NT, HV, K, V] (start state of every chunk);
    g_cum [B, T, HV] fp32. With ``state_indices`` ([N], pool of ``pool_size`` rows), sequences whose index is
    negative / out of range get zeros.
    """
    _check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    dev = q.device
    ci = _ci(cu_seqlens, T, B, chunk_size, chunk_index, dev)
    o = _empty(B, T, HV, V, device=dev, dtype=out_dtype or v_new.dtype)
    if ci.NT == 0 or HV == 0:
        return o
    dt = _dot_dtype(q, k, v_new)
    BV = min(int(CONFIG["output_BV"]), _pow2(V))
    l2 = bool(use_qk_l2norm_in_kernel)
    if l2:
        rq = l2_rnorm(q) if rq is None else rq
        rk = l2_rnorm(k) if rk is None else rk
    else:
        rq = rk = g_cum
    hpp = _output_heads(H, HV)
    _launch(_chunk_output_kernel, (triton.cdiv(V, BV), ci.NT, HV // hpp),
        q, k, v_new, h, g_cum, rq, rk, o, ci.chunk_indices, ci.chunk_offsets, _cu_arg(cu_seqlens, ci.chunk_offsets),
        state_indices if state_indices is not None else ci.chunk_offsets, T, pool_size, float(scale),
        *_strides3(q), *_strides3(k), *_strides3(o),
        H=H, HV=HV, K=K, V=V, BK=min(int(CONFIG["output_BK"]), _pow2(K)), BV=BV, HPP=hpp,
        USE_L2=bool(use_qk_l2norm_in_kernel), IS_VARLEN=ci.is_varlen, HAS_IDX=state_indices is not None,
        DT=_TL[dt], PREC=CONFIG["fp32_dot_precision"],
        num_warps=int(CONFIG["output_warps"]), num_stages=int(CONFIG["output_stages"]),
        maxnreg=CONFIG["output_maxnreg"],
    )
    return o


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                               cu_seqlens=None, chunk_size=CHUNK_SIZE, use_qk_l2norm_in_kernel=False, *,
                               state_layout="v_last", state_indices=None, final_state=None,
                               segment_chunks=None, h_dtype=None, store_ainv=False):
    """The whole forward. Returns ``(o [B, T, HV, V] in v's dtype, final state or None, aux dict)``.

    ``initial_state``/``final_state``/``state_indices`` as in :func:`chunk_state_pass`; aux holds the intermediates
    (g_cum, Ainv when ``store_ainv`` (tensor-core dtype, fp32 with CONFIG["ainv_dtype"] = "fp32"), h, v_new,
    chunk_index, rq / rk (the L2 row scalings, fp32 [B, T, H], None without the L2 norm))."""
    _check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    ci = prepare_chunk_indices(cu_seqlens, T, chunk_size, B, device=q.device)
    dt = _dot_dtype(k, v)
    from_ainv = CONFIG["state_mode"] == "ainv"
    a_dtype = torch.float32 if CONFIG["ainv_dtype"] == "fp32" else dt
    l2 = bool(use_qk_l2norm_in_kernel)
    rk = _empty(B, T, H, device=q.device, dtype=torch.float32) if l2 else None
    rq = l2_rnorm(q) if l2 else None
    g_cum, ainv, w, u = chunk_fwd_prepare(k, v, g, beta, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel,
                                          store_ainv=store_ainv or from_ainv, store_wu=not from_ainv,
                                          chunk_index=ci, ainv_dtype=a_dtype, rk=rk)
    # fp32 operands with the output fused in need too much shared memory for large K: fused only for half inputs
    if CONFIG["fuse_output"] and _dot_dtype(q, k, v) != torch.float32:
        o, ht = chunk_state_output(q, k, v, beta, ainv if from_ainv else None, g_cum, scale, initial_state,
                                   output_final_state, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel, w=w, u=u,
                                   out_dtype=v.dtype, state_layout=state_layout, final_state=final_state,
                                   state_indices=state_indices, segment_chunks=segment_chunks, chunk_index=ci,
                                   rq=rq, rk=rk)
        return o, ht, dict(g_cum=g_cum, ainv=ainv, h=None, v_new=None, chunk_index=ci, rq=rq, rk=rk)
    if h_dtype is None:
        h_dtype = torch.float32 if CONFIG["h_dtype"] == "fp32" else dt
    h, v_new, ht = chunk_state_pass(k, w, u, g_cum, initial_state, output_final_state, cu_seqlens, chunk_size,
                                    use_qk_l2norm_in_kernel, v=v if from_ainv else None,
                                    beta=beta if from_ainv else None, ainv=ainv if from_ainv else None,
                                    h_dtype=h_dtype, state_layout=state_layout, final_state=final_state,
                                    state_indices=state_indices, segment_chunks=segment_chunks, chunk_index=ci,
                                    rk=rk)
    P = initial_state.shape[0] if (state_indices is not None and initial_state is not None) else 0
    o = chunk_output(q, k, v_new, h, g_cum, scale, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel,
                     out_dtype=v.dtype, state_indices=state_indices, pool_size=P, chunk_index=ci, rq=rq, rk=rk)
    return o, ht, dict(g_cum=g_cum, ainv=ainv, h=h, v_new=v_new, chunk_index=ci, rq=rq, rk=rk)


__all__ = [
    "CONFIG", "set_config", "config_override", "bench_configs", "ChunkIndex", "prepare_chunk_indices",
    "chunk_local_cumsum", "chunk_fwd_prepare", "chunk_scaled_dot_kkt_solve", "recompute_w_u", "chunk_state_pass",
    "chunk_output", "chunk_state_output", "chunk_gated_delta_rule_fwd", "l2_rnorm",
]


# ----------------------------------------------------------------------------------------------------------------------
# GPU sweep hook:  python -m gdn.kernels.chunk_fwd [--quick] [--shapes 1x8192:16/32,...] [--configs JSON-list]
# ----------------------------------------------------------------------------------------------------------------------
TARGET_SHAPES = [  # (B, T, H, HV, FlashInfer ms on H200) for bf16, K = V = 128, L2 norm on, final state on
    (1, 8192, 16, 32, 0.424), (1, 32768, 16, 32, 0.921), (4, 4096, 16, 32, 0.264), (1, 65536, 2, 8, 0.452),
    (1, 32768, 64, 64, 2.097),
]


def _time_ms(fn, warmup=3, iters=10):
    if not torch.cuda.is_available():  # plumbing test on CPU (interpreter)
        import time

        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sweep(shapes=None, configs=None, K=128, V=128, iters=10, stages=False, file=None, device="cuda"):
    """Time the forward (and, with ``stages``, its kernels separately) for every config on every shape.

    Prints one line per (shape, config): ms, ratio to FlashInfer, rel. difference of o to the default config's o.
    Returns a list of dicts (shape, config, ms, ...) for JSON dumps.
    """
    import sys

    from gdn.ops import chunk_gated_delta_rule

    out = file or sys.stdout
    shapes = shapes or TARGET_SHAPES
    configs = configs if configs is not None else bench_configs()
    results = []
    dev = torch.device(device)
    for (B, T, H, HV, fi_ms) in shapes:
        torch.manual_seed(0)
        q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(B, T, HV, device=dev) * 0.5 - 0.01
        beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
        if B > 1:  # FlashInfer's prefill is varlen: time the packed form
            cu = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
            q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        else:
            cu = None
        h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
        ref_o = None
        for cfg in configs:
            try:
                with config_override(**cfg):
                    def fn():
                        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
                    o, _ = fn()
                    ms = _time_ms(fn, iters=iters)
                    row = dict(shape=f"{B}x{T} {H}/{HV}", config=cfg, ms=ms, vs_flashinfer=ms / fi_ms)
                    if stages:
                        row.update(_stage_times(q, k, v, g, beta, h0, cu, iters))
            except Exception as e:  # a config that does not compile / fit
                print(f"{B}x{T} {H}/{HV}  {json.dumps(cfg)}  FAILED: {type(e).__name__}: {e}"[:300], file=out)
                continue
            if ref_o is None:
                ref_o = o.float()
            diff = ((o.float() - ref_o).norm() / ref_o.norm()).item()
            row["diff_vs_default"] = diff
            results.append(row)
            extra = "  ".join(f"{k_}={v_:.3f}" for k_, v_ in row.items() if k_.startswith("t_"))
            print(f"{row['shape']:>16}  {ms:8.3f} ms  x{ms / fi_ms:5.2f} FI  diff {diff:.1e}  {json.dumps(cfg)}  {extra}",
                  file=out, flush=True)
    return results


def _stage_times(q, k, v, g, beta, h0, cu, iters):
    """ms of the forward's launches for the current config: prepare (with r_k), the q row norms, and either the fused
    state + output pass (``t_state_out``) or the state pass and the output kernel."""
    B, T, H, K = q.shape
    ci = prepare_chunk_indices(cu, T, CHUNK_SIZE, B, device=q.device)
    dt = _dot_dtype(k, v)
    from_ainv = CONFIG["state_mode"] == "ainv"
    rk = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    prep = lambda: chunk_fwd_prepare(k, v, g, beta, cu, CHUNK_SIZE, True, store_ainv=from_ainv,  # noqa: E731
                                     store_wu=not from_ainv, chunk_index=ci, ainv_dtype=dt, rk=rk)
    g_cum, ainv, w, u = prep()
    rq = l2_rnorm(q)
    res = dict(t_prepare=_time_ms(prep, iters=iters), t_rnorm_q=_time_ms(lambda: l2_rnorm(q), iters=iters))
    if CONFIG["fuse_output"]:
        so = lambda: chunk_state_output(q, k, v, beta, ainv if from_ainv else None, g_cum, K ** -0.5, h0, True,  # noqa
                                        cu, CHUNK_SIZE, True, w=w, u=u, out_dtype=v.dtype, chunk_index=ci, rq=rq, rk=rk)
        res["t_state_out"] = _time_ms(so, iters=iters)
        return res
    hd = torch.float32 if CONFIG["h_dtype"] == "fp32" else dt
    state = lambda: chunk_state_pass(k, w, u, g_cum, h0, True, cu, CHUNK_SIZE, True, v=v if from_ainv else None,  # noqa
                                     beta=beta if from_ainv else None, ainv=ainv, h_dtype=hd, chunk_index=ci, rk=rk)
    h, v_new, _ = state()
    outp = lambda: chunk_output(q, k, v_new, h, g_cum, K ** -0.5, cu, CHUNK_SIZE, True, out_dtype=v.dtype,  # noqa
                                chunk_index=ci, rq=rq, rk=rk)
    res.update(t_state=_time_ms(state, iters=iters), t_output=_time_ms(outp, iters=iters))
    return res


def _main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="sweep chunk_gated_delta_rule forward configs on the GPU")
    p.add_argument("--quick", action="store_true", help="only the default config")
    p.add_argument("--stages", action="store_true", help="also time prepare / state / output separately")
    p.add_argument("--shapes", default=None, help="e.g. 1x8192:16/32,4x4096:16/32")
    p.add_argument("--configs", default=None, help="JSON list of config dicts (default: bench_configs())")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    shapes = None
    if a.shapes:
        fi = {(b, t, h, hv): ms for b, t, h, hv, ms in TARGET_SHAPES}
        shapes = []
        for item in a.shapes.split(","):
            bt, heads = item.split(":")
            b, t = (int(x) for x in bt.split("x"))
            h, hv = (int(x) for x in heads.split("/"))
            shapes.append((b, t, h, hv, fi.get((b, t, h, hv), float("nan"))))
    configs = [{}] if a.quick else (json.loads(a.configs) if a.configs else None)
    res = sweep(shapes, configs, iters=a.iters, stages=a.stages)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    # run the sweep in the imported module, so that CONFIG changes reach the public op (python -m loads this file a
    # second time as __main__, with its own CONFIG)
    from gdn.kernels import chunk_fwd as _mod

    _mod._main()
