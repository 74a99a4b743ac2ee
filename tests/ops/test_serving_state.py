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


# ---------------------------------------------------------------------------------------------------------------------
# prefix-cache checkpoints
# ---------------------------------------------------------------------------------------------------------------------
def _take(x, cu, cuts):
    """The varlen batch of every sequence's tokens [start + a, start + b) for cuts[n] = (a, b)."""
    s = cu.tolist()
    sel = torch.cat([torch.arange(s[n] + a, s[n] + b) for n, (a, b) in enumerate(cuts)]).to(torch.long)
    lens = [b - a for a, b in cuts]
    return [t[:, sel] for t in (x.q, x.k, x.v, x.g, x.beta)], _cu(lens)


@pytest.mark.parametrize("layout", ["v_last", "k_last"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("segment_chunks", [None, 1])
def test_checkpoints_match_truncated_prefill_and_resume(layout, state_dtype, segment_chunks):
    from gdn.kernels import tuning

    lens = [0, 1, 63, 64, 65, 130, 192]
    N, H, HV, K, V, E, C = len(lens), 1, 2, 16, 32, 64, 3
    cu = _cu(lens)
    x = make_inputs(1, int(cu[-1]), H, HV, K, V, device=DEV)
    P = 40
    pool = _pool(P, HV, K, V, layout, state_dtype)
    rd = torch.tensor([0, 1, 2, -1, 4, 5, 6], device=DEV)  # sequence 3 is padding: no checkpoint written
    ck = torch.tensor([[10 + 3 * n + c if (n, c) != (5, 1) else -1 for c in range(C)] for n in range(N)], device=DEV)
    before = pool.clone()
    ctx = tuning.override("chunk_fwd", segment_chunks=segment_chunks) if segment_chunks else _null()
    with torch.no_grad(), ctx:
        o_full, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                           ssm_state_indices=rd, state_layout=layout, checkpoint_every_n_tokens=E,
                                           checkpoint_indices=ck)
    _, st = _ref_states(x, before, rd.tolist(), cu, layout)
    tol = 1e-4 if state_dtype == torch.float32 else 1e-2
    expect = {r: (st[n][-1] if lens[n] else before[r].double()) for n, r in enumerate(rd.tolist()) if r >= 0}
    written = []
    for n in range(N):
        for c in range(C):
            tok, r = (c + 1) * E, int(ck[n, c])
            if r >= 0 and rd[n] >= 0 and tok <= lens[n]:
                expect[r] = st[n][tok - 1]
                written.append((n, c))
    assert (5, 0) in written and (6, 2) in written and (3, 0) not in written
    _check_rows(pool, before, expect, tol)  # checkpoints past the end, -1, padding: rows untouched
    if segment_chunks:
        return
    # bitwise: a prefill that stops at the checkpoint writes the same final state (same kernel path)
    for c in range(C):
        tok = (c + 1) * E
        (q, k, v, g, b), cu_t = _take(x, cu, [(0, min(tok, L)) for L in lens])
        scratch = before.clone()
        out = torch.tensor([20 + n for n in range(N)], device=DEV)
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, v, g, b, initial_state=scratch, cu_seqlens=cu_t, ssm_state_indices=rd,
                                   state_layout=layout, output_state_indices=out)
        for n, cc in written:
            if cc == c:
                assert torch.equal(pool[int(ck[n, c])], scratch[20 + n]), (n, c)
    # resume: prefill(t) then a prefill of the rest from the checkpoint at t = prefill(T)
    t = E
    (q, k, v, g, b), cu_r = _take(x, cu, [(min(t, L), L) for L in lens])
    rd_r = torch.tensor([int(ck[n, 0]) if lens[n] >= t and rd[n] >= 0 else -1 for n in range(N)], device=DEV)
    with torch.no_grad():
        o_r, _ = chunk_gated_delta_rule(q, k, v, g, b, initial_state=pool, cu_seqlens=cu_r, ssm_state_indices=rd_r,
                                        state_layout=layout, output_state_indices=torch.arange(30, 30 + N, device=DEV)
                                        .masked_fill(rd_r < 0, -1))
    s, sr = cu.tolist(), cu_r.tolist()
    for n in range(N):
        if rd_r[n] >= 0 and lens[n] > t:
            assert rel_err(o_r[0, sr[n]:sr[n + 1]], o_full[0, s[n] + t:s[n + 1]]) < tol
            assert rel_err(pool[30 + n], st[n][-1]) < tol


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_checkpoints_torch_backend_matches(monkeypatch):
    """The torch path (GDN_BACKEND=torch) writes the same checkpoints as the kernels (tolerance)."""
    lens = [65, 128, 3]
    cu = _cu(lens)
    HV, K, V = 2, 16, 16
    x = make_inputs(1, int(cu[-1]), 1, HV, K, V, device=DEV)
    pool = _pool(12, HV, K, V, "k_last")
    rd = torch.tensor([0, 1, 2], device=DEV)
    ck = torch.tensor([[3, 4], [5, 6], [7, 8]], device=DEV)
    pools = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("GDN_BACKEND", backend)
        p = pool.clone()
        with torch.no_grad():
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=p, cu_seqlens=cu, ssm_state_indices=rd,
                                   state_layout="k_last", checkpoint_every_n_tokens=64, checkpoint_indices=ck)
        pools.append(p)
    assert rel_err(pools[0], pools[1]) < 1e-4
    assert torch.equal(pools[0][[7, 8, 9, 10, 11]], pool[[7, 8, 9, 10, 11]])  # 3 tokens: no checkpoint; rows untouched
    assert not torch.equal(pools[0][6], pool[6])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_return_chunk_states(backend, monkeypatch):
    monkeypatch.setenv("GDN_BACKEND", backend)
    lens = [65, 0, 128]
    cu = _cu(lens)
    HV, K, V = 2, 16, 32
    x = make_inputs(1, int(cu[-1]), 1, HV, K, V, device=DEV)
    h0 = torch.randn(3, HV, V, K, device=DEV)
    with torch.no_grad():
        o, ht, h = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, cu_seqlens=cu,
                                          output_final_state=True, state_layout="k_last", return_chunk_states=True)
    _, st = _ref_states(x, h0.transpose(-1, -2), [0, 1, 2], cu, "v_last")
    assert h.shape == (4, HV, K, V)
    ref = torch.stack([h0[0].transpose(-1, -2).double(), st[0][63], h0[2].transpose(-1, -2).double(), st[2][63]])
    assert rel_err(h.float(), ref) < (1e-4 if h.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("bad,err,name", [
    ("not_multiple", ValueError, "checkpoint_every_n_tokens"), ("zero", ValueError, "checkpoint_every_n_tokens"),
    ("float_every", TypeError, "checkpoint_every_n_tokens"), ("no_every", ValueError, "checkpoint_every_n_tokens"),
    ("no_idx", ValueError, "checkpoint_indices"), ("shape", ValueError, "checkpoint_indices"),
    ("1d", ValueError, "checkpoint_indices"), ("dtype", TypeError, "checkpoint_indices"),
    ("range", ValueError, "checkpoint_indices"), ("no_pool", ValueError, "checkpoint_indices"),
    ("dup", ValueError, "checkpoint_indices"), ("dup_final", ValueError, "checkpoint_indices"),
    ("reads_other", ValueError, "checkpoint_indices"), ("grad_h", ValueError, "return_chunk_states")])
def test_checkpoint_validation(bad, err, name):
    lens = [64, 70]
    cu = _cu(lens)
    HV, K, V = 2, 16, 16
    x = make_inputs(1, int(cu[-1]), 1, HV, K, V, device=DEV)
    pool = _pool(10, HV, K, V, "v_last")
    before = pool.clone()
    rd = torch.tensor([0, 1], device=DEV)
    ck = {"dup": [[2, 3], [3, 4]], "dup_final": [[2, 3], [5, 0]], "reads_other": [[1, 3], [4, 5]],
          "range": [[2, 10], [4, 5]]}.get(bad, [[2, 3], [4, 5]])
    ck = torch.tensor(ck, device=DEV)
    kw = dict(initial_state=pool, ssm_state_indices=rd, checkpoint_every_n_tokens=64, checkpoint_indices=ck)
    if bad == "not_multiple":
        kw["checkpoint_every_n_tokens"] = 96
    elif bad == "zero":
        kw["checkpoint_every_n_tokens"] = 0
    elif bad == "float_every":
        kw["checkpoint_every_n_tokens"] = 64.0
    elif bad == "no_every":
        kw["checkpoint_every_n_tokens"] = None
    elif bad == "no_idx":
        kw["checkpoint_indices"] = None
    elif bad == "shape":
        kw["checkpoint_indices"] = ck[:1]
    elif bad == "1d":
        kw["checkpoint_indices"] = ck[:, 0]
    elif bad == "dtype":
        kw["checkpoint_indices"] = ck.float()
    elif bad == "no_pool":
        kw.update(initial_state=None, ssm_state_indices=None)
    elif bad == "grad_h":
        kw = dict(initial_state=pool[:2].clone().requires_grad_(), return_chunk_states=True)
    ctx = torch.no_grad() if bad != "grad_h" else _null()
    with pytest.raises(err, match=name), ctx:
        chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=cu, **kw)
    assert torch.equal(pool, before)
