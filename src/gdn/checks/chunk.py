"""gdn check: chunk_gated_delta_rule (varlen, GVA, both layouts, pools, strided q/k/v, segmented long sequences)
against the float64 chunked reference."""
import dataclasses

import torch

from ..ops import chunk_gated_delta_rule
from ..reference import chunk_gated_delta_rule_ref, chunk_intra_ref, l2norm_ref, sequence_spans
from ..testing import GDNInputs, make_inputs, max_rel_err, rel_err, to64
from . import Result, register

TOL = {torch.float32: 2e-3, torch.bfloat16: 1.5e-2}


def _shapes(device):
    if device.type == "cuda":
        return dict(H=16, HV=32, K=128, V=128, lens=[1, 63, 64, 65, 300, 0, 1000], long=8192, long_heads=(2, 4))
    return dict(H=1, HV=2, K=32, V=16, lens=[1, 63, 0, 66], long=4 * 64 + 5, long_heads=(1, 1))


def _cu(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)


def _ref(x, h0=None, cu=None, layout="v_last", l2=True, scale=None):
    return chunk_gated_delta_rule_ref(*to64(x.q, x.k, x.v, x.g, x.beta), scale,
                                      None if h0 is None else h0.detach().double().cpu(), True,
                                      None if cu is None else cu.cpu(), l2, state_layout=layout)


@register
def chunk_varlen(device):
    s = _shapes(device)
    out = []
    cu = _cu(s["lens"], device)
    N, T = len(s["lens"]), int(cu[-1])
    for layout in ("v_last", "k_last"):
        for dtype in (torch.float32, torch.bfloat16):
            x = make_inputs(1, T, s["H"], s["HV"], s["K"], s["V"], dtype=dtype, device=device)
            shape = (N, s["HV"], s["K"], s["V"]) if layout == "v_last" else (N, s["HV"], s["V"], s["K"])
            h0 = torch.randn(shape, device=device) * 0.5
            o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                           cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout=layout)
            ro, rht = _ref(x, h0, cu, layout)
            name = f"varlen GVA {layout} {str(dtype)[6:]}"
            out += [Result("chunk", name + " o", rel_err(o, ro), TOL[dtype]),
                    Result("chunk", name + " state", rel_err(ht, rht), TOL[dtype])]
    return out


@register
def chunk_batched_no_l2(device):
    """Batched input without the L2 norm against float64: fp32, and on a GPU also bf16 at B = 1 and B = 8 (on Hopper
    the fused kernel at V tile 32 with P from the prepare, and the register-state kernel past one wave of it)."""
    s = _shapes(device)
    out = []
    for B, dtype in ((2, torch.float32), (8, torch.bfloat16), (1, torch.bfloat16))[:3 if device.type == "cuda" else 1]:
        T = s["lens"][-1] if device.type == "cuda" else 70
        x = make_inputs(B, T, s["H"], s["HV"], s["K"], s["V"], dtype=dtype, device=device, normalize_qk=True)
        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, output_final_state=True)
        ro, rht = _ref(x, l2=False)
        name = f"batched {str(dtype)[6:]} no-l2" + ("" if dtype == torch.float32 else f" B={B}")
        out += [Result("chunk", name + " o", rel_err(o, ro), TOL[dtype]),
                Result("chunk", name + " state", rel_err(ht, rht), TOL[dtype])]
    return out


@register
def chunk_pool(device):
    s = _shapes(device)
    lens = s["lens"]
    N = len(lens)
    cu = _cu(lens, device)
    T = int(cu[-1])
    P = N + 3
    out = []
    for pool_dtype in (torch.float32, torch.bfloat16):
        x = make_inputs(1, T, s["H"], s["HV"], s["K"], s["V"], dtype=torch.bfloat16, device=device)
        pool = (torch.randn(P, s["HV"], s["V"], s["K"], device=device) * 0.5).to(pool_dtype)
        before = pool.clone()
        idx = torch.randperm(P, device=device)[:N].to(torch.int32)
        idx[1] = -1
        o, fin = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, state_layout="k_last",
                                        ssm_state_indices=idx)
        live = [n for n in range(N) if int(idx[n]) >= 0]
        h0 = torch.zeros((N,) + tuple(pool.shape[1:]), device=device)
        h0[live] = before[idx[live].long()].float()
        ro, rht = _ref(x, h0, cu, "k_last")
        spans = sequence_spans(1, T, cu.cpu())
        pad_zero = all(bool((o[0, a:b] == 0).all()) for n, (_, a, b) in enumerate(spans) if int(idx[n]) < 0)
        for n, (_, a, b) in enumerate(spans):
            if int(idx[n]) < 0:
                ro[0, a:b] = 0
        touched = {int(r) for r in idx.tolist() if r >= 0}
        untouched = [r for r in range(P) if r not in touched]
        same = torch.equal(pool[untouched], before[untouched]) and fin is pool
        name = f"pool k_last {str(pool_dtype)[6:]}"
        out += [Result("chunk", name + " o", rel_err(o, ro), TOL[torch.bfloat16]),
                Result("chunk", name + " state", rel_err(pool[idx[live].long()].float(), rht[live]),
                       TOL[torch.bfloat16]),
                Result("chunk", name + " padding/untouched", 0.0 if pad_zero and same else float("inf"), 0.0)]
    return out


@register
def chunk_strided_qkv(device):
    s = _shapes(device)
    B, T, H, HV, K, V = 2, 130, s["H"], s["HV"], s["K"], s["V"]
    x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=device)
    packed = torch.cat([x.q.flatten(2), x.k.flatten(2), x.v.flatten(2)], dim=-1)
    q = packed[..., :H * K].unflatten(-1, (H, K))
    k = packed[..., H * K:2 * H * K].unflatten(-1, (H, K))
    v = packed[..., 2 * H * K:].unflatten(-1, (HV, V))
    o, ht = chunk_gated_delta_rule(q, k, v, x.g, x.beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ro, rht = _ref(x)
    return [Result("chunk", "packed q/k/v views o", rel_err(o, ro), TOL[torch.bfloat16]),
            Result("chunk", "packed q/k/v views state", rel_err(ht, rht), TOL[torch.bfloat16])]


@register
def chunk_long_segmented(device):
    """One long sequence: the segmented state pass (forced, and the heuristic on GPUs) and the plain pass."""
    from ..kernels.tuning import override

    s = _shapes(device)
    H, HV = s["long_heads"]
    T = s["long"]
    x = make_inputs(1, T, H, HV, s["K"], s["V"], dtype=torch.bfloat16, device=device)
    h0 = torch.randn(1, HV, s["K"], s["V"], device=device) * 0.5
    ro, rht = _ref(x, h0)
    out = []
    for name, seg in (("heuristic", 0), ("forced segments", 8 if device.type == "cuda" else 2), ("unsegmented", -1)):
        with override("chunk_fwd", segment_chunks=seg):
            o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
        out += [Result("chunk", f"long T={T} {name} o", rel_err(o, ro), TOL[torch.bfloat16]),
                Result("chunk", f"long T={T} {name} state", rel_err(ht, rht), TOL[torch.bfloat16])]
    return out


@register
def chunk_sm90_vs_portable(device):
    """Hopper only: the Gluon state pass (gdn.kernels.chunk.hopper) and the fused state + output kernel storing h /
    v_new (``chunk_fwd.state_sm90_fused_states``) against the portable Triton pass on the same inputs (h per chunk,
    v_new, o, final state; pools with a padding row, k_last, varlen, segments), and the fused kernel without h / v_new
    (V tiles 128, with P formed in the kernel and read from the prepare, 64, 32 and 16: o and the final states)
    against the same portable run."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    from ..kernels.chunk import chunk_gated_delta_rule_fwd
    from ..kernels.tuning import override
    from .chunk_backward import _counting_sm90_launches

    s = _shapes(device)
    out = []
    cu = _cu(s["lens"], device)
    N, T = len(s["lens"]), int(cu[-1])
    for layout, seg in (("v_last", -1), ("k_last", -1), ("v_last", 4)):
        x = make_inputs(1, T, s["H"], s["HV"], s["K"], s["V"], dtype=torch.bfloat16, device=device)
        shape = (N + 2, s["HV"], s["K"], s["V"]) if layout == "v_last" else (N + 2, s["HV"], s["V"], s["K"])
        pools, res = [], []
        pool0 = torch.randn(shape, device=device) * 0.5
        idx = torch.randperm(N + 2, device=device)[:N].to(torch.int32)
        idx[2] = -1
        # portable; the Gluon state pass + output kernel; the fused kernel storing h / v_new too
        modes = (("portable", False, False), ("sm90", True, False), ("sm90 fused with states", True, True))
        for mode, sm90, fused in modes:
            pool = pool0.clone()
            # the Hopper pass forced at V tile 64 (the automatic tile leaves grids larger than a wave to the portable pass)
            with override("chunk_fwd", state_sm90=sm90, state_sm90_BV=64, segment_chunks=seg,
                          state_sm90_fused_states=fused), \
                    _counting_sm90_launches("gdn.kernels.chunk.hopper", "launch_fused_pass") as calls:
                o, _, aux = chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, s["K"] ** -0.5, pool, True, cu,
                                                       use_qk_l2norm_in_kernel=True, state_layout=layout,
                                                       state_indices=idx, final_state=pool)
            ran = (calls[0] > 0) == fused
            if seg < 0:     # (forced segments may keep the state pass: fused_output_plan)
                out.append(Result("chunk", f"{mode} {layout}: fused kernel {'as' if ran else 'NOT as'} asked",
                                  0.0 if ran else float("inf"), 0.0))
            pools.append(pool)
            res.append((o, aux["h"], aux["v_new"]))
        for (mode, _, _), r, p in zip(modes[1:], res[1:], pools[1:]):
            name = f"{mode} vs portable {layout} seg={seg}"
            out += [Result("chunk", name + " h", rel_err(r[1], res[0][1]), 4e-3),
                    Result("chunk", name + " v_new", rel_err(r[2], res[0][2]), 4e-3),
                    Result("chunk", name + " o", rel_err(r[0], res[0][0]), 4e-3),
                    Result("chunk", name + " final state", rel_err(p, pools[0]), 4e-3)]
        # 128: the register-state kernel (hopper._chunk_fused_t_sm90_kernel), with P formed in its P partition and
        # ("P read") from the prepare kernel, unsegmented and as a segmented run's final pass
        for bv, p_in in ((128, True), (128, False), (64, True), (32, True), (16, True)):
            pool = pool0.clone()
            with override("chunk_fwd", state_sm90_BV=bv, segment_chunks=seg, state_sm90_t_p_in_kernel=p_in):
                o, _, aux = chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, s["K"] ** -0.5, pool, True, cu,
                                                       use_qk_l2norm_in_kernel=True, state_layout=layout,
                                                       state_indices=idx, final_state=pool, return_states=False)
            name = f"sm90 fused BV {bv}{'' if p_in else ' P read'} vs portable {layout} seg={seg}"
            out += [Result("chunk", name + " (no h in memory)", 0.0 if aux["h"] is None else float("inf"), 0.0),
                    Result("chunk", name + " o", rel_err(o, res[0][0]), 4e-3),
                    Result("chunk", name + " final state", rel_err(pool, pools[0]), 4e-3)]
    return out


def _packed_vs_own_buffers(device, cases, tune, record, expected, label, tol=0.0):
    """Shared body of the checks of intermediates packed into o's rows: for every case (layout, l2, B, x), the
    inference forward (ragged varlen over a pool with a padding row for B = 1, else B sequences of 200 tokens; GVA;
    without the L2 norm one key of norm 300 in every chunk, so that the fp16 solve's overflow redo runs) with the
    packing off and on (``tune(x, packed)``: the chunk_fwd fields), the sm_90 prepare's launches recorded
    (``record(args, kwargs)``); rows: the launches as ``expected(x)`` says ((off, on) record lists), o and the final
    states bitwise equal (the same arithmetic on the same values), or with ``tol`` > 0 within that relative error (a
    change of rounding)."""
    from ..kernels.chunk import chunk_gated_delta_rule_fwd
    from ..kernels.chunk import prepare
    from ..kernels.tuning import override

    s = _shapes(device)
    H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
    real = prepare.hopper_prepare.launch_prepare
    seen = []

    def spy(*a, **kw):
        seen.append(record(a, kw))
        return real(*a, **kw)

    out = []
    cu = _cu(s["lens"], device)
    N, T = len(s["lens"]), int(cu[-1])
    for layout, l2, B, x_ in cases:
        Tb = T if B == 1 else 200
        x = make_inputs(B, Tb, H, HV, K, V, dtype=torch.bfloat16, device=device)
        if not l2:
            x.k[:, ::64, :, 0] = 300.0      # fp16 products overflow in every chunk: the redo path
        n = N if B == 1 else B
        shape = (n + 2, HV, K, V) if layout == "v_last" else (n + 2, HV, V, K)
        pool0 = torch.randn(shape, device=device) * 0.5
        idx = torch.randperm(n + 2, device=device)[:n].to(torch.int32)
        idx[n // 2] = -1
        res = []
        for packed in (False, True):
            pool = pool0.clone()
            seen.clear()
            prepare.hopper_prepare.launch_prepare = spy
            try:
                with override("chunk_fwd", **tune(x_, packed)):
                    o, _, _ = chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, pool, True,
                                                         cu if B == 1 else None, use_qk_l2norm_in_kernel=l2,
                                                         state_layout=layout, state_indices=idx, final_state=pool,
                                                         return_states=False)
            finally:
                prepare.hopper_prepare.launch_prepare = real
            res.append((o, pool, list(seen)))
        name = f"{label(x_)}, {layout}, l2={l2}, B={B}"
        taken = (res[0][2], res[1][2]) == expected(x_)
        out.append(Result("chunk", f"{name}: packed {'as' if taken else 'NOT as'} asked",
                          0.0 if taken else float("inf"), 0.0))
        for what, i in (("o", 0), ("final states", 1)):
            if tol > 0:
                out.append(Result("chunk", f"{name} {what}", rel_err(res[1][i], res[0][i]), tol))
            else:
                out.append(Result("chunk", f"{name} {what} bitwise", 0.0 if torch.equal(res[1][i], res[0][i]) else
                                  max(rel_err(res[1][i], res[0][i]), 1e-30), 0.0))
    return out


@register
def chunk_sm90_packed(device):
    """Hopper only: the register-state forward (V tile 128) with Ainv and P written into the two halves of o's own
    rows (``chunk_fwd.state_sm90_fused_t_packed``) against the same call with them in buffers of their own: o and
    the final states bitwise equal (no Ainv / P left in o), and the packed launch taken (:func:`_packed_vs_own_buffers`:
    ragged varlen lengths 0, 1, 63, 64, 65, ... over a pool with a padding row, both layouts, GVA, with and without
    the L2 norm, the overflow redo writing into o's rows, a batched call); and a segmented run (segments of 4
    chunks: the Gluon segment pass reads the packed Ainv a launch before the final pass writes o over it)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    return _packed_vs_own_buffers(
        device, (("v_last", True, 1, -1), ("k_last", True, 1, -1), ("v_last", False, 1, -1), ("v_last", True, 3, -1),
                 ("k_last", True, 1, 4)),
        # (beta not folded into the packed Ainv: that changes its rounding; chunk_sm90_beta_in_ainv)
        lambda seg, packed: dict(state_sm90_BV=128, segment_chunks=seg, state_sm90_fused_t_packed=packed,
                                 state_sm90_beta_in_ainv=False),
        lambda a, kw: a[5].stride(2),       # launch_prepare(k, q, g, beta, g_cum, ainv, ...): Ainv's head pitch
        lambda seg: ([64], [2 * 64]),
        lambda seg: "sm90 BV 128 Ainv / P packed in o" + (f", seg={seg}" if seg > 0 else ""))


@register
def chunk_sm90_beta_in_ainv(device):
    """Hopper only: the register-state forward with beta folded into the packed Ainv (Ainv diag(beta), stored by the
    prepare and the overflow redo, read by the register-state kernel and the one-CTA segment pass:
    ``chunk_fwd.state_sm90_beta_in_ainv``) against the same call without the fold: the fold taken where asked, o
    and the final states within 1e-2 (Ainv diag(beta) is rounded to bf16 once, where the unfolded chain rounds Ainv
    and multiplies by beta in fp32); ragged varlen over a pool with a padding row, both layouts, GVA, with and
    without the L2 norm (the overflow redo), a batched call, segments of 4 chunks (:func:`_packed_vs_own_buffers`).
    The default path's error against float64 is the target-shape check's."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    return _packed_vs_own_buffers(
        device, (("v_last", True, 1, -1), ("k_last", False, 1, -1), ("v_last", True, 3, -1), ("k_last", True, 1, 4),
                 ("v_last", False, 1, 4)),
        lambda seg, on: dict(state_sm90_BV=128, segment_chunks=seg, state_sm90_fused_t_packed=True,
                             state_sm90_beta_in_ainv=on),
        lambda a, kw: bool(kw.get("beta_in_ainv")),
        lambda seg: ([False], [True]),
        lambda seg: "sm90 BV 128 beta folded into Ainv" + (f", seg={seg}" if seg > 0 else ""), tol=1e-2)


@register
def chunk_sm90_row_scalars(device):
    """Hopper only: the V tile 32 / 64 fused forward forming P itself in an inference call, with g_cum, r_k and the
    overflow flags packed into o's own rows (``chunk_fwd.state_sm90_row_scalars_in_o``) against the same call with
    them in buffers of their own: o and the final states bitwise equal (no scalar left in o), and the packed launch
    taken (the chain and the P partition read g_cum and r_k there; :func:`_packed_vs_own_buffers`: ragged varlen
    over a pool, both layouts, with and without the L2 norm, the overflow redo reading the flags and g_cum there, a
    batched call)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    V = _shapes(device)["V"]
    return _packed_vs_own_buffers(
        device, (("v_last", True, 1, 64), ("k_last", False, 1, 64), ("v_last", True, 3, 64), ("k_last", True, 1, 32),
                 ("v_last", False, 3, 32)),
        lambda bv, packed: dict(state_sm90_BV=bv, segment_chunks=-1, state_sm90_row_scalars_in_o=packed,
                                state_sm90_p_in_kernel_bv=bv),
        lambda a, kw: kw.get("row_scalars"),
        lambda bv: ([None], [(V // 2, bv // 2, V // bv)]),
        lambda bv: f"sm90 BV {bv} row scalars in o")


def _one_launch_rows(name, res, launch, ref):
    """Rows of an A/B of one launch: ``res`` = [(o, final state, launches counted)] without, then with it; that it
    ran once with and never without, and o and the final state against the run without it (``ref``)."""
    ran = res[1][2] == 1 and res[0][2] == 0
    return [Result("chunk", f"{name}: {launch} {'as' if ran else 'NOT as'} asked", 0.0 if ran else float("inf"), 0.0),
            Result("chunk", f"{name} o vs {ref}", rel_err(res[1][0], res[0][0]), 4e-3),
            Result("chunk", f"{name} final state vs {ref}", rel_err(res[1][1], res[0][1]), 4e-3)]


@register
def chunk_sm90_segment_pass(device):
    """Hopper only: the segment pass of segmented runs (local states from zero and transitions, INIT 3) as the Gluon
    state pass against the portable one, on one ragged long sequence with an initial state, forced segments of 4 and
    16 chunks, v_new from Ainv (the fused forward's) and from stored W / U (``chunk_fwd.state_mode`` "wu"): o and the
    final state, and that the Gluon launch ran (its one-CTA-per-(value head, segment) form, the default in ainv mode,
    off). Then that form against it (that sequence and a ragged varlen batch, under three final passes)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    from ..kernels.chunk import chunk_gated_delta_rule_fwd
    from ..kernels.tuning import override
    from .chunk_backward import _counting_sm90_launches

    T, H, HV, K, V = 64 * 96 + 37, 2, 4, 128, 128
    x = make_inputs(1, T, H, HV, K, V, dtype=torch.bfloat16, device=device)
    h0 = torch.randn(1, HV, K, V, device=device) * 0.5
    out = []
    for mode in ("ainv", "wu"):
        for seg in (4, 16):
            res = []
            for gluon in (False, True):
                with override("chunk_fwd", state_mode=mode, segment_chunks=seg, state_sm90_segment_pass=gluon,
                              state_sm90_segment_t=False), \
                        _counting_sm90_launches("gdn.kernels.chunk.hopper", "launch_state_pass",
                                                when=lambda kw: kw.get("INIT") == 3) as calls:
                    o, ht, _ = chunk_gated_delta_rule_fwd(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, h0, True, None,
                                                          use_qk_l2norm_in_kernel=True, return_states=False)
                res.append((o, ht, calls[0]))
            out += _one_launch_rows(f"sm90 segment pass {mode} seg={seg}", res, "Gluon launch", "portable")
    # the one-CTA-per-(value head, segment) form (hopper_segments, chunk_fwd.state_sm90_segment_t): the sequence above
    # and a ragged varlen batch (a partial last chunk, sequences of one segment, a 1-token one), with its register-state
    # final pass reading Ainv packed into o's rows (V tile 128) and with the V tile 64 fused pass
    lens = [64 * 40 + 17, 1, 64 * 9, 63, 64 * 23 + 63]
    xv = make_inputs(1, sum(lens), H, HV, K, V, dtype=torch.bfloat16, device=device)
    cu = _cu(lens, device)
    h0v = torch.randn(len(lens), HV, K, V, device=device) * 0.5
    for label, y, hh, cuv in (("1 sequence", x, h0, None), ("varlen", xv, h0v, cu)):
        for seg, bv in ((4, 128), (16, 64), (8, 0)):
            res = []
            for new in (False, True):
                tune = dict(segment_chunks=seg, state_sm90_segment_t=new, **({"state_sm90_BV": bv} if bv else {}))
                with override("chunk_fwd", **tune), \
                        _counting_sm90_launches("gdn.kernels.chunk.hopper_segments", "launch_segment_pass_t") as calls:
                    o, ht, _ = chunk_gated_delta_rule_fwd(y.q, y.k, y.v, y.g, y.beta, K ** -0.5, hh, True, cuv,
                                                          use_qk_l2norm_in_kernel=True, return_states=False)
                res.append((o, ht, calls[0]))
            out += _one_launch_rows(f"sm90 segment pass, one CTA per (head, segment), {label} seg={seg} "
                                    f"final V tile {bv or 'planned'}", res, "launch", "the Gluon state pass")
    return out


@register
def chunk_sm90_target_shapes(device):
    """Hopper only: the five prefill target shapes and the TP2 shard 1x8192 8/16 (its fused pass at V tile 16)
    (bf16, K = V = 128, L2 norm, final state, varlen B = 1) on the default path (Gluon state pass) against the
    portable path on the whole sequence, and against float64 on a prefix of every sequence (causal: the first tokens'
    outputs do not depend on the rest)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return []
    from ..kernels.tuning import override

    out = []
    prefix = 256
    for N, L, H, HV in ((1, 8192, 16, 32), (1, 32768, 16, 32), (4, 4096, 16, 32), (1, 65536, 2, 8),
                        (1, 32768, 64, 64), (1, 8192, 8, 16)):
        T = N * L
        bf = dict(device=device, dtype=torch.bfloat16)
        x = GDNInputs(torch.randn(1, T, H, 128, **bf), torch.randn(1, T, H, 128, **bf), torch.randn(1, T, HV, 128, **bf),
                      -torch.rand(1, T, HV, device=device) * 0.5, torch.rand(1, T, HV, **bf), None, None, None, None)
        cu = torch.arange(0, N * L + 1, L, device=device, dtype=torch.int32)
        res = []
        for sm90 in (True, False):
            with override("chunk_fwd", state_sm90=sm90):
                res.append(chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu.cpu()))
        name = f"sm90 {N}x{L} {H}/{HV}"
        out += [Result("chunk", name + " o vs portable", rel_err(res[0][0], res[1][0]), 1e-2),
                Result("chunk", name + " state vs portable", rel_err(res[0][1], res[1][1]), 1e-2)]
        errs = []
        for n in range(N):
            sl = slice(n * L, n * L + prefix)
            ro, _ = _ref(dataclasses.replace(x, q=x.q[:, sl], k=x.k[:, sl], v=x.v[:, sl], g=x.g[:, sl],
                                             beta=x.beta[:, sl]))
            errs.append(rel_err(res[0][0][:, sl], ro))
        out.append(Result("chunk", name + f" o[:{prefix}] per sequence vs float64", max(errs), TOL[torch.bfloat16]))
    return out


@register
def chunk_pieces(device):
    """An inference forward in pieces (chunk_fwd.piece_token_heads: spans of one sequence carrying the state, groups
    of a batch's sequences) against the same call in one piece: one sequence and a batch, with an initial state, both
    layouts, the pieces counted (a row fails where the call did not split). On the GPU at sizes the default splits:
    1 x 32768 at 64/64 heads (the V tile 64 fused kernel, Ainv in a buffer of its own), and 2 x 16384 at 16/32 with
    ``state_sm90_fused_t_packed`` off in both runs (with it on, the register-state kernel keeps Ainv in o's rows and
    the call runs whole: nothing to halve); elsewhere small, with the piece size forced. The per-chunk state
    arithmetic is the same, so the final states are equal to rounding (tol 1e-6); o too where both runs take the
    same fused plan. A batch's pieces (one sequence each here) may be planned otherwise than the whole batch, and
    plans that form q's norms differently move a few of P's bf16 roundings, hence o's 1e-4 there (bitwise equal on
    the H200 in the forty-fifth session)."""
    from ..kernels.tuning import override
    from .chunk_backward import _counting_sm90_launches

    cuda = device.type == "cuda"
    forced = {} if cuda else dict(piece_token_heads=200, piece_max=3)
    cases = (((1, 32768, 64, 64, "v_last", {}), (2, 16384, 16, 32, "k_last", dict(state_sm90_fused_t_packed=False)))
             if cuda else ((1, 5 * 64 + 3, 1, 2, "v_last", {}), (3, 70, 1, 2, "k_last", {})))
    K, V = (128, 128) if cuda else (32, 16)
    out = []
    for B, T, H, HV, layout, fields in cases:
        x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=device)
        h0 = torch.randn((B, HV, K, V) if layout == "v_last" else (B, HV, V, K), device=device) * 0.5
        res, split = [], []
        for piece in (dict(piece_token_heads=0), forced):
            with override("chunk_fwd", **fields, **piece), torch.no_grad(), \
                    _counting_sm90_launches("gdn.kernels.chunk.forward", "_forward_in_pieces") as calls:
                res.append(chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True, state_layout=layout))
            split.append(calls[0])
        name = f"pieces {B}x{T} {H}/{HV} {layout}"
        ran = split == [0, 1]
        o_tol = 1e-4 if (cuda and B > 1) else 1e-6
        out += [Result("chunk", f"{name}: {'in pieces' if ran else 'NOT in pieces'} as asked",
                       0.0 if ran else float("inf"), 0.0),
                Result("chunk", name + " o vs one piece", rel_err(res[1][0], res[0][0]), o_tol),
                Result("chunk", name + " final state vs one piece", rel_err(res[1][1], res[0][1]), 1e-6)]
    return out


NAN_INPUTS = ("q", "k", "v", "g", "beta")


def nan_isolation_batches(device):
    """The varlen batches of the NaN-isolation checks (forward: ``chunk_nan_isolation``; backward:
    ``checks.chunk_backward.chunk_backward_nan_isolation``), as dicts: heads ``H`` / ``HV``, ``lens``, inputs ``x``,
    ``cu``, ``clean`` (the inputs by name, :data:`NAN_INPUTS`), the poisoned sequence 1's token span ``b0`` .. ``b1``
    (sharing partial chunks with both neighbours: a chunk's tile rows past a sequence's end hold the next sequence's
    tokens), ``others`` (a token mask of the other sequences) and ``keep`` (their indices). On the GPU 16/32 heads
    over four sequences (past one wave) and 4/8 over three (a few-head grid); elsewhere tiny shapes in fp32."""
    cuda = device.type == "cuda"
    configs = ([(16, 32, 128, 128, [4096 + 33, 70, 4095, 4000]), (4, 8, 128, 128, [1000, 70, 2000])] if cuda
               else [(1, 2, 32, 16, [70, 60, 5])])
    for H, HV, K, V, lens in configs:
        T = sum(lens)
        cu = _cu(lens, device)
        b0, b1 = int(cu[1]), int(cu[2])
        others = torch.ones(T, dtype=torch.bool, device=device)
        others[b0:b1] = False
        x = make_inputs(1, T, H, HV, K, V, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
        yield dict(H=H, HV=HV, lens=lens, cu=cu, b0=b0, b1=b1, others=others,
                   keep=[n for n in range(len(lens)) if n != 1], x=x, clean={n: getattr(x, n) for n in NAN_INPUTS})


def nan_poisoned(batch):
    """(input name, the batch's inputs as a dict with that one's first and last tokens of sequence 1 set to NaN), for
    each of q, k, v, g, beta in turn."""
    clean = batch["clean"]
    for name in NAN_INPUTS:
        bad = dict(clean)
        bad[name] = clean[name].clone()
        bad[name][:, [batch["b0"], batch["b1"] - 1]] = float("nan")
        yield name, bad


@register
def chunk_nan_isolation(device):
    """A non-finite input in one sequence of a varlen batch leaves the other sequences' outputs and final states
    bitwise as they were (a serving batch: one bad request must not poison its neighbours), NaN on the poisoned
    sequence's first and last tokens, one input at a time (:func:`nan_isolation_batches`). On the GPU the 16/32 batch
    runs three plans: the register-state kernel with P formed in it, again with P from the prepare kernel, and the V
    tile 64 fused kernel (P formed by its output partition); the 4/8 batch a few-head grid (the fused V tile 16 / 32
    kernel, segmented where the planner splits the longest sequence)."""
    from ..kernels.tuning import override

    out = []
    for b in nan_isolation_batches(device):
        h0 = torch.randn(len(b["lens"]), b["HV"], b["x"].k.shape[3], b["x"].v.shape[3], device=device) * 0.5
        others, keep = b["others"], b["keep"]
        tunings = ({}, {"state_sm90_t_p_in_kernel": False}, {"state_sm90_fused_t": False}) \
            if device.type == "cuda" and b["H"] == 16 else ({},)

        def run(inp):
            with torch.no_grad():
                return chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=h0,
                                              output_final_state=True, cu_seqlens=b["cu"],
                                              use_qk_l2norm_in_kernel=True)

        clean = b["clean"]
        for tune in tunings:
            label = "".join(f", {f}={v}" for f, v in tune.items())
            with override("chunk_fwd", **tune):
                o0, h1 = run(clean)
                for name, bad in nan_poisoned(b):
                    o, ht = run(bad)
                    err = max(rel_err(o[:, others], o0[:, others]), rel_err(ht[keep], h1[keep]))
                    out.append(Result("chunk", f"NaN {name} in one of {len(b['lens'])} seqs, {b['H']}/{b['HV']}"
                                               f"{label}: others unchanged", err, 0.0))
    return out


@register
def chunk_prepare_elementwise(device):
    """The prepare kernel's per-chunk outputs element by element (max error over max value) against float64, in every
    mode the library launches it (the forward's Ainv in the tensor-core dtype, with and without the output matrix P /
    qf; an fp32 Ainv; W / U recomputed from a stored Ainv), each launched twice and required bitwise equal: a few
    wrong elements (a miscompiled pipeline gave ~0.02% of Ainv off by 0.1 on the H200) vanish in a norm-wise error."""
    from ..kernels.chunk import chunk_fwd_prepare, recompute_w_u
    from ..kernels.tuning import override
    from .chunk_backward import _sm90_gluon_available

    s = _shapes(device)
    lens = [8192, 1000, 65, 64, 63, 1, 0] if device.type == "cuda" else [130, 1, 63, 0, 66]
    cu = _cu(lens, device)
    T, H, HV = int(cu[-1]), s["H"], s["HV"]
    x = make_inputs(1, T, H, HV, s["K"], s["V"], dtype=torch.bfloat16, device=device)
    scale = s["K"] ** -0.5
    ref = chunk_intra_ref(x.q, x.k, x.g, x.beta, scale, cu, True)
    out = []

    def twice(name, fn):
        a, b = fn(), fn()
        same = all((u is None and w is None) or torch.equal(u, w) for u, w in zip(a, b))
        out.append(Result("chunk", f"prepare {name}: two launches bitwise equal", 0.0 if same else float("inf"), 0.0))
        return a

    def compare(name, got, want, tol):
        out.append(Result("chunk", f"prepare {name} (max error / max)", max_rel_err(got, want), tol))

    def forward_prepare(y, with_p, rk=None):
        return chunk_fwd_prepare(y.k, y.v, y.g, y.beta, cu, 64, True, store_wu=False, ainv_dtype=y.k.dtype,
                                 q=y.q if with_p else None, scale=y.k.shape[-1] ** -0.5, rk=rk)

    def sm90_vs_portable(label, y, with_p):
        """the sm_90 (Gluon) prepare against the portable kernel on the same inputs, r_k included"""
        res, rks = [], []
        for sm90 in (False, True):
            rks.append(torch.full((1, T, y.k.shape[2]), float("nan"), device=device))
            with override("chunk_fwd", prepare_sm90=sm90):
                res.append(forward_prepare(y, with_p, rks[-1]))
        for name, i in (("g_cum", 0), ("Ainv", 1)) + ((("P", 4), ("qf", 5)) if with_p else ()):
            compare(f"{label} {name}: sm_90 vs portable", res[1][i], res[0][i], 1e-2 if name in ("Ainv", "P") else 1e-5)
        compare(f"{label} r_k: sm_90 vs portable", rks[1], rks[0], 1e-5)

    for with_p in (False, True):
        mode = "forward, P and qf" if with_p else "forward"
        r = twice(mode, lambda: forward_prepare(x, with_p))
        compare(mode + " g_cum", r[0], ref["g_cum"], 1e-5)
        compare(mode + " Ainv bf16", r[1], ref["ainv"], 1e-2)
        if with_p:
            compare(mode + " P", r[4], ref["p"], 1e-2)
            compare(mode + " qf", r[5], ref["qf"], 1e-5)
        if _sm90_gluon_available(device):
            sm90_vs_portable(mode, x, with_p)
    r32 = twice("fp32 Ainv", lambda: chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False))
    compare("fp32 Ainv", r32[1], ref["ainv"], 1e-4)
    # W = Ainv diag(beta exp(c) r_k) K and U = Ainv diag(beta) V per chunk, from the kernel's own bf16 Ainv
    ainv = r[1]
    w, u = twice("W / U recompute", lambda: recompute_w_u(x.k, x.v, x.beta, ainv, r[0], cu, 64, True))
    k64 = l2norm_ref(x.k[0].double()).repeat_interleave(HV // H, dim=1)
    fk = (x.beta[0].double() * ref["g_cum"][0].exp())[..., None] * k64                  # [T, HV, K]
    fv = x.beta[0].double()[..., None] * x.v[0].double()
    w_ref, u_ref = torch.zeros_like(fk), torch.zeros_like(fv)
    a64 = ainv[0].double()
    for _, s0, e0 in sequence_spans(1, T, cu):
        for c0 in range(s0, e0, 64):
            c1 = min(c0 + 64, e0)
            blk = a64[c0:c1, :, :c1 - c0].transpose(0, 1)                                  # [HV, L, L]
            w_ref[c0:c1] = (blk @ fk[c0:c1].transpose(0, 1)).transpose(0, 1)
            u_ref[c0:c1] = (blk @ fv[c0:c1].transpose(0, 1)).transpose(0, 1)
    compare("W recompute", w[0], w_ref, 1e-2)
    compare("U recompute", u[0], u_ref, 1e-2)
    if _sm90_gluon_available(device):
        def forward_w(y):
            """the training forward's prepare with W stored by the sm_90 kernel (chunk_bwd.w_from_forward)"""
            return chunk_fwd_prepare(y.k, y.v, y.g, y.beta, cu, 64, True, store_wu=False, ainv_dtype=y.k.dtype,
                                     q=y.q, scale=y.k.shape[-1] ** -0.5, keep_w=True)

        # its W against the float64 W of the same Ainv (the forward's, bitwise) and against the W recompute
        rw = twice("forward, P, qf and W (sm_90)", lambda: forward_w(x))
        same = torch.equal(rw[1], r[1])
        out.append(Result("chunk", "prepare forward W (sm_90): Ainv bitwise the forward's", 0.0 if same else float("inf"),
                          0.0))
        compare("forward W (sm_90)", rw[2][0], w_ref, 1e-2)
        compare("forward W (sm_90) vs W recompute", rw[2], w, 1e-2)
        # the sm_90 prepare's other builds: K = 64 (its solve scratch in tiles of its own), fp16, four value heads per
        # key head, no GVA
        for H2, HV2, K2, dt2 in ((2, 4, 64, torch.bfloat16), (2, 8, 128, torch.float16), (4, 4, 64, torch.float16)):
            y = make_inputs(1, T, H2, HV2, K2, K2, dtype=dt2, device=device)
            label = f"K={K2} {H2}/{HV2} {str(dt2)[6:]}"
            sm90_vs_portable(label, y, True)
            ry = forward_w(y)
            compare(f"{label} forward W (sm_90) vs W recompute", ry[2],
                    recompute_w_u(y.k, y.v, y.beta, ry[1], ry[0], cu, 64, True, store_u=False)[0], 1e-2)
        # the fp16 solve's overflow fallback (chunk_fwd.solve_sm90_f16): raw keys (no L2 norm) of norm ~0.3 but two
        # tokens per chunk (0 and 10) along one direction with norm 300, so A[10, 0] ~ 8e4 > fp16's 65504 in every
        # chunk: redone in tf32, Ainv (entries up to ~1e6) as the tf32 Gluon solve's and the portable kernel's
        y = make_inputs(1, T, H, HV, s["K"], s["V"], dtype=torch.bfloat16, device=device)
        kb = y.k.float() * 0.03
        u = torch.randn(s["K"], device=device)
        kb[0, 0::64] = kb[0, 10::64] = 300 * u / u.norm()
        y = dataclasses.replace(y, k=kb.to(torch.bfloat16), g=torch.zeros_like(y.g), beta=torch.full_like(y.beta, 0.9))
        res = []
        for sm90, f16 in ((False, False), (True, False), (True, True)):
            with override("chunk_fwd", prepare_sm90=sm90, solve_sm90_f16=f16):
                res.append(chunk_fwd_prepare(y.k, y.v, y.g, y.beta, cu, 64, False, store_wu=False,
                                             ainv_dtype=y.k.dtype)[1])
        out.append(Result("chunk", "prepare fp16 solve, overflowing chunks: Ainv finite",
                          0.0 if bool(torch.isfinite(res[2]).all()) else float("inf"), 0.0))
        compare("fp16 solve, overflowing chunks: Ainv vs the tf32 solve (sm_90)", res[2], res[1], 1e-2)
        compare("fp16 solve, overflowing chunks: Ainv vs portable", res[2], res[0], 1e-2)
    return out


@register
def chunk_sm90_fresh_thread(device):
    """Hopper: an sm_90 kernel launched as the first CUDA work of a new host thread (autograd's device thread runs a
    backward that way). Triton encodes a launch's TMA descriptors before its launcher makes a CUDA context current,
    so that first launch failed with "invalid device context" until ``gdn.kernels.launch.ensure_context``. The sm_90
    prepare on a varlen batch, once here (which also fills torch's allocation cache: the thread's allocations then
    make no CUDA call) and once on a new thread: no error, outputs bitwise equal."""
    import threading

    from ..kernels.chunk import chunk_fwd_prepare
    from ..kernels.chunk.plan import prepare_chunk_indices
    from .chunk_backward import _sm90_gluon_available

    if not _sm90_gluon_available(device):
        return []
    lens = [300, 64, 129]
    cu = _cu(lens, device)
    T = sum(lens)
    x = make_inputs(1, T, 16, 32, 128, 128, dtype=torch.bfloat16, device=device)
    ci = prepare_chunk_indices(cu, T, 64, 1, device=device)

    def run():
        return chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False, ainv_dtype=x.k.dtype,
                                 chunk_index=ci)

    first = run()
    want = [None if t is None else t.clone() for t in first]
    del first
    torch.cuda.synchronize(device)
    got, errors = [], []

    def body():
        try:
            got.append(run())
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            errors.append(e)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    torch.cuda.synchronize(device)
    if errors:
        return [Result("chunk", "sm_90 prepare as a new thread's first launch", float("inf"), 0.0,
                       f"{type(errors[0]).__name__}: {errors[0]}")]
    same = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got[0], want))
    return [Result("chunk", "sm_90 prepare as a new thread's first launch: bitwise equal",
                   0.0 if same else float("inf"), 0.0)]


@register
def chunk_host_plans(device):
    """Host plans of the public op planned whole (``gdn.ops.chunk._planned_call``: inference calls whose validation
    reads no device values): four calls with fresh inputs of one key (plain, recorded, two replays), each against
    the same call with plans off: o and the final state (or the pool, updated in place) bitwise equal, and the
    public plan replayed. A small varlen batch with ``cu_seqlens_cpu`` and a bf16 pool with padding rows and index
    checks skipped (``GDN_SKIP_VALUE_CHECKS``); on sm_90 also 1x8192 16/32, 1x8192 4/8 (segmented), 4x1024 16/32
    (the register-state path, Ainv / P packed into o) and 1x2048 64/64 (V tile 64 forming P, the per-token scalars
    in o's rows) in bf16."""
    import os

    from ..kernels import host_plan, launch
    from ..ops import chunk as chunk_mod
    from .chunk_backward import _sm90_gluon_available

    s = _shapes(device)
    small = dict(H=s["H"], HV=s["HV"], K=s["K"], V=s["V"])
    cases = [("varlen", small, s["lens"], torch.float32, False), ("pool k_last", small, s["lens"], torch.bfloat16, True)]
    if _sm90_gluon_available(device):
        big = dict(K=128, V=128)
        cases += [("1x8192 16/32", dict(big, H=16, HV=32), [8192], torch.bfloat16, False),
                  ("1x8192 4/8", dict(big, H=4, HV=8), [8192], torch.bfloat16, False),
                  ("4x1024 16/32", dict(big, H=16, HV=32), [1024] * 4, torch.bfloat16, False),
                  # the V tile 64 kernel forming P: g_cum, r_k and flags in o's rows through an fp32 view of o
                  ("1x2048 64/64", dict(big, H=64, HV=64), [2048], torch.bfloat16, False)]
    saved = launch.VERIFY, host_plan.ENABLED, host_plan.PLAN_CPU, os.environ.get("GDN_SKIP_VALUE_CHECKS")
    launch.VERIFY, host_plan.PLAN_CPU = False, device.type == "cpu"
    out = []
    try:
        for tag, sh, lens, dtype, pooled in cases:
            host_plan.clear()
            os.environ["GDN_SKIP_VALUE_CHECKS"] = "1" if pooled else "0"
            cu = _cu(lens, device)
            N, T = len(lens), int(cu[-1])
            layout = "k_last" if pooled else "v_last"
            sshape = (sh["HV"], sh["K"], sh["V"]) if layout == "v_last" else (sh["HV"], sh["V"], sh["K"])
            idx = None
            if pooled:   # one draw per case (on the CPU a host tensor's values are part of the key)
                idx = torch.randperm(N + 2, device=device)[:N].to(torch.int32)
                idx[1] = -1
            same = True
            for _ in range(4):
                x = make_inputs(1, T, sh["H"], sh["HV"], sh["K"], sh["V"], dtype=dtype, device=device)
                state = torch.randn(N + 2 if pooled else N, *sshape, device=device)
                if pooled:
                    state = state.to(torch.bfloat16)
                runs = []
                for on in (True, False):
                    host_plan.ENABLED = on
                    st = state.clone()
                    with torch.no_grad():
                        o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=st,
                                                       output_final_state=True, cu_seqlens=cu,
                                                       cu_seqlens_cpu=cu.cpu(), use_qk_l2norm_in_kernel=True,
                                                       state_layout=layout, ssm_state_indices=idx)
                    runs.append((o, ht, st))
                same = same and all(torch.equal(a, b) for a, b in zip(*runs))
            n = host_plan.stats(chunk_mod._planned_call())["plans"]
            why = host_plan.stats()["why"]
            out.append(Result("chunk", f"public host plan {tag}: replays bitwise equal to the Python path",
                              0.0 if same else float("inf"), 0.0))
            out.append(Result("chunk", f"public host plan {tag}: the whole call replayed ({n} plans"
                              f"{'' if n == 1 and not why else ', ' + str(why)})",
                              0.0 if n == 1 and not why else float("inf"), 0.0))
    finally:
        launch.VERIFY, host_plan.ENABLED, host_plan.PLAN_CPU = saved[:3]
        if saved[3] is None:
            os.environ.pop("GDN_SKIP_VALUE_CHECKS", None)
        else:
            os.environ["GDN_SKIP_VALUE_CHECKS"] = saved[3]
        host_plan.clear()
    return out
