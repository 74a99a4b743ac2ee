"""Context parallelism for the chunked gated delta rule over ``torch.distributed``, packed (varlen) rows included.

Each rank of a process group holds a contiguous, rank-ordered slice along T: of the same B sequences (batch form), or,
with global ``cu_seqlens``, of one packed row of N documents (B == 1), where a document may lie inside one slice,
cross one boundary or cross several slices. Only a document that crosses a slice boundary needs anything from
another rank, and at most one document crosses each boundary.

The math
--------
The recurrence is affine in the state: over a rank's part of a document, ``S_out = M S_in + H`` with ``M`` the
``[K, K]`` transition of that part (per value head) and ``H`` its end state from a zero start; the outputs are
``o_t = o_t(zero start) + Qt_t S_in`` with ``Qt_t = scale * q_t^T M_t`` (``M_t`` the transition up to token t).

Two phases, one exchange
------------------------
1. **Local phase** (no communication). Rank r runs

   * the *entering* document (the one crossing the slice's left edge; its first ``L`` tokens here) from a zero start
     while computing its transition: one op call on ``[v | 0]`` from ``[0 | I]`` gives ``[o0 | Qt]`` and
     ``[H | M]`` (the recurrence never mixes value columns, so K extra zero columns started from the identity carry
     the transition; the intra-chunk work -- gates, ``K K^T``, the triangular solve -- is shared, only the V-sized
     parts grow by K columns); two calls (``v`` from 0, ``0`` from I) when ``V + K`` exceeds the kernels' 256;
   * every document that starts in the slice after that (``local_docs``) with the plain op on ``cu_seqlens``, from
     their own ``initial_state`` rows: exact outputs and end states, no transition. A rank whose slice starts a new
     document has only this part: it never waits for anybody's transition work.

2. **One exchange.** Every rank contributes one fixed-size tensor for its right boundary, ``[H | M]``
   (``[B, HV, K, V + K]`` float32): the entering document's ``[H | M]`` if it passes through the whole slice, the
   exact end state ``[S | 0]`` of the document it started if that one leaves the slice, zeros if no document crosses
   the boundary; one ``all_gather``. Rank r folds ``S = M_j S + H_j`` over ``j < r`` (a scan over at most
   ``world`` small matrices; a zero ``M`` restarts it) to get its entering document's start state ``S_in``. When no
   document crosses any boundary, nothing is exchanged.

3. **Correction.** ``o[:L] = o0 + Qt S_in`` (one small batched GEMM, ``2 L K V`` flops per value head) and, if the
   entering document ends here, its final state ``M S_in + H``.

Why this correction and not a rerun: rerunning the op on the entering document from ``S_in`` is exact too, but it
can only start after the exchange, i.e. after the previous ranks' whole local phase, so its ``L`` tokens are
serialised behind them (with one document crossing two equal halves, rank 1 finishes at ``t(T/2) + t(T/2)``: no
speed-up at all). The K extra columns are computed inside the local phase, in parallel with the other ranks, and
cost only the V-sized parts of the op for ``L`` tokens (measured on an H200, 1 x 32768 tokens, 16/32 heads,
K = V = 128: the ``V + K`` call is 1.44x the plain call, forward and forward + backward), and the backward needs no
second pass either: the gradient reaching ``S_in`` is ``Qt^T do``. Documents that do not cross a boundary cost
exactly what they cost on one GPU, so with equal shards only the crossing documents' parts add work.

Backward: if final states are returned, one ``all_reduce`` of their gradient (``[N, ...]``; the gradient of a
replicated output is the sum of what every rank gives it). Then one ``all_gather`` of ``c_r = Qt^T do (+ M^T
dfinal`` when the entering document ends on rank r), ``[B, HV, K, V]``; every rank folds its successors backwards,
``lam = c_j + M_j^T lam`` (``M_j`` zero unless the document passes through rank j), to get the gradient of its own
right-boundary state, and backpropagates through its local calls with ``d[o0 | Qt] = [do | do S_in^T]`` and
``d[H | M] = [mu | mu S_in^T]`` (``mu``: the gradient of the entering document's end state here).

Final states are all-gathered (each document's from the rank holding its last token; ``[max_owned, B, HV, K, V]``
per rank) so that every rank returns all N. Gradients of ``initial_state`` are each rank's partial sums (rows of
the documents that start on the rank; an empty document's row gets the rank's own ``final_state`` gradient): their
sum over the group is the single-process gradient. Every rank of the group must backpropagate through the call (it
holds collectives), as with any collective inside autograd.

Communication per call (independent of T): the shard lengths (one ``all_gather`` of one integer, skipped with
``shard_lengths=``), forward ``world * B * HV * K * (V + K)`` floats gathered, backward ``world * B * HV * K * V``,
plus the final states (``world * max_owned * B * HV * K * V`` forward, ``N * B * HV * K * V`` all-reduced backward)
when ``output_final_state``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._shards import Layout, all_gather, doc_bounds, make_layout, shard_offsets

__all__ = ["cp_chunk_gated_delta_rule"]

_LAYOUTS = ("v_last", "k_last")

# the Triton kernels take head dims up to this; a wider [v | 0] runs as two calls (columns are independent)
_MAX_AUG_COLS = 256


def _chunk_op(q, k, v, g, beta, scale, initial_state, l2, chunk_size, cu_seqlens=None):
    """The single-device op every rank calls (v_last layout, final state always returned)."""
    from gdn.ops import chunk_gated_delta_rule

    kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2,
                                  state_layout="v_last", **kw)


def _local_affine(q, k, v, g, beta, scale, l2, chunk_size):
    """``([o0 | Qt], [H | M])`` of one stretch of tokens (batch rows = lanes), each as a list of tensors whose
    concatenation along the last dim is the pair: outputs and final state from a zero start, and their transitions
    (linear in the start state). One call on ``[v | 0]`` from ``[0 | I]`` when ``V + K`` columns fit the kernels,
    else two calls (``v`` from 0, ``0`` from I); both exact since the recurrence never mixes value columns."""
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


def _cols(parts: List[torch.Tensor], V: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``[: V]`` and ``[V :]`` columns of a ``[x | y]`` pair kept as one tensor or two (detached)."""
    if len(parts) == 1:
        x = parts[0].detach()
        return x[..., :V], x[..., V:]
    return parts[0].detach(), parts[1].detach()


def _mT(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


class _CPChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, layout: Layout, rank, packed, scale, l2, group, chunk_size, want_final):
        world = len(layout.parts)
        part = layout.parts[rank]
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        Nd = len(layout.docs)
        dev, f32 = q.device, torch.float32
        L = part.L
        inputs = (q, k, v, g, beta, h0)
        needs = tuple(bool(n) and x is not None for n, x in zip(ctx.needs_input_grad[:6], inputs))
        track = any(needs)
        leaves = tuple(None if x is None else x.detach().requires_grad_(n) if track else x.detach()
                       for x, n in zip(inputs, needs))
        lq, lk, lv, lg, lb, lh0 = leaves
        e_out = e_state = r_out = r_state = None
        with torch.set_grad_enabled(track):
            h0v = None if lh0 is None else lh0.view(Nd, B, HV, K, V)  # [documents, lanes, ...]
            # ---- local phase: the entering document (zero start + transition), then the documents starting here
            if L > 0:
                e_out, e_state = _local_affine(*(x[:, :L] for x in (lq, lk, lv, lg, lb)), scale, l2, chunk_size)
            if T > L:
                docs = part.local_docs
                init = None if h0v is None else h0v[list(docs)].flatten(0, 1)
                cu = None
                if packed:
                    base = part.a + L
                    pts = [layout.docs[n][0] - base for n in docs] + [min(layout.docs[docs[-1]][1], part.b) - base]
                    cu = torch.tensor(pts, dtype=torch.int32, device=dev)
                r_out, r_state = _chunk_op(*(x[:, L:] for x in (lq, lk, lv, lg, lb)), scale, init, l2, chunk_size,
                                           cu)
        if e_out is not None:
            o0, qt = _cols(e_out, V)
            h_e, m_e = _cols(e_state, V)
        elif part.passthru:  # an empty slice inside a document: S_out = S_in
            h_e = torch.zeros(B, HV, K, V, device=dev, dtype=f32)
            m_e = torch.eye(K, device=dev, dtype=f32).expand(B, HV, K, K)
        fin_r = None if r_state is None else r_state.detach().view(-1, B, HV, K, V)  # [local docs, lanes, ...]

        # ---- one exchange: the right boundary's [H | M] of every rank; fold the predecessors for S_in
        Ms: List[Optional[torch.Tensor]] = [None] * world
        s_in = None
        if layout.any_crossing:
            send = torch.zeros(B, HV, K, V + K, device=dev, dtype=f32)
            if part.passthru:
                send[..., :V] = h_e
                send[..., V:] = m_e
            elif part.leave is not None:  # the last local document leaves the slice: its end state is exact
                send[..., :V] = fin_r[-1]
            gathered = all_gather(send, group)
            Ms = [x[..., V:] for x in gathered]
            if part.enter is not None:
                S = torch.zeros(B, HV, K, V, device=dev, dtype=f32)
                for j in range(rank):
                    S = torch.matmul(Ms[j], S) + gathered[j][..., :V]
                s_in = S

        # ---- correction: o[:L] = o0 + Qt S_in (written into the output; the local documents' part copied beside)
        if L == 0:
            out = r_out.detach() if r_out is not None else v.new_zeros(B, 0, HV, V)
        else:
            out = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
            torch.add(o0, torch.einsum("bthk,bhkv->bthv", qt, s_in.to(qt.dtype)), out=out[:, :L])
            if T > L:
                out[:, L:] = r_out.detach()

        # ---- final states of all documents on every rank (each from the rank holding its last token)
        final = None
        if want_final:
            mine = []
            for n in part.owned:
                if n == part.enter:
                    mine.append(torch.matmul(m_e, s_in) + h_e)
                else:
                    mine.append(fin_r[part.local_docs.index(n)])
            pad = torch.zeros(max(layout.max_owned, 1), B, HV, K, V, device=dev, dtype=f32)
            if mine:
                pad[:len(mine)] = torch.stack(mine)
            every = all_gather(pad, group)
            final = torch.zeros(Nd, B, HV, K, V, device=dev, dtype=f32)
            for j, p in enumerate(layout.parts):
                for i, n in enumerate(p.owned):
                    final[n] = every[j][i]
            for n in layout.empty_docs():
                if h0v is not None:
                    final[n] = h0v[n].detach().to(f32)
            final = final.view(Nd * B, HV, K, V)

        ctx.layout, ctx.rank, ctx.group, ctx.want_final, ctx.V, ctx.track = layout, rank, group, want_final, V, track
        ctx.needs = needs
        if track:
            ctx.leaves = leaves
            ctx.local = (e_out, e_state, r_out, r_state)
            ctx.Ms, ctx.s_in = Ms, s_in
            ctx.m_e = m_e if (L > 0 or part.passthru) else None
        return out, final

    @staticmethod
    def backward(ctx, do, dfinal):
        if not ctx.track:  # pragma: no cover - autograd only calls backward when something needs a gradient
            return (None,) * 14
        layout, rank, group, V = ctx.layout, ctx.rank, ctx.group, ctx.V
        world = len(layout.parts)
        part = layout.parts[rank]
        e_out, e_state, r_out, r_state = ctx.local
        lq, lv = ctx.leaves[0], ctx.leaves[2]
        B, T, H, K = lq.shape
        HV = lv.shape[2]
        Nd = len(layout.docs)
        dev, f32 = lq.device, torch.float32
        L, s_in, m_e = part.L, ctx.s_in, ctx.m_e
        if do is None:
            do = torch.zeros(B, T, HV, V, dtype=lv.dtype, device=dev)

        # gradient of every document's final state, summed over the ranks (the adjoint of replicating it)
        dfin = None
        if ctx.want_final:
            dfin = torch.zeros(Nd * B, HV, K, V, dtype=f32, device=dev) if dfinal is None \
                else dfinal.to(f32).contiguous().clone()
            dist.all_reduce(dfin, group=group)
            dfin = dfin.view(Nd, B, HV, K, V)

        # ---- one exchange: c_j = gradient reaching rank j's S_in (its own outputs, its final state); fold the
        # successors backwards (through their transitions where the document passes through) to d S(b_rank)
        ends_here = part.enter is not None and not part.passthru
        lam = None
        if layout.any_crossing:
            c = torch.zeros(B, HV, K, V, dtype=f32, device=dev)
            if L > 0:
                qt = _cols(e_out, V)[1]
                c += torch.einsum("bthk,bthv->bhkv", qt, do[:, :L].to(qt.dtype)).to(f32)
            if ends_here and dfin is not None:
                c += torch.matmul(_mT(m_e), dfin[part.enter])
            cs = all_gather(c, group)
            if part.leave is not None:
                lam = torch.zeros(B, HV, K, V, dtype=f32, device=dev)
                for j in range(world - 1, rank, -1):
                    lam = torch.matmul(_mT(ctx.Ms[j]), lam) + cs[j]

        # ---- local backward through the saved graphs of the op calls
        pairs = []
        if e_out is not None:
            mu = lam if part.passthru else (dfin[part.enter] if dfin is not None else None)
            do_e = do[:, :L]
            d_out = torch.cat([do_e, torch.einsum("bthv,bhkv->bthk", do_e, s_in.to(do_e.dtype))], -1)
            pairs += list(zip(e_out, _split_last(e_out, d_out)))
            if mu is not None:
                d_state = torch.cat([mu, torch.matmul(mu, _mT(s_in))], -1)
                pairs += list(zip(e_state, _split_last(e_state, d_state)))
        if r_out is not None:
            pairs.append((r_out, do[:, L:]))
            if dfin is not None or lam is not None:
                rows = []
                for n in part.local_docs:
                    if n == part.leave:
                        rows.append(lam)
                    elif dfin is not None:
                        rows.append(dfin[n])
                    else:
                        rows.append(torch.zeros(B, HV, K, V, dtype=f32, device=dev))
                pairs.append((r_state, torch.stack(rows).view_as(r_state)))

        leaves = ctx.leaves
        wanted = [x for x, n in zip(leaves, ctx.needs) if n]
        outs, gouts = [], []
        for o_, go in pairs:
            if o_.requires_grad:
                outs.append(o_)
                gouts.append(go.to(o_.dtype))
        grads = iter(torch.autograd.grad(outs, wanted, gouts, allow_unused=True) if outs else [None] * len(wanted))
        result = []
        for i, (x, n) in enumerate(zip(leaves, ctx.needs)):
            if not n:
                result.append(None)
                continue
            gx = next(grads)
            gx = torch.zeros_like(x) if gx is None else gx
            if i == 5 and dfinal is not None:  # an empty document's final state is its initial state, on every rank
                empty = layout.empty_docs()
                if empty:
                    gv, dv_ = gx.view(Nd, B, HV, K, V), dfinal.view(Nd, B, HV, K, V)
                    gv[empty] += dv_[empty].to(gx.dtype)
            result.append(gx)
        del ctx.leaves, ctx.local, ctx.Ms, ctx.s_in, ctx.m_e  # free the saved graphs
        return (*result,) + (None,) * 8


def cp_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, scale: Optional[float] = None,
                              initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, *, cu_seqlens: Optional[torch.Tensor] = None,
                              group=None, state_layout: str = "v_last", chunk_size: Optional[int] = None,
                              shard_lengths: Optional[Sequence[int]] = None
                              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Context-parallel :func:`gdn.ops.chunk_gated_delta_rule` over the ranks of ``group`` (default: the world).

    Every rank passes its own contiguous slice along T (``q, k: [B, T_r, H, K]``, ``v: [B, T_r, HV, V]``,
    ``g, beta: [B, T_r, HV]``), in rank order; slice lengths may differ (0 included).

    * Batch form (``cu_seqlens=None``): the slices are of the same B sequences. ``initial_state`` ``[B, ...]`` is
      read on the rank holding the first token (rank 0 unless its slice is empty; passing it on every rank is fine).
    * Packed form: ``cu_seqlens`` (``[N + 1]``, global offsets into the row that all slices concatenate to, the same
      on every rank; B == 1) splits the row into N documents, which may lie inside one slice or cross any number of
      slice boundaries. ``initial_state`` is ``[N, ...]`` on every rank (each rank reads the rows of the documents
      that start in its slice).

    States are ``[*, HV, K, V]`` (``"v_last"``) or ``[*, HV, V, K]`` (``"k_last"``). Returns ``(o_local [B, T_r, HV,
    V], final_state)``; ``final_state`` (float32, ``[B or N, ...]``, every document's state after its last token) is
    given on every rank when ``output_final_state``, else None.

    Forward and backward equal the single-device op on the concatenated row. Gradients flow to each rank's q, k, v,
    g, beta; ``initial_state``'s gradient on each rank is that rank's partial sum (sum over the group = the
    single-device gradient); the gradient of ``final_state`` is the sum of those given on all ranks. Design,
    math and communication volume: see the module docstring (two phases and one exchange; only documents that cross
    a slice boundary are exchanged). ``chunk_size`` is passed to the op; ``shard_lengths`` (every rank's ``T_r``, rank
    order) saves the one small ``all_gather`` that otherwise finds them.
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
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: packed rows need B == 1, got B = {B}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    offsets = shard_offsets(T, q.device, group, shard_lengths)
    docs = doc_bounds(cu_seqlens, offsets[-1])
    layout = make_layout(offsets, docs)
    packed = cu_seqlens is not None
    N = len(docs) if packed else B
    h0 = None
    if initial_state is not None:
        want = (N, HV, K, V) if state_layout == "v_last" else (N, HV, V, K)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"initial_state: expected shape {list(want)} ({state_layout}"
                             f"{', one row per document' if packed else ''}), got {got}")
        h0 = initial_state if state_layout == "v_last" else initial_state.transpose(-1, -2)
        h0 = h0.contiguous()
    o, final = _CPChunkGatedDeltaRule.apply(q, k, v, g, beta, h0, layout, rank, packed, scale,
                                            bool(use_qk_l2norm_in_kernel), group, chunk_size,
                                            bool(output_final_state))
    if not output_final_state:
        return o, None
    return o, final if state_layout == "v_last" else final.transpose(-1, -2)
