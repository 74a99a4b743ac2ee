"""gdn check: gradients of the chunked op (gdn.kernels.chunk.backward) against float64 autograd of the reference.

Every gradient (q, k, v, g, beta, initial state) of ``chunk_gated_delta_rule_bwd`` -- the backward the op's autograd
Function calls -- is compared with torch autograd through ``chunk_gated_delta_rule_ref`` in float64: fixed-length
batch with GVA, L2 norm, initial state and final-state gradient; a ragged varlen batch (lengths 0, 1, 63, 65, ...);
bf16 and fp32; plus strong decay (g = -30) and, when the public op is differentiable, autograd through it in both
state layouts. CUDA: B=2, T=300, H=2, HV=4, K=V=128; CPU (interpreter): tiny shapes.
"""
from __future__ import annotations

import contextlib

import torch

from ..reference import chunk_gated_delta_rule_ref
from ..testing import make_inputs, rel_err
from . import Result, register

_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
_TOL = {torch.float32: 3e-3, torch.bfloat16: 3e-2}


def _shapes(device):
    if device.type == "cuda":
        return dict(B=2, T=300, H=2, HV=4, K=128, V=128, lens=[0, 1, 63, 65, 300, 129])
    return dict(B=1, T=70, H=1, HV=2, K=16, V=16, lens=[0, 1, 63, 65])


def _ref_grads(q, k, v, g, beta, scale, h0, cu, l2, do, dht, layout="v_last"):
    # float64 on the inputs' device (exact either way; on a GPU this keeps the check to seconds)
    xs = [None if x is None else x.detach().to(torch.float64).requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_gated_delta_rule_ref(*xs[:5], scale, xs[5], True, cu, l2, state_layout=layout)
    outs, grads = [o], [do.detach().to(torch.float64)]
    if dht is not None:
        outs.append(ht)
        grads.append(dht.detach().to(torch.float64))
    torch.autograd.backward(outs, grads)
    return [None if x is None else x.grad for x in xs]


def _rows(device, s, varlen, extra_lens=()):
    """(cu_seqlens, B, T, N) of the check batch: ``s["lens"]`` + ``extra_lens`` packed in one row (varlen), else
    ``s["B"]`` rows of ``s["T"]`` tokens."""
    if not varlen:
        return None, s["B"], s["T"], s["B"]
    lens = list(s["lens"]) + list(extra_lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return cu, 1, int(cu[-1]), len(lens)


def _case(device, dtype, *, varlen, l2=True, g_range=(-1.0, -0.01)):
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd

    s = _shapes(device)
    cu, B, T, N = _rows(device, s, varlen)
    H, HV, K, V = s["H"], s["HV"], s["K"], s["V"]
    x = make_inputs(B, T, H, HV, K, V, dtype=dtype, device=device, g_range=g_range)
    h0 = torch.randn(N, HV, K, V, device=device)
    dht = torch.randn(N, HV, K, V, device=device)
    do = torch.randn(B, T, HV, V, device=device).to(dtype)
    scale = K ** -0.5
    mine = chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, scale, h0, cu, 64, l2, do, dht)
    ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, scale, h0, cu, l2, do, dht)
    return mine, ref


def _results(tag, mine, ref, tol, note=""):
    out = []
    for name, a, r in zip(_NAMES, mine, ref):
        if r is None:
            continue
        out.append(Result("chunk_backward", f"{tag} {name}", rel_err(a, r), tol, note))
    return out


@register
def chunk_backward_batch(device):
    """Also with gates near 1 (g in [-0.02, -0.001]): with the default gates a chunk decays the carried state
    gradient below fp32 resolution, so only these cases test its carry across chunks."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        mine, ref = _case(device, dtype, varlen=False)
        out += _results(f"B={_shapes(device)['B']} GVA l2 {str(dtype)[6:]}", mine, ref, _TOL[dtype])
        mine, ref = _case(device, dtype, varlen=True, g_range=(-0.02, -0.001))
        out += _results(f"varlen gates near 1 {str(dtype)[6:]}", mine, ref, _TOL[dtype])
    return out


@register
def chunk_backward_varlen(device):
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        mine, ref = _case(device, dtype, varlen=True, l2=dtype == torch.float32)
        out += _results(f"varlen {str(dtype)[6:]}", mine, ref, _TOL[dtype])
    return out


@register
def chunk_backward_strong_decay(device):
    """g = -30: dg is ~exp(-30) small, so it is measured against the scale of dv instead of its own norm."""
    mine, ref = _case(device, torch.float32, varlen=False, g_range=(-30.0, -30.0))
    out = [r for r in _results("g=-30 fp32", mine, ref, _TOL[torch.float32]) if not r.case.endswith(" dg")]
    dg_err = (mine[3].detach().to(ref[3]) - ref[3]).norm().item() / ref[2].norm().item()
    out.append(Result("chunk_backward", "g=-30 fp32 dg (vs |dv|)", dg_err, 1e-5))
    return out


@register
def chunk_backward_public_op(device):
    """Autograd through gdn.ops.chunk_gated_delta_rule in both state layouts (skipped until it is differentiable)."""
    from ..ops import chunk_gated_delta_rule

    s = _shapes(device)
    out = []
    for layout in ("v_last", "k_last"):
        B, T, H, HV, K, V = s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"]
        x = make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, device=device)
        shp = (B, HV, K, V) if layout == "v_last" else (B, HV, V, K)
        h0 = torch.randn(shp, device=device)
        dht = torch.randn(shp, device=device)
        do = torch.randn(B, T, HV, V, device=device).to(torch.bfloat16)
        leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
        try:
            o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, state_layout=layout)
        except NotImplementedError:
            return []
        if o.grad_fn is None:
            return []
        torch.autograd.backward([o, ht], [do, dht])
        ref = _ref_grads(x.q, x.k, x.v, x.g, x.beta, K ** -0.5, h0, None, True, do, dht, layout=layout)
        out += _results(f"op {layout} bf16", [t.grad for t in leaves], ref, _TOL[torch.bfloat16])
    return out


def _sm90_gluon_available(device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    from ..kernels import _gluon_api

    return _gluon_api.AVAILABLE


@contextlib.contextmanager
def _counting_sm90_launches(module="hopper", name="launch_dh_pass", when=None):
    """Counts calls of an sm_90 launcher (default the reverse pass, ``hopper.launch_dh_pass``; the parts kernel is
    ``hopper_parts.launch_parts``; a dotted ``module`` is a full module path) in its block, only those whose keyword
    arguments satisfy ``when(kw)`` where given: yields a one-item list."""
    import importlib

    mod = importlib.import_module(module if "." in module else f"gdn.kernels.chunk.backward.{module}")
    calls = [0]
    real = getattr(mod, name)

    def counted(*a, **kw):
        calls[0] += when is None or bool(when(kw))
        return real(*a, **kw)
    setattr(mod, name, counted)
    try:
        yield calls
    finally:
        setattr(mod, name, real)


@register
def chunk_backward_reverse_sm90(device):
    """Hopper only: the Gluon reverse pass (gdn.kernels.chunk.backward.hopper) against the portable kernel on the same
    inputs: gs (gradient of every chunk's end state), dvn and dh0 of ``chunk_bwd_dh``; a ragged varlen batch with an
    end-state gradient and the L2 norm (gates near 1, and strong decay: g in [-8, -2], so e^(cL) underflows and
    e^(-c) would overflow), a batch without either, forced segments (the local, transition and final passes: INIT
    0 / 3 / 2), K = 64 with fp16 operands; GVA (HV = 2 H). The Gluon pass reading dv_local from its kernel, and,
    unsegmented, computing it itself, also at V tile 128 (K = 128), there also forming W from Ainv. Also that the
    Gluon kernel did run in every case (and did not with it switched off)."""
    if not _sm90_gluon_available(device):
        return []
    from ..kernels.chunk.backward.reverse import chunk_bwd_dh
    from ..kernels.chunk.prepare import chunk_fwd_prepare
    from ..kernels.tuning import override

    s = _shapes(device)
    H, HV, V = s["H"], s["HV"], s["V"]
    out = []
    near1 = (-0.002, -0.0005)
    for name, varlen, l2, with_dht, seg, K, dt, g_range in (
            ("varlen dht l2", True, True, True, -1, s["K"], torch.bfloat16, near1),
            ("varlen dht l2 strong decay", True, True, True, -1, s["K"], torch.bfloat16, (-8.0, -2.0)),
            ("batch", False, False, False, -1, s["K"], torch.bfloat16, near1),
            ("varlen segments", True, True, True, 2, s["K"], torch.bfloat16, near1),
            ("K=64 fp16 varlen dht", True, True, True, -1, 64, torch.float16, near1)):
        cu, B, T, N = _rows(device, s, varlen, (64,))
        # gates near 1 (g ~ -1e-3): the end-state gradient is carried across every chunk (with the default gates a
        # chunk decays it by ~e^-30, below fp32 resolution, and a wrong carry would go unseen)
        x = make_inputs(B, T, H, HV, K, V, dtype=dt, device=device, g_range=g_range)
        g_cum, ainv, w, _ = chunk_fwd_prepare(x.k, x.v, x.g, x.beta, cu, 64, l2, store_ainv=True, store_wu=True,
                                              ainv_dtype=dt)
        do = torch.randn(B, T, HV, V, device=device).to(dt)
        dht = torch.randn(N, HV, K, V, device=device) if with_dht else None
        res = []
        # portable; Gluon reading dv_local from its kernel; Gluon computing it (unsegmented plans only); and at V
        # tile 128 (two warpgroups; unsegmented, K = 128: forced here, chosen where only it fits one wave)
        modes = (("Gluon off", False, 0), ("Gluon", True, 10 ** 9), ("Gluon, dv_local in the kernel", True, 0))
        if seg < 0 and K == 128 and V % 128 == 0:
            modes += (("Gluon V tile 128", True, 0), ("Gluon V tile 128, W from Ainv", True, 0))
        for mode, sm90, local_min in modes:
            plan = (None, lambda programs, VC: 128) if "V tile 128" in mode else None
            w_ainv = "W from Ainv" in mode
            with override("chunk_bwd", dh_sm90=sm90, segment_chunks=seg, dh_sm90_local_min_heads=local_min), \
                    _counting_sm90_launches() as calls:
                res.append(chunk_bwd_dh(x.q, x.k, None if w_ainv else w, g_cum, do, dht, K ** -0.5, cu, 64, l2, True,
                                        plan=plan, ainv=ainv if w_ainv else None,
                                        beta=x.beta.contiguous() if w_ainv else None))
            ran = calls[0] >= (3 if seg > 0 else 1) if sm90 else calls[0] == 0
            out.append(Result("chunk_backward", f"sm90 reverse {name}: {mode} {'as asked' if ran else 'NOT as asked'}",
                              0.0 if ran else float("inf"), 0.0))
        for (mode, *_), r in zip(modes[1:], res[1:]):
            if seg > 0 and r is not res[1]:
                continue   # segmented plans read dv_local from its kernel in every mode
            for label, a, b in zip(("gs", "dvn", "dh0"), r, res[0]):
                out.append(Result("chunk_backward", f"sm90 reverse ({mode}) vs portable {name} {label}",
                                  rel_err(a, b), 5e-3))
    return out


@register
def chunk_backward_parts_sm90(device):
    """Hopper only: the Gluon parts kernel (gdn.kernels.chunk.backward.hopper_parts) against the portable parts A
    and B on the same inputs: every gradient of ``chunk_gated_delta_rule_bwd`` with ``chunk_bwd.parts_sm90`` on and
    off (nothing else differs); a ragged varlen batch (lengths 0, 1, 63, 65, 300, 129, 64) with initial state,
    end-state gradient and L2 norm, with gates near 1 and with the default gates; a batch with T = 300 (its last
    chunk's rows past T are the next batch row's) without the L2 norm; K = V = 64 in fp16; GVA (HV = 2 H); and HV = H
    (varlen with the L2 norm, the batch without). The Gluon kernel also does the q/k kernel's work (with GVA the last
    value head of a key head sums the group's slots; with HV = H dq, dk are finished from fp32, so not bitwise the
    portable path's). Also that the Gluon kernel ran (and not when switched off)."""
    if not _sm90_gluon_available(device):
        return []
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd
    from ..kernels.tuning import override

    s = _shapes(device)
    HV = s["HV"]
    out = []
    for name, varlen, l2, D, dt, g_range, mha in (
            ("varlen l2 gates near 1", True, True, 128, torch.bfloat16, (-0.02, -0.001), False),
            ("varlen l2", True, True, 128, torch.bfloat16, (-1.0, -0.01), False),
            ("batch T=300", False, False, 128, torch.bfloat16, (-0.1, -0.01), False),
            ("K=V=64 fp16 varlen l2", True, True, 64, torch.float16, (-0.1, -0.01), False),
            ("HV=H varlen l2", True, True, 128, torch.bfloat16, (-0.1, -0.01), True),
            ("HV=H batch T=300", False, False, 128, torch.bfloat16, (-0.1, -0.01), True)):
        H = HV if mha else s["H"]
        cu, B, T, N = _rows(device, s, varlen, (64,))
        x = make_inputs(B, T, H, HV, D, D, dtype=dt, device=device, g_range=g_range)
        h0 = torch.randn(N, HV, D, D, device=device)
        dht = torch.randn(N, HV, D, D, device=device)
        do = torch.randn(B, T, HV, D, device=device).to(dt)
        res = []
        for on in (True, False):   # Gluon first: its scratch (dq / dk per value head) cannot be the portable run's
            with override("chunk_bwd", parts_sm90=on), _counting_sm90_launches("hopper_parts", "launch_parts") as c:
                res.append(chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, D ** -0.5, h0, cu, 64, l2, do,
                                                      dht)[:5])
            ran = c[0] == (1 if on else 0)
            out.append(Result("chunk_backward", f"sm90 parts {name}: Gluon {'ran' if on else 'off'}",
                              0.0 if ran else float("inf"), 0.0))
        for label, a, b in zip(_NAMES, res[0], res[1]):
            out.append(Result("chunk_backward", f"sm90 parts vs portable {name} {label}", rel_err(a, b), 5e-3))
    return out


@register
def chunk_backward_packed_qkv(device):
    """Autograd through ``chunk_gated_delta_rule_packed`` (the layer's training call: q|k|v packed in one tensor,
    its gradient written as one tensor) against the public op on split views of the same tensor: the gradient of
    qkv, g and beta bitwise equal; GVA, L2 norm, a ragged varlen batch and a batch (fixed length); bf16. On sm_90
    also at 1x8192 16/32 (the target shapes' packing), and that the parts kernel wrote into the packed gradient
    itself (one sm_90 launch, no portable copy)."""
    from ..ops import chunk_gated_delta_rule
    from ..ops.chunk import chunk_gated_delta_rule_packed, split_packed_qkv

    s = _shapes(device)
    cases = [("varlen", True, s["H"], s["HV"], s["K"]), ("batch", False, s["H"], s["HV"], s["K"])]
    sm90 = _sm90_gluon_available(device)
    if sm90:
        cases.append(("1x8192 16/32", None, 16, 32, 128))
    out = []
    for name, varlen, H, HV, K in cases:
        if varlen is None:
            cu, B, T = torch.tensor([0, 8192], dtype=torch.int32, device=device), 1, 8192
        else:
            cu, B, T, _ = _rows(device, s, varlen)
        dims = (H, K, HV, K)
        qkv = (torch.randn(B, T, 2 * H * K + HV * K, device=device)).to(torch.bfloat16)
        g = -torch.rand(B, T, HV, device=device) * 0.1 - 0.01
        beta = torch.rand(B, T, HV, device=device).to(torch.bfloat16)
        do = torch.randn(B, T, HV, K, device=device).to(torch.bfloat16)
        grads = []
        for packed in (True, False):
            leaves = [t.detach().clone().requires_grad_() for t in (qkv, g, beta)]
            # the portable copy-back is chunk_bwd_main calling itself (the backward's own call is not counted: it
            # holds its own reference to the function)
            with _counting_sm90_launches("hopper_parts", "launch_parts") as calls, \
                    _counting_sm90_launches("parts", "chunk_bwd_main") as copies:
                if packed:
                    o = chunk_gated_delta_rule_packed(leaves[0], *dims, leaves[1], leaves[2], cu_seqlens=cu,
                                                      use_qk_l2norm_in_kernel=True)
                else:
                    o, _ = chunk_gated_delta_rule(*split_packed_qkv(leaves[0], *dims), leaves[1], leaves[2],
                                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
                o.backward(do)
            grads.append([t.grad for t in leaves])
            if packed and sm90:
                ok = calls[0] == 1 and copies[0] == 0
                out.append(Result("chunk_backward", f"packed qkv {name}: sm90 parts launches {calls[0]} (want 1), "
                                  f"copied back {copies[0]} (want 0)", 0.0 if ok else float("inf"), 0.0))
        for label, a, b in zip(("dqkv", "dg", "dbeta"), *grads):
            same = a is not None and b is not None and torch.equal(a, b)
            out.append(Result("chunk_backward", f"packed qkv {name} {label} bitwise equal to split views",
                              0.0 if same else float("inf"), 0.0))
    return out


@register
def chunk_backward_target_shapes(device):
    """Hopper only: the backward at the training target shapes (bf16, K = V = 128, L2 norm, varlen B = 1) on the
    default path against the portable reverse pass (``chunk_gated_delta_rule_bwd``, every gradient, random dO over
    the whole sequence; the portable pass segments these long sequences, the sm_90 one does not), and autograd
    through the public op against float64 on a prefix of every sequence with dO zero after it (then the prefix's
    gradients are those of the prefix alone), in bf16 (fp32: ``chunk_backward_fp32_long``), and with W from the
    forward's prepare against W recomputed; the default backward run twice is bitwise the same."""
    if not _sm90_gluon_available(device):
        return []
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd
    from ..kernels.tuning import override
    from ..ops import chunk_gated_delta_rule

    out = []
    prefix = 192
    scale = 128 ** -0.5
    # the last field: launches of the sm_90 reverse pass (one unsegmented where its grid fits one wave, or at V tile
    # 128 in a few waves for several sequences; three, one per pass of 8 one-wave segments, for few heads over a long
    # sequence: reverse.reverse_plan)
    for N, L, H, HV, launches9 in ((1, 8192, 16, 32, 1), (1, 32768, 16, 32, 1), (4, 4096, 16, 32, 1),
                                   (4, 4096, 16, 64, 1), (1, 65536, 2, 8, 3), (1, 32768, 64, 64, 1)):
        T = N * L
        # gates near 1 (g in [-0.02, -0.001]): gradients carried over hundreds of chunks, so the unsegmented sm_90
        # pass and the segmented portable one differ by rounding, not by nothing
        x = make_inputs(1, T, H, HV, 128, 128, dtype=torch.bfloat16, device=device, g_range=(-0.02, -0.001))
        cu = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)
        do = torch.randn(1, T, HV, 128, device=device).to(torch.bfloat16)
        tag = f"{N}x{L} {H}/{HV}"
        res = []
        for on in (True, False):
            with override("chunk_bwd", dh_sm90=on), _counting_sm90_launches() as calls:
                res.append(chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, scale, None, cu, 64, True, do,
                                                      None)[:5])
            want = launches9 if on else 0
            out.append(Result("chunk_backward", f"target {tag}: sm90 reverse pass launches {calls[0]} (want {want})",
                              0.0 if calls[0] == want else float("inf"), 0.0))
        out += [Result("chunk_backward", f"target {tag} {n} vs portable reverse", rel_err(a, b), 1e-2)
                for n, a, b in zip(_NAMES, res[0], res[1])]
        again = chunk_gated_delta_rule_bwd(x.q, x.k, x.v, x.g, x.beta, scale, None, cu, 64, True, do, None)[:5]
        same = all(torch.equal(a, b) for a, b in zip(res[0], again))
        out.append(Result("chunk_backward", f"target {tag}: two runs bitwise equal (deterministic)",
                          0.0 if same else float("inf"), 0.0))

        keep = torch.zeros(T, dtype=torch.bool, device=device)
        for n in range(N):
            keep[n * L:n * L + prefix] = True
        leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta)]
        o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu.cpu())
        o.backward(torch.where(keep[None, :, None, None], do, 0))
        errs = {n: 0.0 for n in _NAMES[:5]}
        for n in range(N):
            sl = slice(n * L, n * L + prefix)
            ref = _ref_grads(x.q[:, sl], x.k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl], scale, None, None,
                             True, do[:, sl], None)
            for name, a, r in zip(_NAMES, leaves, ref):
                errs[name] = max(errs[name], rel_err(a.grad[:, sl], r))
        out += [Result("chunk_backward", f"target {tag} {n}[:{prefix}] per sequence vs float64", e,
                       _TOL[torch.bfloat16]) for n, e in errs.items()]
        # the op's W from the forward's prepare (chunk_bwd.w_from_forward, where the reverse pass does not form W
        # itself) against the backward's own W recompute, every gradient over the whole sequences
        alt = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta)]
        with override("chunk_bwd", w_from_forward=False):
            o2, _ = chunk_gated_delta_rule(*alt, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu.cpu())
            o2.backward(torch.where(keep[None, :, None, None], do, 0))
        out += [Result("chunk_backward", f"target {tag} {n}: W from the forward vs recomputed", rel_err(a.grad, b.grad),
                       1e-2) for n, a, b in zip(_NAMES, leaves, alt)]
    return out


@register
def chunk_backward_fp32_long(device):
    """Hopper only: the backward at 1x8192 16/32 with fp32 inputs (the portable kernels: the sm_90 passes take
    16-bit operands) against float64 on a 192-token prefix (dO zero after it). Its own check because its fp32
    kernels take minutes to compile on a fresh machine (``chunk_backward_target_shapes`` is the bf16 / sm_90 one)."""
    if not _sm90_gluon_available(device):
        return []
    from ..kernels.chunk.backward import chunk_gated_delta_rule_bwd

    T, prefix, scale = 8192, 192, 128 ** -0.5
    x = make_inputs(1, T, 16, 32, 128, 128, dtype=torch.float32, device=device, g_range=(-0.02, -0.001))
    cu = torch.tensor([0, T], device=device, dtype=torch.int32)
    d32 = torch.randn(1, T, 32, 128, device=device)
    d32[:, prefix:] = 0
    x32 = [x.q, x.k, x.v, x.g, x.beta]
    got = chunk_gated_delta_rule_bwd(*x32, scale, None, cu, 64, True, d32, None)[:5]
    ref = _ref_grads(*[t[:, :prefix] for t in x32], scale, None, None, True, d32[:, :prefix], None)
    return [Result("chunk_backward", f"target 1x8192 16/32 fp32 {n}[:{prefix}] vs float64",
                   rel_err(a[:, :prefix], r), _TOL[torch.float32]) for n, a, r in zip(_NAMES, got, ref)]


@register
def chunk_backward_host_plans(device):
    """Host plans (:mod:`gdn.kernels.host_plan`): forward + backward through the public op called four times with
    fresh inputs of one shape (the first runs the Python path, the second is recorded, the last two replay), each
    call against the same call with plans off: outputs and every gradient bitwise equal, and the replays happened
    (a plan for the forward and one for the backward). With ``launch.VERIFY`` off for the check (it bypasses plans).
    Small varlen batch with an initial state, both layouts; on sm_90 also 1x8192 16/32 and 4/8 (segmented) bf16 with
    ``cu_seqlens_cpu`` (the Gluon kernels' descriptors rebuilt by the replay, the intermediates in the workspace)."""
    from ..kernels import host_plan, launch
    from ..ops import chunk_gated_delta_rule

    s = _shapes(device)
    cases = [("varlen v_last", s, True, "v_last", torch.float32), ("batch k_last", s, False, "k_last", torch.bfloat16)]
    if _sm90_gluon_available(device):
        cases.append(("1x8192 16/32", dict(H=16, HV=32, K=128, V=128, lens=[8192]), True, "v_last", torch.bfloat16))
        # TP4's segmented forward (segment pass, merge, fused pass): more intermediates sharing the workspace
        cases.append(("1x8192 4/8", dict(H=4, HV=8, K=128, V=128, lens=[8192]), True, "v_last", torch.bfloat16))
    saved = launch.VERIFY, host_plan.ENABLED, host_plan.PLAN_CPU
    launch.VERIFY, host_plan.PLAN_CPU = False, device.type == "cpu"
    out = []
    try:
        for tag, sh, varlen, layout, dtype in cases:
            host_plan.clear()
            cu, B, T, N = _rows(device, dict(sh, B=s["B"], T=s["T"]), varlen)
            H, HV, K, V = sh["H"], sh["HV"], sh["K"], sh["V"]
            cu_host = None if cu is None else cu.cpu()
            same = True
            for _ in range(4):
                x = make_inputs(B, T, H, HV, K, V, dtype=dtype, device=device)
                h0 = torch.randn(N, HV, K, V, device=device)
                if layout == "k_last":
                    h0 = h0.transpose(-1, -2).contiguous()
                do = torch.randn(B, T, HV, V, device=device).to(dtype)
                dht = torch.randn_like(h0)
                runs = []
                for on in (True, False):
                    host_plan.ENABLED = on
                    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta, h0)]
                    o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                                   cu_seqlens=cu, cu_seqlens_cpu=cu_host,
                                                   use_qk_l2norm_in_kernel=True, state_layout=layout)
                    runs.append([o, ht] + list(torch.autograd.grad((o, ht), leaves, (do, dht))))
                same = same and all(torch.equal(a, b) for a, b in zip(*runs))
            st = host_plan.stats()
            out.append(Result("chunk_backward", f"host plan {tag}: replays bitwise equal to the Python path",
                              0.0 if same else float("inf"), 0.0))
            ok = st["plans"] == 2 and not st["why"]
            out.append(Result("chunk_backward", f"host plan {tag}: forward and backward replayed "
                              f"({st['plans']} plans{'' if ok else ', ' + str(st['why'])})",
                              0.0 if ok else float("inf"), 0.0))
    finally:
        launch.VERIFY, host_plan.ENABLED, host_plan.PLAN_CPU = saved
        host_plan.clear()
    return out


@register
def chunk_backward_nan_isolation(device):
    """Training on packed sequences: a non-finite input in one sequence of a varlen batch leaves every gradient of the
    other sequences (q, k, v, g, beta on their tokens, their initial states) bitwise as it was (one bad sample must not
    poison the batch's other samples). Autograd through the public op with an initial state and a final-state
    gradient, on the batches of the forward's check (``checks.chunk.nan_isolation_batches``: the poisoned sequence
    shares partial chunks with both neighbours, NaN on its first and last tokens, one input at a time; on the GPU
    16/32 heads over four sequences, the sm_90 reverse pass and parts kernel where available, and 4/8 over three)."""
    from ..ops import chunk_gated_delta_rule
    from .chunk import NAN_INPUTS, nan_isolation_batches, nan_poisoned

    out = []
    for b in nan_isolation_batches(device):
        x, cu, others, keep = b["x"], b["cu"], b["others"], b["keep"]
        N, HV, K, V = len(b["lens"]), b["HV"], x.k.shape[3], x.v.shape[3]
        h0 = torch.randn(N, HV, K, V, device=device) * 0.5
        dht = torch.randn(N, HV, K, V, device=device)
        do = torch.randn(x.v.shape, device=device).to(x.v.dtype)

        def grads(inp):
            leaves = [inp[n].detach().clone().requires_grad_() for n in NAN_INPUTS] + [h0.clone().requires_grad_()]
            o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=cu.cpu())
            torch.autograd.backward([o, ht], [do, dht])
            return [t.grad for t in leaves]

        g0 = grads(b["clean"])
        for name, bad in nan_poisoned(b):
            g1 = grads(bad)
            err = max([rel_err(a[:, others], r[:, others]) for a, r in zip(g1[:5], g0[:5])]
                      + [rel_err(g1[5][keep], g0[5][keep])])
            out.append(Result("chunk_backward", f"NaN {name} in one of {N} seqs, {b['H']}/{HV}: others' gradients "
                                                "unchanged", err, 0.0))
    return out
