"""How a row split into rank shards meets the documents packed into it (shared by the context-parallel ops).

The row of ``T`` tokens is cut into contiguous, rank-ordered shards ``[a_r, b_r)`` (``offsets[r] = a_r``; a shard may
be empty). Its documents are ``[s_n, e_n)`` (global ``cu_seqlens``; without ``cu_seqlens`` one document ``[0, T)``
per batch row, all rows sharing the split). Everything here is plain Python on host integers, computed identically
on every rank, so every rank takes the same decisions about who sends what without talking.

A document *crosses* position ``p`` when ``s_n < p < e_n``; at most one (non-empty) document crosses a position. For
rank r: ``enter`` = the document crossing ``a_r`` (its first ``L`` tokens of the shard continue a state from the
left), ``leave`` = the document crossing ``b_r``; ``passthru`` when they are the same document (the shard lies inside
it). ``local_docs`` = the non-empty documents that start inside the shard after the entering part.
"""
from __future__ import annotations

import bisect
from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class RankPart(NamedTuple):
    a: int                      # global position of the shard's first token
    b: int                      # one past its last
    enter: Optional[int]        # document crossing a (continues from the previous rank), or None
    leave: Optional[int]        # document crossing b (continues on the next rank), or None
    L: int                      # tokens of the entering document in this shard (0 without one)
    local_docs: Tuple[int, ...]  # non-empty documents starting in [a + L, b), in order
    owned: Tuple[int, ...]      # non-empty documents whose last token is in this shard, in order

    @property
    def passthru(self) -> bool:
        return self.enter is not None and self.enter == self.leave


class Layout(NamedTuple):
    offsets: Tuple[int, ...]          # [world + 1] shard offsets
    docs: Tuple[Tuple[int, int], ...]  # (s, e) of every document
    parts: Tuple[RankPart, ...]        # one per rank
    any_crossing: bool                 # some document crosses some shard boundary
    max_owned: int                     # most documents ending on one rank

    def empty_docs(self) -> List[int]:
        return [n for n, (s, e) in enumerate(self.docs) if e <= s]


@lru_cache(maxsize=256)
def make_layout(offsets: Tuple[int, ...], docs: Tuple[Tuple[int, int], ...]) -> Layout:
    """The plan of every rank (see the module docstring) for shard ``offsets`` and documents ``docs``."""
    world = len(offsets) - 1
    nonempty = [n for n, (s, e) in enumerate(docs) if e > s]
    starts = [docs[n][0] for n in nonempty]

    def crossing(p: int) -> Optional[int]:
        i = bisect.bisect_left(starts, p) - 1  # last non-empty document starting before p
        if i >= 0 and docs[nonempty[i]][1] > p:
            return nonempty[i]
        return None

    owned: List[List[int]] = [[] for _ in range(world)]
    for n in nonempty:  # the rank holding token e - 1 (the last rank with a_j <= e - 1: never an empty shard)
        owned[bisect.bisect_right(offsets, docs[n][1] - 1) - 1].append(n)
    parts = []
    for r in range(world):
        a, b = offsets[r], offsets[r + 1]
        enter, leave = crossing(a), crossing(b)
        L = min(docs[enter][1], b) - a if enter is not None else 0
        lo, hi = bisect.bisect_left(starts, a + L), bisect.bisect_left(starts, b)
        local = tuple(nonempty[i] for i in range(lo, hi)) if a + L < b else ()
        parts.append(RankPart(a, b, enter, leave, L, local, tuple(owned[r])))
    return Layout(tuple(offsets), tuple(docs), tuple(parts), any(p.leave is not None for p in parts),
                  max((len(o) for o in owned), default=0))


def shard_offsets(T_local: int, device, group, shard_lengths: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """``[world + 1]`` offsets of the shards: from ``shard_lengths`` (every rank's slice length, rank order) when
    given, else one ``all_gather`` of the lengths (a host synchronisation)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if shard_lengths is None:
        t = torch.tensor([T_local], dtype=torch.int64, device=device)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=group)
        lens = [int(x.item()) for x in out]
    else:
        lens = [int(x) for x in shard_lengths]
        if len(lens) != world or lens[rank] != T_local or min(lens) < 0:
            raise ValueError(f"shard_lengths: expected {world} non-negative lengths (one per rank) with entry {rank} "
                             f"= {T_local} (this rank's slice), got {list(shard_lengths)}")
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return tuple(offs)


def doc_bounds(cu_seqlens: Optional[torch.Tensor], total: int) -> Tuple[Tuple[int, int], ...]:
    """Documents ``(s, e)`` from global ``cu_seqlens`` (validated: starts at 0, non-decreasing, ends at ``total``),
    or the single ``(0, total)`` of the batch form."""
    if cu_seqlens is None:
        return ((0, total),)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens: expected a 1-D int32/int64 tensor [N + 1] of global offsets, got "
                         + (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
                            if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__))
    c = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    if c[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {c[0]}")
    if any(y < x for x, y in zip(c, c[1:])):
        raise ValueError("cu_seqlens: must be non-decreasing")
    if c[-1] != total:
        raise ValueError(f"cu_seqlens: must end at {total} (the total of all ranks' slices), got {c[-1]}")
    return tuple(zip(c[:-1], c[1:]))


def all_gather(x: torch.Tensor, group) -> List[torch.Tensor]:
    """``all_gather`` into a list (NCCL and gloo alike)."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out
