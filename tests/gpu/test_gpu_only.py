"""GPU-only checks (run by bench/gpu_session.py on the device machine; not collected without CUDA).

- a bf16 state pool of more than 2^31 elements decodes into its last slot correctly (64-bit offsets);
- decode and speculative-verify steps captured in a CUDA graph replay correctly with new inputs;
- torch.compile with inductor on a decode step.
"""
import pytest
import torch

from gdn.ops import fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from gdn.reference import recurrent_gated_delta_rule_ref
from gdn.testing import make_inputs, rel_err, to64

pytestmark = pytest.mark.gpu


def test_pool_past_2_pow_31_elements_last_slot():
    HV, K, V = 32, 128, 128
    P = (2**31) // (HV * K * V) + 2  # > 2^31 elements
    pool = torch.empty(P, HV, V, K, dtype=torch.bfloat16, device="cuda")
    assert pool.numel() > 2**31
    pool[-1].normal_()
    pool[0].normal_()
    before_last, before_first = pool[-1].clone(), pool[0].clone()
    x = make_inputs(2, 1, 16, HV, K, V, dtype=torch.bfloat16, device="cuda")
    idx = torch.tensor([P - 1, 0], device="cuda", dtype=torch.int32)
    o, _ = gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, state_indices=idx,
                                   use_qk_l2norm=True)
    h0 = torch.stack([before_last, before_first]).double().cpu()
    ro, rs = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v), A_log=x.A_log.double().cpu(),
                                            a=x.a.double().cpu(), dt_bias=x.dt_bias.double().cpu(),
                                            b=x.b.double().cpu(), initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, state_layout="k_last")
    assert rel_err(o, ro) < 1e-2
    assert rel_err(pool[-1].float(), rs[0]) < 1e-2 and rel_err(pool[0].float(), rs[1]) < 1e-2


def test_decode_cuda_graph_replay():
    B, H, HV, K, V, P = 8, 4, 8, 128, 128, 20
    x = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(P, HV, V, K, device="cuda")
    idx = torch.randperm(P, device="cuda")[:B].to(torch.int32)
    idx[3] = -1
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device="cuda")

    def step():
        gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, state_indices=idx, output=out,
                                use_qk_l2norm=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile/warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):  # new inputs in place, replay, compare with eager on copies
        y = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device="cuda")
        for f in ("q", "k", "v", "a", "b"):
            getattr(x, f).copy_(getattr(y, f))
        pool_eager = pool.clone()
        o_eager, _ = gated_delta_rule_decode(x.q, x.k, x.v, pool_eager, x.A_log, x.a, x.dt_bias, x.b,
                                             state_indices=idx, use_qk_l2norm=True)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, o_eager) and torch.equal(pool, pool_eager)


def test_spec_verify_cuda_graph_replay():
    N, Tm, H, HV, K, V, P = 4, 3, 2, 4, 128, 128, 32
    x = make_inputs(N, Tm, H, HV, K, V, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(P, HV, K, V, device="cuda").to(torch.bfloat16)
    idx = torch.arange(N * Tm, device="cuda", dtype=torch.int32).reshape(N, Tm)
    acc = torch.tensor([1, 2, 3, 1], device="cuda", dtype=torch.int32)

    def step():
        return fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool,
                                                ssm_state_indices=idx, num_accepted_tokens=acc,
                                                inplace_final_state=True, use_qk_l2norm_in_kernel=True)[0]

    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = step()
    pool_eager = pool.clone()
    o_eager = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool_eager,
                                               ssm_state_indices=idx, num_accepted_tokens=acc,
                                               inplace_final_state=True, use_qk_l2norm_in_kernel=True)[0]
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, o_eager) and torch.equal(pool, pool_eager)


def test_decode_torch_compile_inductor():
    x = make_inputs(4, 1, 2, 4, 128, 128, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(6, 4, 128, 128, device="cuda")

    def step(q, k, v, a, b, pool, idx):
        o, _ = gated_delta_rule_decode(q, k, v, pool, x.A_log, a, x.dt_bias, b, state_indices=idx,
                                       use_qk_l2norm=True)
        return o.float().sum(-1)

    idx = torch.tensor([5, 0, -1, 2], device="cuda")
    p1, p2 = pool.clone(), pool.clone()
    ref = step(x.q, x.k, x.v, x.a, x.b, p1, idx)
    out = torch.compile(step, fullgraph=True)(x.q, x.k, x.v, x.a, x.b, p2, idx)
    assert rel_err(out, ref) < 1e-5 and torch.equal(p1, p2)


def test_varlen_prefill_cuda_graph_replay():
    """A varlen prefill (pool in place, k_last) with cu_seqlens_cpu reads nothing back from the device, so it can be
    captured in a CUDA graph: replaying on new inputs equals the eager call."""
    from gdn.ops import chunk_gated_delta_rule

    lens = [1, 63, 64, 65, 300]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T, N, HV, K, V = int(cu[-1]), len(lens), 8, 128, 128
    cu_d = cu.cuda()
    idx = torch.tensor([3, 0, -1, 5, 1], dtype=torch.int32, device="cuda")
    x = make_inputs(1, T, 4, HV, K, V, dtype=torch.bfloat16, device="cuda")
    pool = torch.randn(N + 2, HV, V, K, device="cuda") * 0.5
    static = [t.clone() for t in (x.q, x.k, x.v, x.g, x.beta)]
    pool_g = pool.clone()

    def call(p):
        return chunk_gated_delta_rule(*static, initial_state=p, output_final_state=True, cu_seqlens=cu_d,
                                      use_qk_l2norm_in_kernel=True, state_layout="k_last", ssm_state_indices=idx,
                                      cu_seqlens_cpu=cu)[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(pool_g.clone())                 # warm-up: compiles, fills the chunk-table cache
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g = call(pool_g)
    y = make_inputs(1, T, 4, HV, K, V, dtype=torch.bfloat16, device="cuda")
    for dst, src in zip(static, (y.q, y.k, y.v, y.g, y.beta)):
        dst.copy_(src)
    pool_g.copy_(pool)
    graph.replay()
    pool_e = pool.clone()
    o_e = call(pool_e)
    assert torch.equal(o_g, o_e)
    assert torch.equal(pool_g, pool_e)


@pytest.mark.parametrize("state_dtype,layout", [(torch.float32, "v_last"), (torch.bfloat16, "k_last"),
                                                (torch.bfloat16, "v_last")])
def test_layer_decode_step_cuda_graph_replay(state_dtype, layout):
    """One cached decode step of the GatedDeltaNet layer (the fused step where the decode_step table takes it)
    captured in a CUDA graph: replays with new inputs equal eager steps on a copy of the cache, bitwise."""
    from gdn.layers import GatedDeltaNet, GDNCache

    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 4, 128, 128, device="cuda", dtype=torch.bfloat16).eval()
    N = 6
    cache = GDNCache.for_layers(layer, num_slots=N + 2, dtype=state_dtype, state_layout=layout)
    slots = cache.allocate(N + 2)[2:].clone()
    slots[1] = -1
    x = torch.randn(N, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(torch.randn(N, 5, 256, device="cuda", dtype=torch.bfloat16), cache=cache.batch(slots))
        layer(x, cache=cache.batch(slots))   # warm-up outside capture (compiles, packs the in-projections)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = layer(x, cache=cache.batch(slots))
        twin = GDNCache.for_layers(layer, num_slots=N + 2, dtype=state_dtype, state_layout=layout)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            twin.conv_states.copy_(cache.conv_states), twin.ssm_states.copy_(cache.ssm_states)
            y_eager = layer(x, cache=twin.batch(slots))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, y_eager)
            assert torch.equal(cache.conv_states, twin.conv_states) and torch.equal(cache.ssm_states, twin.ssm_states)


def test_fast_launch_path_equals_triton_launch(monkeypatch):
    """gdn.kernels.launch's fast path (second and later launches of a key) gives bitwise the outputs of Triton's own
    launch path, with launch.VERIFY asking Triton for its kernel on every fast launch; misaligned views and other
    integer values get their own kernels. Forward + backward of the chunked op, decode."""
    from gdn.kernels import launch as L
    from gdn.ops import chunk_gated_delta_rule

    monkeypatch.setattr(L, "VERIFY", True)
    assert L._ENABLED

    def fwd_bwd(x, T, cu):
        q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
        o, ht = chunk_gated_delta_rule(q, k, v, x.g, x.beta, output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
        (o.float().square().sum() + ht.sum()).backward()
        return [o, ht, q.grad, k.grad, v.grad]

    for T, lens in ((300, [1, 63, 64, 65, 107]), (517, [517])):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        x = make_inputs(1, T, 4, 8, 128, 128, dtype=torch.bfloat16, device="cuda")
        monkeypatch.setattr(L, "_ENABLED", False)
        want = fwd_bwd(x, T, cu)
        monkeypatch.setattr(L, "_ENABLED", True)
        n0 = len(L._CACHE)
        for _ in range(3):
            got = fwd_bwd(x, T, cu)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert len(L._CACHE) > n0 or n0 > 0
    # an input view whose data pointer is not 16-byte aligned: another specialisation, same results as Triton's
    pad = torch.randn(1, 300 * 4 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    x = make_inputs(1, 300, 4, 8, 128, 128, dtype=torch.bfloat16, device="cuda")
    q_odd = pad[:, 1:].view(1, 300, 4, 128)
    q_odd.copy_(x.q)
    x.q = q_odd
    cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    monkeypatch.setattr(L, "_ENABLED", False)
    want = fwd_bwd(x, 300, cu)
    monkeypatch.setattr(L, "_ENABLED", True)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(fwd_bwd(x, 300, cu), want))
    # decode: pool rows through indices, several batch sizes
    for N in (3, 16, 33):
        d = make_inputs(N, 1, 4, 8, 128, 128, dtype=torch.bfloat16, device="cuda")
        pool = torch.randn(N + 1, 8, 128, 128, device="cuda")
        idx = torch.randperm(N + 1, device="cuda")[:N].int()
        outs = []
        for fast in (False, True, True):
            monkeypatch.setattr(L, "_ENABLED", fast)
            p = pool.clone()
            o, _ = gated_delta_rule_decode(d.q, d.k, d.v, p, d.A_log, d.a, d.dt_bias, d.b, state_indices=idx,
                                           use_qk_l2norm=True)
            outs.append((o, p))
        assert all(torch.equal(a[0], outs[0][0]) and torch.equal(a[1], outs[0][1]) for a in outs[1:])
