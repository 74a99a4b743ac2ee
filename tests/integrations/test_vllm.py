"""gdn.integrations.vllm: each entry point against the float64 reference with the arguments vLLM 0.33's Qwen GDN
layer passes (packed q|k|v views, k-last pools with 0 = NULL_BLOCK padding, 2-D slot indices with
num_accepted_tokens, varlen, core_attn_out), paged pools (rows not packed), error cases, enable()/disable() on a
fake vLLM module tree, and the general plugin's environment switch."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import gdn.integrations.vllm as gv
from gdn.reference import chunk_gated_delta_rule_ref, gdn_gate_ref, recurrent_gated_delta_rule_ref
from gdn.testing import poison_, rel_err

TOL = 2e-5


def _raw(T, HV, device):
    return (torch.rand(HV, device=device) - 0.5, torch.randn(T, HV, device=device) * 2,
            torch.randn(HV, device=device) * 0.5, torch.randn(T, HV, device=device) * 2)


def _paged(P, HV, V, K, device, paged):
    """A k-last pool [P, HV, V, K]; ``paged``: rows spaced like vLLM's page-padded cache views (stride(0) > row)."""
    if not paged:
        return torch.randn(P, HV, V, K, device=device)
    raw = torch.randn(P, HV * V * K + 37, device=device)
    return raw[:, : HV * V * K].view(P, HV, V, K)


@pytest.mark.parametrize("paged", [False, True])
def test_packed_decode(device, paged):
    H, HV, K, V, B, P = 2, 4, 16, 16, 4, 6
    mixed = torch.randn(B, 2 * H * K + HV * V, device=device)
    A_log, a, dt_bias, b = _raw(B, HV, device)
    pool = _paged(P, HV, V, K, device, paged)
    pool0 = pool.clone()
    idx = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=device)  # 0 = vLLM's NULL_BLOCK_ID: padding
    out = poison_(torch.empty(B, 1, HV, V, device=device))
    r = gv.fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                                                          scale=K ** -0.5, initial_state=pool, out=out,
                                                          ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
    assert r[0] is out and r[1] is pool
    q = mixed[:, : H * K].view(B, 1, H, K)
    k = mixed[:, H * K: 2 * H * K].view(B, 1, H, K)
    v = mixed[:, 2 * H * K:].view(B, 1, HV, V)
    g = gdn_gate_ref(a.double(), A_log.double(), dt_bias.double())[:, None]
    o_ref, ht = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g,
                                               torch.sigmoid(b.double())[:, None], None, pool0[idx.long()].double(),
                                               True, use_qk_l2norm_in_kernel=True, state_layout="k_last")
    keep = idx > 0
    assert rel_err(out[keep], o_ref[keep]) < TOL and torch.all(out[~keep] == 0)
    assert rel_err(pool[idx[keep].long()], ht[keep]) < TOL
    untouched = [r for r in range(P) if r not in idx[keep].tolist()]
    assert torch.equal(pool[untouched], pool0[untouched])


@pytest.mark.parametrize("paged", [False, True])
def test_spec_decode(device, paged):
    """The layer's spec path: fused_sigmoid_gating_delta_rule_update with 2-D slot indices [N, T_max],
    num_accepted_tokens, varlen (ragged draft counts), per-token states written in place, a padded sequence."""
    H, HV, K, V, P = 1, 2, 16, 8, 12
    lens = [3, 1, 2]
    N, T = len(lens), sum(lens)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32, device=device)
    mixed = torch.randn(T, 2 * H * K + HV * V, device=device)
    q = mixed[:, : H * K].view(1, T, H, K)
    k = mixed[:, H * K: 2 * H * K].view(1, T, H, K)
    v = mixed[:, 2 * H * K:].view(1, T, HV, V)
    A_log, a, dt_bias, b = _raw(T, HV, device)
    pool = _paged(P, HV, V, K, device, paged)
    pool0 = pool.clone()
    idx = torch.tensor([[2, 3, 4], [5, 0, 0], [0, 0, 0]], dtype=torch.int32, device=device)
    idx[2] = torch.tensor([7, 8, 0])
    acc = torch.tensor([2, 1, 1], dtype=torch.int32, device=device)
    o, st = gv.fused_sigmoid_gating_delta_rule_update(A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v,
                                                      initial_state=pool, inplace_final_state=True, cu_seqlens=cu,
                                                      ssm_state_indices=idx, num_accepted_tokens=acc,
                                                      use_qk_l2norm_in_kernel=True)
    assert st is pool
    g = gdn_gate_ref(a.double(), A_log.double(), dt_bias.double())
    beta = torch.sigmoid(b.double())
    for n, L in enumerate(lens):
        s = int(cu[n])
        h0 = pool0[int(idx[n, int(acc[n]) - 1])].double()[None]
        for t in range(L):
            o_ref, ht = recurrent_gated_delta_rule_ref(q[:, s:s + t + 1].double(), k[:, s:s + t + 1].double(),
                                                       v[:, s:s + t + 1].double(), g[None, s:s + t + 1],
                                                       beta[None, s:s + t + 1], None, h0, True,
                                                       use_qk_l2norm_in_kernel=True, state_layout="k_last")
            assert rel_err(o[0, s + t], o_ref[0, t]) < TOL
            assert rel_err(pool[int(idx[n, t])], ht[0]) < TOL
    assert torch.equal(pool[[0, 1, 6, 9, 10, 11]], pool0[[0, 1, 6, 9, 10, 11]])


def test_recurrent_not_inplace(device):
    """inplace_final_state=False: a new [T, HV, V, K] tensor holds the state after every token (vLLM's layout)."""
    H, HV, K, V = 1, 2, 16, 16
    cu = torch.tensor([0, 2, 5], device=device)
    T = 5
    q, k = (torch.randn(1, T, H, K, device=device) for _ in range(2))
    v = torch.randn(1, T, HV, V, device=device)
    g = F.logsigmoid(torch.randn(1, T, HV, device=device))
    beta = torch.rand(1, T, HV, device=device)
    h0 = torch.randn(2, HV, V, K, device=device)
    o, st = gv.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, inplace_final_state=False,
                                                cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert st.shape == (T, HV, V, K)
    for n, (s, e) in enumerate([(0, 2), (2, 5)]):
        for t in range(s, e):
            o_ref, ht = recurrent_gated_delta_rule_ref(q[:, s:t + 1].double(), k[:, s:t + 1].double(),
                                                       v[:, s:t + 1].double(), g[:, s:t + 1].double(),
                                                       beta[:, s:t + 1].double(), None, h0[n:n + 1].double(), True,
                                                       use_qk_l2norm_in_kernel=True, state_layout="k_last")
            assert rel_err(o[0, t], o_ref[0, -1]) < TOL and rel_err(st[t], ht[0]) < TOL


def test_sigmoid_gating_general_softplus(device):
    H, HV, K, V, N = 1, 2, 16, 16, 3
    q, k = (torch.randn(N, 1, H, K, device=device) for _ in range(2))
    v = torch.randn(N, 1, HV, V, device=device)
    A_log, a, dt_bias, b = _raw(N, HV, device)
    a = a * 10
    pool = torch.randn(4, HV, V, K, device=device)
    pool0 = pool.clone()
    idx = torch.tensor([1, 2, 3], device=device)
    o, _ = gv.fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, beta=0.5, threshold=2.0,
                                                     initial_state=pool, ssm_state_indices=idx)
    x = a.double() + dt_bias.double()
    sp = torch.where(0.5 * x <= 2.0, torch.log1p(torch.exp(0.5 * x)) / 0.5, x)
    g = (-torch.exp(A_log.double()) * sp)[:, None]
    o_ref, ht = recurrent_gated_delta_rule_ref(q.double(), k.double(), v.double(), g,
                                               torch.sigmoid(b.double())[:, None], None, pool0[idx].double(), True,
                                               state_layout="k_last")
    assert rel_err(o, o_ref) < TOL and rel_err(pool[idx], ht) < TOL


@pytest.mark.parametrize("lens", [[1, 64, 65], [63]])
def test_chunk_prefill(device, lens):
    """The prefill path: gathered k-last initial states, output_final_state, cu_seqlens with vLLM's chunk tables,
    L2 norm off (applied before), output written into core_attn_out."""
    H, HV, K, V = 1, 2, 16, 16
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q, k = (F.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(1, T, HV, V, device=device, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, T, HV, device=device) + 2)
    beta = torch.rand(1, T, HV, device=device)
    h0 = torch.randn(N, HV, V, K, device=device)
    out = poison_(torch.empty(T + 3, HV, V, device=device, dtype=torch.bfloat16))
    o, ht = gv.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, chunk_indices=torch.zeros(1), chunk_offsets=torch.zeros(1),
                                      use_qk_l2norm_in_kernel=False, core_attn_out=out)
    o_ref, ht_ref = chunk_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), None,
                                               h0.double(), True, cu, state_layout="k_last")
    assert o.data_ptr() == out.data_ptr() and o.shape == v.shape
    assert rel_err(out[:T], o_ref[0]) < 1e-2 and torch.isnan(out[T:]).all()
    assert ht.dtype == torch.float32 and rel_err(ht, ht_ref) < 1e-2


def test_errors(device):
    H, HV, K, V = 1, 2, 16, 16
    q, k = (torch.randn(1, 2, H, K, device=device) for _ in range(2))
    v = torch.randn(1, 2, HV, V, device=device)
    g = torch.full((1, 2, HV), -0.1, device=device)
    pool = torch.randn(3, HV, V, K, device=device)
    pool0 = pool.clone()
    with pytest.raises(NotImplementedError, match="beta"):
        gv.fused_recurrent_gated_delta_rule(q, k, v, g, torch.rand(1, 2, HV, V, device=device), initial_state=pool,
                                            ssm_state_indices=torch.tensor([1], device=device))
    with pytest.raises(NotImplementedError, match="is_kda"):
        gv.fused_sigmoid_gating_delta_rule_update(g[0, :, 0], g[0], g[0], g[0, :, 0], q, k, v, is_kda=True)
    with pytest.raises(ValueError, match="ssm_state_indices"):
        gv.fused_recurrent_gated_delta_rule(q, k, v, g, g.exp(), initial_state=pool,
                                            ssm_state_indices=torch.tensor([5], device=device))
    with pytest.raises(ValueError, match="mixed_qkv"):
        gv.fused_recurrent_gated_delta_rule_packed_decode(torch.randn(1, 2 * K + HV * V + 1, device=device),
                                                          g[0, :1], g[0, :1], g[0, 0], g[0, 0], 1.0, pool,
                                                          torch.empty(1, 1, HV, V, device=device),
                                                          torch.tensor([1], device=device))
    with pytest.raises(ValueError, match="core_attn_out"):
        gv.chunk_gated_delta_rule(q, k, v, g, g.exp(), core_attn_out=torch.empty(3, device=device))
    assert torch.equal(pool, pool0)


_OPS = "vllm.third_party.flash_linear_attention.ops"
_LAYER = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


def _fake_vllm(monkeypatch):
    names = ["vllm", "vllm.third_party", "vllm.third_party.flash_linear_attention", _OPS, _OPS + ".chunk",
             _OPS + ".fused_recurrent", _OPS + ".fused_sigmoid_gating", "vllm.model_executor",
             "vllm.model_executor.layers", "vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.gdn",
             _LAYER]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    orig = {fn: (lambda *a, _n=fn, **k: _n) for fn in gv._ALL}
    m = sys.modules
    for fn, f in orig.items():
        setattr(m[_OPS], fn, f)
    m[_OPS + ".chunk"].chunk_gated_delta_rule = orig["chunk_gated_delta_rule"]
    m[_OPS + ".fused_recurrent"].fused_recurrent_gated_delta_rule = orig["fused_recurrent_gated_delta_rule"]
    m[_OPS + ".fused_recurrent"].fused_recurrent_gated_delta_rule_packed_decode = \
        orig["fused_recurrent_gated_delta_rule_packed_decode"]
    m[_OPS + ".fused_sigmoid_gating"].fused_sigmoid_gating_delta_rule_update = \
        orig["fused_sigmoid_gating_delta_rule_update"]
    layer = m[_LAYER]
    layer.fla_chunk_gated_delta_rule = orig["chunk_gated_delta_rule"]
    layer.fused_sigmoid_gating_delta_rule_update = orig["fused_sigmoid_gating_delta_rule_update"]
    layer.fused_recurrent_gated_delta_rule_packed_decode = orig["fused_recurrent_gated_delta_rule_packed_decode"]
    return orig


def test_enable_disable(monkeypatch):
    orig = _fake_vllm(monkeypatch)
    layer, ops = sys.modules[_LAYER], sys.modules[_OPS]
    done = gv.enable()
    try:
        assert _LAYER in done and _OPS + ".fused_recurrent" in done and gv.is_enabled()
        assert layer.fla_chunk_gated_delta_rule is gv.chunk_gated_delta_rule
        assert layer.fused_sigmoid_gating_delta_rule_update is gv.fused_sigmoid_gating_delta_rule_update
        for fn in orig:
            assert getattr(ops, fn) is getattr(gv, fn)
    finally:
        gv.disable()
    assert not gv.is_enabled()
    assert layer.fla_chunk_gated_delta_rule is orig["chunk_gated_delta_rule"]
    for fn, f in orig.items():
        assert getattr(ops, fn) is f


def test_plugin_env(monkeypatch):
    orig = _fake_vllm(monkeypatch)
    ops = sys.modules[_OPS]
    monkeypatch.delenv(gv.ENV_VAR, raising=False)
    gv.register()
    assert not gv.is_enabled() and ops.chunk_gated_delta_rule is orig["chunk_gated_delta_rule"]
    monkeypatch.setenv(gv.ENV_VAR, "1")
    try:
        gv.register()
        assert ops.chunk_gated_delta_rule is gv.chunk_gated_delta_rule
    finally:
        gv.disable()


def test_entry_point_declared():
    """pyproject declares the vLLM general plugin (vLLM loads group ``vllm.general_plugins``)."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    eps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"gdn": "gdn.integrations.vllm:register"}
