r"""Backward pass of the chunked gated delta rule (Triton).

Notation (one sequence, one value head, one chunk of C tokens; rows are tokens)
------------------------------------------------------------------------------
``Q = scale * qn``, ``K = kn`` (``qn``/``kn`` = q/k after the optional in-kernel L2 norm), ``V``, ``b`` = beta,
``c`` = chunk-local cumulative log-gate (``c_r = g_1 + ... + g_r``), ``cL`` = ``c`` at the chunk's last position
(padding tokens of a partial chunk have g = 0, so ``cL = c_{C-1}``), ``H`` = state entering the chunk ``[K, V]``,
``Gm = dL/dH_next`` (gradient of the state leaving the chunk). Masks: ``Mc`` causal (i >= j), ``SL`` strictly lower.
``Gam_ij = exp(c_i - c_j)`` on ``Mc`` (0 elsewhere; every exponent used anywhere is of a non-positive difference).

Forward (recomputed, see ``gdn.reference.chunk_gated_delta_rule_ref``)::

    A    = SL * diag(b) (Gam * K K^T)          Ainv = (I + A)^-1
    Kb   = diag(b e^c) K,  Vb = diag(b) V,     W = Ainv Kb,  U = Ainv Vb
    Vn   = U - W H                              (= Ainv X  with  X = Vb - Kb H)
    O    = diag(e^c) Q H + (Q K^T * Gam) Vn
    Hnext= e^cL H + (diag(e^(cL - c)) K)^T Vn

Backward, derived by hand and checked piece by piece against float64 autograd
(``tests/ops/test_chunk_bwd.py::test_math_prototype`` runs this exact algebra in torch):

1. Reverse pass over chunks (sequential, state gradients in fp32; ``chunk_bwd_dh_kernel``)::

       dVn  = (K Q^T * Gam^T) dO + diag(e^(cL - c)) K Gm          ("dv_local" + state part)
       dH   = e^cL Gm + (diag(e^c) Q)^T dO - W^T dVn              (Gm of the previous chunk)

   It stores ``Gm`` of every chunk and ``dVn``; the final ``dH`` is ``dh0``. It needs no forward state, so on
   CUDA it runs on a side stream concurrently with the recomputation of the forward states H (not where the
   sm_90 form runs: that and the sm_90 state pass take an SM per CTA, so they cannot share the machine).

2. Per chunk, fully parallel (``chunk_bwd_main_kernel``), with P-terms written without any transposed
   register tensor::

       dPm  = (dO Vn^T) * Gam            dPmT = (Vn dO^T) * Gam^T          (both from loaded tiles)
       dQ   = diag(e^c) dO H^T + dPm K                                      (grad of scale*qn)
       dKs  = diag(e^(cL - c)) Vn Gm^T   dK = dPmT Q + dKs + (WY terms below)
       dc_i = Q_i.dQ_i - K_i.(dPmT Q + dKs)_i                               (gate terms of attention/state)
       dcL  = e^cL <H, Gm> + sum(K * dKs)                                   (added at the last position)

   WY / UT-transform backward. Because ``Vn = Ainv X`` the adjoints collapse to (``dU = dVn``,
   ``dW = -dVn H^T``)::

       dVb  = Ainv^T dVn                 dV = diag(b) dVb,   db += rowsum(dVb * V)
       dKb  = Ainv^T dW = -dVb H^T       dK += diag(b e^c) dKb,  db += e^c rowsum(dKb*K),  dc += b e^c rowsum(dKb*K)
       dA   = -Ainv^T dAinv Ainv^T = -dVb Vn^T    (dAinv = dVn X^T)
       dA^T = -Vn dVbT,  dVbT = dVn^T Ainv          (computed, not transposed)
       M    = SL * dA * diag(b) Gam,   M^T likewise from dA^T
       dK  += (M + M^T) K,  db += rowsum(SL * dA * Gam * K K^T),  dc += rowsum(dA*A) - colsum(dA*A)

   then ``dg`` = reverse cumulative sum of ``dc`` inside the chunk, ``dq = scale * dQ`` and, with the in-kernel L2
   norm, ``dx = r (dy - y (y.dy))`` (``y = x r``, ``r = rsqrt(|x|^2 + 1e-6)``).

Kernels, after the forward kept Ainv, the gate cumsum and the L2 scalings (only W is recomputed, then the forward
states H and v_new from k, v, beta and Ainv, on a side stream concurrently with 1-2 unless 2 runs on sm_90). Files: ``dv_local.py`` (1), ``reverse.py``
and ``hopper.py`` (2), ``parts.py`` (3-5), ``hopper_parts.py`` (3-4 on sm_90), ``common.py``; tuning: the
``chunk_bwd`` table of :mod:`gdn.kernels.tuning`.

1. ``chunk_bwd_dv_local_kernel`` (parallel, chunk x value head): ``dv_local = (K Q^T * Gam^T) dO`` into ``dvn``
   (not launched where the unsegmented sm_90 pass of 2 computes it: ``chunk_bwd.dh_sm90_local_min_heads``).
2. ``chunk_bwd_dh_kernel`` (sequential in chunks; sequences x value heads x V blocks, long sequences in segments
   with ``chunk_bwd_dh_merge_kernel``): adds the state term to ``dvn`` and stores ``Gm`` per chunk.
   On sm_90 the Gluon form of the same pass (``hopper.py``: TMA ring, asynchronous wgmma) where its grid fits
   one wave of CTAs (``reverse.reverse_plan``).
3. ``chunk_bwd_out_kernel`` (parallel, chunk x value head x side): side 0 dQ per value head, side 1 dK per value
   head (state, attention and WY-through-H terms on one accumulator); both over V tiles.
4. ``chunk_bwd_wy_kernel`` (parallel, chunk x value head): dv, dbeta, dg and the remaining dK terms, over V tiles.
   On sm_90, 3 and 4 are one Gluon kernel (``hopper_parts.py``: one CTA per chunk x value head, every tile by TMA
   once, asynchronous wgmma).
5. ``chunk_bwd_qk_kernel`` (parallel, chunk x q/k head): the GVA sum over value heads (deterministic, no atomics)
   and the L2-norm backward. On sm_90 the Gluon kernel of 3-4 does this itself (with GVA the last value head of
   each key head sums the group) and 5 is not launched.

Every register tile is fp32 (fp64 for fp64 inputs); tl.dot takes operands in the input dtype (bf16/fp16) with fp32
accumulation. No program holds more than two [C, K]-or-larger accumulators, so at 4 warps nothing spills beyond
~0.3 KB/thread on sm_90 (``bench/aot_regs.py``).

Hopper / Triton 3.4-3.7.0 (fla-org/flash-linear-attention#640, #984): the miscompiles reported there are
``tl.dot(tl.trans(x), y)`` where ``x`` is itself the (converted) result of a ``tl.dot`` (the wgmma accumulator
layout transposed into a ``#linear`` layout, BK=64 tiling), and a large fused WY-backward kernel with BT=64 at
num_warps=4. These kernels never call ``tl.trans`` on anything but a freshly loaded tile (a shared-memory view, the
FlashAttention idiom); every transposed product of computed tensors (dPm^T, dA^T) is obtained as its own dot of
loaded operands instead. The parallel kernels use no K tiling (BK = K). On an H200 with Triton 3.6 every gradient
passes ``gdn check`` against float64 (42/42).
"""
from __future__ import annotations

import torch

from ...common import l2_rnorm
from ... import tuning
from ...host_plan import planned
from ..common import _dot_dtype, _empty, _state_dtype
from ..plan import prepare_chunk_indices
from ..prepare import chunk_fwd_prepare, recompute_w_u
from ..state import chunk_state_pass
from .parts import chunk_bwd_main
from .reverse import chunk_bwd_dh, reverse_plan, runs_sm90, w_in_pass


_SIDE_STREAMS = {}


def _side_stream(device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def wants_forward_w(q, k, v, ci) -> bool:
    """Whether the training forward should have its prepare store W for this backward (``chunk_bwd.w_from_forward``):
    everywhere but where the reverse pass forms W itself from Ainv (:func:`reverse.w_in_pass`). ``v`` stands in for
    dO (same shape) in the reverse pass's plan; ``ci``: the forward's chunk tables."""
    dev = q.device
    if not tuning.chunk_bwd(dev).w_from_forward or dev.type != "cuda":
        return False
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    plan = reverse_plan(q, k, v, None, _state_dtype(dev, _dot_dtype(k, v)), ci, HV, K, V, dev)
    return not w_in_pass(plan, ci, HV, V, dev)


@planned
def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size,
                               use_qk_l2norm_in_kernel, do, dht, *, g_cum=None, ainv=None, w=None, u=None,
                               h=None, v_new=None, segment_chunks=None, rq=None, rk=None, chunk_index=None,
                               out=None):
    """Gradients of ``chunk_gated_delta_rule`` (v_last states). Returns ``(dq, dk, dv, dg, dbeta, dh0)``.

    q, k [B, T, H, K] (strided, last dim contiguous); v [B, T, HV, V]; g, beta [B, T, HV]; initial_state None or
    [N, HV, K, V]; do [B, T, HV, V]; dht None or [N, HV, K, V]. dq/dk are summed over each q/k head's value heads;
    grads come back in the inputs' dtypes; dh0 is fp32 [N, HV, K, V], or None without initial_state.

    Pipeline: W from the forward's Ainv (``recompute_w_u``, or inside the reverse pass where it runs on sm_90 at V
    tile 128: ``reverse.w_in_pass``; the whole ``chunk_fwd_prepare``, W and U, when ``ainv`` is not given; or the
    forward's own ``w``, stored by its sm_90 prepare where :func:`wants_forward_w` says so) -> the
    forward state pass (h, v_new from k, v, beta and Ainv as in the forward, or from W and U; on a side CUDA stream)
    concurrently with ``chunk_bwd_dh`` (dv_local, then the reverse pass; needs only w and g_cum) ->
    ``chunk_bwd_main`` (parts A and B, the q/k kernel).
    Intermediates saved by the forward can be passed in (``g_cum``, ``ainv``, ``w``, ``u``, ``h``, ``v_new``, ``rq``,
    ``rk``, as returned by gdn.kernels.chunk.forward) to skip their recomputation.
    ``segment_chunks``: reverse-pass segmentation (None heuristic, -1 off, n chunks per segment).
    ``chunk_index``: the forward's chunk tables (saves reading cu_seqlens on the host again).
    ``out``: (dq, dk, dv) to write into, e.g. views of one packed gradient of q|k|v (:func:`parts.chunk_bwd_main`).
    Host work is recorded and replayed per call key (:mod:`gdn.kernels.host_plan`).
    """
    B, T, H, K = q.shape
    C = int(chunk_size)
    l2 = bool(use_qk_l2norm_in_kernel)
    dev = q.device
    ci = chunk_index if chunk_index is not None else prepare_chunk_indices(cu_seqlens, T, C, B, device=dev)
    need_h = h is None or v_new is None
    w_dt = _dot_dtype(k, v)
    if g_cum is None or ainv is None:
        g_cum, ainv, w, u = chunk_fwd_prepare(k, v, g, beta, cu_seqlens, C, l2, store_ainv=True, store_wu=True,
                                                chunk_index=ci, ainv_dtype=w_dt)
        w_dt = w.dtype
    elif w is None:
        u = None   # the forward states are recomputed from k, v, beta and Ainv (the forward's form), W below
    h_dtype = h.dtype if h is not None else _state_dtype(dev, w_dt)
    if do.stride(-1) != 1:
        do = do.contiguous()
    HV, V = v.shape[2], v.shape[3]
    rplan = reverse_plan(q, k, do, w, h_dtype, ci, HV, K, V, dev, segment_chunks)
    beta_c = None
    if w is None:
        if w_in_pass(rplan, ci, HV, V, dev) and ainv.dtype == k.dtype and ainv.is_contiguous():
            beta_c = beta.contiguous()     # W formed in the reverse pass from Ainv (no W tensor)
        else:
            w, _ = recompute_w_u(k, v, beta, ainv, g_cum, cu_seqlens, C, l2, chunk_index=ci, store_u=False)

    if l2:
        rq = l2_rnorm(q) if rq is None else rq
        rk = l2_rnorm(k) if rk is None else rk

    def state_pass(buffers=None):
        if u is None:   # v_new = Ainv (beta (v - (e^c k_hat) h)), the forward's own form
            return chunk_state_pass(k, None, None, g_cum, initial_state, False, cu_seqlens, C, l2, v=v, beta=beta,
                                    ainv=ainv, h_dtype=h_dtype, vnew_dtype=w_dt, chunk_index=ci, rk=rk,
                                    buffers=buffers)[:2]
        return chunk_state_pass(k, w, u, g_cum, initial_state, False, cu_seqlens, C, l2, h_dtype=h_dtype,
                                chunk_index=ci, rk=rk, buffers=buffers)[:2]

    concurrent = need_h and dev.type == "cuda" and tuning.chunk_bwd(dev).concurrent \
        and not torch.cuda.is_current_stream_capturing() \
        and not runs_sm90(rplan, ci, HV, V)
    if concurrent:
        cur = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        # h and v_new are allocated here, on the stream that reads and frees them; the side stream writes them before
        # cur waits for it. (With record_stream instead, their frees were deferred and the caching allocator took
        # fresh device memory on every call while the host ran ahead of the GPU.)
        h = _empty(ci.NT, HV, K, V, device=dev, dtype=h_dtype)
        v_new = _empty(*v.shape, device=dev, dtype=w_dt)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            state_pass((h, v_new))
    elif need_h:
        h, v_new = state_pass()
    gs, dvn, dh0 = chunk_bwd_dh(q, k, w, g_cum, do, dht, scale, cu_seqlens, C, l2, initial_state is not None,
                                state_dtype=h_dtype, chunk_index=ci, segment_chunks=segment_chunks, rq=rq, rk=rk,
                                plan=rplan, ainv=ainv, beta=beta_c)
    if concurrent:
        cur.wait_stream(side)
    del w, u  # peak memory: not needed by the last kernel
    dq, dk, dv, dbeta, dg = chunk_bwd_main(q, k, v, g_cum, beta, ainv, v_new, dvn, do, h, gs, scale, cu_seqlens, C,
                                           l2, g_dtype=g.dtype, chunk_index=ci, rq=rq, rk=rk, out=out)
    return dq, dk, dv, dg, dbeta, dh0


__all__ = ["chunk_gated_delta_rule_bwd", "chunk_bwd_dh", "chunk_bwd_main", "wants_forward_w"]
