"""vLLM's GDN kernel entry points on gdn's kernels, and the switch that points vLLM at them.

    import gdn.integrations.vllm as gdn_vllm
    gdn_vllm.enable()     # before the model is built; GDN_VLLM=1 does this in every vLLM process (general plugin)
    gdn_vllm.disable()    # restore vLLM's own functions

Signatures, defaults and return values are those of vLLM 0.33.0 (``vllm/third_party/flash_linear_attention/ops/``:
``chunk.py``, ``fused_recurrent.py``, ``fused_sigmoid_gating.py``), as called by
``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py`` (Qwen3-Next / Qwen3.5) and ``olmo_gdn_linear_attn.py``.
vLLM conventions kept: states are k_last (``[.., HV, V, K]``); a pool slot index ``<= 0`` is padding (vLLM's
``NULL_BLOCK_ID`` is 0): nothing read or written, outputs zeros. Pools whose rows are not packed (paged caches with a
larger ``stride(0)``) go through a copy of the rows used. Not patched: ``fi_chunk_gated_delta_rule`` (FlashInfer
prefill, vLLM's default prefill backend on Hopper): run vLLM with ``--gdn-prefill-backend triton`` so that prefill
goes through ``chunk_gated_delta_rule``.
"""
from __future__ import annotations

import os
from typing import List

import torch

from . import _engine

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "fused_sigmoid_gating_delta_rule_update",
           "fused_recurrent_gated_delta_rule_packed_decode", "enable", "disable", "is_enabled", "enabled", "register",
           "ENV_VAR"]

ENV_VAR = "GDN_VLLM"


def _slots(idx):
    """vLLM slot indices (<= 0 = padding) -> gdn's (-1 = padding)."""
    if idx is None:
        return None
    return torch.where(idx > 0, idx, torch.full_like(idx, -1))


def _per_token_buffer(q, v, state_dtype, cu_seqlens):
    """vLLM's ``inplace_final_state=False`` result: the state after every token, ``[B*T, HV, V, K]``, and the kernel
    cache arguments that write it (sequence n's token t at row ``bos_n + t``)."""
    B, T, HV, Vd = v.shape
    K = q.shape[-1]
    buf = torch.empty((B * T, HV, Vd, K), dtype=state_dtype, device=v.device)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1]
    else:
        starts = torch.arange(0, B * T, T, device=v.device)
    cache = buf.as_strided((B * T, 1, HV, Vd, K), (HV * Vd * K, HV * Vd * K, Vd * K, K, 1))
    return buf, cache, starts.to(torch.int64)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, chunk_indices=None, chunk_offsets=None, use_qk_l2norm_in_kernel=False,
                           core_attn_out=None):
    """vLLM 0.33.0 ``vllm/third_party/flash_linear_attention/ops/chunk.py::chunk_gated_delta_rule`` on
    :func:`gdn.ops.chunk_gated_delta_rule`.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g (log-space), beta ``[B, T, HV]``; ``initial_state``
    ``[N, HV, V, K]``. ``chunk_indices`` / ``chunk_offsets`` are vLLM's precomputed tables for ``cu_seqlens`` (gdn
    derives its own). ``core_attn_out``: o is written into its first ``v.numel()`` elements and returned as a view of
    it. Returns ``(o [B, T, HV, V] in q's dtype, final_state fp32 [N, HV, V, K] or None)``.
    """
    from gdn import ops

    if core_attn_out is not None and core_attn_out.numel() < v.numel():
        raise ValueError(f"core_attn_out: too small, {core_attn_out.numel()} < {v.numel()} elements")
    if core_attn_out is not None and not core_attn_out.is_contiguous():
        raise ValueError("core_attn_out: must be contiguous")
    o, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout="k_last")
    if core_attn_out is not None:
        out = core_attn_out.view(-1)[: v.numel()].view(v.shape)
        out.copy_(o)
        o = out
    return o.to(q.dtype), final


def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None, inplace_final_state=True,
                                     cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                     use_qk_l2norm_in_kernel=False):
    """vLLM 0.33.0 ``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py::fused_recurrent_gated_delta_rule``
    on gdn's recurrent kernel.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]`` (beta None = 1; a per-column beta
    ``[B, T, HV, V]`` is not supported). ``initial_state``: ``[N, HV, V, K]``, or with ``ssm_state_indices``
    (``[N]`` or ``[N, T_max]``, ``<= 0`` = padding) a pool ``[P, HV, V, K]``; ``num_accepted_tokens`` ``[N]``: start
    from slot ``idx[n, num_accepted[n] - 1]``. ``inplace_final_state``: the final state (1-D indices; row n without
    indices) or every token's state (2-D) is written into the pool; else a new ``[B*T, HV, V, K]`` tensor holds the
    state after every token. Returns ``(o [B, T, HV, V], that state tensor)``.
    """
    if beta is not None and beta.dim() == v.dim():
        raise NotImplementedError("beta: a per-column beta [B, T, HV, V] (vLLM's IS_BETA_HEADWISE) has no gdn kernel")
    return _recurrent(q, k, v, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                      num_accepted_tokens, use_qk_l2norm_in_kernel, g=g, beta=beta)


def _recurrent(q, k, v, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
               num_accepted_tokens, l2norm, **gates):
    if initial_state is None:
        raise ValueError("initial_state: vLLM's recurrent entry points need a state or pool [P, HV, V, K]")
    idx = _slots(ssm_state_indices)
    cache = starts = None
    if not inplace_final_state:
        final, cache, starts = _per_token_buffer(q, v, initial_state.dtype, cu_seqlens)
    o = _engine.recurrent(q, k, v, scale=scale, state=initial_state, idx=idx, num_accepted=num_accepted_tokens,
                          cu_seqlens=cu_seqlens, l2norm=l2norm, write=bool(inplace_final_state), cache=cache,
                          cache_idx=starts, **gates)
    return o.to(q.dtype), (initial_state if inplace_final_state else final)


def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None,
                                           initial_state=None, inplace_final_state=True, cu_seqlens=None,
                                           ssm_state_indices=None, num_accepted_tokens=None,
                                           use_qk_l2norm_in_kernel=False, is_kda=False):
    """vLLM 0.33.0 ``vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py::
    fused_sigmoid_gating_delta_rule_update``: the recurrent step with the gates computed from the raw projections,
    ``g = -exp(A_log) softplus_beta,threshold(a + dt_bias)``, ``beta_t = sigmoid(b)``.

    a, b ``[B*T, HV]`` or ``[B, T, HV]``; A_log, dt_bias ``[HV]``; ``beta`` / ``threshold`` are softplus's
    (``log(1 + exp(beta x)) / beta`` where ``beta x <= threshold``, else x; 1 / 20 is torch's softplus, computed in
    the kernel; other values through fp32 gates). The rest as :func:`fused_recurrent_gated_delta_rule`.
    """
    if is_kda:
        raise NotImplementedError("is_kda: per-channel (KDA) gates have no gdn kernel")
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    a3, b3 = _engine.as_btv(a, B, T, HV, "a"), _engine.as_btv(b, B, T, HV, "b")
    if _engine.is_default_softplus(beta, threshold):
        gates = dict(A_log=A_log, a=a3, dt_bias=dt_bias, b=b3)
    else:
        g, bt = _engine.raw_gates(A_log, a3, dt_bias, b3, beta, threshold)
        gates = dict(g=g, beta=bt)
    return _recurrent(q, k, v, scale, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices,
                      num_accepted_tokens, use_qk_l2norm_in_kernel, **gates)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel=False):
    """vLLM 0.33.0 ``vllm/third_party/flash_linear_attention/ops/fused_recurrent.py::
    fused_recurrent_gated_delta_rule_packed_decode``: one decode token per sequence, q|k|v read in place from the
    packed conv output.

    mixed_qkv ``[B, 2*H*K + HV*V]`` (last dim contiguous); a, b ``[B, HV]``; A_log, dt_bias ``[HV]``;
    ``initial_state`` a pool ``[P, HV, V, K]`` updated in place at rows ``ssm_state_indices`` ``[B]`` (<= 0 = padding:
    zeros out); ``out`` ``[B, 1, HV, V]`` contiguous, written. Returns ``(out, initial_state)``.
    """
    _engine.packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, _slots(ssm_state_indices),
                          use_qk_l2norm_in_kernel)
    return out, initial_state


# ----------------------------------------------------------------------------------------------------------------------
# the switch
# ----------------------------------------------------------------------------------------------------------------------
_OPS = "vllm.third_party.flash_linear_attention.ops"
_OLD_OPS = "vllm.model_executor.layers.fla.ops"  # before vLLM moved fla under third_party
_ALL = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    "fused_recurrent_gated_delta_rule_packed_decode": fused_recurrent_gated_delta_rule_packed_decode,
    "fused_sigmoid_gating_delta_rule_update": fused_sigmoid_gating_delta_rule_update,
}
_MODULES = {}
for _pkg in (_OPS, _OLD_OPS):
    _MODULES[_pkg] = dict(_ALL)
    _MODULES[_pkg + ".chunk"] = {"chunk_gated_delta_rule": chunk_gated_delta_rule}
    _MODULES[_pkg + ".fused_recurrent"] = {
        "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
        "fused_recurrent_gated_delta_rule_packed_decode": fused_recurrent_gated_delta_rule_packed_decode}
    _MODULES[_pkg + ".fused_sigmoid_gating"] = {
        "fused_sigmoid_gating_delta_rule_update": fused_sigmoid_gating_delta_rule_update}
_LAYERS = {  # the GDN layers (they import the names at their own import time)
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn": dict(_ALL, fla_chunk_gated_delta_rule=chunk_gated_delta_rule),
    "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn": dict(_ALL),
    "vllm.model_executor.models.qwen3_next": dict(_ALL, fla_chunk_gated_delta_rule=chunk_gated_delta_rule),
}
_MODULES.update(_LAYERS)
_patcher = _engine.Patcher("vllm", _MODULES, import_now=[m for m in _MODULES if m not in _LAYERS])


def enable() -> List[str]:
    """Point vLLM's GDN kernel functions (in its fla ops package and submodules, and in GDN layer modules already
    imported) at this module's. Call before the model is built. Returns the modules patched; again = no-op."""
    return _patcher.enable()


def disable() -> None:
    """Restore vLLM's own functions everywhere they were repointed."""
    _patcher.disable()


def is_enabled() -> bool:
    return bool(_patcher.patched)


def enabled():
    """``with enabled(): ...``: patched inside the block."""
    return _patcher.enabled()


def register() -> None:
    """vLLM general plugin (``[project.entry-points."vllm.general_plugins"]``, loaded in every vLLM process):
    ``GDN_VLLM=1`` switches vLLM's GDN kernels to gdn's; unset or 0 leaves vLLM alone."""
    if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        enable()
