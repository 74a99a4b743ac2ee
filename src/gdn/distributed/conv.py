"""Context-parallel causal conv1d: the GDN block's depthwise conv over a row split into rank shards.

``y[t] = act(bias + sum_j weight[:, j] * x[t - (W - 1) + j])`` within each document. The first ``W - 1`` outputs of
a shard's entering document (the one that started on a previous rank) need the ``W - 1`` inputs before the shard:
the *halo*. A shard shorter than ``W - 1`` holds only part of it, so every rank contributes its last ``W - 1``
inputs (fewer if its shard is shorter, zero-padded) to one ``all_gather`` (``world * B * (W - 1) * D`` values, a few
KB) and each rank assembles its halo from its predecessors' tails, keeping only positions inside the entering
document (no halo across a document start). Backward: one ``all_gather`` of the halo gradients; each rank adds what
its successors send back for its own tail positions to its input gradient. Nothing is exchanged when no document
crosses a shard boundary.

Local work: the single-device op on the whole shard (local ``cu_seqlens``, zero history for every document), then
the first ``min(W - 1, L)`` outputs of the entering document are recomputed with the halo in plain PyTorch and
written over (a few rows). ``weight`` / ``bias`` gradients are each rank's partial sums.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ._shards import Layout, all_gather, doc_bounds, make_layout, shard_offsets

__all__ = ["cp_causal_conv1d"]


def _halo(tails, layout: Layout, rank: int, W1: int) -> torch.Tensor:
    """``[B, W1, D]``: the inputs at global positions ``[a - W1, a)`` (oldest first) that belong to the document
    entering this rank's shard, zeros elsewhere; ``tails[j]`` holds rank j's last ``W1`` inputs (right-aligned)."""
    part = layout.parts[rank]
    halo = torch.zeros_like(tails[0])
    start = max(layout.docs[part.enter][0], part.a - W1)
    for p in range(start, part.a):
        j = max(i for i in range(rank) if layout.offsets[i] <= p < layout.offsets[i + 1])
        halo[:, p - (part.a - W1)] = tails[j][:, p - (layout.offsets[j + 1] - W1)]
    return halo


class _CPConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, layout: Layout, rank, packed, group):
        from gdn.ops import causal_conv1d
        from gdn.ops.conv import _activation
        from gdn.reference import causal_conv1d_ref

        part = layout.parts[rank]
        B, T, D = x.shape
        W1 = weight.shape[1] - 1
        needs = tuple(bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:3], (x, weight, bias)))
        track = any(needs)
        leaves = tuple(None if t is None else t.detach().requires_grad_(n) if track else t.detach()
                       for t, n in zip((x, weight, bias), needs))
        lx, lw, lb = leaves

        # ---- the tails of every rank -> this rank's halo
        halo = None
        if layout.any_crossing and W1 > 0:
            tail = x.new_zeros(B, W1, D)
            m = min(T, W1)
            if m:
                tail[:, W1 - m:] = x[:, T - m:]
            tails = all_gather(tail, group)
            if part.enter is not None:
                halo = _halo(tails, layout, rank, W1)
        lhalo = None if halo is None else halo.requires_grad_(track)

        with torch.set_grad_enabled(track):
            cu = None
            if packed and T > 0:
                pts = sorted({0, T} | {s - part.a for s, e in layout.docs if part.a < s < part.b and e > s})
                cu = torch.tensor(pts, dtype=torch.int32, device=x.device)
            y = causal_conv1d(lx, lw, lb, activation, cu_seqlens=cu)
            m = min(W1, part.L)
            if lhalo is not None and m > 0:  # the entering document's first outputs, with the halo before them
                head, _ = causal_conv1d_ref(lx[:, :m], lw, lb, "silu" if _activation(activation) else None,
                                            initial_conv_state=lhalo.transpose(1, 2))
                y[:, :m] = head
        ctx.layout, ctx.rank, ctx.group, ctx.track, ctx.needs, ctx.W1 = layout, rank, group, track, needs, W1
        if track:
            ctx.leaves, ctx.halo, ctx.y = leaves, lhalo, y
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        layout, rank, W1 = ctx.layout, ctx.rank, ctx.W1
        lx = ctx.leaves[0]
        B, T, D = lx.shape
        wanted = [t for t, n in zip(ctx.leaves, ctx.needs) if n]
        halo = ctx.halo
        if halo is not None:
            wanted.append(halo)
        grads = list(torch.autograd.grad([ctx.y], wanted, [dy], allow_unused=True))
        dhalo = grads.pop() if halo is not None else None
        it = iter(grads)
        res = [None if not n else (lambda gx, t: torch.zeros_like(t) if gx is None else gx)(next(it), t)
               for t, n in zip(ctx.leaves, ctx.needs)]
        if layout.any_crossing and W1 > 0:
            # every rank's halo gradient (zeros without a halo) back to the ranks owning those inputs
            mine = torch.zeros(B, W1, D, dtype=lx.dtype, device=lx.device)
            if dhalo is not None:  # only the slots inside the entering document are inputs (the others are zeros)
                part = layout.parts[rank]
                n = part.a - max(layout.docs[part.enter][0], part.a - W1)
                mine[:, W1 - n:] = dhalo[:, W1 - n:]
            every = all_gather(mine, ctx.group)
            a, b = layout.offsets[rank], layout.offsets[rank + 1]
            if ctx.needs[0] and b > a:
                dx = res[0]
                for j in range(rank + 1, len(layout.parts)):
                    aj = layout.offsets[j]
                    for p in range(max(a, aj - W1), min(b, aj)):  # positions of this shard in rank j's halo
                        dx[:, p - a] += every[j][:, p - (aj - W1)]
        del ctx.leaves, ctx.halo, ctx.y
        return (*res, None, None, None, None, None)


def cp_causal_conv1d(x_local: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     activation="silu", *, cu_seqlens: Optional[torch.Tensor] = None, group=None,
                     shard_lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Context-parallel :func:`gdn.ops.causal_conv1d` over the ranks of ``group`` (default: the world).

    ``x_local`` ``[B, T_r, D]`` is this rank's contiguous slice along T (rank order; lengths may differ, 0
    included) of the same B sequences, or, with ``cu_seqlens`` (global ``[N + 1]`` offsets into the concatenated row,
    the same on every rank; B == 1), of a packed row of N documents. ``weight`` ``[D, W]``, ``bias`` ``[D]`` on every
    rank. Returns ``y_local`` ``[B, T_r, D]``: the slice of the single-device conv of the whole row (the ``W - 1``
    inputs before the slice come from the previous ranks, never across a document start). Differentiable: the halo's
    gradient goes back to the ranks that own those inputs; ``weight`` / ``bias`` gradients are each rank's partial
    sums (their sum over the group is the single-device gradient). Every rank must backpropagate through the call.
    ``shard_lengths`` (every rank's ``T_r``) saves the small ``all_gather`` that otherwise finds them.
    """
    from gdn.ops import causal_conv1d

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_causal_conv1d: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    if not isinstance(x_local, torch.Tensor) or x_local.dim() != 3:
        raise ValueError("x_local: expected a tensor [B, T_r, D], got "
                         + (str(tuple(x_local.shape)) if isinstance(x_local, torch.Tensor) else type(x_local).__name__))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != x_local.shape[-1]:
        raise ValueError(f"weight: expected [D, W] with D = {x_local.shape[-1]}, got "
                         + (str(tuple(weight.shape)) if isinstance(weight, torch.Tensor) else type(weight).__name__))
    if cu_seqlens is not None and x_local.shape[0] != 1:
        raise ValueError(f"cu_seqlens: packed rows need B == 1, got B = {x_local.shape[0]}")
    # the op validates the rest (dtypes, bias, activation) on a zero-length slice before anything is exchanged
    causal_conv1d(x_local[:, :0], weight, bias, activation)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    offsets = shard_offsets(x_local.shape[1], x_local.device, group, shard_lengths)
    layout = make_layout(offsets, doc_bounds(cu_seqlens, offsets[-1]))
    return _CPConv.apply(x_local, weight, bias, activation, layout, rank, cu_seqlens is not None, group)
