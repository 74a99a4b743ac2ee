"""chunk_gated_delta_rule forward (Triton kernels; Triton's interpreter on CPU) against the float64 references.

Shapes are tiny: the interpreter runs every program in Python. Each test touches a handful of (chunk, head) pairs.
"""
import dataclasses
import importlib.util
import os

import pytest
import torch

from gdn.ops import chunk_gated_delta_rule
from gdn.reference import chunk_gated_delta_rule_ref, chunk_intra_ref, recurrent_gated_delta_rule_ref, sequence_spans
from gdn.testing import make_inputs, rel_err, to64

TOL = {torch.float32: 2e-3, torch.bfloat16: 1.5e-2, torch.float16: 1e-2}
C = 64


@pytest.fixture(autouse=True)
def _poison_and_triton(monkeypatch):
    """Every buffer the kernels' launch functions allocate starts as NaN, and the Triton path is used."""
    monkeypatch.setenv("GDN_BACKEND", "triton")
    from gdn.kernels import tuning

    with tuning.override("chunk_fwd", debug_poison=True):
        yield


def _refs(x, scale=None, h0=None, cu=None, l2=False, layout="v_last", beta=True, recurrent=False):
    q, k, v, g, b = to64(x.q, x.k, x.v, x.g, x.beta)
    h0 = None if h0 is None else h0.detach().to(torch.float64)
    fn = recurrent_gated_delta_rule_ref if recurrent else chunk_gated_delta_rule_ref
    return fn(q, k, v, g, b if beta else None, scale, h0, True, cu, l2, state_layout=layout)


def _state(N, HV, K, V, layout, dtype=torch.float32):
    shape = (N, HV, K, V) if layout == "v_last" else (N, HV, V, K)
    return (torch.randn(shape) * 0.5).to(dtype)


def _check(o, ht, ro, rht, dtype, what=""):
    tol = TOL[dtype]
    eo = rel_err(o, ro)
    assert eo <= tol, f"{what} output rel err {eo:.2e} > {tol}"
    if rht is not None:
        assert ht is not None and ht.dtype == torch.float32
        eh = rel_err(ht, rht)
        assert eh <= tol, f"{what} final state rel err {eh:.2e} > {tol}"


# ----------------------------------------------------------------------------------------------------------------------
# basic agreement, both references
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("l2", [False, True])
def test_matches_chunk_and_recurrent_reference(l2):
    B, T, H, HV, K, V = 2, 70, 1, 2, 32, 32
    x = make_inputs(B, T, H, HV, K, V, normalize_qk=not l2)
    h0 = _state(B, HV, K, V, "v_last")
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2)
    assert o.shape == (B, T, HV, V) and o.dtype == x.v.dtype
    for rec in (False, True):
        ro, rht = _refs(x, h0=h0, l2=l2, recurrent=rec)
        _check(o, ht, ro, rht, torch.float32, "recurrent" if rec else "chunk")


@pytest.mark.parametrize("ratio,layout", [(1, "k_last"), (2, "v_last"), (4, "k_last")])
def test_gva_and_layouts(ratio, layout):
    B, T, H, K, V = 1, 40, 1, 32, 16
    HV = H * ratio
    x = make_inputs(B, T, H, HV, K, V)
    h0 = _state(B, HV, K, V, layout)
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=0.3, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, state_layout=layout)
    assert ht.shape == h0.shape and ht.is_contiguous()
    ro, rht = _refs(x, scale=0.3, h0=h0, l2=True, layout=layout)
    _check(o, ht, ro, rht, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    B, T, H, HV, K, V = 1, 100, 1, 2, 64, 32
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype)
    h0 = _state(B, HV, K, V, "v_last", dtype=dtype)  # bf16/fp16 initial state, fp32 final
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and ht.dtype == torch.float32
    ro, rht = _refs(x, h0=h0, l2=True)
    _check(o, ht, ro, rht, dtype)


def test_non_power_of_two_head_dims():
    B, T, H, HV, K, V = 1, 65, 1, 1, 80, 48
    x = make_inputs(B, T, H, HV, K, V)
    h0 = _state(B, HV, K, V, "k_last")
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, state_layout="k_last")
    ro, rht = _refs(x, h0=h0, l2=True, layout="k_last")
    _check(o, ht, ro, rht, torch.float32)


def test_no_initial_state_no_final_beta_none():
    B, T, H, HV, K, V = 1, 30, 2, 2, 16, 16
    x = make_inputs(B, T, H, HV, K, V, normalize_qk=True)
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, None)
    assert ht is None
    ro, _ = _refs(x, beta=False)
    _check(o, None, ro, None, torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# gates at the extremes
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g_range,beta_range", [((-30.0, -29.0), (0.99, 1.0)), ((0.0, 0.0), (0.0, 0.01)),
                                                ((0.0, 0.0), (0.99, 1.0))])
def test_extreme_gates(g_range, beta_range):
    B, T, H, HV, K, V = 1, 80, 1, 1, 32, 32
    x = make_inputs(B, T, H, HV, K, V, g_range=g_range, beta_range=beta_range)
    h0 = _state(B, HV, K, V, "v_last")
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ro, rht = _refs(x, h0=h0, l2=True, recurrent=True)
    _check(o, ht, ro, rht, torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# varlen
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["v_last", "k_last"])
def test_varlen_ragged(layout):
    lens = [0, 1, C - 1, C, C + 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    N, H, HV, K, V = len(lens), 1, 2, 32, 16
    x = make_inputs(1, T, H, HV, K, V)
    h0 = _state(N, HV, K, V, layout)
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout=layout)
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True, layout=layout)
    _check(o, ht, ro, rht, torch.float32)
    # the empty sequence's final state is its initial state
    assert torch.allclose(ht[0], h0[0])


def test_varlen_int64_cu_seqlens_no_state():
    cu = torch.tensor([0, 5, 75], dtype=torch.int64)
    x = make_inputs(1, 75, 1, 1, 16, 16)
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, output_final_state=True, cu_seqlens=cu)
    ro, rht = _refs(x, cu=cu)
    _check(o, ht, ro, rht, torch.float32)


def test_empty_batch():
    x = make_inputs(2, 0, 1, 1, 16, 16)
    h0 = _state(2, 1, 16, 16, "v_last")
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 1, 16)
    assert torch.equal(ht, h0)


# ----------------------------------------------------------------------------------------------------------------------
# state pools
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_dtype,layout,segment,in_dtype", [(torch.float32, "v_last", None, torch.float32),
                                                                (torch.bfloat16, "k_last", None, torch.bfloat16),
                                                                (torch.float32, "k_last", 1, torch.float32),
                                                                (torch.bfloat16, "v_last", 2, torch.bfloat16)])
def test_state_pool(pool_dtype, layout, segment, in_dtype):
    from gdn.kernels import tuning

    lens = [C + 3, 5, 0, 20]
    idx = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    N, P, H, HV, K, V = len(lens), 6, 1, 2, 16, 16
    x = make_inputs(1, T, H, HV, K, V, dtype=in_dtype)
    pool = _state(P, HV, K, V, layout, dtype=pool_dtype)
    before = pool.clone()
    with tuning.override("chunk_fwd", segment_chunks=segment or 0, debug_poison=True):
        o, fin = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout=layout,
                                        ssm_state_indices=idx)
    assert fin is pool
    # reference: gather rows (padding -> zeros), run, compare
    valid = idx >= 0
    h0 = torch.zeros((N,) + tuple(pool.shape[1:]))
    h0[valid] = before[idx[valid].long()].float()
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True, layout=layout)
    spans = sequence_spans(1, T, cu)
    for n, (_, s, e) in enumerate(spans):
        if idx[n] < 0:
            assert torch.equal(o[0, s:e], torch.zeros_like(o[0, s:e])), "padding sequence output must be zeros"
            ro[0, s:e] = 0
    assert rel_err(o, ro) <= TOL[in_dtype]
    tol_state = 2e-3 if pool_dtype == torch.float32 and in_dtype == torch.float32 else 1.5e-2
    for n in range(N):
        if idx[n] >= 0:
            assert rel_err(pool[int(idx[n])], rht[n]) <= tol_state
    untouched = [r for r in range(P) if r not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched]), "rows not named by ssm_state_indices must be untouched"


def test_state_pool_without_final_still_writes_back():
    x = make_inputs(1, 10, 1, 1, 16, 16)
    pool = _state(3, 1, 16, 16, "v_last")
    before = pool.clone()
    idx = torch.tensor([1], dtype=torch.int64)
    o, fin = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, ssm_state_indices=idx)
    assert fin is None
    _, rht = _refs(x, h0=before[1:2])
    assert rel_err(pool[1:2], rht) <= 2e-3
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])


def test_torch_backend_pool_matches(monkeypatch):
    lens = [7, 3]
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    idx = torch.tensor([-1, 2], dtype=torch.int32)
    x = make_inputs(1, 10, 1, 2, 16, 16)
    pool = _state(3, 2, 16, 16, "v_last")
    pool_t = pool.clone()
    o, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, cu_seqlens=cu,
                                  ssm_state_indices=idx)
    monkeypatch.setenv("GDN_BACKEND", "torch")
    o_t, fin_t = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool_t, cu_seqlens=cu,
                                        ssm_state_indices=idx, output_final_state=True)
    assert fin_t is pool_t
    assert torch.equal(o_t[0, :lens[0]], torch.zeros_like(o_t[0, :lens[0]]))
    assert rel_err(o, o_t) <= 2e-3 and rel_err(pool, pool_t) <= 2e-3


# ----------------------------------------------------------------------------------------------------------------------
# strided q/k/v read in place
# ----------------------------------------------------------------------------------------------------------------------
def test_strided_packed_qkv():
    B, T, H, HV, K, V = 2, 33, 1, 2, 16, 32
    x = make_inputs(B, T, H, HV, K, V)
    packed = torch.cat([x.q.flatten(2), x.k.flatten(2), x.v.flatten(2)], dim=-1)  # [B, T, 2HK + HV V]
    q = packed[..., :H * K].unflatten(-1, (H, K))
    k = packed[..., H * K:2 * H * K].unflatten(-1, (H, K))
    v = packed[..., 2 * H * K:].unflatten(-1, (HV, V))
    assert not q.is_contiguous() and not v.is_contiguous()
    gb = torch.stack([x.g.double(), x.beta.double()], dim=-1)  # strided (and float64) g / beta as well
    g, beta = gb[..., 0], gb[..., 1]
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rht = _refs(x, l2=True)
    _check(o, ht, ro, rht, torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# segmented state pass (long sequences split over SMs), forced at small sizes
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seg,merge_bk", [(1, 128), (2, 128), (2, 16)])
def test_forced_segments(seg, merge_bk):
    """merge_bk 16 < K: the merge steps over K tiles through memory; else one tile with the state in registers."""
    from gdn.kernels import tuning

    lens = [4 * C + 9, 3, 2 * C]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    N, H, HV, K, V = len(lens), 1, 1, 32, 16
    x = make_inputs(1, T, H, HV, K, V)
    h0 = _state(N, HV, K, V, "k_last")
    with tuning.override("chunk_fwd", segment_chunks=seg, merge_BK=merge_bk):
        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout="k_last")
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True, layout="k_last")
    _check(o, ht, ro, rht, torch.float32)


def test_one_wave_segments_for_the_fused_final_pass(monkeypatch):
    """Segment length for a fused final pass: the shortest power-of-two multiple of the planner's length whose grid
    V / tile x HV x segments fits one CTA per SM; 0 where no split fits or the tile does not divide V."""
    from gdn.kernels.chunk import plan as plan_mod, state
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    monkeypatch.setattr(plan_mod, "_num_sms", lambda dev: 132)
    dev = torch.device("cpu")
    ci = prepare_chunk_indices(None, 65536, 64, 1, device=dev)                      # 1024 chunks
    assert state._one_wave_len(ci, 8, 128, 32, dev, 64) == 256                      # 4 x 8 x 4 = 128 CTAs
    assert state._one_wave_len(ci, 8, 128, 64, dev, 64) == 128                      # 8 x 8 x 2 = 128 CTAs
    assert state._one_wave_len(ci, 8, 96, 64, dev, 64) == 0                         # 64 does not divide 96
    cu = torch.tensor([0, 64 * 100, 64 * 100 + 64 * 30 + 5], dtype=torch.int32)      # 100 and 31 chunks
    ci2 = prepare_chunk_indices(cu, int(cu[-1]), 64, 1, device=dev)
    # V tile 32 leaves room for 2 segments (no split of the 100-chunk sequence); V tile 64 for 4: 64 + 36, 31
    assert state._one_wave_len(ci2, 16, 128, 32, dev, 8) == 0
    assert state._one_wave_len(ci2, 16, 128, 64, dev, 8) == 64
    assert state._one_wave_len(ci, 64, 128, 32, dev, 64) == 0                       # 64 heads: one segment is a wave


def test_chunk_spans_give_every_chunk_its_sequence_span(monkeypatch):
    """plan.ChunkIndex.chunk_spans (varlen, chunk_fwd.prepare_sm90_chunk_spans on: the default): row i = (bos, eos)
    of chunk i's sequence, so that the sm_90 prepare reads a chunk's token span beside its chunk_indices row instead
    of after it; lengths 0, 1, 63, 64, 65 and a long one, drawn in a fresh order; the chunk table and offsets as
    without spans (one buffer); None with the field off and without cu_seqlens."""
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    lens = [0, 1, 63, 64, 65, 0, 64 * 7 + 3]
    lens = [lens[i] for i in torch.randperm(len(lens)).tolist()]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    ci = prepare_chunk_indices(cu, int(cu[-1]), 64, 1, device=torch.device("cpu"))
    assert ci.chunk_spans.shape == (ci.NT, 2) and ci.chunk_spans.dtype == torch.int32
    for i, (n, c) in enumerate(ci.chunk_indices.tolist()):
        bos, eos = ci.chunk_spans[i].tolist()
        assert (bos, eos) == (int(cu[n]), int(cu[n + 1])) and bos + 64 * c < eos
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.prepare_sm90_chunk_spans=false")
    off = prepare_chunk_indices(cu, int(cu[-1]), 64, 1, device=torch.device("cpu"))
    assert off.chunk_spans is None
    assert torch.equal(off.chunk_indices, ci.chunk_indices) and torch.equal(off.chunk_offsets, ci.chunk_offsets)
    assert ci.chunk_offsets.tolist() == ci.offsets and ci.chunk_indices.is_contiguous()
    assert all(t.data_ptr() % 16 == 0 for t in (ci.chunk_indices, ci.chunk_spans, ci.chunk_offsets))
    assert prepare_chunk_indices(None, 130, 64, 2, device=torch.device("cpu")).chunk_spans is None


@pytest.mark.parametrize("T, HV, want", [
    (8192, 8, (64, 16)),        # segments of 16 chunks (H100 kernels: 124 us against 200 plain; with the host's
                                # cheaper launches, segment_fixed_cost 20: bench/results/host_direct_launch_h100.json)
    (8192, 16, (32, None)),     # plain (236 us; segmented at V tile 32 320)
    (32768, 16, (32, None)),    # plain (915 us; segmented at V tile 32 1125)
    (16384, 8, (64, 32)),       # segments of 32 chunks at V tile 64 (307 us; 64-chunk ones at tile 32: 341; plain 411)
    (32768, 8, (64, 64)),       # (502 us; at V tile 32: 615)
    (65536, 8, (64, 128)),      # 2/8 (877 us; at V tile 32: 1131)
    (32768, 32, (32, None)),    # 16/32: the plain pass fits one wave
])
def test_fused_forward_segments_by_the_cost_model(monkeypatch, T, HV, want):
    """Where the planner segments, the fused forward takes the cheapest of the plain pass and the one-wave segmented
    runs at V tile 32 / 64 (state._fused_segments); the cases are H200 kernel sums (tuning comment, 132 SMs)."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod, state
    from gdn.kernels.chunk.plan import plan_segments, prepare_chunk_indices

    for m in (state, plan_mod):
        monkeypatch.setattr(m, "_num_sms", lambda dev: 132)
    dev = torch.device("cpu")
    ci = prepare_chunk_indices(None, T, 64, 1, device=dev)
    cfg = tuning.chunk_fwd(dev)
    bv, plan = state._fused_segments(ci, HV, 128, 128, dev, plan_segments(ci, 8, dev), cfg, 32)
    assert (bv, plan.seg_len if plan.segmented else None) == want
    # no plain candidate (its grid would not fit one wave): the cheapest segmented run where a split fits
    bv, plan = state._fused_segments(ci, HV, 128, 128, dev, plan_segments(ci, 8, dev), cfg, 0)
    assert bv in (32, 64) and plan.segmented
    # a free merge and segment pass: segments win wherever a split fits
    with tuning.override("chunk_fwd", state_sm90_merge_cost=0.0, state_sm90_segment_pass_cost=0.0,
                         state_sm90_segment_pass_cost2=0.0, state_sm90_segment_t_cost=0.0,
                         state_sm90_wide_step_cost=1.0, state_sm90_segment_fixed_cost=0.0):
        bv, plan = state._fused_segments(ci, HV, 128, 128, dev, plan_segments(ci, 8, dev), tuning.chunk_fwd(dev), 32)
        assert plan.segmented


@pytest.mark.parametrize("segment_t, T, HV, want", [
    # the segment pass as four 64-column programs per (segment, head) (H100, bench/results/
    # fwd_segments_register_state_h100.json)
    (False, 8192, 8, (64, 16)),     # 4/8: V tile 128 at 16 segments of 8 lost (device time 111.5 -> 122-126 us)
    (False, 16384, 8, (64, 32)),    # lost there too (191.7 -> 198.2)
    (False, 32768, 8, (128, 32)),   # 4/8 350.5 -> 339.1 us; 2/8 349.6 -> 330.9
    (False, 65536, 8, (128, 64)),   # 2/8 666.8 -> 606.6; 4/8 659.4 -> 616.3
    (False, 16384, 16, (32, None)),  # 8/16: plain kept (327.6; V tile 128 at 8 segments 332.5)
    (False, 32768, 16, (128, 64)),  # 8/16 642.1 -> 617.4
    (False, 65536, 16, (128, 128)),  # 8/16 1277.3 -> 1189.2
    (False, 32768, 32, (32, None)),  # 16/32: the plain pass fits one wave
    # as one CTA per (value head, segment) (hopper_segments, the default; H200 kernel sums against the plans above,
    # bench/results/fwd_segment_pass_t_ab_h200.json)
    (True, 8192, 8, (128, 8)),      # 4/8 106 -> 99 us
    (True, 8192, 16, (128, 16)),    # 8/16 164 (plain) -> 142
    (True, 16384, 8, (128, 16)),    # 4/8 187 -> 151
    (True, 32768, 8, (128, 32)),    # 2/8 289 -> 252, 4/8 288 -> 257
    (True, 65536, 8, (128, 64)),    # 2/8 530 -> 459, 4/8 526 -> 466
    (True, 32768, 32, (32, None)),  # 16/32: the plain pass fits one wave
])
def test_fused_forward_segments_register_state_candidate(monkeypatch, segment_t, T, HV, want):
    """With the register-state kernel allowed (``wide``: no h / v_new kept), state._fused_segments also weighs its
    one-wave segments at V tile 128 (``state_sm90_t_step_cost`` per final-pass step): taken for long few-head
    sequences, where the H100 measured it faster (bench/results/fwd_segments_register_state_h100.json), and not for
    the shorter ones, where it measured slower; without ``wide`` never. With the segment pass as one CTA per (value
    head, segment) (``state_sm90_segment_t``) the segmented runs cost less and are taken from 1 x 8192 few-head on,
    as the H200 measured them."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod, state
    from gdn.kernels.chunk.plan import plan_segments, prepare_chunk_indices

    for m in (state, plan_mod):
        monkeypatch.setattr(m, "_num_sms", lambda dev: 132)
    dev = torch.device("cpu")
    ci = prepare_chunk_indices(None, T, 64, 1, device=dev)
    cfg = dataclasses.replace(tuning.chunk_fwd(dev), state_sm90_segment_t=segment_t)
    bv, plan = state._fused_segments(ci, HV, 128, 128, dev, plan_segments(ci, 8, dev), cfg, 32, wide=True)
    assert (bv, plan.seg_len if plan.segmented else None) == want
    if bv == 128:
        assert plan.S * HV <= 132     # one wave of one CTA per SM
        bv, _ = state._fused_segments(ci, HV, 128, 128, dev, plan_segments(ci, 8, dev), cfg, 32)
        assert bv in (32, 64)


def _emulated_fused_plan(monkeypatch, B, T, H, HV, K=128):
    """``plan(cfg, states) -> (V tile, segment plan)`` of state._fused_output_plan for B sequences of T tokens (H key,
    HV value heads, V = 128) on an emulated 132-SM sm_90 where the Gluon kernels are supported (tiles 16 / 32 / 64 for
    the fused kernel)."""
    from gdn.kernels.chunk import hopper, plan as plan_mod, state
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    for m in (state, plan_mod):
        monkeypatch.setattr(m, "_num_sms", lambda dev: 132)
    monkeypatch.setattr(hopper, "supported", lambda *a, **k: True)
    monkeypatch.setattr(hopper, "fused_supported", lambda q, k, bv: bv in (16, 32, 64))
    q = torch.empty(B, T, H, K, dtype=torch.bfloat16)
    v = torch.empty(B, T, HV, 128, dtype=torch.bfloat16)
    ci = prepare_chunk_indices(None, T, 64, B, device=torch.device("cpu"))
    return lambda cfg, states: state._fused_output_plan(q, q, v, ci, None, False, cfg, states)


@pytest.mark.parametrize("B, T, H, HV, states, want", [
    (4, 4096, 16, 32, False, 128),   # past one wave even at V tile 64: the register-state kernel on 128 columns
    (8, 2048, 16, 32, False, 128),
    (4, 4096, 16, 32, True, 64),     # the caller keeps h / v_new: the hand-off kernel at V tile 64
    (1, 8192, 16, 32, False, 32),    # one wave at V tile 32
    (1, 32768, 64, 64, False, 64),   # one wave at V tile 64
    (1, 8192, 16, 64, False, 128),   # ... with key heads shared: the register-state kernel (state_sm90_t_gva_min)
    (2, 8192, 16, 32, False, 128),   # two value heads per key head (state_sm90_t_gva_min)
    (1, 8192, 8, 16, False, 16),     # few heads: 128 CTAs at V tile 16 (chunk_fwd.state_sm90_narrow_bv)
    (1, 32768, 8, 16, False, 16),
    (1, 8192, 8, 16, True, 32),      # the caller keeps h / v_new: not narrowed
    (2, 8192, 8, 16, False, 32),     # 256 CTAs at 16: past one wave
    (1, 8192, 8, 16, False, (64, 32)),   # K = 64: the V tile 16 build is not checked there, so 32
])
def test_fused_forward_tile_choice(monkeypatch, B, T, H, HV, states, want):
    """The fused forward's V tile (state._fused_output_plan) on a 132-SM sm_90 (emulated): the narrowest tile whose
    grid fits one wave (16 only for inference forwards), else the register-state kernel at 128 where no h / v_new is
    kept, else 64. Segmented plans are the tests' above and below (here kept off)."""
    from gdn.kernels import tuning

    monkeypatch.setattr(tuning, "chunk_fwd", lambda dev, _f=tuning.chunk_fwd: dataclasses.replace(
        _f(dev), state_sm90_fused_segmented=False))
    dev = torch.device("cpu")
    K, want = want if isinstance(want, tuple) else (128, want)
    fused_plan = _emulated_fused_plan(monkeypatch, B, T, H, HV, K)
    bv, plan = fused_plan(tuning.chunk_fwd(dev), states)
    assert bv == want and not plan.segmented
    with tuning.override("chunk_fwd", state_sm90_fused_t=False):
        bv, _ = fused_plan(tuning.chunk_fwd(dev), states)
        assert bv == (64 if want == 128 else want)
    with tuning.override("chunk_fwd", state_sm90_narrow_bv=0):
        bv, _ = fused_plan(tuning.chunk_fwd(dev), states)
        assert bv == (32 if want == 16 else want)


@pytest.mark.parametrize("B, T, H, HV, states, want", [
    (1, 32768, 16, 32, False, (128, 128)),  # 16/32: four segments (H200 kernel sums 915 -> 881 us)
    (1, 65536, 16, 32, False, (128, 256)),  # (1795 -> 1718)
    (1, 16384, 16, 32, False, (128, 64)),   # a tie (470 / 467): segmented for its peak (no P, Ainv in o's rows)
    (1, 8192, 16, 32, False, (32, None)),   # segments lose (242 -> 256)
    (1, 8192, 16, 64, False, (128, None)),  # 16/64: segments lose (436 -> 467); key heads shared: V tile 128
    (1, 32768, 64, 64, False, (64, None)),  # 64/64: no P to save at V tile 64
    (1, 32768, 16, 32, True, (32, None)),   # the caller keeps h / v_new: no register-state pass, nothing offered
    (2, 32768, 16, 32, False, (128, None)),  # two sequences: no one-wave segments; V tile 128 (shared key heads)
])
def test_fused_forward_offers_segments_to_long_sequences(monkeypatch, B, T, H, HV, states, want):
    """Where the planner keeps one long sequence over many heads whole (plan.choose_segment_len prices the older
    segment pass), the fused forward still offers it one-wave segments with the register-state final pass when the
    segment pass is hopper_segments' (state._fused_segments, ``offered``), priced against the plain pass plus the
    prepare's P (chunk_fwd.state_sm90_prepare_p_cost); on an emulated 132-SM sm_90, as the H200 measured them."""
    from gdn.kernels import tuning

    fused_plan = _emulated_fused_plan(monkeypatch, B, T, H, HV)
    cfg = tuning.chunk_fwd(torch.device("cpu"))
    bv, plan = fused_plan(cfg, states)
    assert (bv, plan.seg_len if plan.segmented else None) == want
    if plan.segmented:
        assert plan.S * HV <= 132
        # the older segment pass (four programs per segment and head) is not cheap enough to offer segments
        bv, plan = fused_plan(dataclasses.replace(cfg, state_sm90_segment_t=False), states)
        assert (bv, plan.segmented) == (32, False)
        # nor is the plain pass without the prepare's P to save
        bv, plan = fused_plan(dataclasses.replace(cfg, state_sm90_prepare_p_cost=0.0), states)
        assert (bv, plan.segmented) == (32, False)


@pytest.mark.parametrize("B, T, H, HV, states, want", [
    (1, 8192, 16, 64, False, (128, 64)),  # 4 value heads per key head: 64 CTAs at V tile 128 (field on / off)
    (1, 8192, 32, 64, False, (128, 64)),  # 2
    (2, 8192, 16, 32, False, (128, 64)),
    (1, 8192, 64, 64, False, (64, 64)),   # none shared
    (1, 8192, 16, 64, True, (64, 64)),    # the caller keeps h / v_new: no register-state kernel
    (1, 8192, 16, 32, False, (32, 32)),   # one wave at V tile 32 already
    (4, 4096, 16, 32, False, (128, 128)),  # past one wave at 64: the register-state kernel anyway
])
def test_fused_forward_register_state_for_shared_key_heads(monkeypatch, B, T, H, HV, states, want):
    """chunk_fwd.state_sm90_t_gva_min (2 by default): an unsegmented plan whose one-wave tile is V tile 64
    takes the register-state kernel (V tile 128, half the CTAs) where value heads per key head reach the field;
    on an emulated 132-SM sm_90."""
    from gdn.kernels import tuning

    fused_plan = _emulated_fused_plan(monkeypatch, B, T, H, HV)
    cfg = dataclasses.replace(tuning.chunk_fwd(torch.device("cpu")), state_sm90_fused_segmented=False,
                              state_sm90_narrow_bv=0)
    for gva_min, expect in zip((2, 0), want):
        bv, plan = fused_plan(dataclasses.replace(cfg, state_sm90_t_gva_min=gva_min), states)
        assert bv == expect and not plan.segmented


@pytest.mark.parametrize("form", ["one sequence", "varlen one sequence", "batch"])
@pytest.mark.parametrize("layout", ["v_last", "k_last"])
def test_inference_forward_in_pieces_equals_whole(monkeypatch, form, layout):
    """chunk_fwd.piece_token_heads: an inference forward in pieces (spans of whole chunks of one sequence carrying
    the state, or groups of whole sequences) gives bitwise the output and final state of the call in one piece (same
    per-chunk arithmetic; the state passes between spans in fp32), with the pieces really taken."""
    import gdn.kernels.chunk.forward as F
    from gdn.kernels import tuning

    T = 5 * C + 5 if form != "batch" else C + 7
    B = 3 if form == "batch" else 1
    H, HV, K, V = 1, 2, 32, 16
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    h0 = _state(B, HV, K, V, layout)
    cu = torch.tensor([0, T], dtype=torch.int32) if form == "varlen one sequence" else None
    calls = []
    real = F._forward_in_pieces
    monkeypatch.setattr(F, "_forward_in_pieces", lambda *a: calls.append(a[10]) or real(*a))

    def run(piece, most=4):
        with tuning.override("chunk_fwd", piece_token_heads=piece, piece_max=most, debug_poison=True), torch.no_grad():
            return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout=layout)

    o1, ht1 = run(0)
    assert not calls
    o2, ht2 = run(B * T * HV // 3)     # three pieces (batch: one sequence each; one sequence: spans of 2 chunks, the
    #                                    last 69 tokens ending mid-chunk)
    assert calls == [3]
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    o3, ht3 = run(B * T * HV // 3, most=2)      # piece_max caps the count
    assert calls == [3, 2] and torch.equal(o1, o3) and torch.equal(ht1, ht3)
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True, layout=layout)
    _check(o2, ht2, ro, rht, torch.bfloat16)


def test_tune_env_var_forces(monkeypatch):
    """GDN_TUNE reaches the launchers at call time (forced segments, a smaller state tile)."""
    from gdn.kernels import tuning

    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.segment_chunks=2, chunk_fwd.state_BV=16")
    cfg = tuning.chunk_fwd()
    assert cfg.segment_chunks == 2 and cfg.state_BV == 16 and cfg.debug_poison   # override blocks still apply
    x = make_inputs(1, 3 * C, 1, 1, 16, 32)
    o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
    ro, rht = _refs(x)
    _check(o, ht, ro, rht, torch.float32)


def test_memoised_lookups_and_plans_follow_tuning_changes(monkeypatch):
    """The host-side memos (tuning rows, the state pass's segment plan) answer anew when GDN_TUNE or an override block
    changes between calls of one process, and return the same objects while nothing changes."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk.plan import prepare_chunk_indices
    from gdn.kernels.chunk.state import _pass_plan

    dev = torch.device("cpu")
    ci = prepare_chunk_indices(None, 10 * C, C, 1, device=dev)
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.segment_chunks=2")
    assert tuning.chunk_fwd(dev) is tuning.chunk_fwd(dev)
    plan = _pass_plan(ci, 2, 16, 16, dev, False, None)[0]
    assert plan.segmented and plan.S == 5 and _pass_plan(ci, 2, 16, 16, dev, False, None)[0] is plan
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.segment_chunks=4")
    assert tuning.chunk_fwd(dev).segment_chunks == 4 and _pass_plan(ci, 2, 16, 16, dev, False, None)[0].S == 3
    with tuning.override("chunk_fwd", segment_chunks=-1):
        assert not _pass_plan(ci, 2, 16, 16, dev, False, None)[0].segmented
    assert _pass_plan(ci, 2, 16, 16, dev, False, None)[0].S == 3
    monkeypatch.delenv("GDN_TUNE")
    assert tuning.chunk_fwd(dev).segment_chunks == tuning.TABLES["chunk_fwd"]["default"].segment_chunks


def test_host_integer_helpers_match_triton():
    """gdn.kernels.common.cdiv / next_pow2 (plain Python, used on the launch path) agree with triton's."""
    import triton

    from gdn.kernels.common import cdiv, next_pow2

    for n in range(1, 2100):
        assert next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)
    assert cdiv(0, 64) == 0


@pytest.mark.parametrize("raw,match", [("chunk_fwd.state_BV", "bad item"), ("chunk.state_BV=16", "unknown family"),
                                       ("chunk_fwd.state_bv=16", "unknown key"),
                                       ("chunk_fwd.state_BV=wide", "expected int"),
                                       ("chunk_fwd.state_split_h=maybe", "expected bool"),
                                       ("chunk_fwd.output_heads=-1", "output_heads")])
def test_tune_env_var_errors(monkeypatch, raw, match):
    """A bad GDN_TUNE raises ValueError naming the variable and the item before any kernel runs."""
    from gdn.kernels import tuning

    monkeypatch.setenv("GDN_TUNE", raw)
    x = make_inputs(1, 5, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=match) as e:
        tuning.chunk_fwd()
        tuning.chunk_bwd()
        chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    assert "GDN_TUNE" in str(e.value)


# ----------------------------------------------------------------------------------------------------------------------
# the forward intermediates (used by the backward for recompute)
# ----------------------------------------------------------------------------------------------------------------------
def test_intermediates():
    import gdn.kernels.chunk as cf

    lens = [C + 5, 20]
    cu = torch.tensor([0, C + 5, C + 25], dtype=torch.int32)
    T = C + 25
    H, HV, K, V = 1, 2, 16, 16
    x = make_inputs(1, T, H, HV, K, V)
    g_cum = cf.chunk_local_cumsum(x.g, 64, cu)
    ref = torch.zeros_like(g_cum)
    for s, e in ((0, C), (C, C + 5), (C + 5, T)):
        ref[0, s:e] = x.g[0, s:e].cumsum(0)
    assert torch.allclose(g_cum, ref, atol=1e-5)
    ainv = cf.chunk_scaled_dot_kkt_solve(x.k, g_cum, x.beta, cu, 64, True)
    # check one chunk explicitly: (I + A) @ Ainv == I
    kk = x.k[0, :C, 0] / x.k[0, :C, 0].norm(dim=-1, keepdim=True)
    for hv in range(HV):
        gc = g_cum[0, :C, hv]
        A = (x.beta[0, :C, hv, None] * torch.exp(gc[:, None] - gc[None, :]).tril() * (kk @ kk.T)).tril(-1)
        assert torch.allclose((torch.eye(C) + A) @ ainv[0, :C, hv], torch.eye(C), atol=1e-4)
    assert torch.equal(ainv[0, C:C + 5, :, 5:], torch.zeros_like(ainv[0, C:C + 5, :, 5:]))
    g2, a2, w, u = cf.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True)
    w2, u2 = cf.recompute_w_u(x.k, x.v, x.beta, ainv, g_cum, cu, 64, True)
    assert rel_err(w2, w) < 1e-5 and rel_err(u2, u) < 1e-5 and rel_err(a2, ainv) < 1e-6
    h, v_new, ht = cf.chunk_state_pass(x.k, w, u, g_cum, None, True, cu, 64, True)
    assert h.shape == (3, HV, K, V) and h.dtype == torch.float32 and v_new.shape == (1, T, HV, V)
    # chunk starts: h of the first chunk of each sequence is zero; the second chunk of sequence 0 starts from the
    # recurrent state after C tokens
    assert torch.equal(h[0], torch.zeros_like(h[0])) and torch.equal(h[2], torch.zeros_like(h[2]))
    q64, k64, v64, g64, b64 = to64(x.q, x.k, x.v, x.g, x.beta)
    _, s_c = recurrent_gated_delta_rule_ref(q64[:, :C], k64[:, :C], v64[:, :C], g64[:, :C], b64[:, :C], None, None,
                                            True, None, True)
    assert rel_err(h[1], s_c[0]) < 2e-3
    o = cf.chunk_output(x.q, x.k, v_new, h, g_cum, K ** -0.5, cu, 64, True)
    ro, rht = _refs(x, cu=cu, l2=True)
    _check(o, ht, ro, rht, torch.float32)


@pytest.mark.parametrize("l2", [True, False])
def test_prepare_output_matrix(l2):
    """STORE_P of the prepare kernel (the fused Hopper pass's inputs): P = causal(scale r_q r_k^T Gamma Q K^T) and
    qf = scale r_q exp(g_cum), so that o = diag(qf) (q h) + P v_new per chunk equals the output kernel's o."""
    import gdn.kernels.chunk as cf

    cu = torch.tensor([0, C + 1, C + 1 + (C - 1), 2 * C + 1 + C], dtype=torch.int32)   # lengths 65, 63, 65
    T = int(cu[-1])
    H, HV, K, V = 1, 2, 32, 16
    x = make_inputs(1, T, H, HV, K, V, normalize_qk=not l2)
    scale = K ** -0.5
    rq = torch.full((1, T, H), float("nan"))    # poisoned: every row written with the L2 norm, none without
    g_cum, ainv, _, _, p, qf = cf.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, l2, store_wu=False, q=x.q,
                                                    scale=scale, rq=rq)
    assert p.shape == (1, T, HV, 64) and qf.shape == (1, T, HV)
    if l2:   # q's L2 row scalings, as l2_rnorm computes them (the backward reads these instead)
        assert rel_err(rq, 1.0 / (x.q.double().pow(2).sum(-1) + 1e-6).sqrt()) < 1e-6
    else:
        assert torch.isnan(rq).all()
    ref = chunk_intra_ref(x.q, x.k, x.g, x.beta, scale, cu, l2)    # float64 P and qf
    starts = [0, 64, C + 1, 2 * C, 2 * C + 64]
    ends = [64, C + 1, 2 * C, 2 * C + 64, T]
    for a, b in zip(starts, ends):
        L = b - a
        for hv in range(HV):
            # P's entries are scale (r_q q).(r_k k) e^(gate differences) with unit-norm (L2-normed or normalised)
            # rows: errors measured against that scale, not against the block's own norm (a 1-token chunk's single
            # entry can be a near-cancelling dot product, whose fp32 relative error alone reached 1.9e-5 in CI)
            assert (p[0, a:b, hv, :L].double() - ref["p"][0, a:b, hv, :L]).abs().max().item() < 1e-5 * scale
            assert torch.equal(p[0, a:b, hv, L:], torch.zeros_like(p[0, a:b, hv, L:]))
            assert rel_err(qf[0, a:b, hv], ref["qf"][0, a:b, hv]) < 1e-5
    # the output identity on the stored states
    h, v_new, _ = cf.chunk_state_pass(x.k, None, None, g_cum, None, False, cu, 64, l2, v=x.v, beta=x.beta, ainv=ainv)
    o = cf.chunk_output(x.q, x.k, v_new, h, g_cum, scale, cu, 64, l2)
    for c, (a, b) in enumerate(zip(starts, ends)):   # c: global chunk index (chunks [0, 1], [2], [3, 4])
        for hv in range(HV):
            mine = qf[0, a:b, hv, None] * (x.q[0, a:b, 0] @ h[c, hv]) + p[0, a:b, hv, :b - a] @ v_new[0, a:b, hv]
            assert rel_err(mine, o[0, a:b, hv]) < 1e-4


@pytest.mark.parametrize("l2", [True, False])
def test_chunk_intra_ref_against_recurrence(l2):
    """The float64 per-chunk oracle: for sequences of at most one chunk from a zero state, o = P (Ainv diag(beta) V)
    and o's inter-chunk factor qf matches, against the token-by-token recurrence (an independent formulation)."""
    cu = torch.tensor([0, 1, 1 + 63, 1 + 63 + 64, 1 + 63 + 64 + 17], dtype=torch.int32)
    T = int(cu[-1])
    x = make_inputs(1, T, 2, 4, 16, 8, dtype=torch.float64, normalize_qk=not l2)
    scale = 0.3
    ref = chunk_intra_ref(x.q, x.k, x.g, x.beta, scale, cu, l2)
    o_rec, _ = recurrent_gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, scale, None, False, cu, l2)
    for _, s, e in sequence_spans(1, T, cu):
        L = e - s
        a, p = ref["ainv"][0, s:e, :, :L].transpose(0, 1), ref["p"][0, s:e, :, :L].transpose(0, 1)   # [HV, L, L]
        assert torch.equal(ref["ainv"][0, s:e, :, L:], torch.zeros_like(ref["ainv"][0, s:e, :, L:]))
        v_new = a @ (x.beta[0, s:e].T[..., None] * x.v[0, s:e].transpose(0, 1))
        assert rel_err((p @ v_new).transpose(0, 1), o_rec[0, s:e]) < 1e-12
        gc = torch.cumsum(x.g[0, s:e], 0)
        q = x.q[0, s:e].repeat_interleave(2, dim=1)
        rq = (q.square().sum(-1) + 1e-6).rsqrt() if l2 else torch.ones_like(gc)
        assert rel_err(ref["qf"][0, s:e], scale * torch.exp(gc) * rq) < 1e-12
        assert rel_err(ref["g_cum"][0, s:e], gc) < 1e-12


def test_prepare_elementwise_check_passes():
    """``gdn check``'s element-wise prepare case (every launch mode against chunk_intra_ref, bitwise repeatable) at
    its interpreter size; on the GPU it caught a miscompiled pipeline that norm-wise errors averaged away."""
    from gdn.checks.chunk import chunk_prepare_elementwise

    results = chunk_prepare_elementwise(torch.device("cpu"))
    assert len(results) == 13
    bad = [(r.case, r.rel_err, r.tol) for r in results if not r.passed]
    assert not bad, bad


def test_pieces_check_passes():
    """``gdn check``'s pieces case at its interpreter size (forced piece size): both calls split as asked, and the
    pieces equal the one-piece call."""
    from gdn.checks.chunk import chunk_pieces

    results = chunk_pieces(torch.device("cpu"))
    assert len(results) == 6 and sum("in pieces as asked" in r.case for r in results) == 2
    bad = [(r.case, r.rel_err, r.tol) for r in results if not r.passed]
    assert not bad, bad


def test_nan_isolation_check_passes():
    """``gdn check``'s NaN isolation case at its interpreter size: NaN in one sequence's q, k, v, g or beta leaves the
    other sequences' o and final states bitwise unchanged, the neighbours sharing partial chunks with it."""
    from gdn.checks.chunk import chunk_nan_isolation

    results = chunk_nan_isolation(torch.device("cpu"))
    assert len(results) == 5
    bad = [(r.case, r.rel_err, r.tol) for r in results if not r.passed]
    assert not bad, bad


# ----------------------------------------------------------------------------------------------------------------------
# autograd plumbing (the backward kernels live in gdn.kernels.chunk.backward)
# ----------------------------------------------------------------------------------------------------------------------
def test_forward_under_autograd():
    x = make_inputs(1, 20, 1, 1, 16, 16)
    q = x.q.clone().requires_grad_()
    h0 = _state(1, 1, 16, 16, "k_last").requires_grad_()
    o, ht = chunk_gated_delta_rule(q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                   state_layout="k_last")
    assert o.requires_grad and ht.requires_grad and ht.shape == h0.shape
    ro, rht = _refs(x, h0=h0, layout="k_last")
    _check(o, ht, ro, rht, torch.float32)
    if importlib.util.find_spec("gdn.kernels.chunk.backward") is None:
        with pytest.raises(NotImplementedError):
            (o.sum() + ht.sum()).backward()


def test_pool_with_grad_rejected():
    x = make_inputs(1, 8, 1, 1, 16, 16)
    pool = _state(2, 1, 16, 16, "v_last")
    before = pool.clone()
    q = x.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="ssm_state_indices"):
        chunk_gated_delta_rule(q, x.k, x.v, x.g, x.beta, initial_state=pool,
                               ssm_state_indices=torch.tensor([0], dtype=torch.int32))
    assert torch.equal(pool, before)


# ----------------------------------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument, buffers untouched
# ----------------------------------------------------------------------------------------------------------------------
def _bad_cases():
    x = make_inputs(1, 8, 2, 4, 16, 16)
    q, k, v, g, b = x.q, x.k, x.v, x.g, x.beta
    pool = torch.randn(3, 4, 16, 16)
    idx = torch.tensor([0], dtype=torch.int32)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    return pool, [
        ("q", ValueError, dict(q=q[0])),
        ("k", ValueError, dict(k=k[:, :, :1])),
        ("k", TypeError, dict(k=k.to(torch.bfloat16))),
        ("v", ValueError, dict(v=v[:, :, :3])),
        ("v", TypeError, dict(v=v.to(torch.int32))),
        ("g", ValueError, dict(g=g[..., :2])),
        ("beta", TypeError, dict(beta=b.to(torch.int64))),
        ("q", ValueError, dict(q=q.transpose(-1, -2).contiguous().transpose(-1, -2))),
        ("cu_seqlens", ValueError, dict(cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32))),
        ("cu_seqlens", TypeError, dict(cu_seqlens=cu.float())),
        ("chunk_size", ValueError, dict(chunk_size=32)),
        ("state_layout", ValueError, dict(state_layout="kv")),
        ("initial_state", ValueError, dict(initial_state=torch.randn(2, 4, 16, 16))),
        ("initial_state", TypeError, dict(initial_state=torch.zeros(1, 4, 16, 16, dtype=torch.int32))),
        ("ssm_state_indices", ValueError, dict(initial_state=pool, ssm_state_indices=torch.tensor([3]))),
        ("ssm_state_indices", ValueError, dict(initial_state=pool, ssm_state_indices=torch.tensor([-2]))),
        ("ssm_state_indices", ValueError, dict(initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))),
        ("initial_state", ValueError, dict(initial_state=None, ssm_state_indices=idx)),
        ("scale", TypeError, dict(scale="x")),
    ]


def test_bad_inputs_raise_naming_argument():
    pool, cases = _bad_cases()
    before = pool.clone()
    x = make_inputs(1, 8, 2, 4, 16, 16)
    base = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    for name, exc, kw in cases:
        args = dict(base)
        args.update(kw)
        with pytest.raises(exc, match=rf"^{name}:"):
            chunk_gated_delta_rule(**args)
    assert torch.equal(pool, before)


def test_bad_heads_and_dims():
    x = make_inputs(1, 8, 2, 3, 16, 16)
    with pytest.raises(ValueError, match="^v:"):
        chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    x = make_inputs(2, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    y = make_inputs(1, 2, 1, 1, 272, 16)
    with pytest.raises(ValueError, match="^q:"):
        chunk_gated_delta_rule(y.q, y.k, y.v, y.g, y.beta)


_VARIANTS = [dict(state_mode="wu", segment_chunks=1), dict(state_split_h=True, ainv_dtype="fp32"),
             dict(state_mode="wu", segment_chunks=2, h_dtype="fp32")]


@pytest.mark.parametrize("cfg", _VARIANTS)
def test_state_pass_variants(cfg):
    """The alternative state-pass formulations the tuning table offers (w/u round trip, split h, fp32 Ainv, fp32 h),
    each against the float64 reference."""
    from gdn.kernels import tuning

    cu = torch.tensor([0, 2 * C + 3, 2 * C + 40], dtype=torch.int32)
    T = int(cu[-1])
    x = make_inputs(1, T, 1, 2, 16, 16, dtype=torch.bfloat16)
    h0 = _state(2, 2, 16, 16, "v_last")
    with tuning.override("chunk_fwd", **cfg):
        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True)
    _check(o, ht, ro, rht, torch.bfloat16)


@pytest.mark.parametrize("heads,BK,BV", [(2, 16, 32), (0, 64, 64), (3, 16, 64), (1, 32, 32)])
def test_output_kernel_value_heads_per_program(heads, BK, BV):
    """The output kernel with several value heads per program (shared q k^T): GVA 4, K split into BK tiles (the
    first one kept across the heads), V tiles, a pool with a padding sequence (zeros for all its heads)."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk.output import _output_heads

    lens = [C + 9, 0, 30, 5]
    idx = torch.tensor([2, 0, -1, 1], dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    H, HV, K, V = 1, 4, 48, 40
    x = make_inputs(1, T, H, HV, K, V)
    pool = _state(3, HV, K, V, "v_last")
    before = pool.clone()
    with tuning.override("chunk_fwd", output_heads=heads, output_BK=BK, output_BV=BV, debug_poison=True):
        assert _output_heads(H, HV) == {2: 2, 0: 4, 3: 2, 1: 1}[heads]
        o, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                      cu_seqlens=cu, use_qk_l2norm_in_kernel=True, ssm_state_indices=idx)
    h0 = torch.stack([before[i] if i >= 0 else torch.zeros_like(before[0]) for i in idx.tolist()])
    ro, rht = _refs(x, h0=h0, cu=cu, l2=True)
    s, e = int(cu[2]), int(cu[3])
    assert torch.equal(o[0, s:e], torch.zeros_like(o[0, s:e]))
    ro[0, s:e] = 0
    assert rel_err(o, ro) <= TOL[torch.float32]
    for n, i in enumerate(idx.tolist()):
        if i >= 0:
            assert rel_err(pool[i], rht[n]) <= 2e-3


def test_heads_per_program_settings_are_checked(monkeypatch):
    from gdn.kernels import tuning
    from gdn.kernels.chunk.output import _output_heads

    with pytest.raises(ValueError, match="output_heads"):
        with tuning.override("chunk_fwd", output_heads=-1):
            _output_heads(1, 4)
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.output_heads=-2")
    with pytest.raises(ValueError, match="GDN_TUNE.*output_heads"):
        _output_heads(1, 4)
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.output_heads=3")
    assert _output_heads(1, 4) == 2 and _output_heads(2, 12) == 3


def test_solve_correlated_keys_and_rnorm():
    """The blocked inverse (16x16 substitution + (I - M)(I + M^2) Dinv merge) against float64 on nearly identical
    keys with beta ~ 1 and no decay: entries of the block powers grow, the inverse must still be right. Also the
    stored r_k and l2_rnorm against 1 / |x|."""
    import gdn.kernels.chunk as cf
    from gdn.kernels.common import l2_rnorm

    C, H, HV, K, V = 64, 2, 2, 32, 16
    T = C + 7
    base = torch.randn(K)
    k = base + 0.05 * torch.randn(1, T, H, K)
    g = torch.zeros(1, T, HV)
    beta = 0.95 + 0.05 * torch.rand(1, T, HV)
    v = torch.randn(1, T, HV, V)
    rk = torch.full((1, T, H), float("nan"))
    g_cum, ainv, _, _ = cf.chunk_fwd_prepare(k, v, g, beta, None, 64, True, store_wu=False, rk=rk)
    ref_rk = 1.0 / (k.double().pow(2).sum(-1) + 1e-6).sqrt()
    assert rel_err(rk, ref_rk) < 1e-6
    assert rel_err(l2_rnorm(k), ref_rk) < 1e-6
    q_view = torch.randn(1, T, 3 * H, K)[:, :, H:2 * H]        # strided view
    assert rel_err(l2_rnorm(q_view), 1.0 / (q_view.double().pow(2).sum(-1) + 1e-6).sqrt()) < 1e-6
    kn = (k.double() * ref_rk[..., None])
    for hv in range(HV):
        for s, e in ((0, C), (C, T)):
            kk = kn[0, s:e, hv // (HV // H)]
            A = (beta[0, s:e, hv, None].double() * (kk @ kk.T)).tril(-1)
            inv = torch.linalg.inv(torch.eye(e - s, dtype=torch.float64) + A)
            assert rel_err(ainv[0, s:e, hv, :e - s], inv) < 1e-4, (hv, s)


def test_cu_seqlens_cpu_reads_nothing_back(monkeypatch):
    """With cu_seqlens_cpu the op gives the same result and gdn's code never copies cu_seqlens to the host (the
    device-to-host read that makes a varlen call wait for the GPU); bad host copies raise ValueError/TypeError."""
    import traceback

    from gdn.ops import chunk_gated_delta_rule
    from gdn.testing import make_inputs, rel_err

    lens = [1, 63, 0, 66, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    x = make_inputs(1, T, 1, 2, 32, 16, dtype=torch.float32)
    h0 = torch.randn(len(lens), 2, 32, 16)
    ref, ref_ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    from gdn.kernels.chunk import plan

    plan._TABLE_CACHE.clear()
    reads = []
    orig_cpu, orig_tolist = torch.Tensor.cpu, torch.Tensor.tolist

    def spy(orig):
        def f(self, *a, **kw):
            if self.data_ptr() == cu.data_ptr() and any("/gdn/" in fr.filename for fr in traceback.extract_stack()):
                reads.append("".join(traceback.format_stack(limit=6)))
            return orig(self, *a, **kw)
        return f

    monkeypatch.setattr(torch.Tensor, "cpu", spy(orig_cpu))
    monkeypatch.setattr(torch.Tensor, "tolist", spy(orig_tolist))
    for host in (cu.clone(), [int(c) for c in cu]):
        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=host)
        assert rel_err(o, ref) < 1e-6 and rel_err(ht, ref_ht) < 1e-6
    assert not reads, reads[0]
    monkeypatch.undo()
    for bad, err in (([0, 1], ValueError), (cu.float(), TypeError), ("0,1", TypeError)):
        with pytest.raises(err, match="cu_seqlens_cpu"):
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=cu, cu_seqlens_cpu=bad)
    bad = [int(c) for c in cu]
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="non-decreasing"):
        chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=cu, cu_seqlens_cpu=bad)


def test_inference_frees_ainv_before_the_output_kernel(monkeypatch, device):
    """An inference call (no autograd) drops Ainv / W / U once the state pass has read them, before the output kernel
    allocates o: the call's peak memory is o + h + v_new, not that plus Ainv. Output still equals the reference."""
    import weakref

    import gdn.kernels.chunk.forward as F

    seen, alive_at_output = [], []
    prepare, output = F.chunk_fwd_prepare, F.chunk_output

    def spy_prepare(*a, **kw):
        out = prepare(*a, **kw)
        seen.extend(weakref.ref(t) for t in out[1:4] if t is not None)   # Ainv, W, U (not g_cum: the output reads it)
        return out

    def spy_output(*a, **kw):
        alive_at_output.append(sum(r() is not None for r in seen))
        return output(*a, **kw)

    monkeypatch.setattr(F, "chunk_fwd_prepare", spy_prepare)
    monkeypatch.setattr(F, "chunk_output", spy_output)
    x = make_inputs(1, 130, 2, 4, 32, 32, device=device)
    cu = torch.tensor([0, 1, 64, 130], dtype=torch.int32, device=device)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, output_final_state=True, cu_seqlens=cu)
    assert seen and alive_at_output == [0]
    ro, rs = _refs(x, cu=cu)
    assert rel_err(o, ro) < 1e-4 and rel_err(ht, rs) < 1e-4


@pytest.mark.parametrize("with_q, g_is_cumsum, ainv_dtype, sm90", [
    (True, False, torch.bfloat16, True), (False, False, torch.bfloat16, True), (True, True, torch.bfloat16, False),
    (False, False, torch.float32, False)])
def test_prepare_dispatch_sm90(monkeypatch, with_q, g_is_cumsum, ainv_dtype, sm90):
    """chunk_fwd_prepare's dispatch where the sm_90 prepare supports the launch (support emulated, launches
    recorded): the forward's launches (bf16 Ainv, with or without P / qf) go to the Gluon kernel with the outputs
    the caller gets back, r_k only with the L2 norm, and the portable kernel does not run; a cumulative g or an
    fp32 Ainv keep the portable kernel."""
    from gdn.kernels.chunk import prepare

    calls, launched = [], []
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(prepare, "_launch", lambda kernel, grid, *a, **kw: launched.append(kernel))
    B, T, H, HV, K = 1, 130, 2, 4, 64
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    rk = torch.empty(B, T, H)
    out = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, None, 64, True, store_wu=False, g_is_cumsum=g_is_cumsum,
                                    ainv_dtype=ainv_dtype, rk=rk, q=x.q if with_q else None, scale=0.125)
    # the sm_90 path: the Gluon prepare, then the redo launch of the items whose fp16 products overflowed
    assert len(calls) == int(sm90)
    assert launched == ([prepare._prepare_redo_kernel] if sm90 else [prepare._chunk_prepare_kernel])
    if sm90:
        a, kw = calls[0]
        assert kw["solve_f16"] and kw["flags"].dtype == torch.int8 and kw["flags"].shape == (3 * HV, 64)
        # (k, q, g, beta, g_cum, ainv, rk, p, qf, ...): the buffers returned to the caller
        assert a[0] is x.k and a[4] is out[0] and a[5] is out[1] and a[6] is rk and out[1].dtype == torch.bfloat16
        assert (a[1] is x.q and a[7] is out[4] and a[8] is out[5]) if with_q else (a[1] is None and len(out) == 4)
        assert kw["H"] == H and kw["HV"] == HV and kw["use_l2"]
        assert kw["chunk_spans"] is None and not kw["is_varlen"]


@pytest.mark.parametrize("spans", [False, True])
def test_prepare_dispatch_sm90_varlen_passes_chunk_spans(monkeypatch, spans):
    """A varlen call of the sm_90 prepare (support emulated, launch recorded) gets cu_seqlens and, with
    chunk_fwd.prepare_sm90_chunk_spans, the chunk spans of its chunk table: (bos, eos) per chunk."""
    from gdn.kernels.chunk import prepare
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    monkeypatch.setenv("GDN_TUNE", f"chunk_fwd.prepare_sm90_chunk_spans={spans}")

    calls = []
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(prepare, "_launch", lambda kernel, grid, *a, **kw: None)
    cu = torch.tensor([0, 65, 65, 129], dtype=torch.int32)
    x = make_inputs(1, 129, 2, 4, 64, 64, dtype=torch.bfloat16)
    prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False, ainv_dtype=torch.bfloat16,
                              rk=torch.empty(1, 129, 2))
    (a, kw), = calls
    ci = prepare_chunk_indices(cu, 129, 64, 1)
    assert kw["is_varlen"] and a[9] is ci.chunk_indices and a[10] is cu
    assert (kw["chunk_spans"] is ci.chunk_spans) if spans else kw["chunk_spans"] is None
    assert ci.chunk_spans.tolist() == [[0, 65], [0, 65], [65, 129]] if spans else ci.chunk_spans is None


@pytest.mark.parametrize("with_w, packed, scalars", [(True, False, False), (False, False, False),
                                                     (False, True, False), (True, False, True), (False, False, True)])
def test_prepare_redo_overflowed(with_w, packed, scalars):
    """redo_overflowed (the sm_90 prepare's overflow path): the flagged (chunk, value head) items' Ainv (and W) are
    recomputed from k, beta and the stored g_cum, equal to the portable prepare's; unflagged items are untouched
    (their NaN poison stays); with no flag set nothing is written. Ragged varlen, GVA, the L2 norm. ``packed``: Ainv
    is the first half of o-like [B, T, HV, 128] rows (the register-state forward's layout); the other half stays
    untouched. ``scalars``: g_cum and the flags packed into an o [B, T, HV, 64] (V tile 16:
    ``hopper.row_scalar_pack``), only valid rows flagged there; o is not written."""
    from gdn.kernels.chunk import hopper, prepare
    from gdn.kernels.chunk.plan import get_chunk_index

    cu = torch.tensor([0, C + 1, C + 1 + (C - 1), 2 * C + 2 * C + 2], dtype=torch.int32)   # 65, 63, 130 tokens
    T = int(cu[-1])
    H, HV, K = 1, 2, 32
    x = make_inputs(1, T, H, HV, K, K, dtype=torch.bfloat16)
    ci = get_chunk_index(cu, T, 1, 64, None, x.k.device)
    g_cum, ainv, _, _ = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False,
                                                  ainv_dtype=torch.bfloat16)
    _, _, w, _ = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_ainv=False)
    # the token rows of every item (chunk * HV + value head)
    rows = []
    for n, c in ci.chunk_indices.view(-1, 2).tolist():
        a = int(cu[n]) + 64 * c
        rows.append((a, min(a + 64, int(cu[n + 1]))))
    items = [(a, b, hv) for (a, b) in rows for hv in range(HV)]
    flags = torch.zeros(len(items), 64, dtype=torch.int8)       # a flag per row: one row of half the items set
    for i in torch.randperm(len(items))[:len(items) // 2].tolist():
        flags[i, torch.randint(0, 64, ()).item()] = 1
    for fl in (flags, torch.zeros_like(flags)):
        rows128 = torch.full((1, T, HV, 128), float("nan"), dtype=ainv.dtype)
        a_out = rows128[..., :64] if packed else torch.full_like(ainv, float("nan"))
        w_out = torch.full_like(w, float("nan")) if with_w else None
        if scalars:
            o = torch.randn(1, T, HV, 64).to(ainv.dtype)
            view, vp, vb = hopper.row_scalar_pack(o, 16)
            rs = view.view(1, T, HV, vp)
            for i, (a, b, hv) in enumerate(items):      # field f of token t: entry f nv + t of the chunk's block
                nv = b - a
                for f, vals in ((0, g_cum[0, a:b, hv]), (2, fl[i, :nv].float() * torch.rand(nv).add(0.5))):
                    e = f * nv + torch.arange(nv)
                    rs[0, a + e // vb, hv, e % vb] = vals
            o_before = o.clone()
            prepare.redo_overflowed(view, x.k, x.beta, view, a_out, w_out, ci, cu, T, True,
                                    packed_pitch=(vp, vb))
            assert torch.equal(o.view(torch.int16), o_before.view(torch.int16))
            # (flags past a chunk's valid rows cannot be packed: those items count as unflagged below)
            fl = torch.stack([fl[i] * (torch.arange(64) < b - a) for i, (a, b, hv) in enumerate(items)])
        else:
            prepare.redo_overflowed(fl, x.k, x.beta, g_cum, a_out, w_out, ci, cu, T, True)
        assert torch.isnan(rows128[..., 64:]).all()
        for i, (a, b, hv) in enumerate(items):
            if fl[i].any():
                assert torch.equal(a_out[0, a:b, hv], ainv[0, a:b, hv])
                if with_w:
                    assert torch.equal(w_out[0, a:b, hv], w[0, a:b, hv])
            else:
                assert torch.isnan(a_out[0, a:b, hv]).all()
                if with_w:
                    assert torch.isnan(w_out[0, a:b, hv]).all()


def test_prepare_redo_packed_flags_batched():
    """redo_overflowed with the flags and g_cum in o's rows (``hopper.row_scalar_pack``, V tile 16) on a batched
    (not varlen) input of two rows of 130 tokens: the same items redone, to the same Ainv, as from the flag buffer
    (items in the second batch row included; the other items keep their NaN poison)."""
    from gdn.kernels.chunk import hopper, prepare
    from gdn.kernels.chunk.plan import get_chunk_index

    B, T, H, HV, K = 2, 130, 1, 2, 32
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    ci = get_chunk_index(None, T, B, 64, None, x.k.device)
    g_cum, ainv, _, _ = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, None, 64, True, store_wu=False,
                                                  ainv_dtype=torch.bfloat16)
    items = [(n, 64 * c, min(64 * c + 64, T), hv) for n, c in ci.chunk_indices.view(-1, 2).tolist()
             for hv in range(HV)]
    flags = torch.zeros(len(items), 64, dtype=torch.int8)
    redo = (1, len(items) - 3, len(items) - 1)          # the second row's items among them (the last: 2 rows)
    for i in redo:
        flags[i, torch.randint(0, items[i][2] - items[i][1], ()).item()] = 1
    o = torch.randn(B, T, HV, 64).to(ainv.dtype)
    view, vp, vb = hopper.row_scalar_pack(o, 16)
    rs = view.view(B, T, HV, vp)
    for i, (n, a, b, hv) in enumerate(items):      # field f of token t: entry f nv + t of the chunk's block
        nv = b - a
        for f, vals in ((0, g_cum[n, a:b, hv]), (2, flags[i, :nv].float())):
            e = f * nv + torch.arange(nv)
            rs[n, a + e // vb, hv, e % vb] = vals
    want, got = torch.full_like(ainv, float("nan")), torch.full_like(ainv, float("nan"))
    prepare.redo_overflowed(flags, x.k, x.beta, g_cum, want, None, ci, None, T, True)
    prepare.redo_overflowed(view, x.k, x.beta, view, got, None, ci, None, T, True, packed_pitch=(vp, vb))
    assert int((~want.isnan()).sum()) == sum((items[i][2] - items[i][1]) * 64 for i in redo)
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())


@pytest.mark.parametrize("gluon", [True, False])
def test_segment_pass_dispatch_sm90(monkeypatch, gluon):
    """chunk_state_pass's segment pass where the sm_90 state pass supports INIT 3 (support emulated, launches
    recorded): a segmented run sends its local states + transitions launch to the Gluon pass once, over (V / tile +
    K / tile, HV, segments) programs at ``chunk_fwd.state_sm90_segment_BV``, with hloc / trans as its outputs; with
    ``state_sm90_segment_pass`` off, or unsegmented, it does not."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import prepare, state

    calls = []
    monkeypatch.setattr(state.hopper, "supported", lambda *a, **kw: a[8] == 3)
    monkeypatch.setattr(state.hopper, "launch_state_pass", lambda grid, *a, **kw: calls.append((grid, a, kw)))
    B, T, H, HV, K = 1, 5 * 64 + 3, 1, 2, 64
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    g_cum, ainv, _, _ = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, None, 64, True, store_wu=False,
                                                  ainv_dtype=torch.bfloat16)
    for seg in (2, -1):
        calls.clear()
        with tuning.override("chunk_fwd", state_sm90_segment_pass=gluon):
            state.chunk_state_pass(x.k, None, None, g_cum, None, True, None, 64, True, v=x.v, beta=x.beta, ainv=ainv,
                                   segment_chunks=seg)
        if gluon and seg > 0:
            (grid, a, kw), = calls
            bv = tuning.chunk_fwd(x.k.device).state_sm90_segment_BV
            assert kw["INIT"] == 3 and kw["BV"] == bv and grid == (K // bv + K // bv, HV, 3)   # 6 chunks / 2
            assert a[8].shape == (3, HV, K, K) and a[9].shape == (3, HV, K, K)    # h0 = trans, ht = hloc
        else:
            assert calls == []


@pytest.mark.parametrize("segment_t", [True, False])
def test_segment_pass_one_cta_per_segment_dispatch_sm90(monkeypatch, segment_t):
    """chunk_state_pass's segment pass at K = V = 128 in ainv mode where the sm_90 passes are supported (emulated,
    launches recorded): with ``chunk_fwd.state_sm90_segment_t`` the one-CTA-per-(value head, segment) launch
    (hopper_segments) takes it, once per call, with trans [S, HV, K, K] / hloc [S, HV, K, V] and the segment table,
    and the Gluon state pass's INIT 3 launch does not run; without the field that launch runs instead."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import prepare, state

    seg_calls, init3 = [], []
    monkeypatch.setattr(state.hopper, "supported", lambda *a, **kw: a[8] == 3)
    monkeypatch.setattr(state.hopper, "launch_state_pass", lambda grid, *a, **kw: init3.append(grid))
    monkeypatch.setattr(state.hopper_segments, "segment_t_ok", lambda *a: True)
    monkeypatch.setattr(state.hopper_segments, "launch_segment_pass_t", lambda *a, **kw: seg_calls.append((a, kw)))
    B, T, H, HV, K = 1, 5 * 64 + 3, 1, 2, 128
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    g_cum, ainv, _, _ = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, None, 64, True, store_wu=False,
                                                  ainv_dtype=torch.bfloat16)
    with tuning.override("chunk_fwd", state_sm90_segment_t=segment_t):
        state.chunk_state_pass(x.k, None, None, g_cum, None, True, None, 64, True, v=x.v, beta=x.beta,
                               ainv=ainv, segment_chunks=2)
    if segment_t:
        ((a, kw),) = seg_calls
        assert init3 == []
        trans, hloc, segments, S = a[6], a[7], a[8], a[11]
        assert S == 3 and trans.shape == (3, HV, K, K) and hloc.shape == (3, HV, K, K)    # 6 chunks / 2
        assert segments.shape[0] == 3 and kw["K"] == kw["V"] == K and kw["HV"] == HV
    else:
        assert seg_calls == [] and len(init3) == 1


@pytest.mark.parametrize("fused_states", [True, False])
def test_fused_kernel_keeps_states_when_asked(monkeypatch, fused_states):
    """chunk_gated_delta_rule_fwd with return_states where the fused Hopper kernel takes the final pass (plan and
    launch emulated, launches recorded): with ``chunk_fwd.state_sm90_fused_states`` the fused kernel gets h / v_new
    buffers (and the chunk offsets that index h) and the caller gets those same tensors back; without it the fused
    kernel is not used (the state pass + output kernel run)."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, state

    calls = []
    B, T, H, HV, K = 1, 130, 2, 4, 64
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)

    def plan(q, k, v, ci, seg, ckpt, states=False):
        return 32, state._pass_plan(ci, HV, K, K, q.device, False, seg)[0]

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: calls.append(kw))
    with tuning.override("chunk_fwd", state_sm90_fused_states=fused_states):
        o, _, aux = forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64,
                                                       True, return_states=True)
    assert len(calls) == int(fused_states)
    if fused_states:
        kw = calls[0]
        assert kw["h_out"] is aux["h"] and kw["vnew"] is aux["v_new"] and kw["chunk_offsets"] is not None
        assert aux["h"].shape == (3, HV, K, K) and aux["h"].dtype == torch.bfloat16
        assert aux["v_new"].shape == x.v.shape
    else:
        assert aux["h"] is not None and aux["v_new"] is not None


@pytest.mark.parametrize("packed, store_ainv, seg, p_in", [
    (True, False, None, False), (False, False, None, False), (True, True, None, False), (True, False, "gluon", False),
    (True, False, "portable", False), (True, False, None, True), (False, False, None, True), (True, True, None, True),
    (True, False, "gluon", True), (True, False, "portable", True)])
def test_register_state_forward_packs_ainv_and_p_into_o(monkeypatch, packed, store_ainv, seg, p_in):
    """chunk_gated_delta_rule_fwd where the register-state kernel (V tile 128) takes the final pass and the sm_90
    prepare runs (plan, support and launches emulated, launches recorded): with ``chunk_fwd.state_sm90_fused_t_packed``
    an inference call has the prepare write Ainv and P into the two halves of o's own rows (views at head pitch 128;
    the overflow redo told that pitch) and the fused launch reads them there and writes that o; the field off, or a
    call that keeps Ainv (training), gets buffers of their own. ``seg``: a segmented run (segments of 2 chunks) whose
    segment pass is the Gluon one (it is handed the packed Ainv view as it is) or the portable one (no packing: that
    kernel reads a contiguous Ainv only; were it handed a packed one, it reads a contiguous copy). ``p_in``
    (``chunk_fwd.state_sm90_t_p_in_kernel``): the kernel forms P itself, unsegmented or as a segmented run's final
    pass, so the prepare gets no q and writes no P (Ainv alone in o's first half when packed), stores q's L2 row
    scalings from q's tiles instead, and the fused launch gets those in qf's place."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, prepare, state

    B, T, H, HV, K, V = 2, 130, 2, 4, 64, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    prep, redo, fused, seg_gluon, seg_portable = [], [], [], [], []

    def plan(q, k, v, ci, s, ckpt, states=False):
        return 128, state._pass_plan(ci, HV, K, V, q.device, False, 2 if seg else s)[0]

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(forward, "segment_pass_sm90_ok", lambda k, v, dt: seg == "gluon")
    monkeypatch.setattr(state, "_segment_sm90", lambda *a: seg == "gluon")
    monkeypatch.setattr(state, "merge_segment_states", lambda *a, **kw: torch.zeros(1))
    monkeypatch.setattr(state.hopper, "launch_state_pass", lambda *a, **kw: seg_gluon.append(a))
    monkeypatch.setattr(state, "_launch", lambda kernel, grid, *a, **kw: seg_portable.append(a))
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: prep.append((a, kw)))
    monkeypatch.setattr(prepare, "_launch", lambda kernel, grid, *a, **kw: redo.append(kw))
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: fused.append((a, kw)))
    with tuning.override("chunk_fwd", state_sm90_fused_t_packed=packed, prepare_sm90=True,
                         state_sm90_t_p_in_kernel=p_in):
        o, _, aux = forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64,
                                                       True, return_states=False, store_ainv=store_ainv)
    ((pa, pkw),), ((fa, fkw),), (rkw,) = prep, fused, redo
    # beta folded into a packed Ainv (chunk_fwd.state_sm90_beta_in_ainv) where only the register-state kernel reads
    # it: unsegmented (the Gluon segment pass at K = 64 is the INIT 3 state pass, which takes no such Ainv)
    folded = packed and not store_ainv and seg is None
    assert pkw["beta_in_ainv"] == fkw["beta_in_ainv"] == rkw.get("A_BETA", False) == folded
    ainv, p = pa[5], pa[7]                      # launch_prepare(k, q, g, beta, g_cum, ainv, rk, p, qf, ...)
    assert fa[5] is ainv and fa[6] is p and fa[10] is o     # launch_fused_pass(grid, q, k, v, beta, ainv, p, qf, ..)
    if p_in:
        assert pa[1] is None and p is None and pa[8] is None and pkw["rq_of"] is x.q
        assert fa[7] is pkw["rq"] and pkw["rq"].shape == (B, T, H) and pkw["rq"].dtype == torch.float32
        p = ainv                                # (the layout checks below: Ainv alone)
    else:
        assert pa[1] is x.q and pkw["rq_of"] is None
    assert ainv.shape == p.shape == (B, T, HV, 64)
    assert len(seg_gluon) == int(seg == "gluon") and len(seg_portable) == int(seg == "portable")
    if seg == "gluon":
        assert seg_gluon[0][4] is ainv          # launch_state_pass(grid, k, v, beta, ainv, ...): the view as it is
    if packed and not store_ainv and seg != "portable":
        es = o.element_size()
        assert ainv.data_ptr() == o.data_ptr() and (p is ainv or p.data_ptr() == o.data_ptr() + 64 * es)
        assert ainv.stride() == p.stride() == o.stride() and rkw.get("AP") == 128 and aux["ainv"] is None
    else:
        lo, hi = o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()
        assert not (lo <= ainv.data_ptr() < hi) and not (lo <= p.data_ptr() < hi)
        assert ainv.is_contiguous() and p.is_contiguous() and "AP" not in rkw
        assert aux["ainv"] is ainv


@pytest.mark.parametrize("packed", [True, False])
def test_inference_pieces_skipped_where_ainv_is_in_o(monkeypatch, packed):
    """chunk_fwd.piece_token_heads: where the register-state kernel takes an inference call with Ainv in o's own rows
    (``state_sm90_fused_t_packed``; plan, support and launches emulated), the call runs whole, since pieces halve
    intermediates it does not hold; with the field off (Ainv in a buffer of its own) the same call runs in pieces."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, prepare, state

    B, T, H, HV, K, V = 1, 5 * C + 3, 2, 4, 64, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    pieces, fused = [], []
    monkeypatch.setattr(forward, "fused_output_plan", lambda q, k, v, ci, s, ckpt, states=False:
                        (128, state._pass_plan(ci, HV, K, V, q.device, False, s)[0]))
    monkeypatch.setattr(forward, "_forward_in_pieces", lambda *a: pieces.append(a[10]) or (a[0], None, {}))
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: None)
    monkeypatch.setattr(prepare, "_launch", lambda *a, **kw: None)
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: fused.append(a))
    with tuning.override("chunk_fwd", state_sm90_fused_t_packed=packed, prepare_sm90=True,
                         piece_token_heads=B * T * HV // 3, piece_max=4):
        forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, C, True,
                                           return_states=False)
    assert pieces == ([] if packed else [3]) and len(fused) == int(packed)


@pytest.mark.parametrize("bv, pin, on, store_ainv, seg, l2", [
    (64, 64, True, False, None, True), (64, 64, True, False, None, False), (32, 32, True, False, None, True),
    (32, 64, True, False, None, True), (16, 64, True, False, None, True), (64, 64, False, False, None, True),
    (64, 64, True, True, None, True), (64, 64, True, False, 2, True)])
def test_fused_forward_packs_row_scalars_into_o(monkeypatch, bv, pin, on, store_ainv, seg, l2):
    """chunk_gated_delta_rule_fwd where the V tile 16 / 32 / 64 fused kernel takes the final pass and the sm_90
    prepare runs (plan, support and launches emulated, launches recorded): with ``chunk_fwd.state_sm90_row_scalars_in_o``
    an unsegmented inference call whose fused kernel forms P itself (V tile >= ``state_sm90_p_in_kernel_bv``) hands
    the prepare, the overflow redo and the fused launch one pointer for g_cum, r_k (with the L2 norm) and the flags:
    o's own bytes as fp32, with o's pitch and the tile's (VP = V / 2, VB = BV / 2, V / BV copies), and returns no g_cum
    / r_k (o overwrites them); P from the prepare (smaller tiles), the field off, a call that keeps Ainv (training) or
    a segmented run gets buffers of their own."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, prepare, state

    B, T, H, HV, K, V = 1, 130, 2, 4, 64, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    prep, redo, fused = [], [], []

    def plan(q, k, v, ci, s, ckpt, states=False):
        return bv, state._pass_plan(ci, HV, K, V, q.device, False, seg if seg else s)[0]

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(state, "merge_segment_states", lambda *a, **kw: torch.zeros(1))
    monkeypatch.setattr(state.hopper, "launch_state_pass", lambda *a, **kw: None)
    monkeypatch.setattr(state, "_launch", lambda *a, **kw: None)
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: prep.append((a, kw)))
    monkeypatch.setattr(prepare, "_launch", lambda kernel, grid, *a, **kw: redo.append((a, kw)))
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: fused.append((a, kw)))
    with tuning.override("chunk_fwd", state_sm90_row_scalars_in_o=on, prepare_sm90=True, solve_sm90_f16=True,
                         state_sm90_p_in_kernel_bv=pin):
        o, _, aux = forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64,
                                                       l2, return_states=False, store_ainv=store_ainv)
    ((pa, pkw),), ((ra, rkw),), ((fa, fkw),) = prep, redo, fused
    # launch_prepare(k, q, g, beta, g_cum, ainv, rk, p, qf, ...); launch_fused_pass(grid, q, k, v, beta, ainv, p, qf,
    # g_cum, rk, o, ...); the redo kernel's (flags, n_items, k, beta, gcum, ...)
    pk = bv in (32, 64) and pin <= bv and not seg
    assert (pa[1] is None) == pk and (pa[7] is None) == pk
    if on and pk and not store_ainv:
        view = pa[4]
        assert view.dtype == torch.float32 and view.data_ptr() == o.data_ptr() and view.numel() * 2 == o.numel()
        assert pkw["row_scalars"] == (V // 2, bv // 2, V // bv) and fkw["row_scalars"] == (V // 2, bv // 2)
        assert pkw["flags"] is view and (pa[6] is view if l2 else pa[6] is None) and pa[8] is None
        assert fa[8] is view and (fa[9] is view if l2 else True) and fa[7] is None
        assert ra[0] is view and ra[4] is view and rkw["VP"] == V // 2 and rkw["VB"] == bv // 2
        assert aux["g_cum"] is None and aux["rk"] is None
    else:
        lo, hi = o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()
        assert pkw.get("row_scalars") is None and fkw.get("row_scalars") is None and "VP" not in rkw
        assert pa[4].shape == (B, T, HV) and not (lo <= pa[4].data_ptr() < hi)
        assert pkw["flags"].dtype == torch.int8 and aux["g_cum"] is pa[4]


@pytest.mark.parametrize("store_ainv", [False, True])
def test_prepare_stores_rq_only_for_a_backward(monkeypatch, store_ainv):
    """chunk_gated_delta_rule_fwd where the fused Hopper kernel takes P from the sm_90 prepare (plan, support and
    launches emulated, launches recorded): q's L2 row scalings r_q (fp32 [B, T, H]) are stored by the prepare and
    returned in aux only for a call that keeps Ainv (training: the backward reads them); an inference call gets the
    prepare launch without r_q (no buffer, nothing stored) and aux["rq"] None."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, prepare, state

    B, T, H, HV, K, V = 1, 130, 2, 4, 64, 64
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    prep = []

    def plan(q, k, v, ci, s, ckpt, states=False):
        return 32, state._pass_plan(ci, HV, K, V, q.device, False, -1)[0]

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: prep.append((a, kw)))
    monkeypatch.setattr(prepare, "_launch", lambda *a, **kw: None)
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: None)
    with tuning.override("chunk_fwd", prepare_sm90=True, state_sm90_p_in_kernel_bv=0):
        _, _, aux = forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64,
                                                       True, return_states=False, store_ainv=store_ainv)
    ((a, kw),) = prep
    assert a[1] is x.q and a[7] is not None          # P is formed either way
    if store_ainv:
        assert kw["rq"] is aux["rq"] and aux["rq"].shape == (B, T, H) and aux["rq"].dtype == torch.float32
    else:
        assert kw["rq"] is None and aux["rq"] is None


def test_segment_pass_reads_packed_ainv_contiguously_where_portable(monkeypatch):
    """chunk_state_pass handed an Ainv packed into o's rows (the fused register-state final pass) on a segmented run
    whose segment pass is the portable kernel: that kernel gets a contiguous copy (it reads Ainv at pitch 64), the
    fused final pass the packed view itself. The copy's values are the view's."""
    from gdn.kernels.chunk import state

    B, T, H, HV, K, V = 1, 200, 2, 4, 64, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    o = torch.randn(B, T, HV, 2 * 64).to(torch.bfloat16)
    ainv = o[..., :64]
    seg_calls, fused = [], []
    ci = state.get_chunk_index(None, T, B, 64, None, o.device)
    plan = state._pass_plan(ci, HV, K, V, o.device, False, 2)[0]
    monkeypatch.setattr(state, "_segment_sm90", lambda *a: False)
    monkeypatch.setattr(state, "merge_segment_states", lambda *a, **kw: torch.zeros(1))
    monkeypatch.setattr(state, "_launch", lambda kernel, grid, *a, **kw: seg_calls.append(a))
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: fused.append(a))
    g_cum = torch.zeros(B, T, HV)
    fuse = dict(q=x.q, p=o[..., 64:], qf=torch.zeros(B, T, HV), o=o, o_idx=None, PO=0, BV=128, plan=plan,
                states=False, scale=0.125)
    state.chunk_state_pass(x.k, None, None, g_cum, None, False, None, 64, False, v=x.v, beta=x.beta, ainv=ainv,
                           h_dtype=torch.bfloat16, output=fuse, chunk_index=ci)
    assert plan.segmented and len(seg_calls) == 1 and len(fused) == 1
    aa = seg_calls[0][3]                        # _chunk_state_kernel(k, v, beta, ainv, ...)
    assert aa.is_contiguous() and aa.data_ptr() != o.data_ptr() and torch.equal(aa, ainv)
    assert fused[0][5] is ainv


def _fused_forward_emulated(monkeypatch, x, bv, seg, l2=True, **fields):
    """chunk_gated_delta_rule_fwd (inference, scale 0.125) with the fused Hopper kernel at V tile ``bv`` taking the
    final pass (plan and launch emulated; the portable prepare runs) under the ``chunk_fwd`` fields given: (the q
    each prepare call got, [(args, kwargs)] of the fused launches, aux)."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, state

    calls, preps = [], []
    HV, K, V = x.v.shape[2], x.k.shape[3], x.v.shape[3]

    def plan(q, k, v, ci, s, ckpt, states=False):
        return bv, state._pass_plan(ci, HV, K, V, q.device, False, seg)[0]

    real_prepare = forward.chunk_fwd_prepare

    def prepare(*a, **kw):
        preps.append(kw.get("q"))
        return real_prepare(*a, **kw)

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(forward, "chunk_fwd_prepare", prepare)
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: calls.append((a, kw)))
    with tuning.override("chunk_fwd", **fields):
        _, _, aux = forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64,
                                                       l2, return_states=False)
    return preps, calls, aux


@pytest.mark.parametrize("bv, seg, field, formed", [(64, -1, 64, True), (32, -1, 64, False), (64, 2, 64, False),
                                                     (64, -1, 0, False)])
def test_fused_kernel_forms_p_where_the_tuning_says(monkeypatch, bv, seg, field, formed):
    """chunk_gated_delta_rule_fwd where the fused Hopper kernel takes the final pass (plan and launch emulated,
    launches recorded): at an unsegmented V tile >= ``chunk_fwd.state_sm90_p_in_kernel_bv`` the prepare gets no q
    (no P, no qf, no r_q) and the fused launch gets P = qf = None with the call's scale; elsewhere P and qf come from
    the prepare as before."""
    B, T, H, HV, K = 1, 5 * 64 + 3, 2, 4, 64
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    preps, calls, aux = _fused_forward_emulated(monkeypatch, x, bv, seg, state_sm90_p_in_kernel_bv=field)
    (a, kw), = calls
    assert (preps[0] is None) == formed and (a[6] is None) == formed and (a[7] is None) == formed
    # (r_q: only for a training call's backward, which keeps Ainv; an inference call stores none)
    assert kw["scale"] == 0.125 and kw["BV"] == bv and aux["rq"] is None
    if not formed:
        assert a[6].shape == (B, T, HV, 64) and a[7].shape == (B, T, HV)


@pytest.mark.parametrize("field, l2, seg", [(True, True, -1), (True, False, -1), (False, True, -1), (True, True, 2),
                                            (False, True, 2)])
def test_register_state_kernel_forms_p_where_the_tuning_says(monkeypatch, field, l2, seg):
    """chunk_gated_delta_rule_fwd where the register-state kernel (V tile 128) takes the final pass (plan and launch
    emulated; the portable prepare here): with ``chunk_fwd.state_sm90_t_p_in_kernel`` an unsegmented run's prepare
    gets no q (no P, no qf) and the launch gets P = None and, in qf's place, q's L2 row scalings (fp32 [B, T, H],
    rsqrt(|q|^2 + 1e-6); None without the L2 norm), also segmented (segments of 2 chunks: the final pass forms P
    as well); with the field off, P and qf come from the prepare."""
    B, T, H, HV, K, V = 1, 3 * 64 + 5, 2, 4, 64, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    preps, calls, _ = _fused_forward_emulated(monkeypatch, x, 128, seg, l2, state_sm90_t_p_in_kernel=field)
    (a, kw), = calls
    assert kw["BV"] == 128 and kw["transposed"] and kw["scale"] == 0.125
    p, qf = a[6], a[7]
    if not field:
        assert preps[0] is x.q and p.shape == (B, T, HV, 64) and qf.shape == (B, T, HV)
        return
    assert preps[0] is None and p is None
    if not l2:
        assert qf is None
        return
    want = torch.rsqrt(x.q.float().pow(2).sum(-1) + 1e-6)
    assert qf.shape == (B, T, H) and qf.dtype == torch.float32
    torch.testing.assert_close(qf, want, rtol=1e-5, atol=0)


def test_segment_pass_sm90_ok_follows_the_gluon_segment_pass(monkeypatch):
    """state.segment_pass_sm90_ok (whether the forward may pack Ainv into o's rows on a segmented run) says yes exactly
    where the segment pass would be the Gluon one: sm_90 (emulated here), 16-bit inputs laid out as TMA rows, K in
    (64, 128), the ``chunk_fwd.state_sm90_segment_pass`` field on; no on other devices, for fp32 inputs, K = 96, or
    with the field off."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import hopper, state

    x = make_inputs(1, 128, 2, 4, 128, 128, dtype=torch.bfloat16)
    assert not state.segment_pass_sm90_ok(x.k, x.v, torch.bfloat16)        # a CPU tensor: not sm_90
    monkeypatch.setattr(hopper, "capability", lambda dev: "sm_90")
    # (a Triton without Gluon has no Gluon segment pass at all)
    assert state.segment_pass_sm90_ok(x.k, x.v, torch.bfloat16) == bool(hopper.G.AVAILABLE)
    with tuning.override("chunk_fwd", state_sm90_segment_pass=False):
        assert not state.segment_pass_sm90_ok(x.k, x.v, torch.bfloat16)
    x32 = make_inputs(1, 128, 2, 4, 128, 128, dtype=torch.float32)
    assert not state.segment_pass_sm90_ok(x32.k, x32.v, torch.float32)
    x96 = make_inputs(1, 128, 2, 4, 96, 128, dtype=torch.bfloat16)
    assert not state.segment_pass_sm90_ok(x96.k, x96.v, torch.bfloat16)


@pytest.mark.parametrize("packed", [False, True])
def test_prepare_redo_beta_in_ainv(packed):
    """redo_overflowed with ``beta_in_ainv`` (the sm_90 prepare's Ainv diag(beta) form, chunk_fwd.state_sm90_beta_in_ainv):
    the flagged items' Ainv comes back with its columns scaled by their tokens' beta (float64 Ainv of the same inputs
    times beta, within bf16 rounding), the unflagged ones keep their NaN poison. Ragged varlen (65, 63, 130 tokens),
    GVA, the L2 norm, beta drawn over (0, 0.5) (so that no column's beta is near 1, where the unscaled Ainv would
    pass for the scaled one: a one-token chunk's Ainv is [1]); ``packed``: Ainv the first half of o-like rows (head
    pitch 128)."""
    from gdn.kernels.chunk import prepare
    from gdn.kernels.chunk.plan import get_chunk_index

    cu = torch.tensor([0, C + 1, C + 1 + (C - 1), 2 * C + 2 * C + 2], dtype=torch.int32)
    T = int(cu[-1])
    H, HV, K = 1, 2, 32
    x = make_inputs(1, T, H, HV, K, K, dtype=torch.bfloat16, beta_range=(0.0, 0.5))
    ci = get_chunk_index(cu, T, 1, 64, None, x.k.device)
    g_cum = prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False,
                                      ainv_dtype=torch.bfloat16)[0]
    ref = chunk_intra_ref(x.q, x.k, x.g, x.beta, K ** -0.5, cu, True)["ainv"]          # float64, no beta factor
    items = [(int(cu[n]) + 64 * c, min(int(cu[n]) + 64 * c + 64, int(cu[n + 1])), hv)
             for n, c in ci.chunk_indices.view(-1, 2).tolist() for hv in range(HV)]
    flags = torch.zeros(len(items), 64, dtype=torch.int8)
    redo = sorted(torch.randperm(len(items))[:len(items) // 2 + 1].tolist())
    for i in redo:
        flags[i, torch.randint(0, items[i][1] - items[i][0], ()).item()] = 1
    rows128 = torch.full((1, T, HV, 128), float("nan"), dtype=torch.bfloat16)
    a_out = rows128[..., :64] if packed else torch.full((1, T, HV, 64), float("nan"), dtype=torch.bfloat16)
    prepare.redo_overflowed(flags, x.k, x.beta, g_cum, a_out, None, ci, cu, T, True, beta_in_ainv=True)
    assert torch.isnan(rows128[..., 64:]).all()
    for i, (a, b, hv) in enumerate(items):
        got = a_out[0, a:b, hv, :b - a]
        if i in redo:
            want = ref[0, a:b, hv, :b - a] * x.beta[0, a:b, hv].double()[None, :]
            assert rel_err(got.double(), want) < 1e-2, (i, rel_err(got.double(), want))
            # (beta is not 1: the unscaled Ainv would fail)
            assert rel_err(got.double(), ref[0, a:b, hv, :b - a]) > 0.05
        else:
            assert torch.isnan(a_out[0, a:b, hv]).all()


def test_beta_in_ainv_argument_errors():
    """``beta_in_ainv`` is refused where its Ainv diag(beta) would reach a kernel that does not take it: the portable
    prepare (a CPU tensor here), a prepare that also stores W, the V tile 32 / 64 fused kernel; each a ValueError
    naming the argument, raised before any launch."""
    from gdn.kernels.chunk import hopper, hopper_prepare, prepare

    x = make_inputs(1, 130, 2, 4, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="beta_in_ainv"):
        prepare.chunk_fwd_prepare(x.k, x.v, x.g, x.beta, None, 64, True, store_wu=False, ainv_dtype=torch.bfloat16,
                                  beta_in_ainv=True)
    t = torch.empty(1)
    with pytest.raises(ValueError, match="beta_in_ainv"):
        hopper_prepare.launch_prepare(x.k, None, x.g, x.beta, t, t, None, None, None, t, None, 3, 130, 1.0,
                                      (0, 0, 0), (0, 0, 0), H=2, HV=4, K=64, use_l2=True, is_varlen=False,
                                      w=torch.empty(1, 130, 4, 64), beta_in_ainv=True)
    with pytest.raises(ValueError, match="beta_in_ainv"):
        hopper.launch_fused_pass((1, 4, 1), x.q, x.k, x.v, x.beta, t, None, None, t, None, t, None, None, t, t, None,
                                 t, None, 130, 0, 0, 0, (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), H=2, HV=4, K=64, V=64,
                                 use_l2=True, is_varlen=False, INIT=0, H0_BY_SEG=False, H0_INDEXED=False,
                                 HT_BY_SEG=False, HT_INDEXED=False, BV=32, beta_in_ainv=True)


@pytest.mark.parametrize("seg_t, field, store_ainv", [(True, True, False), (False, True, False), (True, False, False),
                                                      (True, True, True)])
def test_segmented_forward_folds_beta_for_the_one_cta_segment_pass(monkeypatch, seg_t, field, store_ainv):
    """A segmented register-state forward (K = V = 128, segments of 2 chunks; plan, support and launches emulated,
    launches recorded): with ``chunk_fwd.state_sm90_beta_in_ainv`` and the one-CTA segment pass (``state._segment_t``)
    the prepare, its overflow redo, the segment pass and the final pass are all told that Ainv is Ainv diag(beta);
    with the INIT 3 Gluon segment pass instead, the field off, or a call that keeps Ainv, none is."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import forward, prepare, state

    B, T, H, HV, K, V = 1, 260, 2, 4, 128, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    prep, redo, fused, seg_pass = [], [], [], []

    def plan(q, k, v, ci, s, ckpt, states=False):
        return 128, state._pass_plan(ci, HV, K, V, q.device, False, 2)[0]

    monkeypatch.setattr(forward, "fused_output_plan", plan)
    monkeypatch.setattr(forward, "segment_pass_sm90_ok", lambda k, v, dt: True)
    monkeypatch.setattr(state, "_segment_sm90", lambda *a: True)
    monkeypatch.setattr(state, "_segment_t", lambda *a: seg_t)
    monkeypatch.setattr(state, "merge_segment_states", lambda *a, **kw: torch.zeros(1))
    monkeypatch.setattr(state.hopper, "launch_state_pass", lambda *a, **kw: seg_pass.append(("init3", kw)))
    monkeypatch.setattr(state.hopper_segments, "launch_segment_pass_t", lambda *a, **kw: seg_pass.append(("t", kw)))
    monkeypatch.setattr(prepare.hopper_prepare, "supported", lambda k, q, K, adt, prec: adt == k.dtype)
    monkeypatch.setattr(prepare.hopper_prepare, "launch_prepare", lambda *a, **kw: prep.append(kw))
    monkeypatch.setattr(prepare, "_launch", lambda kernel, grid, *a, **kw: redo.append(kw))
    monkeypatch.setattr(state.hopper, "launch_fused_pass", lambda *a, **kw: fused.append(kw))
    with tuning.override("chunk_fwd", prepare_sm90=True, state_sm90_beta_in_ainv=field):
        forward.chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, 0.125, None, False, None, 64, True,
                                           return_states=False, store_ainv=store_ainv)
    (pkw,), (fkw,), (rkw,), ((kind, skw),) = prep, fused, redo, seg_pass
    folded = seg_t and field and not store_ainv
    assert kind == ("t" if seg_t else "init3")
    assert pkw["beta_in_ainv"] == fkw["beta_in_ainv"] == rkw.get("A_BETA", False) == folded
    assert skw.get("beta_in_ainv", False) == folded


def test_beta_in_ainv_ok_follows_the_one_cta_segment_pass(monkeypatch):
    """state.beta_in_ainv_ok (whether the forward may fold beta into the packed Ainv): yes for an unsegmented plan; for
    a segmented one exactly where the segment pass is the one-CTA form (sm_90 emulated, K = V = 128, Gluon present):
    not on another device, with ``chunk_fwd.state_sm90_segment_t`` off, or with ``state_split_h`` on (the state
    pass then runs another segment pass, which takes no Ainv diag(beta))."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import hopper, state
    from gdn.kernels.chunk.plan import get_chunk_index

    B, T, H, HV, K, V = 1, 512, 2, 4, 128, 128
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16)
    ainv = torch.empty(B, T, HV, 64, dtype=torch.bfloat16)
    ci = get_chunk_index(None, T, B, 64, None, x.k.device)
    whole = state._pass_plan(ci, HV, K, V, x.k.device, False, -1)[0]
    segs = state._pass_plan(ci, HV, K, V, x.k.device, False, 2)[0]
    assert not whole.segmented and segs.segmented
    assert state.beta_in_ainv_ok(x.k, x.v, ainv, torch.bfloat16, whole)
    assert not state.beta_in_ainv_ok(x.k, x.v, ainv, torch.bfloat16, segs)         # a CPU tensor: not sm_90
    monkeypatch.setattr(hopper, "capability", lambda dev: "sm_90")
    assert state.beta_in_ainv_ok(x.k, x.v, ainv, torch.bfloat16, segs) == bool(hopper.G.AVAILABLE)
    for field in ("state_sm90_segment_t", "state_split_h"):
        with tuning.override("chunk_fwd", **{field: field == "state_split_h"}):
            assert not state.beta_in_ainv_ok(x.k, x.v, ainv, torch.bfloat16, segs)
