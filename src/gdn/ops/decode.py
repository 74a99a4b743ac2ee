"""gated_delta_rule_decode: single-token decode with the FlashInfer competition's inputs (seed 000)."""
from __future__ import annotations

import torch

from . import _validate as V_
from .recurrent import plan_recurrent, run_recurrent


def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, b, scale=None, *, use_qk_l2norm=False,
                            state_indices=None, output=None, state_layout="k_last", output_state_indices=None):
    """One decode step with gates computed in the kernel: ``g = -exp(A_log) softplus(a + dt_bias)``,
    ``beta = sigmoid(b)``.

    q, k ``[B, 1, H, K]``; v ``[B, 1, HV, V]``; a, b ``[B, 1, HV]``; A_log, dt_bias ``[HV]``. ``state``
    ``[B, HV, V, K]`` (``k_last``, default) or ``[B, HV, K, V]`` (``v_last``), fp32/bf16/fp16, updated in place; with
    ``state_indices`` ``[B]`` it is a pool ``[P, HV, ...]`` and row ``state_indices[b]`` is used (-1: padding, output
    zeros); ``output_state_indices`` ``[B]`` (needs ``state_indices``): the new state goes to that row instead (-1 =
    not written; the read row stays untouched). ``scale`` None or 0 means ``K ** -0.5``. Returns ``(o [B, 1, HV, V], state)``; o is bfloat16 unless
    ``output`` (written in place) is given. CUDA-graph capturable.
    """
    V_.tensor("q", q, ndim=4, dtypes=V_.FLOAT_DTYPES, shape_doc="[B, 1, H, K]")
    if q.shape[1] != 1:
        raise ValueError(f"q: decode takes one token per sequence, expected shape [B, 1, H, K], got {tuple(q.shape)}")
    if scale is not None and not isinstance(scale, torch.Tensor) and scale == 0.0:
        scale = None
    V_.tensor("state", state, ndim=4, dtypes=V_.STATE_DTYPES, device=q.device,
              shape_doc="[B, HV, V, K] (k_last) or [B, HV, K, V] (v_last)")
    plan = plan_recurrent(q, k, v, None, None, scale, state, False, None, state_layout, state_indices, None, True,
                          A_log, a, dt_bias, b, state_name="state", indices_name="state_indices",
                          output_state_indices=output_state_indices)
    if output is not None:
        V_.tensor("output", output, ndim=4, dtypes=V_.FLOAT_DTYPES, device=q.device, shape_doc="[B, 1, HV, V]")
        V_.shape("output", output, tuple(v.shape), "[B, 1, HV, V]")
        V_.contiguous("output", output)
    else:
        output = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    o, _ = run_recurrent(q, k, v, plan, A_log=A_log, a=a, dt_bias=dt_bias, b=b, initial_state=state,
                         ssm_state_indices=state_indices, l2norm=use_qk_l2norm, out=output,
                         output_state_indices=output_state_indices)
    return o, state
