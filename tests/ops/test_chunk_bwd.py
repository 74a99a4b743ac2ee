"""Backward of the chunked gated delta rule (gdn.kernels.chunk.backward) against float64 autograd of the reference.

Three layers:
* the algebra of the backward (module docstring of gdn.kernels.chunk.backward) in plain float64 torch vs autograd (no kernels);
* the kernels fed with float64/fp32/bf16 forward intermediates computed here in torch (any chunk size, fp64
  gradcheck, bf16 numerics) -- independent of the forward kernels;
* the full ``chunk_gated_delta_rule_bwd`` (forward intermediates recomputed by gdn.kernels.chunk.forward, chunk 64) and,
  once it is wired, the public op through autograd.
"""
from __future__ import annotations

import pytest
import torch

from gdn.reference import chunk_gated_delta_rule_ref, l2norm_ref, sequence_spans
from gdn.testing import make_inputs, rel_err

TOL32 = 3e-3
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------
def _inputs(B, T, H, HV, K, V, *, dtype=torch.float32, N=None, h0=True, dht=True, g_range=(-1.0, -0.01)):
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, g_range=g_range)
    N = B if N is None else N
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    init = torch.randn(N, HV, K, V, dtype=sdt) if h0 else None
    dht_ = torch.randn(N, HV, K, V, dtype=sdt) if dht else None
    do = torch.randn(B, T, HV, V, dtype=dtype)
    return x, init, do, dht_


def _ref_grads(q, k, v, g, beta, scale, h0, cu, l2, do, dht, C=64):
    xs = [None if x is None else x.detach().to(torch.float64).requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_gated_delta_rule_ref(*xs[:5], scale, xs[5], dht is not None, cu, l2, chunk_size=C)
    outs, grads = [o], [do.to(torch.float64)]
    if dht is not None:
        outs.append(ht)
        grads.append(dht.to(torch.float64))
    torch.autograd.backward(outs, grads)
    return [None if x is None else x.grad for x in xs]


def _torch_intermediates(q, k, v, g, beta, h0, cu, C, l2, dtype=None):
    """Forward intermediates in float64 torch, in the layouts of gdn.kernels.chunk.forward:
    g_cum [B,T,HV], Ainv [B,T,HV,C], w [B,T,HV,K], h [NT,HV,K,V] (chunk start states), v_new [B,T,HV,V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    f = torch.float64
    kn = k.to(f)
    if l2:
        kn = l2norm_ref(kn)
    kn = kn.repeat_interleave(HV // H, 2)
    gcum = torch.zeros(B, T, HV, dtype=f)
    ainv = torch.zeros(B, T, HV, C, dtype=f)
    w = torch.zeros(B, T, HV, K, dtype=f)
    vn = torch.zeros(B, T, HV, V, dtype=f)
    hs = []
    for n, (bi, s, e) in enumerate(sequence_spans(B, T, cu)):
        S = h0[n].to(f) if h0 is not None else torch.zeros(HV, K, V, dtype=f)
        for c0 in range(s, e, C):
            c1 = min(c0 + C, e)
            L = c1 - c0
            kc = kn[bi, c0:c1].transpose(0, 1)
            vc = v[bi, c0:c1].to(f).transpose(0, 1)
            gc = g[bi, c0:c1].to(f).transpose(0, 1).cumsum(-1)
            bc = beta[bi, c0:c1].to(f).transpose(0, 1)
            mask = torch.ones(L, L, dtype=torch.bool).tril()
            gam = torch.where(mask, torch.exp(torch.where(mask, gc[:, :, None] - gc[:, None, :], 0.0)), 0.0)
            A = (bc[..., None] * gam * (kc @ kc.transpose(-1, -2))).tril(-1)
            Ai = torch.linalg.inv(torch.eye(L, dtype=f) + A)
            W = Ai @ (kc * (bc * gc.exp())[..., None])
            U = Ai @ (vc * bc[..., None])
            hs.append(S.clone())
            Vn = U - W @ S
            gl = gc[:, -1]
            S = S * gl.exp()[:, None, None] + (kc * (gl[:, None] - gc).exp()[..., None]).transpose(-1, -2) @ Vn
            gcum[bi, c0:c1] = gc.transpose(0, 1)
            ainv[bi, c0:c1, :, :L] = Ai.transpose(0, 1)
            w[bi, c0:c1] = W.transpose(0, 1)
            vn[bi, c0:c1] = Vn.transpose(0, 1)
    hs = torch.stack(hs) if hs else torch.zeros(0, HV, K, V, dtype=f)
    dt = dtype or q.dtype
    return dict(g_cum=gcum.to(torch.float64 if dt == f else torch.float32), ainv=ainv.to(dt), w=w.to(dt),
                h=hs.to(dt), v_new=vn.to(dt))


def _kernel_bwd(q, k, v, g, beta, scale, h0, cu, C, l2, do, dht, inter=None, segment_chunks=None):
    """The two backward kernels fed with torch intermediates (any chunk size, fp64 capable)."""
    from gdn.kernels.chunk import chunk_bwd_dh, chunk_bwd_main, prepare_chunk_indices

    it = inter or _torch_intermediates(q, k, v, g, beta, h0, cu, C, l2)
    B, T = q.shape[:2]
    tables = prepare_chunk_indices(cu, T, C, B, device=q.device)
    gs, dvn, dh0 = chunk_bwd_dh(q, k, it["w"], it["g_cum"], do, dht, scale, cu, C, l2, h0 is not None,
                                chunk_index=tables, segment_chunks=segment_chunks)
    dq, dk, dv, db, dg = chunk_bwd_main(q, k, v, it["g_cum"], beta, it["ainv"], it["v_new"], dvn, do, it["h"], gs,
                                        scale, cu, C, l2, g_dtype=g.dtype, chunk_index=tables)
    return dq, dk, dv, dg, db, dh0


def _full_bwd(q, k, v, g, beta, scale, h0, cu, l2, do, dht, segment_chunks=None):
    from gdn.kernels.chunk.backward import chunk_gated_delta_rule_bwd

    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, h0, cu, 64, l2, do, dht,
                                      segment_chunks=segment_chunks)


def _compare(mine, ref, tol, skip=()):
    msgs = []
    for name, a, r in zip(NAMES, mine, ref):
        if r is None:
            assert a is None, f"{name}: expected None"
            continue
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} vs {tuple(r.shape)}"
        if name in skip:
            continue
        e = rel_err(a, r)
        if not e < tol:
            msgs.append(f"{name}: rel_err {e:.3e} >= {tol}")
    assert not msgs, "; ".join(msgs)


# ----------------------------------------------------------------------------------------------------------------------
# 1. the algebra (float64 torch, no kernels)
# ----------------------------------------------------------------------------------------------------------------------
def _torch_bwd_math(q, k, v, g, beta, scale, h0, do, dht, C, l2):
    """The backward of the module docstring, term by term, one (batch, value head, chunk) at a time."""
    f = torch.float64
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    R = HV // H
    qn, kn = (l2norm_ref(q), l2norm_ref(k)) if l2 else (q, k)
    qe, ke = qn.repeat_interleave(R, 2), kn.repeat_interleave(R, 2)
    it = _torch_intermediates(q, k, v, g, beta, h0, None, C, l2, dtype=f)
    NT = -(-T // C)
    dq, dk = torch.zeros(B, T, HV, K, dtype=f), torch.zeros(B, T, HV, K, dtype=f)
    dv, dg, db = torch.zeros_like(v), torch.zeros_like(g), torch.zeros_like(beta)
    dh0 = torch.zeros_like(h0)
    for b in range(B):
        for hv in range(HV):
            Gm = dht[b, hv].clone()
            Gs, dVns = [None] * NT, [None] * NT
            for c in reversed(range(NT)):              # reverse pass
                sl = slice(c * C, min((c + 1) * C, T))
                n = sl.stop - sl.start
                gc = it["g_cum"][b, sl, hv]
                gl = gc[-1]
                Q, Kc, dO = qe[b, sl, hv] * scale, ke[b, sl, hv], do[b, sl, hv]
                m = torch.ones(n, n, dtype=torch.bool).tril()
                gamT = torch.where(m.T, torch.exp(torch.where(m.T, gc[None, :] - gc[:, None], 0.0)), 0.0)
                Gs[c] = Gm
                dVns[c] = ((Kc @ Q.T) * gamT) @ dO + (Kc * (gl - gc).exp()[:, None]) @ Gm
                Gm = Gm * gl.exp() + (Q * gc.exp()[:, None]).T @ dO - it["w"][b, sl, hv].T @ dVns[c]
            dh0[b, hv] = Gm
            for c in range(NT):                        # parallel part
                sl = slice(c * C, min((c + 1) * C, T))
                n = sl.stop - sl.start
                gc = it["g_cum"][b, sl, hv]
                gl = gc[-1]
                Q, Kc, Vc, dO, be = qe[b, sl, hv] * scale, ke[b, sl, hv], v[b, sl, hv], do[b, sl, hv], beta[b, sl, hv]
                Hc, Gc, Vn, dVn = it["h"][c + b * NT, hv], Gs[c], it["v_new"][b, sl, hv], dVns[c]
                Ai = it["ainv"][b, sl, hv, :n]
                m = torch.ones(n, n, dtype=torch.bool).tril()
                SL = torch.ones(n, n, dtype=torch.bool).tril(-1)
                gam = torch.where(m, torch.exp(torch.where(m, gc[:, None] - gc[None, :], 0.0)), 0.0)
                eg, egl = gc.exp(), (gl - gc).exp()
                dPm, dPmT = (dO @ Vn.T) * gam, (Vn @ dO.T) * gam.T
                P = dPm * (Q @ Kc.T) * SL
                dc = P.sum(1) - P.sum(0)
                dqh = eg[:, None] * (dO @ Hc.T)
                dc = dc + (Q * dqh).sum(1)
                dqh = dqh + dPm @ Kc
                dKs = egl[:, None] * (Vn @ Gc.T)
                kdks = (Kc * dKs).sum(1)
                dkh = dKs + dPmT @ Q
                dVb = Ai.T @ dVn
                dbe = (dVb * Vc).sum(1)
                dKb = -dVb @ Hc.T
                kdkb = (dKb * Kc).sum(1) * eg
                dbe, dc = dbe + kdkb, dc + kdkb * be
                dkh = dkh + (be * eg)[:, None] * dKb
                dA, dAT = -dVb @ Vn.T, -Vn @ (dVn.T @ Ai)
                KK = Kc @ Kc.T
                dAgk = dA * gam * KK * SL
                dbe = dbe + dAgk.sum(1)
                dAA = dAgk * be[:, None]
                dc = dc + dAA.sum(1) - dAA.sum(0)
                dkh = dkh + (dA * gam * be[:, None] * SL + dAT * gam.T * be[None, :] * SL.T) @ Kc
                dgt = dc.flip(0).cumsum(0).flip(0) + (kdks.cumsum(0) - kdks) + gl.exp() * (Hc * Gc).sum()
                dq[b, sl, hv], dk[b, sl, hv] = dqh * scale, dkh
                dv[b, sl, hv], db[b, sl, hv], dg[b, sl, hv] = be[:, None] * dVb, dbe, dgt
    dq, dk = dq.view(B, T, H, R, K).sum(3), dk.view(B, T, H, R, K).sum(3)
    if l2:
        def l2b(x, dy):
            y = l2norm_ref(x)
            return torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) * (dy - y * (y * dy).sum(-1, keepdim=True))
        dq, dk = l2b(q, dq), l2b(k, dk)
    return dq, dk, dv, dg, db, dh0


def test_math_prototype():
    """The derivation itself, exact to float64 rounding (partial last chunk, GVA 2, L2 norm, h0 and dht)."""
    x, h0, do, dht = _inputs(2, 37, 2, 4, 8, 6, dtype=torch.float64)
    scale = 0.7
    mine = _torch_bwd_math(x.q, x.k, x.v, x.g, x.beta, scale, h0, do, dht, 16, True)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, scale, h0, None, True, do, dht, C=16)
    _compare(mine, ref, 1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# 2. kernels fed with torch intermediates
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,HV,K,V,C,l2", [(2, 2, 16, 16, 16, False), (1, 4, 32, 16, 16, True),
                                           (2, 4, 16, 32, 32, True)])
def test_kernels_fp32(H, HV, K, V, C, l2):
    x, h0, do, dht = _inputs(2, 45, H, HV, K, V)
    scale = K ** -0.5
    mine = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, scale, h0, None, C, l2, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, scale, h0, None, l2, do, dht, C=C)
    _compare(mine, ref, TOL32)


@pytest.mark.parametrize("bv", ["32", "64"])
def test_kernels_v_tiles(monkeypatch, bv):
    """V = 80 and K = 24 (not powers of two): the parallel kernels loop over V tiles (the last one partial), the
    reverse pass runs several V blocks; every masked edge is exercised."""
    monkeypatch.setenv("GDN_TUNE", f"chunk_bwd.BV={bv},chunk_bwd.dh_BV={bv}")
    x, h0, do, dht = _inputs(1, 37, 1, 2, 24, 80)
    scale = 24 ** -0.5
    mine = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, scale, h0, None, 16, True, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, scale, h0, None, True, do, dht, C=16)
    _compare(mine, ref, TOL32)


def test_kernels_bf16():
    """bf16 inputs and bf16 intermediates (the training configuration): fla-like accuracy."""
    x, h0, do, dht = _inputs(2, 50, 2, 4, 32, 16, dtype=torch.bfloat16)
    mine = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, 0.2, h0, None, 16, True, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.2, h0, None, True, do, dht, C=16)
    for name, a, t in zip(NAMES[:5], mine[:5], (x.q, x.k, x.v, x.g, x.beta)):
        assert a.dtype == t.dtype, name
    _compare(mine, ref, 3e-2)


class _RefFwdKernelBwd(torch.autograd.Function):
    """Forward: float64 reference; backward: the kernels (fed with float64 intermediates)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, C, l2):
        ctx.save_for_backward(q, k, v, g, beta, h0)
        ctx.cfg = (scale, C, l2)
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, h0, True, None, l2, chunk_size=C)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, C, l2 = ctx.cfg
        dq, dk, dv, dg, db, dh0 = _kernel_bwd(q, k, v, g, beta, scale, h0, None, C, l2, do.contiguous(),
                                              dht.contiguous())
        return dq, dk, dv, dg, db, dh0, None, None, None


@pytest.mark.parametrize("l2", [False, True])
def test_gradcheck_fp64(l2):
    """torch.autograd.gradcheck (numerical differences of the float64 reference vs the kernels in fp64)."""
    x, h0, _, _ = _inputs(1, 21, 1, 2, 16, 16, dtype=torch.float64)
    args = [t.detach().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
    # fast mode: a few random projections of the Jacobian (one kernel backward each instead of one per output)
    assert torch.autograd.gradcheck(lambda *a: _RefFwdKernelBwd.apply(*a, 0.3, 16, l2), args, eps=1e-6,
                                    atol=1e-7, rtol=1e-5, fast_mode=True)


def test_kernels_strong_and_no_decay():
    """g = -30 (everything forgotten every token) stays finite with exact gate gradients; g = 0 (no decay)."""
    x, h0, do, dht = _inputs(1, 40, 2, 4, 16, 16, g_range=(-30.0, -30.0))
    mine = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, None, 16, True, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, None, True, do, dht, C=16)
    _compare(mine, ref, TOL32, skip=("dg",))
    # dg is ~1e-13 here (exp(-30) factors): compare on the scale of the other gradients
    assert (mine[3].double() - ref[3]).abs().max() < 1e-6 * ref[2].abs().max()
    x, h0, do, dht = _inputs(1, 40, 2, 4, 16, 16, g_range=(0.0, 0.0))
    mine = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, None, 16, True, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, None, True, do, dht, C=16)
    _compare(mine, ref, TOL32)


@pytest.mark.parametrize("dht,varlen", [(True, True), (False, False)])
def test_kernels_segmented_reverse_pass(dht, varlen):
    """The parallel-in-time reverse pass (segments of 2 chunks + K x K transitions + merge) equals the plain one;
    ragged varlen incl. an empty sequence and a sequence shorter than one segment."""
    if varlen:
        lens = [37, 0, 16, 70]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x, h0, do, dht_ = _inputs(1, int(cu[-1]), 1, 2, 16, 16, N=len(lens), dht=dht)
    else:
        cu = None
        x, h0, do, dht_ = _inputs(2, 75, 1, 2, 16, 16, dht=dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, True, do, dht_, C=16)
    it = _torch_intermediates(x.q, x.k, x.v, x.g, x.beta, h0, cu, 16, True)
    seg = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, 16, True, do, dht_, inter=it, segment_chunks=2)
    _compare(seg, ref, TOL32)
    plain = _kernel_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, 16, True, do, dht_, inter=it, segment_chunks=-1)
    _compare(plain, ref, TOL32)


# ----------------------------------------------------------------------------------------------------------------------
# 3. the full backward (forward intermediates from gdn.kernels.chunk.forward, chunk 64)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,HV,l2,h0,dht", [(2, 2, True, True, True), (2, 4, False, True, False),
                                            (1, 4, True, False, True), (2, 4, True, False, False)])
def test_full_bwd_fp32(H, HV, l2, h0, dht):
    K, V = 32, 16
    x, init, do, dht_ = _inputs(2, 100, H, HV, K, V, h0=h0, dht=dht)
    mine = _full_bwd(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, init, None, l2, do, dht_)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, init, None, l2, do, dht_)
    _compare(mine, ref, TOL32)
    for name, a, t in zip(NAMES, mine, (x.q, x.k, x.v, x.g, x.beta, init)):
        if t is not None:
            assert a.dtype == (torch.float32 if name == "dh0" else t.dtype), name


def test_full_bwd_varlen_ragged():
    """Sequence lengths 0, 1, chunk - 1, chunk + 1 and 2 chunks + 7 in one varlen batch, GVA 2."""
    lens = [0, 1, 63, 65, 135]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    x, h0, do, dht = _inputs(1, T, 1, 2, 16, 16, N=len(lens))
    mine = _full_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, True, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, True, do, dht)
    _compare(mine, ref, TOL32)
    # the empty sequence passes dht straight through to dh0
    torch.testing.assert_close(mine[5][0], dht[0], rtol=0, atol=0)


def test_full_bwd_strided_qkv():
    """q, k, v as views into one packed [B, T, 2*H*K + HV*V] tensor (no copies), do non-contiguous."""
    B, T, H, HV, K, V = 1, 70, 2, 4, 16, 16
    x, h0, do, dht = _inputs(B, T, H, HV, K, V)
    packed = torch.cat([x.q.flatten(2), x.k.flatten(2), x.v.flatten(2)], -1)
    q = packed[..., :H * K].view(B, T, H, K)
    k = packed[..., H * K:2 * H * K].view(B, T, H, K)
    v = packed[..., 2 * H * K:].view(B, T, HV, V)
    do_nc = torch.randn(B, T, V, HV).transpose(-1, -2)
    mine = _full_bwd(q, k, v, x.g, x.beta, 0.25, h0, None, False, do_nc, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, None, False, do_nc, dht)
    _compare(mine, ref, TOL32)


# ----------------------------------------------------------------------------------------------------------------------
# 4. the public op through autograd (once gdn.ops.chunk_gated_delta_rule is wired to the kernels)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,save_states", [("v_last", False), ("k_last", False), ("v_last", True)])
def test_public_op_autograd(monkeypatch, layout, save_states):
    """Gradients through the public op; with the tuning field chunk_fwd.bwd_save_states the backward takes the
    forward's h and v_new instead of recomputing them."""
    from gdn.ops import chunk_gated_delta_rule

    monkeypatch.setenv("GDN_TUNE", f"chunk_fwd.bwd_save_states={save_states}")

    B, T, H, HV, K, V = 2, 70, 1, 2, 16, 32
    x, h0, do, dht = _inputs(B, T, H, HV, K, V)
    if layout == "k_last":
        h0, dht = h0.transpose(-1, -2).contiguous(), dht.transpose(-1, -2).contiguous()
    leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
    o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, state_layout=layout)
    assert o.grad_fn is not None
    if save_states:  # the saved tensors include the forward's chunk states
        shapes = [tuple(t.shape) for t in o.grad_fn.saved_tensors if t is not None]
        NT = B * -(-T // 64)
        assert shapes.count((B, T, HV, V)) == 2 and (NT, HV, K, V) in shapes   # v and v_new; h per chunk
    torch.autograd.backward([o, ht], [do, dht])
    refs = [t.detach().double().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
    ro, rht = chunk_gated_delta_rule_ref(*refs[:5], initial_state=refs[5], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, state_layout=layout)
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    _compare([t.grad for t in leaves], [t.grad for t in refs], TOL32)


def test_reverse_pass_plan_sm90(monkeypatch):
    """The reverse pass's plan on an (emulated) sm_90 device with 132 SMs: the Gluon pass unsegmented where its
    grid fits one wave and segments do not pay (then the backward skips its side stream); one-wave Gluon segments
    for few heads over long sequences (reverse._reverse_segments); forced segments and the switch respected."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod
    from gdn.kernels.chunk.backward import reverse
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    dev = torch.device("cuda", 0)
    monkeypatch.setitem(tuning._CAPS, 0, "sm_90")
    monkeypatch.setattr(plan_mod, "_num_sms", lambda d: 132)
    monkeypatch.setattr(reverse.hopper, "supported", lambda *a: True)
    x = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)

    def plan(N, L, HV, **kw):
        ci = prepare_chunk_indices(None, L, 64, N, device=torch.device("cpu"))
        rplan = reverse.reverse_plan(x, x, x, x, torch.bfloat16, ci, HV, 128, 128, dev, **kw)
        seg, tile = rplan
        return seg, tile(ci.N * HV if seg is None else plan_mod.segment_count(ci, seg) * HV, 128), \
            reverse.runs_sm90(rplan, ci, HV, 128)

    assert plan(1, 32768, 32) == (None, 32, True)          # 128 CTAs at V tile 32
    assert plan(1, 8192, 8) == (None, 32, True)            # 32 CTAs, 128 chunks: segments do not pay (3 launches)
    assert plan(1, 8192, 16) == (None, 32, True)
    assert plan(1, 32768, 16) == (None, 32, True)          # 4 segments at tile 64: 500 steps against 461
    # few heads over long sequences: 8 segments, three sm_90 passes of 8 x 8 x 2 = 128 CTAs at V tile 64 (H200 2/8
    # reverse pass 0.61 ms against 0.86 in portable segments and 1.5 plain)
    assert plan(1, 65536, 8) == (128, 64, True)
    assert plan(1, 32768, 8) == (64, 64, True)
    # 512 / 256 CTAs at V tile 32 / 64: the whole V per CTA, 128 CTAs (two warpgroups, dv_local in the pass)
    assert plan(4, 4096, 32) == (None, 128, True)
    assert plan(8, 2048, 32) == (None, 128, True)          # two waves of 128 CTAs at V tile 128
    waves = int(tuning.chunk_bwd(dev).dh_sm90_bv128_waves)
    assert plan(132 * waves // 32 + 1, 256, 32) == (None, 0, False)    # past the waves allowed: portable
    with tuning.override("chunk_bwd", dh_sm90_bv128_waves=0):
        assert plan(4, 4096, 32) == (None, 0, False)
    assert plan(1, 8192, 32, segment_chunks=8)[0] == 8 and not plan(1, 8192, 32, segment_chunks=8)[2]
    with tuning.override("chunk_bwd", dh_sm90=False):
        seg, bv, sm90 = plan(1, 32768, 32)
        assert seg is not None and bv == 0 and not sm90
    with tuning.override("chunk_bwd", dh_sm90_segment_fixed_cost=1e9):
        assert plan(1, 65536, 8) == (None, 32, True)       # segments priced out: the plain sm_90 pass


@pytest.mark.parametrize("HV", [2, 4])
def test_parts_dispatch_sm90(monkeypatch, HV):
    """chunk_bwd_main's dispatch where the sm_90 parts kernel takes the launch (support emulated, launches
    recorded): the Gluon kernel gets the final dq / dk and no q/k kernel is launched (with GVA it sums a key head's
    value heads through slots of its own); the portable pair never runs."""
    from gdn.kernels.chunk.backward import parts

    calls, launched = [], []
    monkeypatch.setattr(parts.hopper_parts, "supported", lambda *a: True)
    monkeypatch.setattr(parts.hopper_parts, "launch_parts", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(parts, "launch", lambda kernel, grid, *a, **kw: launched.append(kernel))
    B, T, H, K = 1, 130, 2, 64
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.bfloat16)
    g_cum = torch.randn(B, T, HV)
    ainv = torch.randn(B, T, HV, 64).bfloat16()
    vn, dvn, do = (torch.randn(B, T, HV, K).bfloat16() for _ in range(3))
    h = torch.randn(3, HV, K, K).bfloat16()
    dq, dk, dv, dbeta, dg = parts.chunk_bwd_main(x.q, x.k, x.v, g_cum, x.beta, ainv, vn, dvn, do, h, h.clone(), 0.125,
                                                 None, 64, True)
    assert len(calls) == 1
    args, kw = calls[0]
    # the kernel's dq / dk arguments (14th and 15th) are the outputs themselves
    assert args[13] is dq and args[14] is dk
    assert launched == []
    assert dq.shape == (B, T, H, K) and dk.dtype == x.k.dtype and dv.shape == x.v.shape


@pytest.mark.parametrize("sm90", [False, True])
def test_parts_write_into_packed_gradient(monkeypatch, sm90):
    """chunk_bwd_main(out=) with views of one packed [B, T, 2 H K + HV V] gradient: where the sm_90 kernel takes
    the launch (emulated, recorded) it gets the views themselves; on the portable path the views are filled by a
    copy (poisoned first: every element written) with the values of the call without ``out``."""
    from gdn.kernels.chunk.backward import parts
    from gdn.ops.chunk import split_packed_qkv

    B, T, H, HV, K = 2, 70, 1, 2, 16
    x = make_inputs(B, T, H, HV, K, K, dtype=torch.float32)
    g_cum = -torch.rand(B, T, HV).cumsum(1) * 0.1
    ainv = torch.randn(B, T, HV, 64) * 0.1
    vn, dvn, do = (torch.randn(B, T, HV, K) for _ in range(3))
    h = torch.randn(B * 2, HV, K, K)
    args = (x.q, x.k, x.v, g_cum, x.beta, ainv, vn, dvn, do, h, h.clone(), 0.125, None, 64, True)
    packed = torch.full((B, T, 2 * H * K + HV * K), float("nan"))
    out = split_packed_qkv(packed, H, K, HV, K)
    if sm90:
        calls = []
        monkeypatch.setattr(parts.hopper_parts, "supported", lambda *a: True)
        monkeypatch.setattr(parts.hopper_parts, "launch_parts", lambda *a, **kw: calls.append(a))
        dq, dk, dv, _, _ = parts.chunk_bwd_main(*args, out=out)
        assert len(calls) == 1 and calls[0][13] is out[0] and calls[0][14] is out[1] and calls[0][15] is out[2]
        assert dq is out[0] and dv is out[2]
        return
    ref = parts.chunk_bwd_main(*args)
    got = parts.chunk_bwd_main(*args, out=out)
    assert not packed.isnan().any()
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert got[0].data_ptr() == packed.data_ptr()


def test_token_rows_ok():
    from gdn.kernels.chunk.backward.hopper_parts import _row_stride, token_rows_ok
    from gdn.ops.chunk import split_packed_qkv

    packed = torch.empty(3, 5, 2 * 2 * 16 + 4 * 16)
    q, k, v = split_packed_qkv(packed, 2, 16, 4, 16)
    assert all(token_rows_ok(t) for t in (q, k, v)) and _row_stride(v) == packed.shape[-1]
    assert _row_stride(split_packed_qkv(packed[:, :1], 2, 16, 4, 16)[0]) == packed.stride(0)
    assert not token_rows_ok(torch.empty(3, 5, 16, 2).transpose(-1, -2))        # heads not dense
    assert not token_rows_ok(torch.empty(3, 6, 2, 16)[:, :5])                   # rows not at one stride over the batch


@pytest.mark.parametrize("varlen", [False, True])
def test_packed_op_gradients_equal_split_views(varlen):
    """chunk_gated_delta_rule_packed: output and the gradients of qkv, g, beta equal (bitwise) the public op's on
    split views of the same tensor; GVA, L2 norm; ragged varlen (lengths 0, 1, 63, 65)."""
    from gdn.ops import chunk_gated_delta_rule
    from gdn.ops.chunk import chunk_gated_delta_rule_packed, split_packed_qkv

    H, HV, K, V = 1, 2, 16, 32
    if varlen:
        cu = torch.tensor([0, 0, 1, 64, 129], dtype=torch.int32)
        B, T = 1, 129
    else:
        cu, B, T = None, 2, 70
    qkv = torch.randn(B, T, 2 * H * K + HV * V)
    g = -torch.rand(B, T, HV) * 0.2
    beta = torch.rand(B, T, HV)
    do = torch.randn(B, T, HV, V)
    res = []
    for packed in (True, False):
        leaves = [t.clone().requires_grad_() for t in (qkv, g, beta)]
        if packed:
            o = chunk_gated_delta_rule_packed(leaves[0], H, K, HV, V, leaves[1], leaves[2], cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True)
        else:
            o, _ = chunk_gated_delta_rule(*split_packed_qkv(leaves[0], H, K, HV, V), leaves[1], leaves[2],
                                          cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        o.backward(do)
        res.append([o.detach()] + [t.grad for t in leaves])
    for a, b in zip(*res):
        assert torch.equal(a, b)
    refs = [t.double().requires_grad_() for t in (qkv, g, beta)]
    ro, _ = chunk_gated_delta_rule_ref(*split_packed_qkv(refs[0], H, K, HV, V), refs[1], refs[2], cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
    ro.backward(do.double())
    for a, r in zip(res[0][1:], refs):
        assert rel_err(a, r.grad) < TOL32


def test_packed_op_validation():
    from gdn.ops.chunk import chunk_gated_delta_rule_packed

    qkv = torch.randn(1, 8, 2 * 16 + 32)
    g, beta = torch.zeros(1, 8, 2) - 0.1, torch.rand(1, 8, 2)
    with pytest.raises(ValueError, match="qkv"):
        chunk_gated_delta_rule_packed(qkv, 1, 16, 2, 32, g, beta)
    with pytest.raises(TypeError, match="qkv"):
        chunk_gated_delta_rule_packed(qkv.long(), 1, 16, 2, 16, g, beta)
    with pytest.raises(ValueError, match="g"):
        chunk_gated_delta_rule_packed(qkv, 1, 16, 2, 16, g[:, :4], beta)


def _recorded_reverse_pass(monkeypatch, N, L, H, HV, K, plan=None):
    """chunk_bwd_dh over N sequences of L tokens on an emulated sm_90 device (132 SMs, Gluon support faked) with its
    launches recorded instead of run. ``plan``: a (segment length, tile function) pair, default ``reverse_plan``'s.
    Returns (plan, sm_90 pass keywords per launch, dv_local kernel calls, other kernels launched)."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod
    from gdn.kernels.chunk.backward import reverse
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    monkeypatch.setitem(tuning._CAPS, 0, "sm_90")
    monkeypatch.setattr(plan_mod, "_num_sms", lambda d: 132)
    monkeypatch.setattr(reverse.hopper, "supported", lambda *a: True)
    passes, dvl, others = [], [], []
    monkeypatch.setattr(reverse.hopper, "launch_dh_pass", lambda *a, **kw: passes.append(kw))
    monkeypatch.setattr(reverse, "dv_local", lambda *a, **kw: dvl.append(a))
    monkeypatch.setattr(reverse, "launch", lambda kernel, grid, *a, **kw: others.append(kernel))
    ci = prepare_chunk_indices(None, L, 64, N, device=torch.device("cpu"))
    if plan is None:
        x = torch.empty(1, 1, 1, K, dtype=torch.bfloat16)
        plan = reverse.reverse_plan(x, x, x, x, torch.bfloat16, ci, HV, K, K, torch.device("cuda", 0))
    assert reverse.runs_sm90(plan, ci, HV, K)
    q = torch.randn(N, L, H, K).bfloat16()
    w = torch.randn(N, L, HV, K).bfloat16()
    do = torch.randn(N, L, HV, K).bfloat16()
    g_cum = torch.randn(N, L, HV)
    reverse.chunk_bwd_dh(q, q, w, g_cum, do, None, 0.1, None, 64, True, False, chunk_index=ci, plan=plan)
    return plan, passes, dvl, others


@pytest.mark.parametrize("N, L, HV, local, bv", [(1, 8192, 32, True, 32), (1, 8192, 8, False, 32),
                                               (4, 4096, 32, True, 128)])
def test_dv_local_in_reverse_sm90(monkeypatch, N, L, HV, local, bv):
    """chunk_bwd_dh where the unsegmented sm_90 reverse pass runs (support and device emulated, launches recorded):
    with sequences x value heads >= ``chunk_bwd.dh_sm90_local_min_heads`` the Gluon pass computes dv_local itself
    (``local=True``) and the dv_local kernel is not launched; with fewer heads that kernel runs first and the pass
    reads its result. Four sequences x 32 value heads: one CTA per (sequence, value head) at V tile 128."""
    plan, passes, dvl, _ = _recorded_reverse_pass(monkeypatch, N, L, 4, HV, 128)
    assert plan[0] is None
    assert len(passes) == 1 and passes[0]["local"] is local and passes[0]["HAS_R"] and passes[0]["BV"] == bv
    assert len(dvl) == (0 if local else 1)


def test_reverse_pass_tile_128_needs_local():
    """The sm_90 reverse pass at V tile 128 exists only in the form that computes dv_local (its shared memory holds
    no dv_local ring): asked otherwise, ``launch_dh_pass`` raises before building anything."""
    from gdn.kernels.chunk.backward import hopper

    x = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="V tile 128"):
        hopper.launch_dh_pass((1, 2, 1), x, x, x, None, x, None, None, None, None, None, None, None, None, None,
                              0.1, 64, H=2, HV=2, K=128, V=128, BV=128, use_l2=False, INIT=0, HAS_R=True,
                              STORE_STEPS=True, STORE_END=False, END_BY_SEG=False, local=False)


def test_segmented_sm90_reverse_reads_dv_local_from_its_kernel(monkeypatch):
    """A segmented plan whose passes run on the sm_90 kernel (one-wave segments) never asks the Gluon pass for
    dv_local, even with sequences x value heads >= ``chunk_bwd.dh_sm90_local_min_heads``: the dv_local kernel runs
    first and the three passes (local, transitions, final) read it."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk.backward import reverse

    N, L, H, HV, K = 3, 1024, 2, 8, 128                  # 3 x 8 = 24 sequences x value heads, 16 chunks each
    assert N * HV >= int(tuning.chunk_bwd(torch.device("cpu")).dh_sm90_local_min_heads)
    # 6 segments of 8 chunks, every pass on the sm_90 kernel
    _, passes, dvl, others = _recorded_reverse_pass(monkeypatch, N, L, H, HV, K, plan=(8, lambda programs, VC: 64))
    assert len(dvl) == 1 and len(passes) == 3 and not any(p["local"] for p in passes)
    assert others == [reverse.chunk_bwd_dh_merge_kernel]


def test_w_from_ainv_in_reverse_sm90(monkeypatch):
    """chunk_bwd_dh with w=None (W formed in the pass from Ainv) on an emulated sm_90 device, launches recorded: at
    V tile 128 (4 x 4096 tokens, 32 value heads; ``reverse.w_in_pass`` says yes) the Gluon pass gets Ainv as its w
    operand with ``w_ainv`` and beta, and no dv_local kernel runs; where the plan is another tile (1 x 8192), w=None
    is refused with ValueError before anything is launched, and ``w_in_pass`` says no; switched off, no."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod
    from gdn.kernels.chunk.backward import reverse
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    monkeypatch.setitem(tuning._CAPS, 0, "sm_90")
    monkeypatch.setattr(plan_mod, "_num_sms", lambda d: 132)
    monkeypatch.setattr(reverse.hopper, "supported", lambda *a: True)
    passes, dvl, others = [], [], []
    monkeypatch.setattr(reverse.hopper, "launch_dh_pass", lambda *a, **kw: passes.append((a, kw)))
    monkeypatch.setattr(reverse, "dv_local", lambda *a, **kw: dvl.append(a))
    monkeypatch.setattr(reverse, "launch", lambda kernel, grid, *a, **kw: others.append(kernel))
    dev = torch.device("cuda", 0)
    H, HV, K = 4, 32, 128
    for N, L, ok in ((4, 4096, True), (1, 8192, False)):
        passes.clear()
        ci = prepare_chunk_indices(None, L, 64, N, device=torch.device("cpu"))
        x = torch.empty(1, 1, 1, K, dtype=torch.bfloat16)
        plan = reverse.reverse_plan(x, x, x, None, torch.bfloat16, ci, HV, K, K, dev)
        assert reverse.w_in_pass(plan, ci, HV, K, dev) is ok
        q = torch.randn(N, L, H, K).bfloat16()
        do = torch.randn(N, L, HV, K).bfloat16()
        ainv = torch.randn(N, L, HV, 64).bfloat16()
        beta = torch.rand(N, L, HV)
        g_cum = torch.randn(N, L, HV)
        call = lambda: reverse.chunk_bwd_dh(q, q, None, g_cum, do, None, 0.1, None, 64, True, False,   # noqa: E731
                                            chunk_index=ci, plan=plan, ainv=ainv, beta=beta)
        if ok:
            call()
            (args, kw), = passes
            assert args[3] is ainv and kw["w_ainv"] and kw["beta"] is beta and kw["BV"] == 128 and kw["local"]
            assert dvl == []
        else:
            with pytest.raises(ValueError, match="W from Ainv"):
                call()
            assert passes == []
        with tuning.override("chunk_bwd", dh_sm90_w_from_ainv=False):
            assert not reverse.w_in_pass(plan, ci, HV, K, dev)


def test_backward_takes_w_from_the_forward():
    """The backward given the forward's g_cum / Ainv and a W (as the sm_90 prepare stores it for training:
    ``chunk_bwd.w_from_forward``) reads that W instead of recomputing it: with the recompute's own W it is bitwise
    the backward that recomputes, and a W off by a factor moves the gradients (so the argument is used)."""
    from gdn.kernels.chunk import chunk_fwd_prepare, prepare_chunk_indices, recompute_w_u
    from gdn.kernels.chunk.backward import chunk_gated_delta_rule_bwd

    lens = [0, 1, 63, 65, 135]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    x, h0, do, dht = _inputs(1, T, 1, 2, 16, 16, N=len(lens))
    ci = prepare_chunk_indices(cu, T, 64, 1)
    g_cum, ainv, _, _ = chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, True, store_wu=False, chunk_index=ci)
    w = recompute_w_u(x.k, x.v, x.beta, ainv, g_cum, cu, 64, True, chunk_index=ci, store_u=False)[0]

    def bwd(**kw):
        return chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, 0.25, h0, cu, 64, True, do, dht, g_cum=g_cum,
                                          ainv=ainv, chunk_index=ci, **kw)

    base = bwd()
    for a, b in zip(bwd(w=w.clone()), base):
        assert torch.equal(a, b)
    moved = bwd(w=w * 1.5)
    assert any(not torch.allclose(a, b) for a, b in zip(moved, base))


def test_forward_w_dispatch_sm90(monkeypatch):
    """``wants_forward_w`` on an emulated sm_90 device (132 SMs): the training forward's prepare stores W where the
    reverse pass reads it (one sequence of 32 value heads: V tile 32), not where the pass forms W from Ainv itself
    (4 x 4096 tokens: V tile 128, ``reverse.w_in_pass``), nor with ``chunk_bwd.w_from_forward`` off, nor on CPU."""
    from gdn.kernels import tuning
    from gdn.kernels.chunk import plan as plan_mod
    from gdn.kernels.chunk.backward import reverse, wants_forward_w
    from gdn.kernels.chunk.plan import prepare_chunk_indices

    monkeypatch.setitem(tuning._CAPS, 0, "sm_90")
    monkeypatch.setattr(plan_mod, "_num_sms", lambda d: 132)
    monkeypatch.setattr(reverse.hopper, "supported", lambda *a: True)

    class Meta:   # shape, dtype and device of a CUDA tensor without one
        def __init__(self, *shape):
            self.shape, self.dtype, self.device = shape, torch.bfloat16, torch.device("cuda", 0)

    def wants(N, L, HV, H=16):
        ci = prepare_chunk_indices(None, L, 64, N, device=torch.device("cpu"))
        return wants_forward_w(Meta(N, L, H, 128), Meta(N, L, H, 128), Meta(N, L, HV, 128), ci)

    assert wants(1, 8192, 32) and wants(1, 32768, 64) and wants(1, 65536, 8, H=2)
    assert not wants(4, 4096, 32)
    with tuning.override("chunk_bwd", w_from_forward=False):
        assert not wants(1, 8192, 32)
    x = torch.empty(1, 64, 1, 16)
    assert not wants_forward_w(x, x, x, prepare_chunk_indices(None, 64, 64, 1))


def test_op_releases_forward_w_and_backward_twice(monkeypatch):
    """Where the training forward keeps W (on sm_90; emulated here by adding the recomputed W to the forward's aux),
    the op's backward takes it off ctx (so it can be freed before the last kernel): the gradients equal those of
    the backward that recomputes W, and a second backward through the retained graph (W gone: recomputed) gives
    the same gradients."""
    from gdn.kernels.chunk import forward as fwd_mod
    from gdn.kernels.chunk import recompute_w_u
    from gdn.ops import chunk_gated_delta_rule

    real = fwd_mod.chunk_gated_delta_rule_fwd
    kept = []

    def with_w(*a, **kw):
        o, ht, aux = real(*a, **kw)
        if kw.get("keep_w"):
            q, k, v, g, beta = a[:5]
            aux["w"] = recompute_w_u(k, v, beta, aux["ainv"], aux["g_cum"], a[8], a[9], a[10],
                                     chunk_index=aux["chunk_index"], store_u=False)[0]
            kept.append(aux["w"])
        return o, ht, aux

    lens = [1, 63, 65, 130]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    x, _, do, _ = _inputs(1, T, 1, 2, 16, 16, N=len(lens))
    grads = []
    for keep in (False, True):
        if keep:
            monkeypatch.setattr(fwd_mod, "chunk_gated_delta_rule_fwd", with_w)
        leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta)]
        o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        assert (getattr(o.grad_fn, "w", None) is not None) == keep      # held on ctx, not in saved_tensors
        first = torch.autograd.grad(o, leaves, do, retain_graph=True)
        if keep:
            assert len(kept) == 1 and not hasattr(o.grad_fn, "w")
            again = torch.autograd.grad(o, leaves, do)
            for a, b in zip(first, again):
                assert torch.equal(a, b)
        grads.append(first)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_backward_nan_isolation_check_passes():
    """``gdn check``'s backward NaN isolation case at its interpreter size: NaN in one packed sequence's q, k, v, g or
    beta leaves every gradient of the other sequences (their tokens' dq .. dbeta, their dh0) bitwise unchanged."""
    from gdn.checks.chunk_backward import chunk_backward_nan_isolation

    results = chunk_backward_nan_isolation(torch.device("cpu"))
    assert len(results) == 5
    bad = [(r.case, r.rel_err, r.tol) for r in results if not r.passed]
    assert not bad, bad
