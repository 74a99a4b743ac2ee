"""Property-based tests (hypothesis) of the recurrent op against the float64 reference, determinism, NaN isolation."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn.ops import fused_recurrent_gated_delta_rule
from gdn.reference import recurrent_gated_delta_rule_ref
from gdn.testing import make_inputs, rel_err, to64

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_against_reference(run, x, lens, layout, l2, use_pool, tol):
    """Run ``run(initial_state, cu, **pool_kwargs) -> (o, final)`` on random starting states, directly or through a
    pool with spare rows (which must stay bit-for-bit untouched), and compare with the float64 recurrence."""
    HV, K, V = x.v.shape[2], x.q.shape[3], x.v.shape[3]
    N = len(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    shape = (HV, K, V) if layout == "v_last" else (HV, V, K)
    h0 = torch.randn(N, *shape, device=DEV)
    ro, rs = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v, x.g, x.beta), initial_state=h0.double(),
                                            output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2,
                                            state_layout=layout)
    if use_pool:
        P = N + 3
        pool = torch.randn(P, *shape, device=DEV)
        rows = torch.randperm(P, device=DEV)[:N]
        pool[rows] = h0
        before = pool.clone()
        o, _ = run(pool, cu, ssm_state_indices=rows)
        s = pool[rows]
        others = [r for r in range(P) if r not in set(rows.tolist())]
        assert torch.equal(pool[others], before[others])
    else:
        o, s = run(h0, cu, output_final_state=True)
    if int(cu[-1]):
        assert _close(o, ro, tol)
    assert _close(s, rs, tol)


def _close(x, ref, tol):
    """Relative error below ``tol``, or (a state decayed below float32's normal range, e.g. beta = 0 under gates
    near -30, where fp32 keeps only subnormal digits) every element within float32's smallest normal of the
    reference."""
    return rel_err(x, ref) < tol or float((x.double() - ref).abs().max()) <= torch.finfo(torch.float32).tiny


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
    x = make_inputs(1, sum(lens), H, HV, K, V, device=DEV, g_range=(g_lo, 0.0), beta_range=(0.0, beta_hi),
                    normalize_qk=not l2)

    def run(state, cu, **kw):
        return fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=state, cu_seqlens=cu,
                                                inplace_final_state="ssm_state_indices" in kw,
                                                use_qk_l2norm_in_kernel=l2, state_layout=layout, **kw)

    _check_against_reference(run, x, lens, layout, l2, pool, 1e-4)


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
    x = make_inputs(1, sum(lens), H, HV, K, V, device=DEV, g_range=(g_lo, 0.0))

    def run(state, cu, **kw):
        return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=state, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True, state_layout=layout, **kw)

    _check_against_reference(run, x, lens, layout, True, pool, 2e-3)


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
