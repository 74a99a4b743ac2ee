"""fused_recurrent_gated_delta_rule and gated_delta_rule_decode against the float64 reference."""
import pytest
import torch

from gdn.ops import fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from gdn.reference import decode_ref, recurrent_gated_delta_rule_ref
from gdn.testing import GDNInputs, make_inputs, poison_, rel_err, to64

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _state(N, HV, K, V, layout, dtype=torch.float32):
    shape = (N, HV, K, V) if layout == "v_last" else (N, HV, V, K)
    return torch.randn(shape, device=DEV).to(dtype)


def _ref(x, *, raw=False, **kw):
    q, k, v = to64(x.q, x.k, x.v)
    if raw:
        A_log, a, dt_bias, b = to64(x.A_log, x.a, x.dt_bias, x.b)
        return recurrent_gated_delta_rule_ref(q, k, v, A_log=A_log, a=a, dt_bias=dt_bias, b=b, **kw)
    g, beta = to64(x.g, x.beta)
    return recurrent_gated_delta_rule_ref(q, k, v, g, beta, **kw)


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("raw", [False, True])
def test_fixed_length_matches_reference(layout, H, HV, raw):
    B, T, K, V = 2, 5, 32, 16
    x = make_inputs(B, T, H, HV, K, V, device=DEV)
    h0 = _state(B, HV, K, V, layout)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, state_layout=layout)
    gates = dict(A_log=x.A_log, a=x.a, dt_bias=x.dt_bias, b=x.b) if raw else dict(g=x.g, beta=x.beta)
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, **gates, **kw)
    ro, rs = _ref(x, raw=raw, **{**kw, "initial_state": h0.double()})
    assert o.dtype == x.v.dtype and s.dtype == torch.float32 and s.shape == h0.shape
    assert rel_err(o, ro) < 1e-5
    assert rel_err(s, rs) < 1e-5
    assert torch.equal(h0, h0)  # input state untouched is checked below


def test_initial_state_not_modified_and_no_state_when_not_asked():
    x = make_inputs(2, 3, 2, 2, 16, 16, device=DEV)
    h0 = _state(2, 2, 16, 16, "v_last")
    h0c = h0.clone()
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0)
    assert s is None and torch.equal(h0, h0c)
    ro, _ = _ref(x, initial_state=h0.double())
    assert rel_err(o, ro) < 1e-5


def test_varlen_ragged_lengths_including_zero_and_one():
    lens = [0, 1, 7, 0, 3, 16]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV, dtype=torch.int32)
    T = int(cu[-1])
    H, HV, K, V = 2, 4, 16, 32
    x = make_inputs(1, T, H, HV, K, V, device=DEV)
    h0 = _state(len(lens), HV, K, V, "v_last")
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu)
    ro, rs = _ref(x, initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5
    # a length-0 sequence passes its state through unchanged
    assert torch.equal(s[0], h0[0]) and torch.equal(s[3], h0[3])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["v_last", "k_last"])
def test_pool_1d_inplace_with_padding(state_dtype, layout):
    N, T, H, HV, K, V, P = 4, 3, 1, 2, 16, 16, 7
    x = make_inputs(N, T, H, HV, K, V, device=DEV)
    pool = _state(P, HV, K, V, layout, state_dtype)
    before = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], device=DEV)
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, ssm_state_indices=idx,
                                              inplace_final_state=True, state_layout=layout)
    assert fin is pool
    live = [0, 2, 3]
    ro, rs = _ref(x, initial_state=before[idx.clamp(min=0)].double(), output_final_state=True, state_layout=layout)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_err(o[live], ro[live]) < tol
    assert rel_err(pool[idx[live]].float(), rs[live]) < tol
    assert o[1].abs().max() == 0  # padding sequence: zeros
    untouched = [r for r in range(P) if r not in (5, 0, 2)]
    assert torch.equal(pool[untouched], before[untouched])


def test_pool_not_inplace_returns_new_state():
    N, T, HV, K, V, P = 3, 2, 2, 16, 16, 5
    x = make_inputs(N, T, 2, HV, K, V, device=DEV)
    pool = _state(P, HV, K, V, "v_last")
    before = pool.clone()
    idx = torch.tensor([3, 1, 4], device=DEV)
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, ssm_state_indices=idx,
                                              output_final_state=True)
    assert torch.equal(pool, before)
    ro, rs = _ref(x, initial_state=before[idx].double(), output_final_state=True)
    assert fin.shape == (N, HV, K, V) and rel_err(fin, rs) < 1e-5 and rel_err(o, ro) < 1e-5


def _tune(family, cfg):
    """GDN_TUNE items for "BV:warps:stages[:tiles[:maxnreg]]" of the decode / recurrent tuning table ("" = none)."""
    fields = ("BV", "warps", "stages", "tiles", "maxnreg")
    return ",".join(f"{family}.{f}={v}" for f, v in zip(fields, cfg.split(":"))) if cfg else ""


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("cfg", ["", "8:2:3"])
def test_speculative_decoding_slots(layout, cfg, monkeypatch):
    """Start from the accepted draft's slot; write every token's state into its own slot (also with the token loop
    software-pipelined: the ``recurrent`` tuning fields BV:warps:stages through GDN_TUNE)."""
    monkeypatch.setenv("GDN_TUNE", _tune("recurrent", cfg))
    lens = [3, 1, 4, 2]
    N, H, HV, K, V, P = 4, 2, 4, 16, 16, 20
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV)
    x = make_inputs(1, int(cu[-1]), H, HV, K, V, device=DEV)
    pool = _state(P, HV, K, V, layout)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [8, 9, 10, 11], [-1, 13, 14, 15]], device=DEV)
    acc = torch.tensor([2, 1, 4, 3], device=DEV)
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                              ssm_state_indices=idx, num_accepted_tokens=acc,
                                              inplace_final_state=True, state_layout=layout,
                                              use_qk_l2norm_in_kernel=True)
    assert fin is pool
    start_rows = [int(idx[n, int(acc[n]) - 1]) for n in range(N)]
    written = set()
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        sub = _slice(x, s, e)
        h = before[start_rows[n]][None].double()
        ro, _ = _ref(sub, initial_state=h, use_qk_l2norm_in_kernel=True, state_layout=layout)
        assert rel_err(o[:, s:e], ro) < 1e-5
        for t in range(e - s):  # state after token t sits in idx[n, t]
            _, st = _ref(_slice(sub, 0, t + 1), initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         state_layout=layout)
            r = int(idx[n, t])
            if r >= 0:
                assert rel_err(pool[r], st[0]) < 1e-5
                written.add(r)
    untouched = [r for r in range(P) if r not in written]
    assert torch.equal(pool[untouched], before[untouched])


def _slice(x, s, e):
    """Tokens s:e of packed inputs (B == 1)."""
    return GDNInputs(*(getattr(x, f)[:, s:e] if f in ("q", "k", "v", "g", "beta", "a", "b") else getattr(x, f)
                       for f in GDNInputs.__dataclass_fields__))


def _slice_b(x, n):
    """Batch row n of fixed-length inputs."""
    return GDNInputs(*(getattr(x, f)[n:n + 1] if f in ("q", "k", "v", "g", "beta", "a", "b") else getattr(x, f)
                       for f in GDNInputs.__dataclass_fields__))


def test_gates_at_the_edges():
    """g = -30 (forget everything), g = 0 (no decay), beta 0 and 1 stay finite and exact."""
    B, T, H, HV, K, V = 2, 6, 1, 2, 16, 16
    x = make_inputs(B, T, H, HV, K, V, device=DEV)
    x.g[:, ::2] = -30.0
    x.g[:, 1::2] = 0.0
    x.beta[0] = 0.0
    x.beta[1] = 1.0
    h0 = _state(B, HV, K, V, "v_last") * 100
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    ro, rs = _ref(x, initial_state=h0.double(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def test_bf16_inputs_and_state():
    x = make_inputs(2, 4, 2, 4, 32, 32, dtype=torch.bfloat16, device=DEV)
    h0 = _state(2, 4, 32, 32, "k_last", torch.bfloat16)
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                            state_layout="k_last", use_qk_l2norm_in_kernel=True)
    ro, rs = _ref(x, initial_state=h0.double(), output_final_state=True, state_layout="k_last",
                  use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and rel_err(o, ro) < 1.5e-2 and rel_err(s, rs) < 1.5e-2


def test_strided_packed_qkv_views():
    """q/k/v as slices of one packed conv output [B, T, 2*H*K + HV*V], read in place."""
    B, T, H, HV, K, V = 2, 3, 2, 4, 16, 16
    packed = torch.randn(B, T, 2 * H * K + HV * V, device=DEV) / 4
    q = packed[..., : H * K].view(B, T, H, K)
    k = packed[..., H * K: 2 * H * K].view(B, T, H, K)
    v = packed[..., 2 * H * K:].view(B, T, HV, V)
    x = make_inputs(B, T, H, HV, K, V, device=DEV)
    o, s = fused_recurrent_gated_delta_rule(q, k, v, x.g, x.beta, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    x.q, x.k, x.v = q.contiguous(), k.contiguous(), v.contiguous()
    ro, rs = _ref(x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


def test_non_power_of_two_head_dims():
    x = make_inputs(2, 3, 1, 2, 24, 20, device=DEV)
    h0 = _state(2, 2, 24, 20, "k_last")
    o, s = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                            state_layout="k_last", use_qk_l2norm_in_kernel=True)
    ro, rs = _ref(x, initial_state=h0.double(), output_final_state=True, state_layout="k_last",
                  use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ro) < 1e-5 and rel_err(s, rs) < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["k_last", "v_last"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_seed_formula(layout, state_dtype):
    B, H, HV, K, V = 3, 2, 4, 32, 32
    x = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device=DEV)
    st = _state(B, HV, K, V, layout, state_dtype)
    before = st.clone()
    o, st2 = gated_delta_rule_decode(x.q, x.k, x.v, st, x.A_log, x.a, x.dt_bias, x.b, use_qk_l2norm=True,
                                     state_layout=layout)
    assert st2 is st and o.dtype == torch.bfloat16 and o.shape == (B, 1, HV, V)
    ro, rs = decode_ref(*to64(x.q, x.k, x.v), before.double(), *to64(x.A_log, x.a, x.dt_bias, x.b),
                        use_qk_l2norm=True, state_layout=layout)
    tol = 1e-2 if state_dtype == torch.bfloat16 else 5e-3
    # o is bf16 in both cases: Triton's interpreter casts fp32 -> bf16 by truncation (up to 2^-7 relative per
    # element; a Triton 3.9 CI run measured 5.04e-3 norm-wise with an fp32 state), so o gets the bf16 tolerance
    assert rel_err(o, ro) < 1e-2 and rel_err(st.float(), rs) < tol


def test_decode_pool_padding_and_output_buffer():
    B, H, HV, K, V, P = 4, 1, 2, 16, 16, 9
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    pool = _state(P, HV, K, V, "k_last")
    before = pool.clone()
    idx = torch.tensor([7, -1, 2, 4], device=DEV, dtype=torch.int32)
    out = poison_(torch.empty(B, 1, HV, V, device=DEV))
    o, _ = gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, scale=0.0, state_indices=idx,
                                   output=out)
    assert o is out and torch.isfinite(out).all()
    live = [0, 2, 3]
    ro, rs = decode_ref(*to64(x.q, x.k, x.v), before[idx.long().clamp(min=0)].double(),
                        *to64(x.A_log, x.a, x.dt_bias, x.b))
    o64 = recurrent_gated_delta_rule_ref(*to64(x.q, x.k, x.v), A_log=x.A_log.double(), a=x.a.double(),
                                         dt_bias=x.dt_bias.double(), b=x.b.double(),
                                         initial_state=before[idx.long().clamp(min=0)].double(),
                                         state_layout="k_last")[0]
    assert rel_err(out[live], o64[live]) < 1e-5 and out[1].abs().max() == 0
    assert rel_err(pool[idx[live].long()], rs[live]) < 1e-5
    untouched = [r for r in range(P) if r not in (7, 2, 4)]
    assert torch.equal(pool[untouched], before[untouched])


def test_outputs_fully_written():
    """Poisoned output buffer: every element is overwritten (padding rows too)."""
    B, H, HV, K, V = 3, 1, 2, 16, 24
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    st = _state(5, HV, K, V, "k_last")
    out = poison_(torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=DEV))
    gated_delta_rule_decode(x.q, x.k, x.v, st, x.A_log, x.a, x.dt_bias, x.b, output=out,
                            state_indices=torch.tensor([1, -1, 3], device=DEV))
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("layout", ["k_last", "v_last"])
def test_single_token_2d_slots_with_accepted_counts(layout):
    """T = 1 with 2-D slots (the decode kernel's spec mode): read idx[n, acc[n] - 1], write idx[n, 0]; a sequence
    whose start slot is -1 gets zeros and touches nothing."""
    B, H, HV, K, V, P = 4, 1, 2, 16, 16, 12
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    pool = _state(P, HV, K, V, layout)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, -1, -1], [6, 7, 8], [9, -1, 11]], device=DEV)
    acc = torch.tensor([3, 1, 2, 2], device=DEV)
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, ssm_state_indices=idx,
                                              num_accepted_tokens=acc, inplace_final_state=True, state_layout=layout)
    written = set()
    for n in range(B):
        start = int(idx[n, int(acc[n]) - 1])
        if start < 0:
            assert o[n].abs().max() == 0
            continue
        ro, rs = _ref(_slice_b(x, n), initial_state=before[start][None].double(), output_final_state=True,
                      state_layout=layout)
        assert rel_err(o[n:n + 1], ro) < 1e-5
        assert rel_err(pool[int(idx[n, 0])], rs[0]) < 1e-5
        written.add(int(idx[n, 0]))
    untouched = [r for r in range(P) if r not in written]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("cfg", ["8:1:2:4", "16:2:3:2:0", "8:2:2:3"])
def test_decode_program_loop_over_tiles(monkeypatch, cfg):
    """Programs that walk several tiles of a head (software-pipelined): every tile is done once, padding slots give
    zeros and leave their rows alone (tiles 3 is cut to 2, a divisor of the head's 4 tiles)."""
    monkeypatch.setenv("GDN_TUNE", _tune("decode", cfg))
    B, H, HV, K, V, P = 7, 2, 4, 32, 32, 10
    x = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device=DEV)
    pool = _state(P, HV, K, V, "k_last")
    before = pool.clone()
    idx = torch.tensor([5, -1, 0, 9, -1, 3, 7], device=DEV, dtype=torch.int32)
    out = poison_(torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=DEV))
    gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, use_qk_l2norm=True, state_indices=idx,
                            output=out)
    live = [n for n in range(B) if int(idx[n]) >= 0]
    ro, rs = decode_ref(*to64(x.q, x.k, x.v), before[idx.long().clamp(min=0)].double(),
                        *to64(x.A_log, x.a, x.dt_bias, x.b), use_qk_l2norm=True)
    assert rel_err(out[live], ro[live]) < 1e-2 and out[[1, 4]].abs().max() == 0
    assert rel_err(pool[idx[live].long()], rs[live]) < 5e-3
    untouched = [r for r in range(P) if r not in idx[live].tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("cfg", ["", "32:2:3:3"])
def test_decode_non_power_of_two_dims(layout, cfg, monkeypatch):
    """T = 1 with K = 96, V = 80 (masked rows and columns; with 32-column tiles the last tile runs past V), GVA."""
    monkeypatch.setenv("GDN_TUNE", _tune("decode", cfg))
    B, H, HV, K, V = 3, 1, 2, 96, 80
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    st = _state(B, HV, K, V, layout)
    ro, rs = _ref(x, initial_state=st.double(), output_final_state=True, state_layout=layout,
                  use_qk_l2norm_in_kernel=True)
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=st, output_final_state=True,
                                              state_layout=layout, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ro) < 1e-5 and rel_err(fin, rs) < 1e-5


@pytest.mark.parametrize("value", [_tune("decode", "-8:1:1:1"), _tune("decode", "24:2:1:1"), "decode.BV=16,decode.warps",
                                   "recurrent.BV=16,recurrent.tiles=1", _tune("recurrent", "0:1:1"),
                                   "decode.stages=two"])
def test_bad_tuning_override_raises_before_launch(value, monkeypatch):
    """A malformed tuning override (GDN_TUNE) names itself in a ValueError and leaves the state untouched."""
    monkeypatch.setenv("GDN_TUNE", value)
    name = "GDN_TUNE"
    T = 1 if value.startswith("decode") else 3
    x = make_inputs(2, T, 1, 2, 16, 16, device=DEV)
    st = _state(2, 2, 16, 16, "k_last")
    before = st.clone()
    with pytest.raises(ValueError, match=name):
        fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=st, inplace_final_state=True,
                                         state_layout="k_last")
    assert torch.equal(st, before)
