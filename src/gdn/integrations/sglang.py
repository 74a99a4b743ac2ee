"""SGLang's GDN kernel entry points on gdn's kernels, and the switch that points SGLang at them.

    import gdn.integrations.sglang as gdn_sgl
    gdn_sgl.enable()      # before the model runner is built
    gdn_sgl.disable()     # restore SGLang's own functions

Signatures, defaults and return values are those of SGLang 0.5.23:
``sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py::fused_sigmoid_gating_delta_rule_update``
(decode and EAGLE target-verify, tree verification included) and
``sglang/kernels/ops/attention/fla/chunk.py::chunk_gated_delta_rule`` (extend), as called by
``sglang/srt/layers/attention/linear/kernels/gdn_triton.py`` (``TritonGDNKernel``, used by the GDN backend of
``hybrid_linear_attn_backend.py``). SGLang conventions kept: states are k_last (``[.., HV, V, K]``), a negative
pool slot is padding. Difference: a padding sequence's outputs are zeros here (SGLang runs it from a zero state;
engines discard those rows either way).
"""
from __future__ import annotations

from typing import List

import torch

from . import _engine

__all__ = ["fused_sigmoid_gating_delta_rule_update", "chunk_gated_delta_rule",
           "fused_recurrent_gated_delta_rule_packed_decode", "enable", "disable", "is_enabled", "enabled"]


def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
                                           lower_bound=None, disable_state_update=False,
                                           intermediate_states_buffer=None, intermediate_state_indices=None,
                                           cache_steps=None, retrieve_parent_token=None, cache_ring=False,
                                           replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                                           replayssm_beta=None, match_cutedsl_decode=False):
    """SGLang 0.5.23 ``sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py::
    fused_sigmoid_gating_delta_rule_update`` on gdn's recurrent kernel.

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (strided views with a contiguous last dim: read in place); a, b
    ``[B*T, HV]`` / ``[B, T, HV]``; A_log, dt_bias ``[HV]``. Gates: ``g = -exp(A_log) softplus(a + dt_bias)`` with
    softplus ``log(1 + exp(beta x)) / beta`` where ``beta x <= threshold`` else x (``softplus_beta=1,
    softplus_threshold=20`` in the kernel, other values through fp32 gates), or ``lower_bound * sigmoid(exp(A_log)
    (a + dt_bias))`` when ``lower_bound`` is given; ``beta_t = sigmoid(b)``. ``initial_state_source`` pool
    ``[P, HV, V, K]`` read at rows ``initial_state_indices`` ``[N]`` (-1 = padding) and, unless
    ``disable_state_update``, the final state written back there. Target verify: the state after token t of
    sequence n goes to ``intermediate_states_buffer[intermediate_state_indices[n], t]`` (``[S, steps, HV, V, K]``,
    slot pitch its ``stride(0)``; slot < 0 = none); with ``retrieve_parent_token`` ``[N, T]`` (EAGLE tree) token
    t > 0 starts from the state after its parent token ``retrieve_parent_token[n, t]`` instead of token t - 1.
    Returns o ``[B, T, HV, V]`` in q's dtype.
    """
    if is_kda:
        raise NotImplementedError("is_kda: per-channel (KDA) gates have no gdn kernel")
    if cache_ring:
        raise NotImplementedError("cache_ring: SGLang's ReplaySSM ring write has no gdn equivalent")
    if match_cutedsl_decode:
        raise NotImplementedError("match_cutedsl_decode: bit-parity with FlashInfer's CuTe KDA decode is not offered")
    from gdn.ops import _validate as V_

    B, T, HV, Vd = v.shape
    K = k.shape[-1]
    a3, b3 = _engine.as_btv(a, B, T, HV, "a"), _engine.as_btv(b, B, T, HV, "b")
    if lower_bound is None and _engine.is_default_softplus(softplus_beta, softplus_threshold):
        gates = dict(A_log=A_log, a=a3, dt_bias=dt_bias, b=b3)
    else:
        g, bt = _engine.raw_gates(A_log, a3, dt_bias, b3, softplus_beta, softplus_threshold, lower_bound)
        gates = dict(g=g, beta=bt)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    idx = initial_state_indices if initial_state_source is not None else None
    cache = cache_idx = parent = None
    if retrieve_parent_token is not None and intermediate_states_buffer is None:
        raise ValueError("retrieve_parent_token: tree verification needs intermediate_states_buffer (the parents' "
                         "states are read back from it)")
    if intermediate_states_buffer is not None:
        buf = intermediate_states_buffer
        V_.tensor("intermediate_states_buffer", buf, dtypes=V_.STATE_DTYPES, device=q.device,
                  shape_doc="[S, steps, HV, V, K]")
        steps = buf.stride(0) // (HV * Vd * K) if buf.dim() > 1 else 0
        longest = _engine.max_len(B, T, cu_seqlens)
        if longest is not None and longest > steps:
            raise ValueError(f"intermediate_states_buffer: a slot holds {steps} states (stride(0) / (HV*V*K)), "
                             f"the longest sequence has {longest} tokens")
        cache = _engine.per_token_view(buf, "intermediate_states_buffer", HV, K, Vd, max(steps, 1))
        if intermediate_state_indices is None:
            raise ValueError("intermediate_state_indices: required with intermediate_states_buffer ([N] slots)")
        V_.tensor("intermediate_state_indices", intermediate_state_indices, ndim=1, dtypes=V_.INDEX_DTYPES,
                  device=q.device, shape_doc="[N]")
        V_.shape("intermediate_state_indices", intermediate_state_indices, (N,), "[N]")
        cache_idx = intermediate_state_indices.contiguous()
        if V_.host_checks_allowed(q.device) and N:
            hi = int(cache_idx.max())
            if hi >= buf.shape[0]:
                raise ValueError(f"intermediate_state_indices: slot {hi} is out of range for a buffer of "
                                 f"{buf.shape[0]} slots")
    if retrieve_parent_token is not None:
        V_.tensor("retrieve_parent_token", retrieve_parent_token, ndim=2, dtypes=V_.INDEX_DTYPES, device=q.device,
                  shape_doc="[N, T_max]")
        longest = _engine.max_len(B, T, cu_seqlens)
        if retrieve_parent_token.shape[0] != N or (longest is not None and retrieve_parent_token.shape[1] < longest):
            raise ValueError(f"retrieve_parent_token: expected [N={N}, >= {longest}], got "
                             f"{tuple(retrieve_parent_token.shape)}")
        parent = retrieve_parent_token
    o = _engine.recurrent(q, k, v, scale=scale, state=initial_state_source, idx=idx, num_accepted=None,
                          cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel, write=not disable_state_update,
                          cache=cache, cache_idx=cache_idx, parent=parent,
                          names=("initial_state_source", "initial_state_indices"), **gates)
    return o.to(q.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, inplace_update=True):
    """SGLang 0.5.23 ``sglang/kernels/ops/attention/fla/chunk.py::chunk_gated_delta_rule`` (extend) on gdn's chunked
    kernels.

    q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g (log-space), beta ``[B, T, HV]`` (``head_first``: ``[B, H, T, ..]``).
    ``initial_state`` a pool ``[P, HV, V, K]`` read at rows ``initial_state_indices`` ``[N]`` (-1 = padding: zero
    start, outputs zeros, nothing written); with ``inplace_update`` the final state is written back there. Returns
    ``(o, None, h)``: o in q's dtype, h ``[B, NT, HV, V, K]`` in k's dtype = the state at the start of every chunk of
    64 tokens (NT chunks of all sequences in order; SGLang's track-state path reads it).
    """
    from gdn.kernels.chunk import CHUNK_SIZE
    from gdn.ops.chunk import _validate

    if head_first:
        q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))
    if initial_state is not None and initial_state_indices is None:
        raise ValueError("initial_state_indices: required with initial_state (SGLang's pool [P, HV, V, K])")
    idx = initial_state_indices if initial_state is not None else None
    scale, _, N = _validate(q, k, v, g, beta, scale, initial_state, bool(inplace_update), cu_seqlens,
                            use_qk_l2norm_in_kernel, "k_last", idx, CHUNK_SIZE)
    o, h = _chunk_with_states(q, k, v, g, beta, scale, initial_state, idx, cu_seqlens, bool(use_qk_l2norm_in_kernel),
                              bool(inplace_update) and initial_state is not None)
    B = q.shape[0]
    HV, Vd, K = v.shape[-2], v.shape[-1], q.shape[-1]
    h = h.transpose(-1, -2).reshape(B, -1, HV, Vd, K).to(k.dtype)  # [NT, HV, K, V] -> [B, NT / B, HV, V, K]
    o = o.to(q.dtype)
    if head_first:
        o = o.transpose(1, 2)
    return o, None, h


def _chunk_with_states(q, k, v, g, beta, scale, pool, idx, cu_seqlens, l2, write):
    """(o, h [NT, HV, K, V] chunk start states) of the chunked forward; pool rows idx read, written if ``write``."""
    from gdn.backend import use_triton
    from gdn.kernels.chunk import CHUNK_SIZE

    if use_triton(q.device):
        from gdn.kernels.chunk import chunk_gated_delta_rule_fwd

        # h in the tensor-core dtype (k's for half inputs: what SGLang returns; the Hopper state pass writes it)
        o, _, aux = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, pool, False, cu_seqlens, CHUNK_SIZE, l2,
                                               state_layout="k_last", state_indices=idx,
                                               final_state=pool if write else None)
        return o, aux["h"]
    from gdn.reference import chunk_gated_delta_rule_ref, sequence_spans

    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    hs = []
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu_seqlens)):
        row = int(idx[n]) if idx is not None else -1
        S = (pool[row].transpose(-1, -2).float().clone() if row >= 0
             else torch.zeros(HV, K, Vd, dtype=torch.float32, device=q.device))
        for c in range(s, e, CHUNK_SIZE):
            hs.append(S)
            ce = min(c + CHUNK_SIZE, e)
            sl = (slice(bi, bi + 1), slice(c, ce))
            oc, S = chunk_gated_delta_rule_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, S[None], True, None, l2)
            S = S[0].float()
            if idx is None or row >= 0:
                o[bi, c:ce] = oc[0].to(o.dtype)
        if write and row >= 0:
            pool[row] = S.transpose(-1, -2).to(pool.dtype)
    h = torch.stack(hs) if hs else torch.zeros(0, HV, K, Vd, dtype=torch.float32, device=q.device)
    return o, h


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel=False):
    """SGLang 0.5.23 ``sglang/kernels/ops/attention/fla/fused_recurrent.py::
    fused_recurrent_gated_delta_rule_packed_decode`` (``TritonGDNKernel.packed_decode``): as vLLM's (see
    :func:`gdn.integrations.vllm.fused_recurrent_gated_delta_rule_packed_decode`), with SGLang's padding: a negative
    slot (pool row 0 is a real slot)."""
    _engine.packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                          use_qk_l2norm_in_kernel)
    return out, initial_state


# ----------------------------------------------------------------------------------------------------------------------
# the switch
# ----------------------------------------------------------------------------------------------------------------------
_SIGMOID = {"fused_sigmoid_gating_delta_rule_update": fused_sigmoid_gating_delta_rule_update}
_CHUNK = {"chunk_gated_delta_rule": chunk_gated_delta_rule}
_PACKED = {"fused_recurrent_gated_delta_rule_packed_decode": fused_recurrent_gated_delta_rule_packed_decode}
_KERNELS = {
    "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent": _SIGMOID,
    "sglang.kernels.ops.attention.fla.chunk": _CHUNK,
    "sglang.kernels.ops.attention.fla.fused_recurrent": _PACKED,
    # before SGLang 0.5.2x moved its kernels under sglang.kernels
    "sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent": _SIGMOID,
    "sglang.srt.layers.attention.fla.chunk": _CHUNK,
    "sglang.srt.layers.attention.fla.fused_recurrent": _PACKED,
}
_LAYERS = {  # the GDN kernel backends (they import the names at their own import time)
    "sglang.srt.layers.attention.linear.kernels.gdn_triton": dict(_SIGMOID, **_CHUNK, **_PACKED),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend": dict(_SIGMOID, **_CHUNK, **_PACKED),
}
_patcher = _engine.Patcher("sglang", dict(_KERNELS, **_LAYERS), import_now=list(_KERNELS))


def enable() -> List[str]:
    """Point SGLang's GDN kernel functions (its kernel modules, and the GDN kernel backends already imported) at this
    module's. Call before the model runner is built. Returns the modules patched; again = no-op."""
    return _patcher.enable()


def disable() -> None:
    """Restore SGLang's own functions everywhere they were repointed."""
    _patcher.disable()


def is_enabled() -> bool:
    return bool(_patcher.patched)


def enabled():
    """``with enabled(): ...``: patched inside the block."""
    return _patcher.enabled()
