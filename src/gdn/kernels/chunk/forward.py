"""The chunked forward, host side: prepare -> state pass -> output (three launches; four with a segmented state pass;
two on Hopper where the state pass computes the output too).

Shapes (``C`` = 64, ``NT`` = chunks over all sequences)::

    q, k        [B, T, H, K]     strided views allowed (last dim contiguous)
    v           [B, T, HV, V]    strided views allowed (last dim contiguous)
    g, beta     [B, T, HV]       any strides, any float dtype; g is log-space (<= 0)
    g_cum       [B, T, HV] fp32  chunk-local cumulative sum of g
    Ainv        [B, T, HV, C]    row t holds row (t mod C) of (I + A)^-1 of its chunk
    h           [NT, HV, K, V]   state at the START of every chunk (v_last order)
    v_new       [B, T, HV, V]    u - w @ h(chunk)
    o           [B, T, HV, V]    scale * ((exp(g_cum) q_hat) @ h + ((q_hat k_hat^T) * Gamma, causal) @ v_new)

with ``A = strictLower(diag(beta) (Gamma * K_hat K_hat^T))``, ``Gamma_ij = exp(g_cum_i - g_cum_j)`` (i >= j). Every
exponent is the exp of a non-positive difference of cumulative gates; state arithmetic is fp32. Tuning: the
``chunk_fwd`` table of :mod:`gdn.kernels.tuning`.
"""
from __future__ import annotations

import torch

from .. import tuning
from ..host_plan import planned
from .common import CHUNK_SIZE, _check_chunk_size, _dot_dtype, _empty, _state_dtype
from .output import chunk_output
from .plan import prepare_chunk_indices
from .prepare import chunk_fwd_prepare, sm90_prepare_taken
from .hopper import row_scalar_pack
from .state import beta_in_ainv_ok, chunk_state_pass, fused_output_plan, segment_pass_sm90_ok
from .backward import wants_forward_w


@planned
def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                               cu_seqlens=None, chunk_size=CHUNK_SIZE, use_qk_l2norm_in_kernel=False, *,
                               state_layout="v_last", state_indices=None, final_state=None,
                               segment_chunks=None, h_dtype=None, store_ainv=False, cu_seqlens_cpu=None,
                               final_indices=None, checkpoint_indices=None, checkpoint_every=0, return_states=True,
                               out=None, keep_w=False, _whole=False):
    """The whole forward. Returns ``(o [B, T, HV, V] in v's dtype, final state or None, aux dict)``.

    ``initial_state``/``final_state``/``state_indices``/``final_indices``/``checkpoint_indices``/``checkpoint_every``
    as in :func:`chunk_state_pass`; aux holds the intermediates
    (g_cum, Ainv when ``store_ainv`` (tensor-core dtype, fp32 with the tuning field ``chunk_fwd.ainv_dtype`` = "fp32"), h, v_new,
    chunk_index, rk (the L2 row scalings of k, fp32 [B, T, H], None without the L2 norm), rq (q's, where the prepare
    kernel computes P for the fused Hopper kernel in a call that keeps Ainv for this package's backward, else None:
    the output kernel computes them itself, and the backward again)).
    ``cu_seqlens_cpu``: host copy of cu_seqlens (nothing read back from the device; :func:`prepare_chunk_indices`).
    ``return_states=False``: the caller needs no h / v_new; on Hopper the state pass then computes the output itself
    (one kernel fewer, no h / v_new in memory) and aux["h"] / aux["v_new"] are None; such a call over more token x
    value heads than twice the ``chunk_fwd.piece_token_heads`` field runs in pieces (:func:`_forward_in_pieces`),
    unless its Ainv lives in o's own rows (the register-state kernel's plan: nothing beside o to halve).
    ``out``: o [B, T, HV, V] (contiguous, v's dtype) to write instead of a new tensor (on Hopper's register-state
    path it holds Ainv and P until the state pass overwrites them with o; aux["ainv"] is then None). ``keep_w`` (with
    ``store_ainv``): the caller runs this package's backward next; the prepare stores W where that backward wants it
    (:func:`.backward.wants_forward_w`; aux["w"]: only the sm_90 prepare stores it, elsewhere aux["w"] is None).
    Host work is recorded and replayed per call key (:mod:`gdn.kernels.host_plan`)."""
    _check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    ci = prepare_chunk_indices(cu_seqlens, T, chunk_size, B, device=q.device, cu_seqlens_cpu=cu_seqlens_cpu)
    dt = _dot_dtype(k, v)
    cfg = tuning.chunk_fwd(q.device)
    from_ainv = cfg.state_mode == "ainv"
    a_dtype = torch.float32 if cfg.ainv_dtype == "fp32" else dt
    l2 = bool(use_qk_l2norm_in_kernel)
    ckpt = checkpoint_indices is not None and checkpoint_indices.shape[1] > 0
    if h_dtype is None:
        h_dtype = _state_dtype(q.device, dt)
    # Hopper: the output computed by the state pass itself (P and qf from the prepare kernel; h / v_new in memory
    # only when asked for, and then only in the tensor-core dtype: chunk_fwd.state_sm90_fused_states)
    fused_ok = not return_states or (cfg.state_sm90_fused_states and h_dtype == dt)
    bv_fused, plan = (fused_output_plan(q, k, v, ci, segment_chunks, ckpt, states=return_states)
                      if (fused_ok and from_ainv and a_dtype == dt) else (0, None))
    # unsegmented V tile 64 (chunk_fwd.state_sm90_p_in_kernel_bv): the fused kernel forms P and qf itself, so the
    # prepare reads no q and writes no P
    pk = bv_fused in (32, 64) and 0 < int(cfg.state_sm90_p_in_kernel_bv) <= bv_fused and not plan.segmented
    # the register-state kernel (V tile 128; also a segmented plan's final pass) forms them in its P partition
    # (chunk_fwd.state_sm90_t_p_in_kernel) from q's L2 row scalings, which its load warp reads where qf would be
    pa = bv_fused == 128 and bool(cfg.state_sm90_t_p_in_kernel)
    pk = pk or pa
    # the register-state kernel of an inference call: Ainv (and P where the prepare forms it) as the two halves of
    # o's own rows (they are read a chunk ahead of the o they become; a segmented run's Gluon segment pass reads Ainv
    # there a launch earlier), so the call holds no Ainv / P beside o
    in_o = bv_fused == 128 and (not plan.segmented or segment_pass_sm90_ok(k, v, dt)) and not store_ainv \
        and cfg.state_sm90_fused_t_packed and v.dtype == dt and v.shape[3] == 2 * CHUNK_SIZE \
        and sm90_prepare_taken(k, None if pk else q, dt, store_ainv=True, store_wu=False, g_is_cumsum=False,
                               ainv_dtype=a_dtype)
    # pieces halve the intermediates beside o; with Ainv in o's rows there are none to halve (H200, whole / pieces:
    # peaks within 4 MiB, kernels 2-6% faster whole: bench/results/fwd_pieces_ainv_in_o_h200.json)
    if cfg.piece_token_heads and not (_whole or return_states or store_ainv or ckpt or final_indices is not None) \
            and state_indices is None and final_state is None and (ci.N == 1 or cu_seqlens is None) \
            and not (plan is not None and plan.segmented) and not in_o:
        pieces = min(ci.NT if ci.N == 1 else B, int(cfg.piece_max), (B * T * v.shape[2]) // int(cfg.piece_token_heads))
        if pieces > 1:
            return _forward_in_pieces(q, k, v, g, beta, scale, initial_state, output_final_state, l2, state_layout,
                                      pieces, ci, out)
    # q's L2 row scalings come out of the prepare kernel where it computes P (the fused kernel) and a backward follows
    # (store_ainv): it reads them instead of launching l2_rnorm(q); an inference call neither stores nor holds them
    rq = _empty(B, T, H, device=q.device, dtype=torch.float32) if (l2 and bv_fused and not pk and store_ainv) \
        else None
    # ... and for the register-state kernel's load warp (P formed in the kernel), from q's tiles in the prepare
    rq_t = _empty(B, T, H, device=q.device, dtype=torch.float32) if (l2 and pa) else None
    o = packed = scalars = None
    if pk and not pa and not store_ainv and not return_states and cfg.state_sm90_row_scalars_in_o and v.dtype == dt \
            and sm90_prepare_taken(k, None, dt, store_ainv=True, store_wu=False, g_is_cumsum=False,
                                   ainv_dtype=a_dtype):
        # the V tile 32 / 64 fused kernel forming P itself in an inference call: g_cum, r_k and the overflow flags in
        # o's own rows, a copy per V tile that its CTA reads before it stores those rows (hopper.row_scalar_pack), so
        # that the call holds nothing per token beside o and Ainv (with P from the prepare, V tile 16 / 32, the same
        # with qf too lost: bench/NOTES.md)
        o = out if out is not None else _empty(B, T, v.shape[2], v.shape[3], device=q.device, dtype=v.dtype)
        pack = row_scalar_pack(o, bv_fused)
        scalars = (*pack, v.shape[3] // bv_fused) if pack is not None else None
    rk = (scalars[0] if scalars else _empty(B, T, H, device=q.device, dtype=torch.float32)) if l2 else None
    if in_o:
        o = out if out is not None else _empty(B, T, v.shape[2], v.shape[3], device=q.device, dtype=v.dtype)
        packed = (o[..., :CHUNK_SIZE], None if pk else o[..., CHUNK_SIZE:])
    # ... with beta folded into that Ainv (Ainv diag(beta)) where every kernel reading it takes that form
    beta_in_ainv = bool(packed and cfg.state_sm90_beta_in_ainv and beta_in_ainv_ok(k, v, packed[0], dt, plan))
    prep = chunk_fwd_prepare(k, v, g, beta, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel,
                             store_ainv=store_ainv or from_ainv, store_wu=not from_ainv, chunk_index=ci,
                             ainv_dtype=a_dtype, rk=rk, q=q if (bv_fused and not pk) else None, scale=scale,
                             keep_w=bool(keep_w and store_ainv and from_ainv and wants_forward_w(q, k, v, ci)),
                             ainv_out=packed[0] if packed else None, p_out=packed[1] if packed else None,
                             rq=rq if rq_t is None else rq_t, rq_of=q if rq_t is not None else None,
                             row_scalars=scalars, beta_in_ainv=beta_in_ainv)
    g_cum, ainv, w, u = prep[:4]
    P = initial_state.shape[0] if (state_indices is not None and initial_state is not None) else 0
    fuse = None
    if bv_fused:
        if o is None:
            o = out if out is not None else _empty(B, T, v.shape[2], v.shape[3], device=q.device, dtype=v.dtype)
        fuse = dict(q=q, p=None if pk else prep[4], qf=rq_t if pa else None if pk else prep[5], o=o,
                    o_idx=state_indices, PO=P,
                    BV=bv_fused, plan=plan, states=return_states, scale=scale,
                    row_scalars=scalars[1:3] if scalars else None, beta_in_ainv=beta_in_ainv)
    h, v_new, ht = chunk_state_pass(k, w, u, g_cum, initial_state, output_final_state, cu_seqlens, chunk_size,
                                    use_qk_l2norm_in_kernel, v=v if from_ainv else None,
                                    beta=beta if from_ainv else None, ainv=ainv if from_ainv else None,
                                    h_dtype=h_dtype, state_layout=state_layout, final_state=final_state,
                                    state_indices=state_indices, segment_chunks=segment_chunks, chunk_index=ci,
                                    rk=rk, final_indices=final_indices, checkpoint_indices=checkpoint_indices,
                                    checkpoint_every=checkpoint_every, output=fuse)
    if fuse is not None:
        if scalars:     # (overwritten by o)
            g_cum = rk = None
        return fuse["o"], ht, dict(g_cum=g_cum, ainv=None if packed else ainv, h=h, v_new=v_new, chunk_index=ci,
                                   rk=rk, rq=rq, w=w if from_ainv else None)
    if not store_ainv:
        # Ainv (or W / U) is dead once the state pass has read it: freed before the output kernel allocates o, so
        # the call's peak is o + h + v_new, not o + h + v_new + Ainv (stream order keeps the state pass's reads
        # before any reuse of the block)
        ainv = w = u = prep = None
    o = chunk_output(q, k, v_new, h, g_cum, scale, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel,
                     out_dtype=v.dtype, state_indices=state_indices, pool_size=P, chunk_index=ci, rk=rk)
    if out is not None:
        o = out.copy_(o)
    return o, ht, dict(g_cum=g_cum, ainv=ainv, h=h, v_new=v_new, chunk_index=ci, rk=rk, rq=None,
                       w=w if from_ainv else None)


def _forward_in_pieces(q, k, v, g, beta, scale, initial_state, output_final_state, l2, layout, pieces, ci, out):
    """An inference forward (no h / v_new / Ainv kept, no pool) in ``pieces`` pieces run one after the other, so
    that the intermediates of one piece (Ainv, P, ...: as many bytes as o) are in memory at a time, not the whole
    call's: a batch of B sequences in groups of whole sequences, one sequence in spans of whole chunks, each span
    starting from the state the previous one ended in (an fp32 state in ``layout``, overwritten in place: every
    program of the state pass reads its tile of the start state before it writes the same tile of the end state).
    The pieces are as parallel as the whole (groups of sequences: the whole ran in as many waves; spans: the same
    programs per chunk step). Varlen input here has one sequence, so its cu_seqlens is [0, T] and B == 1."""
    B, T = q.shape[:2]
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    sshape = (HV, K, V) if layout == "v_last" else (HV, V, K)
    o = out if out is not None else _empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    ht = None

    def run(sl, h0, final, want):
        return chunk_gated_delta_rule_fwd(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, h0, want, None, CHUNK_SIZE, l2,
                                          state_layout=layout, final_state=final, return_states=False, out=o[sl],
                                          _whole=True)[1]

    if ci.N > 1:    # groups of whole sequences (batched input)
        rows = -(-B // pieces)
        ht = _empty(B, *sshape, device=q.device, dtype=torch.float32) if output_final_state else None
        for b0 in range(0, B, rows):
            sl = slice(b0, b0 + rows)
            run(sl, None if initial_state is None else initial_state[sl], None if ht is None else ht[sl], False)
        return o, ht, dict(g_cum=None, ainv=None, h=None, v_new=None, chunk_index=ci, rk=None, rq=None)
    span = -(-ci.NT // pieces) * CHUNK_SIZE
    carry = _empty(1, *sshape, device=q.device, dtype=torch.float32)
    h0 = initial_state
    for t0 in range(0, T, span):
        sl = (slice(None), slice(t0, t0 + span))
        last = t0 + span >= T
        ht = run(sl, h0, None if last else carry, last and output_final_state)
        h0 = carry
    return o, ht, dict(g_cum=None, ainv=None, h=None, v_new=None, chunk_index=ci, rk=None, rq=None)


__all__ = ["chunk_gated_delta_rule_fwd"]
