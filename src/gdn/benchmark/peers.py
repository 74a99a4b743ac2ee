"""The peers timed beside gdn, when importable: flash-linear-attention (``fla``) and FlashInfer.

Signatures as of fla-core 0.6.0 and flashinfer-python 0.7.2.post1 (the versions /work/shared/peers installs):

fla (state ``[N, HV, K, V]``, or ``[N, HV, V, K]`` with ``state_v_first=True``; no state pools):
    fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
        output_final_state=False, use_qk_l2norm_in_kernel=False, ..., state_v_first=False, cu_seqlens=None)
    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None,
        scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, ...,
        state_v_first=False, cu_seqlens=None)   # raw gates: g=a, beta=b with both *_in_kernel flags
    fla.modules.causal_conv1d.causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
        output_final_state=False, activation=None, backend='triton', cu_seqlens=None) -> (y, final_state)
    fla.layers.GatedDeltaNet(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode='chunk', ...)
        (in the flash-linear-attention package, not in fla-core)
FlashInfer (state k-last ``[N, HV, V, K]``):
    flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None,
        output=None, use_qk_l2norm=True, initial_state=None, initial_state_indices=None, ...)   # T = 1, in place
    flashinfer.gdn_decode.gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b,
        scale=None, output=None, intermediate_states_buffer=None, ssm_state_indices=None,
        disable_state_update=None, use_qk_l2norm=True, ...)   # T > 1, float32 pool, vLLM-style per-token slots
    flashinfer.gdn_prefill.chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
        output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
        ...)   # q/k/v [total, heads, 128]; g is the LINEAR decay alpha = exp(log g), float32; beta float32;
               # cu_seqlens required; returns (o, final_state k-last) with output_final_state=True

Every call is made by the runners inside try/except: a signature mismatch records null and the error string.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

PEERS = ("fla", "flashinfer")

FLA_BWD_GUARD_NOTE = ("fla backward on Hopper with Triton 3.4-3.7.0 is refused by fla (fla issue #640: "
                      "fla.ops.common.chunk_o.chunk_bwd_dqkwg gives wrong dbeta/dg there); the guard was bypassed "
                      "for timing only, see fla_err for what it computes")


@dataclass
class PeerInfo:
    name: str
    available: bool
    version: Optional[str] = None
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return {"available": self.available, "version": self.version, "error": self.error}


def short_error(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    s = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _probe(name: str, modules: Iterable[str]) -> PeerInfo:
    try:
        top = importlib.import_module(name)
        version = getattr(top, "__version__", None)
    except Exception as e:
        return PeerInfo(name, False, error=short_error(e))
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:
            return PeerInfo(name, False, version, error=f"{m}: {short_error(e)}")
    return PeerInfo(name, True, version)


def detect(wanted: Iterable[str]) -> Dict[str, PeerInfo]:
    """Import each wanted peer's GDN modules once; an import failure makes the peer unavailable, with its reason."""
    out = {}
    for name in wanted:
        if name == "fla":
            out[name] = _probe("fla", ["fla.ops.gated_delta_rule"])
        elif name == "flashinfer":
            # gdn_decode and gdn_prefill are probed separately by the runners (one may import without the other)
            out[name] = _probe("flashinfer", [])
        else:
            out[name] = PeerInfo(name, False, error=f"unknown peer {name!r}; expected one of {PEERS}")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# the peer functions (imported on first use)
# ----------------------------------------------------------------------------------------------------------------------
def fla_chunk():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def fla_recurrent():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return fused_recurrent_gated_delta_rule


def fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:  # older fla
        from fla.modules.convolution import causal_conv1d
    return causal_conv1d


def fla_layer_cls():
    from fla.layers import GatedDeltaNet
    return GatedDeltaNet


def flashinfer_decode():
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
    return gated_delta_rule_decode_pretranspose


def flashinfer_mtp():
    from flashinfer.gdn_decode import gated_delta_rule_mtp
    return gated_delta_rule_mtp


def flashinfer_prefill():
    from flashinfer.gdn_prefill import chunk_gated_delta_rule
    return chunk_gated_delta_rule


def flashinfer_prefill_inputs(q, k, v, g, beta, h0, cu_seqlens=None) -> dict:
    """gdn's chunked-op inputs in FlashInfer's prefill conventions, for :func:`flashinfer_prefill_call`: q / k
    [B, T, H, K], v [B, T, HV, V], log-decay ``g`` [B, T, HV], beta [B, T, HV], fp32 v-last h0 [N, HV, K, V],
    ``cu_seqlens`` over the packed rows (None: the B rows are the sequences) -> packed [total, heads, dim] tensors,
    the linear decay alpha = exp(g) and beta in fp32, a k-last h0 and int64 cu_seqlens (FlashInfer always takes
    them). Converted once, outside what a benchmark times."""
    import torch

    b_, t_ = q.shape[:2]
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    cu = (torch.arange(0, b_ * t_ + 1, t_, device=q.device, dtype=torch.int64) if cu_seqlens is None
          else cu_seqlens.to(torch.int64))
    return dict(q=q.reshape(b_ * t_, H, K), k=k.reshape(b_ * t_, H, K), v=v.reshape(b_ * t_, HV, V),
                g=g.exp().reshape(b_ * t_, HV).float(), beta=beta.float().reshape(b_ * t_, HV),
                h0=h0.transpose(-1, -2).contiguous(), cu=cu, shape=(b_, t_))


def flashinfer_prefill_call(fi, x: dict, scale=None):
    """FlashInfer's chunked prefill ``fi`` (:func:`flashinfer_prefill`) on :func:`flashinfer_prefill_inputs`'
    tensors, L2 norm in the kernel, final state out: (o [B, T, HV, V], ht v-last [N, HV, K, V])."""
    o, ht = fi(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=x["h0"],
               output_final_state=True, cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=True)
    return o.reshape(*x["shape"], *o.shape[1:]), ht.transpose(-1, -2)


def drop_scratch(name: str) -> None:
    """Free an implementation's process-wide scratch buffers (after a device synchronize), so that its next calls
    allocate what they keep between calls where the benchmark sees it (``<impl>_held_MB``). FlashInfer 0.7.2 keeps
    the workspaces of its GDN prefill's context-parallel path (the per-block inverses, the per-segment transfer and
    state matrices, the fixed-up states: ``gdn_kernels.delta_rule_dsl.delta_rule_cp_sm90``) in
    ``flashinfer.utils._cache_buf``, grown to the largest call and never freed (grown-out buffers go to
    ``_cache_buf_retired``); its kernels take the buffers' addresses per call (nothing cached holds them), so they
    can be dropped between calls. gdn and fla hold no such buffers."""
    if name != "flashinfer":
        return
    try:
        import flashinfer.utils as fu
    except Exception:  # noqa: BLE001 - an absent or changed peer keeps whatever it holds
        return
    for attr in ("_cache_buf", "_cache_buf_retired"):
        cache = getattr(fu, attr, None)
        if hasattr(cache, "clear"):
            cache.clear()


@contextlib.contextmanager
def fla_bwd_guard_bypassed():
    """Let fla run its chunked backward where it refuses to (Hopper, Triton >= 3.4 and < 3.7.1, fla issue #640).

    fla 0.6.0's ``fla.ops.common.chunk_o.chunk_bwd_dqkwg`` raises ``RuntimeError`` when its module flags say
    ``IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1``; this flips ``TRITON_ABOVE_3_7_1`` for the
    duration of the block and restores it after. For TIMING ONLY: the gradients fla computes there are known to be
    wrong, which the benchmark's correctness column shows. Yields True when the guard would have fired.
    """
    try:
        mod = importlib.import_module("fla.ops.common.chunk_o")
    except Exception:
        yield False
        return
    flag = "TRITON_ABOVE_3_7_1"
    if not hasattr(mod, flag):
        yield False
        return
    old = getattr(mod, flag)
    active = bool(getattr(mod, "IS_NVIDIA_HOPPER", False) and getattr(mod, "TRITON_ABOVE_3_4_0", False) and not old)
    setattr(mod, flag, True)
    try:
        yield active
    finally:
        setattr(mod, flag, old)


__all__ = ["PEERS", "PeerInfo", "detect", "short_error", "fla_chunk", "fla_recurrent", "fla_conv", "fla_layer_cls",
           "flashinfer_decode", "flashinfer_mtp", "flashinfer_prefill", "flashinfer_prefill_inputs",
           "flashinfer_prefill_call", "fla_bwd_guard_bypassed", "drop_scratch", "FLA_BWD_GUARD_NOTE"]
