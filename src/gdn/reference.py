"""The float64 oracle: plain, readable PyTorch for every op of gdn.

Computation runs in float64 when any input is float64 and in float32 otherwise; with float64 inputs the results are
exact up to float64 rounding. Everything here is differentiable through autograd, which is what the kernels' backward
passes are tested against. Shapes follow ``API.md``: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta
``[B, T, HV]``; states ``[N, HV, K, V]`` (``v_last``) or ``[N, HV, V, K]`` (``k_last``).

Recurrence per value head (state ``S`` of shape ``[K, V]``)::

    S = exp(g_t) * S
    S = S + beta_t * k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# small pieces
# ----------------------------------------------------------------------------------------------------------------------
def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm_ref(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x*x) + eps)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gate_ref(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log-space decay of Qwen3-Next / FlashInfer: ``g = -exp(A_log) * softplus(a + dt_bias)``.

    a: ``[..., HV]``; A_log, dt_bias: ``[HV]``. Returns float32 (float64 for float64 inputs). softplus uses torch's
    default threshold (x for x > 20).
    """
    dt = _compute_dtype(a, A_log, dt_bias)
    return -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))


def resolve_gates(g=None, beta=None, A_log=None, a=None, dt_bias=None, b=None):
    """Return log-space (g, beta) from either form. beta defaults to ones when absent."""
    if g is None:
        if a is None or A_log is None or dt_bias is None:
            raise ValueError("g: give either g (log-space) or all of A_log, a and dt_bias")
        g = gdn_gate_ref(a, A_log, dt_bias)
    if beta is None:
        beta = torch.sigmoid(b.to(_compute_dtype(b))) if b is not None else None
    return g, beta


def sequence_spans(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> List[Tuple[int, int, int]]:
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    c = [int(x) for x in cu_seqlens.tolist()]
    return [(0, c[i], c[i + 1]) for i in range(len(c) - 1)]


def _to_kv(state: torch.Tensor, state_layout: str) -> torch.Tensor:
    """``[..., K, V]`` view of a state stored in ``state_layout``."""
    return state if state_layout == "v_last" else state.transpose(-1, -2)


def _expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """q/k ``[B, T, H, K]`` -> ``[B, T, HV, K]``: value head hv reads q/k head hv // (HV // H)."""
    return x.repeat_interleave(HV // x.shape[2], dim=2)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    dt = _compute_dtype(q, k, v, g, beta)
    HV = v.shape[2]
    K = q.shape[-1]
    q, k = q.to(dt), k.to(dt)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k = _expand_heads(q, HV), _expand_heads(k, HV)
    scale = K ** -0.5 if scale is None else float(scale)
    beta = torch.ones_like(g, dtype=dt) if beta is None else beta.to(dt)
    return q * scale, k, v.to(dt), g.to(dt), beta, dt


def _initial(initial_state, n, HV, K, V, dt, device, state_layout):
    if initial_state is None:
        return torch.zeros(HV, K, V, dtype=dt, device=device)
    return _to_kv(initial_state[n], state_layout).to(dt)


def _finish(o_parts, finals, v, B, T, output_final_state, state_layout, dt):
    o = torch.cat(o_parts, dim=0).reshape(B, T, *v.shape[2:]) if o_parts else v.new_zeros(v.shape)
    final = None
    if output_final_state:
        final = _to_kv(torch.stack(finals), state_layout)
        final = final.to(torch.float64 if dt == torch.float64 else torch.float32)
    return o.to(v.dtype), final


# ----------------------------------------------------------------------------------------------------------------------
# recurrent form
# ----------------------------------------------------------------------------------------------------------------------
def recurrent_gated_delta_rule_ref(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                   output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, *,
                                   state_layout="v_last", A_log=None, a=None, dt_bias=None, b=None,
                                   return_token_states=False):
    """Token-by-token gated delta rule. Returns ``(o [B, T, HV, V], final_state or None)``; with
    ``return_token_states`` a third value: per sequence, the states after each of its tokens ``[len, HV, ...]``
    (``state_layout``, compute dtype), for checking per-token pool writes and checkpoints."""
    g, beta = resolve_gates(g, beta, A_log, a, dt_bias, b)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v_, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    o_parts, finals, per_token = [], [], []
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu_seqlens)):
        S = _initial(initial_state, n, HV, K, V, dt, q.device, state_layout)
        states = []
        for t in range(s, e):
            S = S * torch.exp(g[bi, t])[:, None, None]
            kS = torch.einsum("hk,hkv->hv", k[bi, t], S)  # S^T k
            u = beta[bi, t][:, None] * (v_[bi, t] - kS)
            S = S + k[bi, t][:, :, None] * u[:, None, :]
            o_parts.append(torch.einsum("hk,hkv->hv", q[bi, t], S)[None])
            if return_token_states:
                states.append(_to_kv(S, state_layout))
        finals.append(S)
        if return_token_states:
            per_token.append(torch.stack(states) if states else S.new_zeros((0,) + _to_kv(S, state_layout).shape))
    out = _finish(o_parts, finals, v, B, T, output_final_state, state_layout, dt)
    return (*out, per_token) if return_token_states else out


# ----------------------------------------------------------------------------------------------------------------------
# chunked (WY / UT transform) form
# ----------------------------------------------------------------------------------------------------------------------
def chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, state_layout="v_last",
                               chunk_size=64, return_chunk_states=False):
    """Chunkwise-parallel gated delta rule (seeds 002 and 004). Returns ``(o, final_state or None)``; with
    ``return_chunk_states`` a third value h ``[NT, HV, K, V]`` (v_last order): the start state of every chunk of
    every sequence, in sequence order (as the kernels' h).

    Per chunk of C tokens with cumulative log-gates ``c_r = g_1 + ... + g_r`` and start state ``S0``::

        A    = strictLower(diag(beta) (Gamma * K K^T)),  Gamma_ij = exp(c_i - c_j) for i >= j
        Tm   = (I + A)^-1 diag(beta)                    (the UT transform)
        W    = Tm diag(exp(c)) K,   U = Tm V            (WY representation)
        Vnew = U - W S0
        O    = diag(exp(c)) Q S0 + ((Q K^T) * Gamma, causal) Vnew      (times scale)
        S1   = exp(c_C) S0 + (diag(exp(c_C - c)) K)^T Vnew

    Every exponent is a non-positive difference of cumulative gates, so strong forgetting stays finite.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v_, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    C = int(chunk_size)
    o_parts, finals, starts = [], [], []
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu_seqlens)):
        S = _initial(initial_state, n, HV, K, V, dt, q.device, state_layout)
        L = e - s
        if L == 0:
            finals.append(S)
            continue
        NC = -(-L // C)
        pad = NC * C - L

        def chunks(x):  # [L, HV, D] -> [HV, NC, C, D]; padding tokens have k = v = q = g = beta = 0 (no effect)
            x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if x.dim() > 1 else F.pad(x, (0, pad))
            return x.reshape(NC, C, *x.shape[1:]).movedim(2, 0)

        qc, kc, vc = chunks(q[bi, s:e]), chunks(k[bi, s:e]), chunks(v_[bi, s:e])
        gc = torch.cumsum(chunks(g[bi, s:e]), dim=-1)        # [HV, NC, C]
        bc = chunks(beta[bi, s:e])                           # [HV, NC, C]
        diff = gc[..., :, None] - gc[..., None, :]           # c_i - c_j
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        gamma = torch.exp(diff.masked_fill(~causal, float("-inf")))      # 0 above the diagonal
        A = (bc[..., :, None] * gamma * (kc @ kc.transpose(-1, -2))).tril(-1)
        eye = torch.eye(C, dtype=dt, device=q.device)
        Tm = torch.linalg.solve_triangular(eye + A, torch.diag_embed(bc), upper=False, unitriangular=True)
        W = Tm @ (kc * torch.exp(gc)[..., None])             # decayed to the chunk start
        U = Tm @ vc
        attn = (qc @ kc.transpose(-1, -2)) * gamma           # [HV, NC, C, C]
        outs = []
        for c in range(NC):
            starts.append(S)
            vnew = U[:, c] - W[:, c] @ S
            outs.append((qc[:, c] * torch.exp(gc[:, c])[..., None]) @ S + attn[:, c] @ vnew)
            last = gc[:, c, -1]
            kdec = kc[:, c] * torch.exp(last[:, None] - gc[:, c])[..., None]
            S = S * torch.exp(last)[:, None, None] + kdec.transpose(-1, -2) @ vnew
        o = torch.stack(outs, dim=1).reshape(HV, NC * C, V)[:, :L].transpose(0, 1)  # [L, HV, V]
        o_parts.append(o)
        finals.append(S)
    out = _finish(o_parts, finals, v, B, T, output_final_state, state_layout, dt)
    if return_chunk_states:
        h = torch.stack(starts) if starts else q.new_zeros((0, HV, K, V))
        return (*out, h)
    return out


def chunk_intra_ref(q, k, g, beta, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, chunk_size=64):
    """The per-chunk matrices of the chunked form (as :func:`chunk_gated_delta_rule_ref` builds them), in the kernels'
    row layout ``[B, T, HV, C]``: row t holds row (t - chunk start) of its chunk's matrix, columns past the chunk's
    end are 0. Returns a dict::

        g_cum [B, T, HV]       chunk-local cumulative gates c
        ainv  [B, T, HV, C]    (I + A)^-1,  A = strictLower(diag(beta) (Gamma * K K^T))
        p     [B, T, HV, C]    scale (Q K^T) * Gamma, causal (the intra-chunk part of the output)
        qf    [B, T, HV]       scale exp(c) r_q,  r_q = 1 / sqrt(|q|^2 + eps) with the L2 norm, else 1

    q, k after the optional L2 norm. Computed in float64 on the inputs' device."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    C = int(chunk_size)
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, g, beta = (x.to(torch.float64) for x in (q, k, g, beta))
    rq = torch.rsqrt((q * q).sum(-1) + L2_EPS) if use_qk_l2norm_in_kernel else torch.ones_like(q[..., 0])
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k, rq = _expand_heads(q, HV), _expand_heads(k, HV), _expand_heads(rq[..., None], HV)[..., 0]
    out = dict(g_cum=q.new_zeros(B, T, HV), ainv=q.new_zeros(B, T, HV, C), p=q.new_zeros(B, T, HV, C),
               qf=q.new_zeros(B, T, HV))
    for bi, s, e in sequence_spans(B, T, cu_seqlens):
        for c0 in range(s, e, C):
            c1 = min(c0 + C, e)
            L = c1 - c0
            kc, qc = k[bi, c0:c1].transpose(0, 1), q[bi, c0:c1].transpose(0, 1)     # [HV, L, K]
            gc = torch.cumsum(g[bi, c0:c1], 0).T                                     # [HV, L]
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            gamma = torch.exp((gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")))
            A = (beta[bi, c0:c1].T[:, :, None] * gamma * (kc @ kc.transpose(1, 2))).tril(-1)
            eye = torch.eye(L, dtype=torch.float64, device=q.device)
            out["ainv"][bi, c0:c1, :, :L] = torch.linalg.inv(eye + A).transpose(0, 1)
            out["p"][bi, c0:c1, :, :L] = (scale * (qc @ kc.transpose(1, 2)) * gamma).transpose(0, 1)
            out["g_cum"][bi, c0:c1] = gc.T
            out["qf"][bi, c0:c1] = scale * torch.exp(gc.T) * rq[bi, c0:c1]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# the rest of the block
# ----------------------------------------------------------------------------------------------------------------------
def causal_conv1d_ref(x, weight, bias=None, activation="silu", cu_seqlens=None, initial_conv_state=None):
    """Depthwise causal conv over time, channels last. x ``[B, T, D]``; weight ``[D, W]`` (``weight[:, -1]`` multiplies
    the current token); ``initial_conv_state`` ``[N, D, W-1]`` (oldest first) holds the inputs before each sequence.

    Returns ``(y, final_conv_state [N, D, W-1])``: the last W-1 inputs of each sequence (including the state for
    sequences shorter than W-1).
    """
    B, T, D = x.shape
    W = weight.shape[1]
    dt = _compute_dtype(x, weight)
    ys, finals = [], []
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu_seqlens)):
        prev = (initial_conv_state[n].to(dt).transpose(0, 1) if initial_conv_state is not None
                else torch.zeros(W - 1, D, dtype=dt, device=x.device))
        xx = torch.cat([prev, x[bi, s:e].to(dt)], 0)  # [W-1+L, D]
        L = e - s
        y = sum(xx[j:j + L] * weight[:, j].to(dt) for j in range(W))
        if bias is not None:
            y = y + bias.to(dt)
        if activation in ("silu", "swish"):
            y = F.silu(y)
        elif activation is not None:
            raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
        ys.append(y)
        finals.append(xx[xx.shape[0] - (W - 1):].transpose(0, 1))
    y = torch.cat(ys, 0).reshape(B, T, D) if ys else x.new_zeros(x.shape, dtype=dt)
    return y.to(x.dtype), torch.stack(finals) if finals else None


def gated_rmsnorm_ref(x, z, weight, eps=1e-6):
    """``rmsnorm(x) * weight * silu(z)`` over the last dimension (Qwen3-Next's gated RMSNorm), in x's dtype."""
    dt = _compute_dtype(x, z, weight)
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.to(dt) * F.silu(z.to(dt))
    return y.to(x.dtype)


def decode_ref(q, k, v, state, A_log, a, dt_bias, b, scale=None, *, use_qk_l2norm=False, state_layout="k_last"):
    """The FlashInfer competition's decode (seed 000): one token, raw gates; returns ``(o bf16, new_state fp32)``."""
    if scale is None or scale == 0.0:
        scale = q.shape[-1] ** -0.5
    o, st = recurrent_gated_delta_rule_ref(q, k, v, None, None, scale, state, True, None, use_qk_l2norm,
                                           state_layout=state_layout, A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    return o.to(torch.bfloat16), st


__all__ = [
    "l2norm_ref", "gdn_gate_ref", "recurrent_gated_delta_rule_ref", "chunk_gated_delta_rule_ref",
    "causal_conv1d_ref", "gated_rmsnorm_ref", "decode_ref", "sequence_spans", "resolve_gates", "chunk_intra_ref",
]
