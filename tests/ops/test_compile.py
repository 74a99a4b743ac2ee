"""torch.compile(fullgraph=True) traces the ops without graph breaks (torch.library custom ops with fake impls)."""
import torch

from gdn.ops import fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from gdn.testing import make_inputs, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_decode_step_compiles_fullgraph():
    x = make_inputs(3, 1, 2, 4, 16, 16, device=DEV)
    pool = torch.randn(6, 4, 16, 16, device=DEV)
    idx = torch.tensor([4, -1, 1], device=DEV)

    def step(q, k, v, a, b, pool, idx, A_log, dt_bias):
        o, _ = gated_delta_rule_decode(q, k, v, pool, A_log, a, dt_bias, b, state_indices=idx, use_qk_l2norm=True)
        return o.float() * 2

    p1, p2 = pool.clone(), pool.clone()
    ref = step(x.q, x.k, x.v, x.a, x.b, p1, idx, x.A_log, x.dt_bias)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(x.q, x.k, x.v, x.a, x.b, p2, idx, x.A_log, x.dt_bias)
    assert rel_err(out, ref) == 0.0 and torch.equal(p1, p2)


def test_spec_verify_compiles_fullgraph():
    x = make_inputs(1, 7, 2, 4, 16, 16, device=DEV)
    cu = torch.tensor([0, 3, 7], device=DEV)
    pool = torch.randn(10, 4, 16, 16, device=DEV)
    idx = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]], device=DEV)
    acc = torch.tensor([2, 1], device=DEV)

    def verify(q, k, v, g, beta, pool, cu, idx, acc):
        o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                                ssm_state_indices=idx, num_accepted_tokens=acc,
                                                inplace_final_state=True, use_qk_l2norm_in_kernel=True)
        return o + 1

    p1, p2 = pool.clone(), pool.clone()
    ref = verify(x.q, x.k, x.v, x.g, x.beta, p1, cu, idx, acc)
    torch._dynamo.reset()
    compiled = torch.compile(verify, fullgraph=True, backend="aot_eager")
    out = compiled(x.q, x.k, x.v, x.g, x.beta, p2, cu, idx, acc)
    assert rel_err(out, ref) == 0.0 and torch.equal(p1, p2)
