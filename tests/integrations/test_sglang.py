"""gdn.integrations.sglang: each entry point against the float64 reference with the arguments SGLang 0.5.23's
TritonGDNKernel passes (k-last pools with -1 padding, varlen, strided q/k/v views, target verify with per-token
states and EAGLE trees through retrieve_parent_token, chunk states h), error cases, enable()/disable() on a fake
SGLang module tree, and the signatures against SGLang's own (tests/integrations/engine_signatures.py)."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import gdn.integrations.sglang as sgl
from gdn.reference import chunk_gated_delta_rule_ref, gdn_gate_ref, recurrent_gated_delta_rule_ref
from gdn.testing import poison_, rel_err

TOL = 2e-5  # fp32 inputs and states vs float64


def _raw(T_total, HV, device, a_scale=1.0):
    A_log = torch.rand(HV, device=device) * 1.5 - 1.0
    dt_bias = torch.randn(HV, device=device) * 0.5
    a = torch.randn(T_total, HV, device=device) * a_scale
    b = torch.randn(T_total, HV, device=device) * 2
    return A_log, a, dt_bias, b


def _packed_qkv(T_total, H, HV, K, V, device):
    """q, k, v as [1, T, heads, dim] views of one packed conv output [T, 2*H*K + HV*V] (as SGLang passes them)."""
    mixed = torch.randn(T_total, 2 * H * K + HV * V, device=device)
    q = mixed[:, : H * K].view(1, T_total, H, K)
    k = mixed[:, H * K: 2 * H * K].view(1, T_total, H, K)
    v = mixed[:, 2 * H * K:].view(1, T_total, HV, V)
    return mixed, q, k, v


def _oracle_path(q, k, v, g, beta, scale, h0_kv, tokens):
    """float64 recurrence along the token list ``tokens`` of one sequence (q/k/v [T, ..] rows), from h0 [HV, K, V];
    returns (outputs [len, HV, V], states after each token [len, HV, K, V])."""
    outs, states = [], []
    S = h0_kv
    for t in tokens:
        o, S = recurrent_gated_delta_rule_ref(q[None, None, t], k[None, None, t], v[None, None, t], g[None, None, t],
                                              beta[None, None, t], scale, S[None], True, use_qk_l2norm_in_kernel=True)
        S = S[0]
        outs.append(o[0, 0])
        states.append(S)
    return torch.stack(outs), torch.stack(states)


def _tree_oracle(q, k, v, g, beta, scale, h0_kv, parents):
    """Tree verification in float64: token t's recurrence starts from the state after parents[t] (t > 0; token 0 from
    h0). Returns (o [T, HV, V], per-token states [T, HV, K, V])."""
    T = len(parents)
    outs, states = [None] * T, [None] * T
    for t in range(T):
        path = [t]
        while path[-1] > 0:
            path.append(parents[path[-1]])
        path = path[::-1]  # root (token 0) .. t
        o, st = _oracle_path(q, k, v, g, beta, scale, h0_kv, path)
        outs[t], states[t] = o[-1], st[-1]
    return torch.stack(outs), torch.stack(states)


def _random_tree(T):
    return [0] + [int(torch.randint(0, t, ())) for t in range(1, T)]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_target_verify(device, tree, state_dtype):
    """TritonGDNKernel.target_verify: disable_state_update, per-token states into the intermediate buffer, EAGLE
    trees; -1 padding in both the pool and the cache slots; HV > H."""
    H, HV, K, V, T = 2, 4, 16, 8, 5
    N, P, S = 3, 6, 4
    cu = torch.tensor([0, T, 2 * T, 3 * T], dtype=torch.int32, device=device)
    mixed, q, k, v = _packed_qkv(N * T, H, HV, K, V, device)
    A_log, a, dt_bias, b = _raw(N * T, HV, device)
    pool = torch.randn(P, HV, V, K, device=device).to(state_dtype)
    pool0 = pool.clone()
    idx = torch.tensor([4, -1, 1], dtype=torch.int64, device=device)
    slots = torch.tensor([2, 0, -1], dtype=torch.int64, device=device)
    buf = poison_(torch.empty(S, T + 1, HV, V, K, device=device, dtype=state_dtype))
    parents = [_random_tree(T) if tree else list(range(-1, T - 1)) for _ in range(N)]
    rpt = torch.tensor(parents, dtype=torch.int64, device=device)
    o = sgl.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool, initial_state_indices=idx,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=True, intermediate_states_buffer=buf, intermediate_state_indices=slots, cache_steps=T,
        retrieve_parent_token=rpt if tree else None)
    assert torch.equal(pool, pool0)  # disable_state_update
    g = gdn_gate_ref(a.double(), A_log.double(), dt_bias.double())
    beta = torch.sigmoid(b.double())
    qd, kd, vd = q[0].double(), k[0].double(), v[0].double()
    for n in range(N):
        sl = slice(n * T, (n + 1) * T)
        if idx[n] < 0:
            assert torch.all(o[0, sl] == 0)
            continue
        h0 = pool0[idx[n]].double().transpose(-1, -2)
        # SGLang: a sequence without a cache slot (-1) runs as a chain even with a tree
        par = parents[n] if tree and slots[n] >= 0 else list(range(-1, T - 1))
        oo, st = _tree_oracle(qd[sl], kd[sl], vd[sl], g[sl], beta[sl], K ** -0.5, h0, par)
        tol = TOL if state_dtype == torch.float32 else 1e-2  # bf16: parents' states are read back rounded
        assert rel_err(o[0, sl], oo) < tol
        if slots[n] >= 0:
            assert rel_err(buf[slots[n], :T].transpose(-1, -2), st) < tol
    assert torch.isnan(buf[1]).all() and torch.isnan(buf[3]).all()  # slots nobody names stay unwritten


def test_tree_chain_equals_linear(device):
    """A tree that is a chain (parent t - 1) gives exactly the linear verify."""
    H, HV, K, V, T = 1, 2, 16, 16, 4
    mixed, q, k, v = _packed_qkv(T, H, HV, K, V, device)
    A_log, a, dt_bias, b = _raw(T, HV, device)
    pool = torch.randn(2, HV, V, K, device=device)
    idx = torch.tensor([1], device=device)
    cu = torch.tensor([0, T], device=device)
    outs = []
    for rpt in (None, torch.arange(-1, T - 1, device=device)[None]):
        buf = torch.empty(1, T, HV, V, K, device=device)
        outs.append(sgl.fused_sigmoid_gating_delta_rule_update(
            A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, idx, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            disable_state_update=True, intermediate_states_buffer=buf,
            intermediate_state_indices=torch.tensor([0], device=device), cache_steps=T, retrieve_parent_token=rpt))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("softplus", [(1.0, 20.0), (2.0, 3.0)])
def test_decode_updates_pool(device, softplus):
    """TritonGDNKernel.decode: one token per sequence, state written back to the pool (k-last), -1 padding;
    a general softplus beta/threshold and large gate arguments (the threshold branch)."""
    H, HV, K, V, N, P = 2, 4, 16, 16, 4, 6
    mixed, q, k, v = _packed_qkv(N, H, HV, K, V, device)
    A_log, a, dt_bias, b = _raw(N, HV, device, a_scale=12.0)
    pool = torch.randn(P, HV, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], device=device)
    cu = torch.arange(N + 1, dtype=torch.int32, device=device)
    o = sgl.fused_sigmoid_gating_delta_rule_update(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b,
                                                   initial_state_source=pool, initial_state_indices=idx,
                                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                                   softplus_beta=softplus[0], softplus_threshold=softplus[1])
    x = a.double() + dt_bias.double()
    sp = torch.where(softplus[0] * x <= softplus[1], torch.log1p(torch.exp(softplus[0] * x)) / softplus[0], x)
    g = -torch.exp(A_log.double()) * sp
    valid = idx >= 0
    h0 = pool0[idx.clamp(min=0)].double().transpose(-1, -2)
    o_ref, ht = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g[None],
                                               torch.sigmoid(b.double())[None], None, h0, True, cu,
                                               use_qk_l2norm_in_kernel=True)
    assert rel_err(o[0, valid], o_ref[0, valid]) < TOL
    assert torch.all(o[0, ~valid] == 0)
    assert rel_err(pool[idx[valid]].transpose(-1, -2), ht[valid]) < TOL
    untouched = [r for r in range(P) if r not in idx.tolist()]
    assert torch.equal(pool[untouched], pool0[untouched])


@pytest.mark.parametrize("lens", [[0, 1, 65, 63], [130]])
@pytest.mark.parametrize("inplace", [True, False])
def test_chunk_extend(device, lens, inplace):
    """TritonGDNKernel.extend: varlen prefill from a k-last pool (one -1 padding row), L2 norm in kernel, the final
    states written back (inplace_update), h = the state at the start of every chunk of 64."""
    H, HV, K, V = 1, 2, 16, 16
    T = sum(lens)
    N = len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)
    q = torch.randn(1, T, H, K, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, device=device, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, HV, device=device) + 3)
    beta = torch.rand(1, T, HV, device=device)
    P = N + 2
    pool = torch.randn(P, HV, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.randperm(P, device=device)[:N]
    if N > 1:
        idx[1] = -1
    o, none, h = sgl.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
                                            head_first=False, use_qk_l2norm_in_kernel=True,
                                            initial_state_indices=idx, inplace_update=inplace)
    assert none is None and o.dtype == q.dtype
    NT = sum(-(-L // 64) for L in lens)
    assert h.shape == (1, NT, HV, V, K) and h.dtype == k.dtype
    c = 0
    for n, L in enumerate(lens):
        s = int(cu[n])
        sl = slice(s, s + L)
        if idx[n] < 0:
            assert torch.all(o[0, sl] == 0)
            c += -(-L // 64)
            continue
        S = pool0[idx[n]].double().transpose(-1, -2)
        for c0 in range(0, L, 64):
            assert rel_err(h[0, c].double().transpose(-1, -2), S) < 1e-2
            c += 1
            _, S = recurrent_gated_delta_rule_ref(q[:, s + c0:s + min(c0 + 64, L)].double(),
                                                  k[:, s + c0:s + min(c0 + 64, L)].double(),
                                                  v[:, s + c0:s + min(c0 + 64, L)].double(),
                                                  g[:, s + c0:s + min(c0 + 64, L)].double(),
                                                  beta[:, s + c0:s + min(c0 + 64, L)].double(), None, S[None], True,
                                                  use_qk_l2norm_in_kernel=True)
            S = S[0]
        o_ref, _ = recurrent_gated_delta_rule_ref(q[:, sl].double(), k[:, sl].double(), v[:, sl].double(),
                                                  g[:, sl].double(), beta[:, sl].double(), None,
                                                  pool0[idx[n]].double().transpose(-1, -2)[None], True,
                                                  use_qk_l2norm_in_kernel=True)
        if L:
            assert rel_err(o[0, sl], o_ref[0]) < 2e-2
        row = pool[idx[n]].double().transpose(-1, -2)
        if inplace:
            assert rel_err(row, S) < 1e-2  # bf16 inputs
        else:
            assert torch.equal(pool[idx[n]], pool0[idx[n]])


def test_chunk_head_first(device):
    B, T, H, K, V = 2, 9, 2, 16, 16
    q, k = (torch.randn(B, H, T, K, device=device) for _ in range(2))
    v = torch.randn(B, H, T, V, device=device)
    g = F.logsigmoid(torch.randn(B, H, T, device=device) + 2)
    beta = torch.rand(B, H, T, device=device)
    pool = torch.randn(3, H, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.tensor([2, 0], device=device)
    o, _, h = sgl.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, initial_state_indices=idx,
                                         head_first=True)
    o_ref, ht = chunk_gated_delta_rule_ref(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                           v.transpose(1, 2).double(), g.transpose(1, 2).double(),
                                           beta.transpose(1, 2).double(), None, pool0[idx].double(), True,
                                           state_layout="k_last")
    assert o.shape == (B, H, T, V)
    assert rel_err(o, o_ref.transpose(1, 2)) < TOL
    assert rel_err(pool[idx], ht) < TOL
    assert h.shape == (B, 1, H, V, K) and rel_err(h[:, 0], pool0[idx]) < TOL


def test_packed_decode(device):
    """SGLang's packed decode: negative slot = padding, row 0 a real slot."""
    H, HV, K, V, B = 2, 4, 16, 16, 3
    mixed = torch.randn(B, 2 * H * K + HV * V, device=device)
    A_log, a, dt_bias, b = _raw(B, HV, device)
    pool = torch.randn(4, HV, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.tensor([0, -1, 3], device=device)
    out = poison_(torch.empty(B, 1, HV, V, device=device))
    sgl.fused_recurrent_gated_delta_rule_packed_decode(mixed, a, b, A_log, dt_bias, K ** -0.5, pool, out, idx, True)
    q = mixed[:, : H * K].view(B, 1, H, K)
    k = mixed[:, H * K: 2 * H * K].view(B, 1, H, K)
    v = mixed[:, 2 * H * K:].view(B, 1, HV, V)
    g = gdn_gate_ref(a.double(), A_log.double(), dt_bias.double())[:, None]
    o_ref, ht = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g, torch.sigmoid(b.double())[:, None],
                                               None, pool0[idx.clamp(min=0)].double(), True,
                                               use_qk_l2norm_in_kernel=True, state_layout="k_last")
    keep = idx >= 0
    assert rel_err(out[keep], o_ref[keep]) < TOL and torch.all(out[1] == 0)
    assert rel_err(pool[idx[keep]], ht[keep]) < TOL and torch.equal(pool[[1, 2]], pool0[[1, 2]])


def test_errors(device):
    H, HV, K, V, T = 1, 2, 16, 16, 3
    mixed, q, k, v = _packed_qkv(T, H, HV, K, V, device)
    A_log, a, dt_bias, b = _raw(T, HV, device)
    pool = torch.randn(2, HV, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.tensor([0], device=device)
    cu = torch.tensor([0, T], device=device)
    args = (A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, idx)
    for kw, exc, word in [(dict(is_kda=True), NotImplementedError, "is_kda"),
                          (dict(cache_ring=True), NotImplementedError, "cache_ring"),
                          (dict(match_cutedsl_decode=True), NotImplementedError, "match_cutedsl_decode"),
                          (dict(retrieve_parent_token=torch.zeros(1, T, dtype=torch.int64, device=device)),
                           ValueError, "intermediate_states_buffer"),
                          (dict(intermediate_states_buffer=torch.empty(1, T - 1, HV, V, K, device=device),
                                intermediate_state_indices=idx), ValueError, "intermediate_states_buffer"),
                          (dict(intermediate_states_buffer=torch.empty(1, T, HV, V, K, device=device)), ValueError,
                           "intermediate_state_indices")]:
        with pytest.raises(exc, match=word):
            sgl.fused_sigmoid_gating_delta_rule_update(*args, cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match="initial_state_indices"):
        sgl.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool,
                                                   torch.tensor([7], device=device), cu_seqlens=cu)
    g = torch.zeros(1, T, HV, device=device) - 0.1
    with pytest.raises(ValueError, match="initial_state_indices"):
        sgl.chunk_gated_delta_rule(q, k, v, g, g.exp(), initial_state=pool)
    assert torch.equal(pool, pool0)


def _fake_sglang(monkeypatch):
    """A module tree with SGLang 0.5.23's names (kernels and the GDN kernel backend that imported them)."""
    sentinels = {}
    for name in ["sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention",
                 "sglang.kernels.ops.attention.linear", "sglang.kernels.ops.attention.fla",
                 "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
                 "sglang.kernels.ops.attention.fla.chunk", "sglang.kernels.ops.attention.fla.fused_recurrent",
                 "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention",
                 "sglang.srt.layers.attention.linear", "sglang.srt.layers.attention.linear.kernels",
                 "sglang.srt.layers.attention.linear.kernels.gdn_triton"]:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for fn in ["fused_sigmoid_gating_delta_rule_update", "chunk_gated_delta_rule",
               "fused_recurrent_gated_delta_rule_packed_decode"]:
        sentinels[fn] = lambda *a, _n=fn, **k: _n
    m = sys.modules
    m["sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent"].fused_sigmoid_gating_delta_rule_update = \
        sentinels["fused_sigmoid_gating_delta_rule_update"]
    m["sglang.kernels.ops.attention.fla.chunk"].chunk_gated_delta_rule = sentinels["chunk_gated_delta_rule"]
    m["sglang.kernels.ops.attention.fla.fused_recurrent"].fused_recurrent_gated_delta_rule_packed_decode = \
        sentinels["fused_recurrent_gated_delta_rule_packed_decode"]
    backend = m["sglang.srt.layers.attention.linear.kernels.gdn_triton"]
    for fn, f in sentinels.items():
        setattr(backend, fn, f)
    return sentinels


def test_enable_disable(monkeypatch):
    sentinels = _fake_sglang(monkeypatch)
    backend = sys.modules["sglang.srt.layers.attention.linear.kernels.gdn_triton"]
    done = sgl.enable()
    try:
        assert "sglang.srt.layers.attention.linear.kernels.gdn_triton" in done and sgl.is_enabled()
        assert sgl.enable() == done
        for fn in sentinels:
            assert getattr(backend, fn) is getattr(sgl, fn)
        assert sys.modules["sglang.kernels.ops.attention.fla.chunk"].chunk_gated_delta_rule is \
            sgl.chunk_gated_delta_rule
        # a backend imported while enabled binds gdn's functions; disable() gives it SGLang's back
        late = types.ModuleType("sglang.srt.layers.attention.hybrid_linear_attn_backend")
        late.chunk_gated_delta_rule = sgl.chunk_gated_delta_rule
        monkeypatch.setitem(sys.modules, late.__name__, late)
    finally:
        sgl.disable()
    assert not sgl.is_enabled()
    for fn, f in sentinels.items():
        assert getattr(backend, fn) is f
    assert late.chunk_gated_delta_rule is sentinels["chunk_gated_delta_rule"]
    with sgl.enabled():
        assert backend.chunk_gated_delta_rule is sgl.chunk_gated_delta_rule
    assert backend.chunk_gated_delta_rule is sentinels["chunk_gated_delta_rule"]


def test_enable_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="sglang"):
        sgl.enable()
