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


def _compile_matches(fn, *args):
    """fn(*args) eager vs compiled (fullgraph, aot_eager): outputs and gradients of every float leaf."""
    leaves_e = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in args]
    leaves_c = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                for a in args]
    out_e = fn(*leaves_e)
    torch._dynamo.reset()
    out_c = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves_c)
    assert rel_err(out_c, out_e) < 1e-6
    w = torch.randn_like(out_e)
    (out_e * w).sum().backward()
    (out_c * w).sum().backward()
    for a, b in zip(leaves_e, leaves_c):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert rel_err(b.grad, a.grad) < 1e-6


def test_gate_norm_conv_compile_fullgraph_with_backward():
    from gdn.ops import causal_conv1d, gated_rms_norm, gdn_gate

    _compile_matches(lambda a, A, d: gdn_gate(a, A, d) * 2, torch.randn(2, 5, 4, device=DEV),
                     torch.randn(4, device=DEV), torch.randn(4, device=DEV))
    _compile_matches(lambda x, z, w: gated_rms_norm(x, z, w), torch.randn(2, 3, 4, 16, device=DEV),
                     torch.randn(2, 3, 4, 16, device=DEV), torch.randn(16, device=DEV))
    _compile_matches(lambda x, w, b: causal_conv1d(x, w, b), torch.randn(2, 9, 24, device=DEV),
                     torch.randn(24, 4, device=DEV), torch.randn(24, device=DEV))


def test_conv_update_with_pool_compiles_fullgraph():
    from gdn.ops import causal_conv1d_update

    pool = torch.randn(5, 24, 3, device=DEV)
    x = torch.randn(3, 24, device=DEV)
    w = torch.randn(24, 4, device=DEV)
    idx = torch.tensor([4, -1, 0], device=DEV)
    p1, p2 = pool.clone(), pool.clone()
    ref = causal_conv1d_update(x, p1, w, conv_state_indices=idx)
    torch._dynamo.reset()
    out = torch.compile(lambda x, p: causal_conv1d_update(x, p, w, conv_state_indices=idx) + 1, fullgraph=True,
                        backend="aot_eager")(x, p2)
    assert rel_err(out - 1, ref) < 1e-6 and torch.equal(p1, p2)


def test_chunk_compiles_fullgraph_with_backward():
    from gdn.ops import chunk_gated_delta_rule

    x = make_inputs(1, 70, 2, 4, 16, 16, device=DEV)
    h0 = torch.randn(2, 4, 16, 16, device=DEV)
    cu = torch.tensor([0, 30, 70], device=DEV)

    def fn(q, k, v, g, beta, h0):
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True, state_layout="k_last")
        return o.sum(-1) + ht.sum((1, 2, 3))[None, :1]

    _compile_matches(fn, x.q, x.k, x.v, x.g, x.beta, h0)


def test_chunk_pool_prefill_compiles_fullgraph():
    from gdn.ops import chunk_gated_delta_rule

    x = make_inputs(1, 40, 2, 4, 16, 16, device=DEV)
    cu = torch.tensor([0, 17, 40], device=DEV)
    pool = torch.randn(5, 4, 16, 16, device=DEV)
    idx = torch.tensor([3, 0], device=DEV)

    def fn(q, k, v, g, beta, pool):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                                      use_qk_l2norm_in_kernel=True)[0] * 2

    p1, p2 = pool.clone(), pool.clone()
    ref = fn(x.q, x.k, x.v, x.g, x.beta, p1)
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x.q, x.k, x.v, x.g, x.beta, p2)
    assert rel_err(out, ref) < 1e-6 and torch.equal(p1, p2)


def test_chunk_pool_checkpoints_and_write_rows_compile_fullgraph():
    """Serving state (separate write rows, checkpoints) through the opaque pool op: the compiled graph writes the same
    pool as eager."""
    from gdn.ops import chunk_gated_delta_rule

    x = make_inputs(1, 200, 1, 2, 16, 16, device=DEV)
    cu = torch.tensor([0, 130, 200], device=DEV)
    pool = torch.randn(8, 2, 16, 16, device=DEV)
    idx, out = torch.tensor([3, 0], device=DEV), torch.tensor([1, 2], device=DEV)
    ck = torch.tensor([[4, 5], [6, 7]], device=DEV)

    def fn(q, k, v, g, beta, pool):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                                      output_state_indices=out, checkpoint_every_n_tokens=64,
                                      checkpoint_indices=ck)[0] * 2

    p1, p2 = pool.clone(), pool.clone()
    with torch.no_grad():
        ref = fn(x.q, x.k, x.v, x.g, x.beta, p1)
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x.q, x.k, x.v, x.g, x.beta, p2)
    assert rel_err(got, ref) < 1e-6 and torch.equal(p1, p2) and not torch.equal(p1[[1, 2, 4, 5, 6]], pool[[1, 2, 4, 5, 6]])


def test_gated_deltanet_layer_compiles_fullgraph():
    """A model calling the gdn ops (the GDN block: projections, conv, gates, chunked rule, gated RMSNorm) traces
    with fullgraph=True, forward and backward, and matches eager, parameter gradients included."""
    from gdn.layers import GatedDeltaNet

    layer = GatedDeltaNet(32, 2, 4, 16, 16).to(DEV)
    x = torch.randn(2, 20, 32, device=DEV)
    out_e = layer(x)
    w = torch.randn_like(out_e)
    (out_e * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    out_c = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    (out_c * w).sum().backward()
    assert rel_err(out_c, out_e) < 1e-5
    for n, p in layer.named_parameters():
        assert rel_err(p.grad, grads[n]) < 1e-5, n
