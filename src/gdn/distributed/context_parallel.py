"""Context parallelism for the chunked gated delta rule over ``torch.distributed``.

Each rank of a process group holds a contiguous, rank-ordered slice along T of the same B sequences. The state
recurrence is affine in the state: over one slice, ``S_end = M @ S_start + H`` with ``M`` the ``[K, K]`` transition of
the slice (per batch row and value head) and ``H`` the slice's final state from a zero start. Outputs are affine in the
start state too: ``o_t = o_t(zero start) + Qt_t @ S_start`` with ``Qt_t = scale * M_t^T q_t`` (``M_t`` the transition
up to token t).

How one rank gets all of that from a single call of the public op
------------------------------------------------------------------
The recurrence acts on each column of the ``[K, V]`` state independently (k, g, beta mix rows, never columns), so the
rank appends K zero columns to ``v`` and starts from ``[0 | I]``::

    o_aug, S_aug = chunk_gated_delta_rule(q, k, [v | 0], g, beta, initial_state=[0 | I])
    o_aug = [o(zero start) | Qt],    S_aug = [H | M]

One call with ``V + K`` value columns instead of two or three calls (a transition pass ``v = 0, S0 = I`` plus a rerun
from the right start state): the intra-chunk work (gates, ``K K^T``, the triangular solve) is shared, only the V-sized
parts grow, and the state recurrence, which is sequential over chunks and parallel over value columns, gets more
parallel work at about the same latency. The output correction ``Qt @ S_start`` is one small batched GEMM, and the
backward needs no second pass either: the gradient reaching the start state is ``Qt^T do``, another small GEMM
(a rerun from the right start state would need a second backward through the transition to get it). When
``V + K`` exceeds what the kernels take (256), the same columns run as two calls (``v`` from 0, ``0`` from I).

Communication (independent of T): forward, one ``all_gather`` of ``[H | M]`` (``[B, HV, K, V + K]`` float32 per
rank); every rank folds the predecessors in order (``S = M_j S + H_j``) to get its start state and the final state of
the last rank. Backward, one ``all_gather`` of ``(G_r, dS_final_r)`` with ``G_r = Qt^T do`` (the gradient reaching the
slice's start state through its outputs); every rank folds its successors backwards (``a = M_j^T a + G_j``) to get the
gradient of its own end state, and backpropagates through its local call with
``d[o | Qt] = [do | do S_start^T]`` and ``d[H | M] = [a | a S_start^T]``.

Rank 0 needs no transition (its start state is the user's initial state): it runs the plain op from
``initial_state`` and sends ``[S_end | 0]``; it therefore has less work than the other ranks, and unequal slices
(rank 0 longer) balance the load.

``final_state`` is returned on every rank. Its gradient is the **sum** of the gradients given on all ranks (the
adjoint of broadcasting it), so a loss that uses it on only one rank is handled, and so is a replicated use.
Backward runs one collective per call: every rank of the group must backpropagate through the call (as with any
collective inside autograd).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["cp_chunk_gated_delta_rule"]

_LAYOUTS = ("v_last", "k_last")


# the Triton kernels take head dims up to this; a wider [v | 0] runs as two calls (columns are independent)
_MAX_AUG_COLS = 256


def _chunk_op(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, chunk_size):
    """The single-device op every rank calls (v_last layout, final state always returned)."""
    from gdn.ops import chunk_gated_delta_rule

    kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  state_layout="v_last", **kw)


def _local_affine(q, k, v, g, beta, scale, l2, chunk_size):
    """``([o0 | Qt], [H | M])`` of a slice, each as a list of tensors whose concatenation along the last dim is the
    pair: outputs and final state from a zero start, and their transitions (linear in the start state).

    One op call on ``[v | 0]`` from ``[0 | I]`` when ``V + K`` columns fit the kernels, else two calls (``v`` from 0,
    ``0`` from I); both are exact since the recurrence never mixes value columns.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, f32 = q.device, torch.float32
    eye = torch.eye(K, device=dev, dtype=f32).expand(B, HV, K, K)
    if V + K <= _MAX_AUG_COLS:
        v_aug = torch.cat([v, v.new_zeros(B, T, HV, K)], -1)
        init = torch.cat([torch.zeros(B, HV, K, V, device=dev, dtype=f32), eye], -1)
        o_aug, s_aug = _chunk_op(q, k, v_aug, g, beta, scale, init, l2, chunk_size)
        return [o_aug], [s_aug]
    o0, h = _chunk_op(q, k, v, g, beta, scale, None, l2, chunk_size)
    qt, m = _chunk_op(q, k, v.new_zeros(B, T, HV, K), g, beta, scale, eye.contiguous(), l2, chunk_size)
    return [o0, qt], [h, m]


def _split_last(parts, full: torch.Tensor):
    """``full`` cut along the last dim into the widths of ``parts``."""
    if len(parts) == 1:
        return [full]
    return list(torch.split(full, [p.shape[-1] for p in parts], dim=-1))


def _all_gather(x: torch.Tensor, group) -> List[torch.Tensor]:
    """``all_gather`` with a list (supported by NCCL and gloo alike)."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def _o0_qt(local_out, V):
    if len(local_out) == 1:
        x = local_out[0].detach()
        return x[..., :V], x[..., V:]
    return local_out[0].detach(), local_out[1].detach()


class _CPChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, l2, group, chunk_size):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        f32 = torch.float32
        inputs = (q, k, v, g, beta, h0)
        needs = tuple(bool(n) and x is not None for n, x in zip(ctx.needs_input_grad[:6], inputs))
        track = any(needs)
        leaves = tuple(None if x is None else x.detach().requires_grad_(n) if track else x.detach()
                       for x, n in zip(inputs, needs))
        lq, lk, lv, lg, lb, lh0 = leaves

        # ---- local pass: rank 0 from the user's initial state, the others from [0 | I] with K extra zero columns
        with torch.set_grad_enabled(track):
            if rank == 0:
                if T > 0:
                    o, s_end = _chunk_op(lq, lk, lv, lg, lb, scale, lh0, l2, chunk_size)
                else:
                    o = v.new_zeros(v.shape)
                    s_end = lh0.to(f32) if lh0 is not None else torch.zeros(B, HV, K, V, device=dev, dtype=f32)
                local_out, local_state = [o], [s_end]
                send = torch.cat([s_end.detach().to(f32), torch.zeros(B, HV, K, K, device=dev, dtype=f32)], -1)
            else:
                if T > 0:
                    local_out, local_state = _local_affine(lq, lk, lv, lg, lb, scale, l2, chunk_size)
                else:
                    local_out = [v.new_zeros(B, 0, HV, V + K)]
                    local_state = [torch.cat([torch.zeros(B, HV, K, V, device=dev, dtype=f32),
                                              torch.eye(K, device=dev, dtype=f32).expand(B, HV, K, K)], -1)]
                send = torch.cat([x.detach().to(f32) for x in local_state], -1)

        # ---- one collective: everybody's [H | M]; fold predecessors for the start state, everybody for the final
        gathered = _all_gather(send, group)
        Ms = [x[..., V:] for x in gathered]
        S = gathered[0][..., :V]
        s_start = None
        for j in range(1, world):
            if j == rank:
                s_start = S
            S = torch.matmul(Ms[j], S) + gathered[j][..., :V]
        final = S.clone()

        if rank == 0:
            out = local_out[0].detach()
        else:
            o0, qt = _o0_qt(local_out, V)
            if T > 0:  # o = o0 + Qt @ S_start, one batched GEMM (fp32 accumulation) per (batch, value head)
                corr = torch.einsum("bthk,bhkv->bthv", qt, s_start.to(qt.dtype))
                out = torch.add(o0, corr, out=torch.empty(B, T, HV, V, device=dev, dtype=o0.dtype))
            else:
                out = o0.clone()

        ctx.group, ctx.rank, ctx.world, ctx.V, ctx.track = group, rank, world, V, track
        ctx.needs = needs
        if track:
            ctx.leaves = leaves
            ctx.local = (local_out, local_state)
            ctx.Ms = Ms
            ctx.s_start = s_start
        return out, final

    @staticmethod
    def backward(ctx, do, dfinal):
        if not ctx.track:  # pragma: no cover - autograd only calls backward when something needs a gradient
            return (None,) * 10
        group, rank, world, V = ctx.group, ctx.rank, ctx.world, ctx.V
        local_out, local_state = ctx.local
        o_main = local_out[0]
        B, T, HV = o_main.shape[0], o_main.shape[1], o_main.shape[2]
        K = ctx.Ms[0].shape[-2]
        f32 = torch.float32
        dev = o_main.device
        if do is None:
            do = torch.zeros(B, T, HV, V, dtype=o_main.dtype, device=dev)
        if dfinal is None:
            dfinal = torch.zeros(B, HV, K, V, dtype=f32, device=dev)

        # gradient reaching this slice's start state through its outputs: G = Qt^T do (rank 0 has none)
        if rank > 0 and T > 0:
            qt = _o0_qt(local_out, V)[1]
            G = torch.einsum("bthk,bthv->bhkv", qt, do.to(qt.dtype)).to(f32)
        else:
            G = torch.zeros(B, HV, K, V, dtype=f32, device=dev)

        # ---- one collective: everybody's (G_j, dS_final_j); fold successors backwards to d(S_end) of this rank
        gathered = _all_gather(torch.stack([G, dfinal.to(f32)]), group)
        a = sum(x[1] for x in gathered)
        for j in range(world - 1, rank, -1):
            a = torch.matmul(ctx.Ms[j].transpose(-1, -2), a) + gathered[j][0]

        # ---- local backward through the saved graph of the op call
        # rank > 0: d[o0 | Qt] = [do | do S_start^T],  d[H | M] = [a | a S_start^T]
        if rank == 0:
            pairs = [(local_out[0], do), (local_state[0], a)]
        else:
            s = ctx.s_start
            d_out = torch.cat([do, torch.einsum("bthv,bhkv->bthk", do, s.to(do.dtype))], -1)
            d_state = torch.cat([a, torch.matmul(a, s.transpose(-1, -2))], -1)
            pairs = list(zip(local_out, _split_last(local_out, d_out))) + \
                list(zip(local_state, _split_last(local_state, d_state)))

        leaves = ctx.leaves
        wanted = [x for x, n in zip(leaves, ctx.needs) if n]
        outs, gouts = [], []
        for o_, go in pairs:
            if o_.requires_grad:
                outs.append(o_)
                gouts.append(go.to(o_.dtype))
        grads = iter(torch.autograd.grad(outs, wanted, gouts, allow_unused=True) if outs else [None] * len(wanted))
        result = []
        for x, n in zip(leaves, ctx.needs):
            if not n:
                result.append(None)
                continue
            gx = next(grads)
            result.append(torch.zeros_like(x) if gx is None else gx)
        # free the saved graph
        del ctx.leaves, ctx.local, ctx.Ms, ctx.s_start
        return (*result, None, None, None, None)


def cp_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, scale: Optional[float] = None,
                              initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, *, group=None, state_layout: str = "v_last",
                              chunk_size: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Context-parallel :func:`gdn.ops.chunk_gated_delta_rule` over the ranks of ``group`` (default: the world).

    Every rank passes its own contiguous slice along T (``q, k: [B, T_r, H, K]``, ``v: [B, T_r, HV, V]``,
    ``g, beta: [B, T_r, HV]``) of the same B sequences, in rank order; slice lengths may differ (0 included).
    ``initial_state`` (``[B, HV, K, V]`` for ``"v_last"``, ``[B, HV, V, K]`` for ``"k_last"``) is read on rank 0 only.
    Returns ``(o_local [B, T_r, HV, V], final_state)`` where ``final_state`` (float32, the state after the last token
    of the last rank) is given on every rank when ``output_final_state`` and is ``None`` otherwise.

    Forward and backward equal the single-device op on the concatenated sequence; gradients flow to each rank's
    q, k, v, g, beta and to rank 0's ``initial_state``. The gradient of ``final_state`` is summed over the ranks.
    Communication: one ``all_gather`` of ``B * HV * K * (V + K)`` floats per rank forward, one of ``2 * B * HV * K * V``
    backward. ``chunk_size`` (extra, optional) is passed to the op.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_chunk_gated_delta_rule: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    if state_layout not in _LAYOUTS:
        raise ValueError(f"state_layout: expected one of {_LAYOUTS}, got {state_layout!r}")
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != nd:
            raise ValueError(f"{name}: expected a {nd}-D tensor, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape [B, T, H, K] = {tuple(q.shape)} (q's), got {tuple(k.shape)}")
    if v.shape[:2] != (B, T) or HV % H != 0:
        raise ValueError(f"v: expected shape [B, T, HV, V] = [{B}, {T}, multiple of {H}, *], got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            raise ValueError(f"{name}: expected shape [B, T, HV] = [{B}, {T}, {HV}], got {tuple(x.shape)}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    h0 = None
    if rank == 0 and initial_state is not None:
        want = (B, HV, K, V) if state_layout == "v_last" else (B, HV, V, K)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"initial_state: expected shape {list(want)} ({state_layout}), got {got}")
        h0 = initial_state if state_layout == "v_last" else initial_state.transpose(-1, -2)
        h0 = h0.contiguous()
    o, final = _CPChunkGatedDeltaRule.apply(q, k, v, g, beta, h0, scale, bool(use_qk_l2norm_in_kernel), group,
                                            chunk_size)
    if not output_final_state:
        return o, None
    return o, final if state_layout == "v_last" else final.transpose(-1, -2)
