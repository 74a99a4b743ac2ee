"""Host planning of the chunked kernels: chunk tables (which sequence and chunk every program handles) and the
segments of the long-sequence split, with the cost models that decide whether to split (forward and reverse pass).

Reads ``cu_seqlens`` on the host once per distinct value (tables are cached on the device).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from .. import tuning
from .common import CHUNK_SIZE
from ..common import cdiv


class ChunkIndex(NamedTuple):
    """Chunk bookkeeping shared by all kernels.

    N: number of sequences; NT: total number of chunks; nchunks: chunks per sequence (host list);
    chunk_indices: int32 [NT, 2] = (sequence n, chunk c within the sequence) on the device;
    chunk_offsets: int32 [N + 1] global index of the first chunk of every sequence (host list ``offsets`` too);
    is_varlen: whether ``cu_seqlens`` was given (then B == 1);
    chunk_spans (varlen, where ``chunk_fwd.prepare_sm90_chunk_spans`` asks for it, else None): int32 [NT, 2] =
    (bos, eos), the token span of every chunk's sequence, so that a kernel reads a chunk's rows after one table load
    instead of two dependent ones (chunk_indices, then cu_seqlens).
    The device tables are views of one buffer, filled by one host-to-device copy.
    """
    N: int
    NT: int
    chunk_size: int
    nchunks: List[int]
    offsets: List[int]
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    is_varlen: bool
    chunk_spans: Optional[torch.Tensor] = None


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
                          device=None, cu_seqlens_cpu=None) -> ChunkIndex:
    """Chunk tables for ``cu_seqlens`` (varlen, B == 1) or B sequences of length T. Reads cu_seqlens on the host
    (a device-to-host copy that waits for the GPU) unless ``cu_seqlens_cpu`` (its values as a CPU tensor or a
    sequence of ints) is given."""
    if cu_seqlens is not None:
        device = cu_seqlens.device
        src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
        cu = tuple(int(x) for x in (src.tolist() if isinstance(src, torch.Tensor) else src))
        # the span table only where a kernel reads it
        spans = bool(tuning.chunk_fwd(device).prepare_sm90_chunk_spans)
        key = ("varlen", cu, chunk_size, str(device), spans)
    else:
        device = torch.device(device) if device is not None else torch.device("cpu")
        cu = spans = None
        key = ("batch", B, T, chunk_size, str(device))
    return _cached(key, lambda: _build_chunk_indices(cu, T, chunk_size, B, device, spans))


def _build_chunk_indices(cu, T, chunk_size, B, device, spans=False) -> ChunkIndex:
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
    tables = [torch.stack([seq, within], 1)]
    if is_varlen and spans:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        tables.append(torch.stack([cu_t[seq.long()], cu_t[seq.long() + 1]], 1))
    tables.append(torch.tensor(offsets, dtype=torch.int32))
    chunk_table, *span_table, chunk_offsets = _to_device_at_once(tables, device)
    return ChunkIndex(len(lens), NT, chunk_size, nchunks, offsets, chunk_table, chunk_offsets, is_varlen,
                      span_table[0] if span_table else None)


def _to_device_at_once(tables, device) -> list:
    """int32 host tensors -> views of one device buffer, filled by one host-to-device copy; each view starts on a
    16-byte boundary, as a tensor of its own would."""
    starts, n = [], 0
    for t in tables:
        starts.append(n)
        n += -(-t.numel() // 4) * 4
    host = torch.zeros(n, dtype=torch.int32)
    for t, s0 in zip(tables, starts):
        host[s0:s0 + t.numel()] = t.reshape(-1)
    dev = host.to(device)
    return [dev[s0:s0 + t.numel()].view(t.shape) for t, s0 in zip(tables, starts)]


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


def one_wave_tile(programs: int, V: int, device, tiles=(32, 64)) -> int:
    """The first V tile of ``tiles`` that divides V and whose grid of ``programs`` x (V / tile) CTAs fits one wave of
    one CTA per SM (the sm_90 sequential passes: a chunk step slows down when SMs are shared), else 0."""
    for bv in tiles:
        if V % bv == 0 and programs * (V // bv) <= _num_sms(device):
            return bv
    return 0


def segment_count(ci: ChunkIndex, seg_len: int) -> int:
    """Segments of :func:`plan_segments` with ``seg_len`` chunks each (a sequence of at most one segment, an empty
    one included, is one)."""
    return sum(cdiv(nc, seg_len) if nc else 1 for nc in ci.nchunks)


def one_wave_segment_len(ci: ChunkIndex, programs: int, device, min_len: int) -> int:
    """Chunks per segment (a power-of-two multiple of ``min_len``) of the shortest segments whose launch of
    ``programs`` CTAs per segment fits one wave, one CTA per SM (the sm_90 segmented passes); 0 where no such split
    cuts a sequence in two."""
    room, longest = _num_sms(device) // programs, max(ci.nchunks)
    L = max(1, min_len)
    while L < longest and segment_count(ci, L) > room:
        L *= 2
    return L if L < longest else 0


def choose_segment_len(ci: ChunkIndex, HV: int, V: int, BV: int, device, force: Optional[int] = None,
                       K: Optional[int] = None, plain_cost: Optional[float] = None) -> Optional[int]:
    """Chunks per segment for the segmented state pass, or None for the plain sequential pass.

    Cost model (in "chunk steps" of one state-pass program): the plain pass takes ``waves(N*HV*nV) * max_chunks``;
    segments of L chunks take ``waves(S*HV*(nV+nK)) * L`` (local states + transition matrices, one launch) +
    ``waves(S*HV*nV) * L`` (the pass from the true starts) + the merge, with ``waves(p) = ceil(p / slots)`` and
    ``slots = SMs * state_ctas_per_sm`` (tuning table ``chunk_fwd``). Segmenting triples the work, so it only pays when the plain
    pass leaves most SMs idle (few sequences x heads, many chunks). ``plain_cost``: the plain pass's cost in those
    units when another kernel runs it (the sm_90 pass of ``hopper.py``).
    """
    cfg = tuning.chunk_fwd(device)
    seg = cfg.segment_chunks if force is None else force
    if seg is None or seg < 0:
        return None
    if seg > 0:
        return int(seg)
    if device.type != "cuda" or ci.NT == 0:
        return None
    maxc = max(ci.nchunks)
    if maxc < int(cfg.segment_min_chunks):
        return None
    slots = max(1, int(_num_sms(device) * float(cfg.state_ctas_per_sm)))
    nv = cdiv(V, BV)
    nk = cdiv(K if K is not None else V, BV)

    def waves(p):
        return -(-p // slots)

    base = waves(ci.N * HV * nv) * maxc if plain_cost is None else plain_cost
    best, best_cost = None, None
    L = max(1, int(cfg.segment_min_len))
    while L * 2 <= maxc:
        S = segment_count(ci, L)
        per_seq = -(-maxc // L)
        cost = (waves(S * HV * (nv + nk)) + waves(S * HV * nv)) * L + float(cfg.segment_merge_cost) * per_seq
        if best_cost is None or cost < best_cost:
            best, best_cost = L, cost
        L *= 2
    if best is None or best_cost > float(cfg.segment_gain) * base:
        return None
    return best


def choose_reverse_segment_len(ci: ChunkIndex, HV: int, nv: int, device, force: Optional[int] = None) -> Optional[int]:
    """Chunks per segment of the backward's segmented reverse pass, or None for the plain sequential pass.

    ``force`` (else the ``chunk_bwd.segment_chunks`` tuning field): -1 never, n > 0 segments of n chunks, 0
    heuristic (CUDA only): segment when fewer programs than SMs would run the plain pass and a sequence has >= 16
    chunks, aiming at 2 programs per SM and >= 8 chunks per segment."""
    if force is None:
        force = tuning.chunk_bwd(device).segment_chunks
    if force is not None and force != 0:
        return None if force < 0 else int(force)
    if device.type != "cuda" or not ci.nchunks:
        return None
    sms = _num_sms(device)
    longest = max(ci.nchunks)
    if ci.N * HV * nv >= sms or longest < 16:
        return None
    seg = max(8, -(-sum(ci.nchunks) * HV * nv // (2 * sms)))
    return None if seg >= longest else seg


def get_chunk_index(cu_seqlens, T, B, chunk_size, given: Optional[ChunkIndex], device) -> ChunkIndex:
    """``given``, or the chunk tables of ``cu_seqlens`` / B sequences of length T."""
    if given is not None:
        return given
    return prepare_chunk_indices(cu_seqlens, T, chunk_size, B, device=device)
