"""Property-based tests (hypothesis) of the recurrent op against the float64 reference, determinism, NaN isolation."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn.ops import fused_recurrent_gated_delta_rule
from gdn.reference import recurrent_gated_delta_rule_ref
from gdn.testing import make_inputs, rel_err, to64

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    H = draw(st.sampled_from([1, 2]))
    HV = H * draw(st.sampled_from([1, 2, 4]))
    K = draw(st.sampled_from([8, 16, 24, 32, 48]))
    V = draw(st.sampled_from([8, 16, 20, 32]))
    lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    layout = draw(st.sampled_from(["v_last", "k_last"]))
    g_lo = draw(st.sampled_from([-30.0, -5.0, -0.5, 0.0]))
    beta_hi = draw(st.sampled_from([0.0, 0.5, 1.0]))
    pool = draw(st.booleans())
    l2 = draw(st.booleans())
    return H, HV, K, V, lens, layout, g_lo, beta_hi, pool, l2


@SETTINGS
@given(problems())
def test_recurrent_matches_reference(p):
    H, HV, K, V, lens, layout, g_lo, beta_hi, pool, l2 = p
    N = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    T = int(cu[-1])
    x = make_inputs(1, T, H, HV, K, V, device=DEV, g_range=(g_lo, 0.0), beta_range=(0.0, beta_hi),
                    normalize_qk=not l2)
    shape = (HV, K, V) if layout == "v_last" else (HV, V, K)
    h0 = torch.randn(N, *shape, device=DEV)
    ro, rs = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v, x.g, x.beta), initial_state=h0.double(),
                                            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
                                            state_layout=layout)
    if pool:
        P = N + 3
        pool_t = torch.randn(P, *shape, device=DEV)
        rows = torch.randperm(P, device=DEV)[:N]
        pool_t[rows] = h0
        before = pool_t.clone()
        o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool_t, cu_seqlens=cu,
                                                  ssm_state_indices=rows, inplace_final_state=True,
                                                  use_qk_l2norm_in_kernel=l2, state_layout=layout)
        s = pool_t[rows]
        others = [r for r in range(P) if r not in set(rows.tolist())]
        assert torch.equal(pool_t[others], before[others])
    else:
        o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, cu_seqlens=cu,
                                                output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                                state_layout=layout)
    if T:
        assert rel_err(o, ro) < 1e-4
    assert rel_err(s, rs) < 1e-4


def test_deterministic_bitwise():
    x = make_inputs(1, 12, 2, 4, 32, 32, device=DEV)
    cu = torch.tensor([0, 5, 12], device=DEV)
    h0 = torch.randn(2, 4, 32, 32, device=DEV)
    a = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    b = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_nan_in_one_sequence_stays_there():
    x = make_inputs(1, 10, 1, 2, 16, 16, device=DEV)
    cu = torch.tensor([0, 4, 10], device=DEV)
    x.v[0, 1, 0, 3] = float("nan")
    x.g[0, 2, 1] = float("nan")
    pool = torch.randn(3, 2, 16, 16, device=DEV)
    before = pool.clone()
    o, _ = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                            ssm_state_indices=torch.tensor([2, 0], device=DEV),
                                            inplace_final_state=True)
    assert torch.isfinite(o[0, 4:]).all() and torch.isfinite(pool[0]).all()
    assert torch.equal(pool[1], before[1])
    assert not torch.isfinite(pool[2]).all()  # the poisoned sequence's own state does carry the NaN


# ---------------------------------------------------------------------------------------------------------------------
# the chunked op
# ---------------------------------------------------------------------------------------------------------------------
@st.composite
def chunk_problems(draw):
    H = draw(st.sampled_from([1, 2]))
    HV = H * draw(st.sampled_from([1, 2]))
    K = draw(st.sampled_from([16, 32, 96]))
    V = draw(st.sampled_from([16, 32, 80]))
    lens = draw(st.lists(st.sampled_from([0, 1, 63, 64, 65, 20]), min_size=1, max_size=3))
    layout = draw(st.sampled_from(["v_last", "k_last"]))
    g_lo = draw(st.sampled_from([-30.0, -2.0, 0.0]))
    pool = draw(st.booleans())
    return H, HV, K, V, lens, layout, g_lo, pool


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_problems())
def test_chunk_matches_reference(p):
    from gdn.ops import chunk_gated_delta_rule

    H, HV, K, V, lens, layout, g_lo, pool = p
    N = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    T = int(cu[-1])
    x = make_inputs(1, T, H, HV, K, V, device=DEV, g_range=(g_lo, 0.0))
    shape = (HV, K, V) if layout == "v_last" else (HV, V, K)
    h0 = torch.randn(N, *shape, device=DEV)
    ro, rs = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v, x.g, x.beta), initial_state=h0.double(),
                                            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                            state_layout=layout)
    if pool:
        P = N + 2
        pool_t = torch.randn(P, *shape, device=DEV)
        rows = torch.randperm(P, device=DEV)[:N]
        pool_t[rows] = h0
        before = pool_t.clone()
        o, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool_t, cu_seqlens=cu,
                                      ssm_state_indices=rows, use_qk_l2norm_in_kernel=True, state_layout=layout)
        s = pool_t[rows]
        others = [r for r in range(P) if r not in set(rows.tolist())]
        assert torch.equal(pool_t[others], before[others])
    else:
        o, s = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, cu_seqlens=cu,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, state_layout=layout)
    if T:
        assert rel_err(o, ro) < 2e-3
    assert rel_err(s, rs) < 2e-3


def test_chunk_deterministic_and_nan_isolated():
    from gdn.ops import chunk_gated_delta_rule

    x = make_inputs(1, 150, 2, 4, 32, 32, device=DEV)
    cu = torch.tensor([0, 70, 150], device=DEV)
    h0 = torch.randn(2, 4, 32, 32, device=DEV)
    a = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                               use_qk_l2norm_in_kernel=True)
    b = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                               use_qk_l2norm_in_kernel=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    x.v[0, 10, 1, 3] = float("nan")  # sequence 0 only
    o, s = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o[0, 70:]).all() and torch.isfinite(s[1]).all()
    assert torch.equal(o[0, 70:], a[0][0, 70:]) and torch.equal(s[1], a[1][1])
