"""Serving state: separate write rows (``output_state_indices``) and prefix-cache checkpoints, against float64."""
import pytest
import torch

from gdn.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from gdn.reference import recurrent_gated_delta_rule_ref
from gdn.testing import make_inputs, rel_err, to64

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(P, HV, K, V, layout, dtype=torch.float32):
    shape = (P, HV, K, V) if layout == "v_last" else (P, HV, V, K)
    return torch.randn(shape, device=DEV).to(dtype)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV, dtype=torch.int32)


def _ref_states(x, pool, rows, cu, layout, l2=False):
    """float64 (o, per-sequence per-token states) starting from pool rows ``rows`` (-1: zeros)."""
    q, k, v, g, beta = to64(x.q, x.k, x.v, x.g, x.beta)
    h0 = torch.stack([pool[r].double().cpu() if r >= 0 else torch.zeros(pool.shape[1:], dtype=torch.float64)
                      for r in rows])
    o, _, st = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, state_layout=layout,
                                              use_qk_l2norm_in_kernel=l2, return_token_states=True)
    return o, st


def _check_rows(pool, before, expect, tol):
    """Rows in ``expect`` (row -> float64 state) match; every other row is bitwise unchanged."""
    for r in range(pool.shape[0]):
        if r in expect:
            assert rel_err(pool[r], expect[r]) < tol, r
        else:
            assert torch.equal(pool[r], before[r]), f"row {r} was touched"


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("varlen", [True, False])  # False: T = 1 per sequence (the decode kernel)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_recurrent_1d_separate_write_rows(layout, varlen, state_dtype):
    H, HV, K, V = 1, 2, 16, 16
    cu = _cu([3, 1, 4, 2]) if varlen else None
    x = make_inputs(1, int(cu[-1]), H, HV, K, V, device=DEV) if varlen else make_inputs(4, 1, H, HV, K, V, device=DEV)
    pool = _pool(9, HV, K, V, layout, state_dtype)
    rd = torch.tensor([2, -1, 5, 0], device=DEV)
    wr = torch.tensor([7, 3, -1, 0], device=DEV)  # seq 1 is padding (read -1): writes nothing; seq 2 writes nothing
    before = pool.clone()
    o, fin = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                              ssm_state_indices=rd, inplace_final_state=True, state_layout=layout,
                                              output_state_indices=wr)
    ro, st = _ref_states(x, before, rd.tolist(), cu, layout)
    s1, e1 = (3, 4) if varlen else (1, 2)  # the padding sequence's tokens
    o, ro = o.reshape(-1, HV, V), ro.reshape(-1, HV, V)
    assert torch.all(o[s1:e1] == 0)
    keep = torch.ones(o.shape[0], dtype=torch.bool)
    keep[s1:e1] = False
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_err(o[keep], ro[keep]) < tol
    _check_rows(pool, before, {7: st[0][-1], 0: st[3][-1]}, tol)
    assert fin is pool


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("T", [1, 3])
def test_recurrent_2d_spec_verify_per_token_write_rows(layout, T):
    """2-D indices + num_accepted_tokens: read idx[n, acc[n] - 1], the state after token t -> out[n, t]."""
    N, H, HV, K, V = 3, 2, 4, 16, 32
    x = make_inputs(N, T, H, HV, K, V, device=DEV)
    pool = _pool(16, HV, K, V, layout)
    rd = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], device=DEV)[:, :max(T, 1)].contiguous()
    wr = torch.tensor([[9, 10, -1], [11, -1, 12], [1, 13, 14]], device=DEV)[:, :T].contiguous()
    acc = torch.tensor([T, 1, T], device=DEV)
    before = pool.clone()
    fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, ssm_state_indices=rd,
                                     num_accepted_tokens=acc, inplace_final_state=True, state_layout=layout,
                                     output_state_indices=wr)
    read_rows = [int(rd[n, int(acc[n]) - 1]) for n in range(N)]
    _, st = _ref_states(x, before, read_rows, None, layout)
    expect = {int(wr[n, t]): st[n][t] for n in range(N) for t in range(T) if int(wr[n, t]) >= 0}
    _check_rows(pool, before, expect, 1e-5)


@pytest.mark.parametrize("layout", ["k_last", "v_last"])
def test_decode_op_separate_write_rows(layout):
    B, H, HV, K, V = 4, 1, 2, 16, 16
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    pool = _pool(8, HV, K, V, layout)
    rd = torch.tensor([1, 2, -1, 4], device=DEV, dtype=torch.int32)
    wr = torch.tensor([5, 2, 6, -1], device=DEV, dtype=torch.int32)
    before = pool.clone()
    o, _ = gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, state_indices=rd,
                                   state_layout=layout, output_state_indices=wr)
    q, k, v, A_log, a, dt_bias, b = to64(x.q, x.k, x.v, x.A_log, x.a, x.dt_bias, x.b)
    h0 = torch.stack([before[max(r, 0)].double().cpu() for r in rd.tolist()])
    ro, rs = recurrent_gated_delta_rule_ref(q, k, v, A_log=A_log, a=a, dt_bias=dt_bias, b=b, initial_state=h0,
                                            output_final_state=True, state_layout=layout)
    assert torch.all(o[2] == 0)
    assert rel_err(o[[0, 1, 3]], ro[[0, 1, 3]]) < 1e-2  # o is bf16
    _check_rows(pool, before, {5: rs[0], 2: rs[1]}, 1e-5)


def test_chunk_final_state_to_separate_rows():
    lens = [0, 1, 63, 64, 65]
    cu = _cu(lens)
    H, HV, K, V = 1, 2, 16, 32
    x = make_inputs(1, int(cu[-1]), H, HV, K, V, device=DEV)
    for layout in ("v_last", "k_last"):
        pool = _pool(12, HV, K, V, layout)
        rd = torch.tensor([0, 1, 2, 3, -1], device=DEV)
        wr = torch.tensor([4, 5, -1, 3, 6], device=DEV)  # seq 4 is padding: writes nothing
        before = pool.clone()
        with torch.no_grad():
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                   ssm_state_indices=rd, state_layout=layout, output_state_indices=wr)
        _, st = _ref_states(x, before, rd.tolist(), cu, layout)
        expect = {4: before[0].double(), 5: st[1][-1], 3: st[3][-1]}
        _check_rows(pool, before, expect, 1e-4)


@pytest.mark.parametrize("op", ["recurrent", "decode", "chunk"])
@pytest.mark.parametrize("bad", ["dup", "read_by_other", "shape", "dtype", "range", "no_pool"])
def test_write_rows_validation(op, bad):
    B, H, HV, K, V = 3, 1, 2, 16, 16
    x = make_inputs(B, 1, H, HV, K, V, device=DEV)
    pool = _pool(6, HV, K, V, "k_last")
    before = pool.clone()
    rd = torch.tensor([0, 1, 2], device=DEV)
    wr = {"dup": [3, 3, 4], "read_by_other": [3, 0, 4], "range": [3, 6, 4]}.get(bad, [3, 4, 5])
    wr = torch.tensor(wr, device=DEV)
    err = ValueError
    if bad == "shape":
        wr = wr[:2]
    elif bad == "dtype":
        wr, err = wr.float(), TypeError
    idx = None if bad == "no_pool" else rd
    with pytest.raises(err, match="output_state_indices"):
        with torch.no_grad():
            if op == "recurrent":
                fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, ssm_state_indices=idx,
                                                 initial_state=pool if idx is not None else pool[:3],
                                                 inplace_final_state=True, state_layout="k_last",
                                                 output_state_indices=wr)
            elif op == "decode":
                gated_delta_rule_decode(x.q, x.k, x.v, pool if idx is not None else pool[:3], x.A_log, x.a,
                                        x.dt_bias, x.b, state_indices=idx, output_state_indices=wr)
            else:
                chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool if idx is not None else None,
                                       ssm_state_indices=idx, state_layout="k_last", output_state_indices=wr)
    assert torch.equal(pool, before)
