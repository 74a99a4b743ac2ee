"""Compile every kernel configuration the ops launch for sm_90 (Hopper) with the installed Triton, without a GPU.

    python -m gdn.aot            # prints one line per compiled configuration, exits 1 on any compile error

The ops run on CPU tensors with Triton's real JIT (never the interpreter: this module re-runs itself without
``TRITON_INTERPRET``) under a stand-in driver whose target is ``cuda:90``; each launch is turned into a compile-only
warm-up (``JITFunction.run(..., warmup=True)``: the JIT's own specialisation of the arguments, the launcher's
num_warps / num_stages / maxnreg; nothing runs, outputs stay unwritten). The launchers' GPU-only choices (conv and
norm tiles, SM counts) see an H200 (:data:`_GPU_CHOICES`); segmented state passes are forced by their environment
switches in a second scenario. Scenarios: :func:`_scenarios` (production head sizes K = V = 128 with GVA, both state
layouts and dtypes, pools, varlen, the decode and recurrent configurations of every batch-size regime, fwd + bwd).
Identical signatures compile once (the JIT's cache; ``TRITON_CACHE_DIR`` keeps them across runs). The Gluon Hopper
builds are also checked for their warp-specialized register split (:func:`register_pool_problem`) and for shared
memory placed on tiles an unfinished asynchronous product reads (:func:`async_operand_problem`).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
import types

_ENV_SCENARIOS = [{}, {"GDN_TUNE": "chunk_fwd.segment_chunks=2,chunk_bwd.segment_chunks=8"}]
_FAKE_SMS = 132
# (module, function) of the launchers' device-dependent choices: called with a CUDA-like device here
_GPU_CHOICES = [("gdn.kernels.conv", "_block_d"), ("gdn.kernels.conv", "_block_t"), ("gdn.kernels.conv", "_num_sms"),
                ("gdn.kernels.norm", "_cfg")]


class _Sm90Driver:
    """The parts of Triton's driver the JIT asks for before compiling: device, stream, target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def __getattr__(self, name):
        raise AttributeError(f"gdn.aot: the stand-in sm_90 driver has no {name!r}")


def _install(records: list):
    import torch
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Sm90Driver())
    import gdn.kernels.launch as fast_launch

    fast_launch._ENABLED = False  # every launch through JITFunction.run (the recorder below); nothing really runs
    orig_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        key = (self.fn.__module__, self.fn.__name__, kwargs.get("num_warps"), kwargs.get("num_stages"))
        try:
            kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # a compile error: record it, let the op go on (later launches still compile)
            records.append((key, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            return None
        records.append((key, kernel, time.perf_counter() - t0))
        return kernel

    JITFunction.run = run
    fake = types.SimpleNamespace(type="cuda", index=0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=_FAKE_SMS)
    torch.cuda.current_device = lambda: 0
    import importlib
    import pkgutil

    import gdn.backend
    import gdn.ops

    # the ops take the Triton path for these CPU tensors (as for CUDA ones)
    gdn.backend.use_triton = lambda device: True
    for info in pkgutil.iter_modules(gdn.ops.__path__, "gdn.ops."):
        m = importlib.import_module(info.name)
        if hasattr(m, "use_triton"):
            m.use_triton = gdn.backend.use_triton
    for mod, name in _GPU_CHOICES:
        m = importlib.import_module(mod)
        fn = getattr(m, name)  # AttributeError: a launcher was renamed, update _GPU_CHOICES
        if getattr(fn, "__wrapped_gpu__", False):
            continue

        def gpu(*a, _fn=fn, **k):
            a = tuple(fake if isinstance(x, torch.device) else x for x in a)
            k = {n: fake if isinstance(x, torch.device) else x for n, x in k.items()}
            return _fn(*a, **k)

        gpu.__wrapped_gpu__ = True
        setattr(m, name, gpu)
    return triton


def _scenarios():
    """Op calls covering the launchers' choices (names for the log, callables)."""
    import torch

    import gdn.ops as ops
    from gdn.ops.norm import gated_rms_norm

    H, HV, K, V = 2, 4, 128, 128

    def rnd(*s, dtype=torch.bfloat16, grad=False):
        return torch.randn(*s, dtype=dtype).requires_grad_(grad)

    def gates(*s):
        return -torch.rand(*s), torch.rand(*s)

    def chunk(dtype, layout, varlen, pool, l2, train):
        T = 130
        B = 1 if varlen else 2
        q, k = rnd(B, T, H, K, dtype=dtype, grad=train), rnd(B, T, H, K, dtype=dtype, grad=train)
        v = rnd(B, T, HV, V, dtype=dtype, grad=train)
        g, beta = gates(B, T, HV)
        g, beta = g.to(dtype).requires_grad_(train), beta.to(dtype).requires_grad_(train)
        cu = torch.tensor([0, 1, 64, 130]) if varlen else None
        N = 3 if varlen else B
        shape = (HV, K, V) if layout == "v_last" else (HV, V, K)
        kw = dict(state_layout=layout, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, output_final_state=not pool)
        if pool:
            kw.update(initial_state=torch.randn(N + 2, *shape), ssm_state_indices=torch.tensor([2, -1, 0][:N]))
        else:
            kw.update(initial_state=torch.randn(N, *shape).requires_grad_(train))
        o, st = ops.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        if train:
            (o.float().sum() + (st.sum() if st is not None else 0)).backward()

    def decode(B, state_dtype, layout, spec=False):
        q, k, v = rnd(B, 1, H * 8, K), rnd(B, 1, H * 8, K), rnd(B, 1, HV * 8, V)
        shape = (HV * 8, V, K) if layout == "k_last" else (HV * 8, K, V)
        pool = torch.randn(B + 1, *shape).to(state_dtype)
        A_log, dt_bias = torch.rand(HV * 8), torch.rand(HV * 8)
        a, b = rnd(B, 1, HV * 8), rnd(B, 1, HV * 8)
        idx = torch.arange(B) - int(B > 1)
        ops.gated_delta_rule_decode(q, k, v, pool, A_log, a, dt_bias, b, use_qk_l2norm=True, state_indices=idx,
                                    state_layout=layout)

    def recurrent(N, T, layout, spec):
        q, k, v = rnd(1, N * T, H * 8, K), rnd(1, N * T, H * 8, K), rnd(1, N * T, HV * 8, V)
        g, beta = gates(1, N * T, HV * 8)
        cu = torch.arange(0, N * T + 1, T)
        shape = (HV * 8, K, V) if layout == "v_last" else (HV * 8, V, K)
        pool = torch.randn(N * T + 1, *shape)
        idx = torch.arange(N * T).view(N, T) if spec else torch.arange(N)
        acc = torch.ones(N, dtype=torch.int32) if spec else None
        ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool, cu_seqlens=cu,
                                             use_qk_l2norm_in_kernel=True, state_layout=layout,
                                             ssm_state_indices=idx, num_accepted_tokens=acc,
                                             inplace_final_state=True)

    def conv(dtype, varlen, pool, train):
        D, W = 384, 4
        T = 70
        x = rnd(1, T, D, dtype=dtype, grad=train)
        w, bias = rnd(D, W, dtype=dtype, grad=train), rnd(D, dtype=dtype, grad=train)
        kw = {}
        if varlen:
            kw["cu_seqlens"] = torch.tensor([0, 5, T])
        if pool:
            kw.update(conv_state=rnd(4, D, W - 1, dtype=dtype), conv_state_indices=torch.tensor([1, -1]))
        y = ops.causal_conv1d(x, w, bias, **kw)
        if train:
            y.float().sum().backward()

    def conv_update(dtype):
        D, W = 384, 4
        st = rnd(4, D, W - 1, dtype=dtype)
        ops.causal_conv1d_update(rnd(2, D, dtype=dtype), st, rnd(D, W, dtype=dtype), None,
                                 conv_state_indices=torch.tensor([3, -1]))

    def gate_norm(dtype):
        a = rnd(64, HV, dtype=dtype, grad=True)
        ops.gdn_gate(a, torch.rand(HV), torch.rand(HV)).sum().backward()
        x, z = rnd(64, HV, V, dtype=dtype, grad=True), rnd(64, HV, V, dtype=dtype, grad=True)
        gated_rms_norm(x, z, torch.rand(V, dtype=dtype, requires_grad=True)).float().sum().backward()

    def decode_step(state_dtype, layout, R):
        from gdn.kernels.decode_step import layer_decode_step

        N, Hk, W = 3, 2, 4
        HVk = Hk * R
        D = 2 * Hk * K + HVk * V
        proj = rnd(N, Hk, 2 * K + 2 * R * V)
        ba = rnd(N, Hk, 2 * R)
        q, k, v, z = torch.split(proj, [K, K, R * V, R * V], dim=-1)
        b, a = torch.split(ba, [R, R], dim=-1)
        shape = (HVk, K, V) if layout == "v_last" else (HVk, V, K)
        layer_decode_step(q, k, v, z, b, a, rnd(D, W), None, torch.randn(N + 1, D, W - 1).to(state_dtype),
                          torch.rand(HVk), torch.rand(HVk), torch.rand(V), torch.tensor([2, -1, 0]),
                          torch.randn(N + 1, *shape).to(state_dtype), rnd(N, HVk, V),
                          torch.zeros((N + 1) * HVk, dtype=torch.int64), scale=K ** -0.5, eps=1e-6,
                          k_last=layout == "k_last")

    def prepare_redo(with_w, packed=False):
        # the sm_90 prepare's overflow redo (a portable kernel launched only on the sm_90 path)
        from gdn.kernels.chunk.plan import get_chunk_index
        from gdn.kernels.chunk.prepare import redo_overflowed

        T = 130
        cu = torch.tensor([0, 1, 64, T], dtype=torch.int32)
        ci = get_chunk_index(cu, T, 1, 64, None, torch.device("cpu"))
        k, beta = rnd(1, T, H, K), torch.rand(1, T, HV).bfloat16()
        ainv = rnd(1, T, HV, 128)[..., :64] if packed else rnd(1, T, HV, 64)    # packed: Ainv in o's rows
        redo_overflowed(torch.zeros(ci.NT * HV, 64, dtype=torch.int8), k, beta, torch.randn(1, T, HV),
                        ainv, rnd(1, T, HV, K) if with_w else None, ci, cu, T, True)

    out = [("prepare redo", lambda: prepare_redo(False)), ("prepare redo with W", lambda: prepare_redo(True)),
           ("prepare redo, Ainv packed in o", lambda: prepare_redo(False, True))]
    # the fused layer decode step: every decode_step table row (state dtype x layout), 1 and 2 value heads per key head
    for sd in (torch.float32, torch.bfloat16):
        for layout in ("v_last", "k_last"):
            for R in (1, 2):
                out.append((f"decode step {sd} {layout} R={R}", lambda sd=sd, lo=layout, R=R: decode_step(sd, lo, R)))
    for dtype in (torch.bfloat16, torch.float32):
        for layout in ("v_last", "k_last"):
            out.append((f"chunk train {dtype} {layout}", lambda d=dtype, lo=layout: chunk(d, lo, True, False, True,
                                                                                          True)))
        out.append((f"chunk pool {dtype}", lambda d=dtype: chunk(d, "k_last", True, True, True, False)))
        out.append((f"chunk dense no-l2 {dtype}", lambda d=dtype: chunk(d, "v_last", False, False, False, True)))
        out.append((f"conv {dtype}", lambda d=dtype: (conv(d, False, False, True), conv(d, True, True, True),
                                                      conv_update(d))))
        out.append((f"gate+norm {dtype}", lambda d=dtype: gate_norm(d)))
    # decode regimes of recurrent._decode_config at HV = 32: N*HV < 2048 / fp32 / 16-bit < 8192 / 16-bit >= 8192
    for B, sd in ((1, torch.float32), (64, torch.float32), (64, torch.bfloat16), (256, torch.bfloat16)):
        for layout in ("k_last", "v_last"):
            out.append((f"decode B={B} {sd} {layout}", lambda B=B, sd=sd, lo=layout: decode(B, sd, lo)))
    # recurrent regimes: N*HV < 2048 and >= 2048; speculative verify with 2-D slots
    for N, T, spec in ((2, 3, False), (64, 2, False), (4, 3, True)):
        for layout in ("v_last", "k_last"):
            out.append((f"recurrent N={N} T={T} spec={spec} {layout}",
                        lambda N=N, T=T, s=spec, lo=layout: recurrent(N, T, lo, s)))
    return out


def _run_scenarios() -> int:
    records: list = []
    triton = _install(records)
    print(f"gdn.aot: Triton {triton.__version__}, target cuda:90, env {os.environ.get('GDN_AOT_ENV', '{}')}",
          flush=True)
    scen_errors = 0
    for name, fn in _scenarios():
        n0 = len(records)
        try:
            fn()
        except Exception as e:  # the op itself (not a compile) failed: report, go on
            scen_errors += 1
            print(f"SCENARIO ERROR {name}: {type(e).__name__}: {e}", flush=True)
        new = records[n0:]
        bad = [r for r in new if r[1] is None]
        print(f"{name}: {len(new)} launches, {len(bad)} compile errors", flush=True)
    seen, errors = {}, {}
    for key, kernel, info in records:
        if kernel is None:
            errors.setdefault(key, info)
        else:
            seen.setdefault((key, kernel.hash if hasattr(kernel, "hash") else id(kernel)), (kernel, info))
    for (key, _), (kernel, secs) in sorted(seen.items(), key=lambda x: x[0][0][:2]):
        md = kernel.metadata
        print(f"  ok  {key[0].rsplit('.', 1)[-1]}.{key[1]} warps={md.num_warps} stages={md.num_stages} "
              f"shared={md.shared} ({secs:.1f} s)")
    for key, info in errors.items():
        print(f"  FAIL {key[0]}.{key[1]} warps={key[2]} stages={key[3]}: {info}")
    print(f"gdn.aot: {len(seen)} distinct compiled kernels, {len(errors)} failing configurations, "
          f"{scen_errors} scenario errors", flush=True)
    return 1 if errors or scen_errors else 0



# ----------------------------------------------------------------------------------------------------------------------
# the Gluon (sm_90-only) kernels: compiled directly (the ops take them only on a Hopper GPU)
# ----------------------------------------------------------------------------------------------------------------------
def compile_gluon(kernel, args: dict, constexprs: dict, num_warps: int = 4, options: dict = None):
    """Compile a Gluon kernel (or a ``triton.jit`` one) for sm_90 from example arguments (tensor -> pointer, int ->
    i32, float -> fp32, TMA descriptors by their own signature type); constexprs by value. Used by gdn.aot and
    bench/aot_chunk.py."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import mangle_type

    ptr = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.int8: "i8"}
    sig, consts, attrs = {}, {}, {}
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    for i, n in enumerate(kernel.arg_names):
        if n in constexprs or (n not in args and n in defaults):
            sig[n], consts[(i,)] = "constexpr", constexprs.get(n, defaults.get(n))
            continue
        val = args[n]
        if isinstance(val, torch.Tensor):
            sig[n], attrs[(i,)] = "*" + ptr[val.dtype], [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[n] = "i1"
        elif isinstance(val, int):
            sig[n] = "i32"
        elif isinstance(val, float):
            sig[n] = "fp32"
        else:
            sig[n] = mangle_type(val)
    gluon_kernel = isinstance(kernel, GluonJITFunction)
    src = (GluonASTSource if gluon_kernel else triton.compiler.ASTSource)(fn=kernel, signature=sig, constexprs=consts,
                                                                           attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **(options or {})})


def compile_hopper_state_pass(BV=64, NS=2, from_ainv=True, dtype=None, **flags):
    """The Hopper state pass (gdn.kernels.chunk.hopper) for one configuration; ``flags`` override its constexprs."""
    import torch
    from .kernels.chunk import hopper as m

    dt = dtype or torch.bfloat16
    B, T, H, HV, K, V = 1, 256, 2, 4, 128, 128
    k = torch.empty(B, T, H, K, dtype=dt)
    v = torch.empty(B, T, HV, V, dtype=dt)
    a = torch.empty(B, T, HV, 64 if from_ainv else K, dtype=dt)
    h = torch.empty(8, HV, K, V, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    args = dict(k_desc=m._desc(m._rows2d(k), (64, K), dn), v_desc=m._desc(m._rows2d(v), (64, BV), dn),
                a_desc=m._desc(a.reshape(B * T, -1), (64, a.shape[-1]), dn),
                h_desc=m._desc(h.view(-1, V), (K, BV), dn), beta=torch.empty(4, dtype=dt), gcum=f32, rk_in=f32,
                vnew=torch.empty(4, dtype=dt), h0=f32, ht=f32, h0_idx=i32, ht_idx=i32, segments=i32, cu_seqlens=i32,
                chunk_offsets=i32, T=T, P0=3, P1=3, s_bb=3, s_bt=3, s_bh=1, s0n=3, s0h=3, s0k=3, s0v=1, s1n=3,
                s1h=3, s1k=3, s1v=1)
    cx = dict(H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=True, IS_VARLEN=True, INIT=1, H0_BY_SEG=False, H0_INDEXED=True,
              STORE_H=True, STORE_VNEW=True, STORE_FINAL=True, HT_BY_SEG=False, HT_INDEXED=True, NS=NS,
              FROM_AINV=from_ainv, num_warps=4)
    cx.update(flags)
    return compile_gluon(m._state_pass_sm90_kernel, args, cx)


def _load_warp(BV: int) -> bool:
    """Whether the fused kernel's launcher gives V tile BV a load warp (the default tuning row's
    ``state_sm90_load_warp_bv``)."""
    from .kernels.tuning import ChunkForward

    return BV <= ChunkForward().state_sm90_load_warp_bv


def compile_hopper_fused_pass(BV=32, NS=2, dtype=None, **flags):
    """The fused Hopper state + output kernel (gdn.kernels.chunk.hopper) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m

    dt = dtype or torch.bfloat16
    B, T, H, HV, K, V = 1, 256, 2, 4, 128, 128
    q = torch.empty(B, T, H, K, dtype=dt)
    k = torch.empty(B, T, H, K, dtype=dt)
    v = torch.empty(B, T, HV, V, dtype=dt)
    a = torch.empty(B, T, HV, 64, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    args = dict(k_desc=m._desc(m._rows2d(k), (64, K), dn), v_desc=m._desc(m._rows2d(v), (64, BV), dn),
                a_desc=m._desc(a.reshape(B * T, -1), (64, 64), dn), q_desc=m._desc(m._rows2d(q), (64, K), dn),
                p_desc=m._desc(a.reshape(B * T, -1), (64, 64), dn),
                h_desc=m._desc(torch.empty(4 * HV * K, V, dtype=dt), (K, BV), dn), beta=torch.empty(4, dtype=dt),
                gcum=f32, rk_in=f32, qf=f32, o=torch.empty(4, dtype=dt), vnew=torch.empty(4, dtype=dt), h0=f32,
                ht=f32, h0_idx=i32, ht_idx=i32, o_idx=i32, segments=i32, cu_seqlens=i32, chunk_offsets=i32, T=T,
                P0=3, P1=3, PO=3, scale=0.5,
                s_bb=3, s_bt=3, s_bh=1, s0n=3, s0h=3, s0k=3, s0v=1, s1n=3, s1h=3, s1k=3, s1v=1)
    if flags.get("PK"):     # P formed in the kernel: k's descriptor where P's was
        args["p_desc"] = args["k_desc"]
    cx = dict(H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=True, IS_VARLEN=True, INIT=1, H0_BY_SEG=False, H0_INDEXED=True,
              STORE_H=False, STORE_VNEW=False, STORE_FINAL=True, HT_BY_SEG=False, HT_INDEXED=True, O_INDEXED=True,
              NS=NS, OUT_REGS=m.OUTPUT_PARTITION_REGS, LREGS=m.T_LOADER_REGS, TMA_WARP=_load_warp(BV), num_warps=4,
              PK=False)
    cx.update(flags)
    return compile_gluon(m._chunk_fused_sm90_kernel, args, cx)


def compile_hopper_fused_t_pass(dtype=None, **flags):
    """The register-state fused kernel (gdn.kernels.chunk.hopper, V tile 128) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m

    dt = dtype or torch.bfloat16
    B, T, H, HV, K, V, BV = 1, 256, 2, 4, 128, 128, 128
    q = torch.empty(B, T, H, K, dtype=dt)
    v = torch.empty(B, T, HV, V, dtype=dt)
    a = torch.empty(B, T, HV, 64, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    row = m._desc(m._rows2d(q), (64, K), dn)
    args = dict(k_desc=row, v_desc=m._desc(m._rows2d(v), (64, BV), dn),
                a_desc=m._desc(a.reshape(B * T, -1), (64, 64), dn), q_desc=row,
                p_desc=m._desc(a.reshape(B * T, -1), (64, 64), dn), beta=torch.empty(4, dtype=dt), gcum=f32,
                rk_in=f32, qf=f32, o=torch.empty(4, dtype=dt), h0=f32, ht=f32, h0_idx=i32, ht_idx=i32, o_idx=i32,
                segments=i32, cu_seqlens=i32, T=T, P0=3, P1=3, PO=3, s_bb=3, s_bt=3, s_bh=1, s0n=3, s0h=3, s0k=3,
                s0v=1, s1n=3, s1h=3, s1k=3, s1v=1, scale=0.5)
    cx = dict(H=H, HV=HV, K=K, V=V, BV=BV, USE_L2=True, IS_VARLEN=True, INIT=1, H0_BY_SEG=False, H0_INDEXED=True,
              STORE_FINAL=True, HT_BY_SEG=False, HT_INDEXED=True, O_INDEXED=True, NS=2, num_warps=4)
    # the register budgets hopper.launch_fused_pass gives each form (PA: with the P partition)
    cx.update(dict(WREGS=m.T_PA_CHAIN_REGS, AREGS=m.T_PA_AUX_REGS, LREGS=m.T_PA_LOADER_REGS) if flags.get("PA")
              else dict(WREGS=m.T_CHAIN_REGS, LREGS=m.T_LOADER_REGS))
    cx.update(flags)
    return compile_gluon(m._chunk_fused_t_sm90_kernel, args, cx)


def compile_hopper_segment_t_pass(dtype=None, **flags):
    """The one-CTA-per-(value head, segment) segment pass (gdn.kernels.chunk.hopper_segments) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m
    from .kernels.chunk import hopper_segments as ms

    dt = dtype or torch.bfloat16
    B, T, H, HV, K, V = 1, 256, 2, 4, 128, 128
    k = torch.empty(B, T, H, K, dtype=dt)
    v = torch.empty(B, T, HV, V, dtype=dt)
    a = torch.empty(B, T, HV, 64, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    args = dict(k_desc=m._desc(m._rows2d(k), (64, K), dn), v_desc=m._desc(m._rows2d(v), (64, V), dn),
                a_desc=m._desc(a.reshape(B * T, -1), (64, 64), dn), beta=torch.empty(4, dtype=dt), gcum=f32,
                rk_in=f32, hloc=f32, trans=f32, segments=i32, cu_seqlens=i32, T=T, s_bb=3, s_bt=3, s_bh=1,
                s0n=3, s0h=3, s0k=3, s0v=1, s1n=3, s1h=3, s1k=3, s1v=1)
    cx = dict(H=H, HV=HV, K=K, V=V, USE_L2=True, IS_VARLEN=True, NS=2, LREGS=ms.SEG_LOADER_REGS, num_warps=8)
    cx.update(flags)
    return compile_gluon(ms._segment_t_sm90_kernel, args, cx, num_warps=cx["num_warps"])


def compile_hopper_dh_pass(BV=32, NS=2, dtype=None, K=128, **flags):
    """The Hopper reverse pass of the backward (gdn.kernels.chunk.backward.hopper) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m
    from .kernels.chunk.backward import hopper as mb

    dt = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.bfloat16)
    B, T, H, HV, V = 1, 256, 2, 4, 128
    VC = K if flags.get("INIT") == 3 else V
    q = torch.empty(B, T, H, K, dtype=dt)
    w = torch.empty(B, T, HV, K, dtype=dt)
    do = torch.empty(B, T, HV, V, dtype=dt)
    gs = torch.empty(8, HV, K, V, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    args = dict(k_desc=m._desc(m._rows2d(q), (64, K), dn), w_desc=m._desc(w.view(B * T, -1), (64, K), dn),
                q_desc=m._desc(m._rows2d(q), (64, K), dn), do_desc=m._desc(m._rows2d(do), (64, BV), dn),
                dl_desc=m._desc(m._rows2d(do), (64, BV), dn), gs_desc=m._desc(gs.view(-1, V), (K, BV), dn),
                gcum=f32, rq_in=f32, rk_in=f32, beta=torch.empty(4, dtype=dt), dvn=torch.empty(4, dtype=dt), x0=f32,
                xend=f32, segments=i32,
                cu_seqlens=i32, chunk_offsets=i32, scale=0.5, T=T)
    cx = dict(H=H, HV=HV, K=K, V=VC, BV=BV, USE_L2=True, IS_VARLEN=True, INIT=1, HAS_R=True, STORE_STEPS=True,
              STORE_END=True, END_BY_SEG=False, LOCAL=False, W_AINV=False, NS=NS, num_warps=8 if BV == 128 else 4)
    cx.update(flags)
    if cx["W_AINV"]:
        args["w_desc"] = m._desc(w[..., :64].contiguous().view(B * T, -1), (64, 64), dn)
    return compile_gluon(mb._dh_pass_sm90_kernel, args, cx, num_warps=cx["num_warps"])


def compile_hopper_parts(K=128, dtype=None, **flags):
    """The Hopper parts kernel of the backward (gdn.kernels.chunk.backward.hopper_parts) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m
    from .kernels.chunk.backward import hopper_parts as mp

    dt = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.bfloat16)
    B, T, H, HV = 1, 256, 2, 4
    x = torch.empty(B, T, HV, K, dtype=dt)
    hh = torch.empty(8 * HV * K, K, dtype=dt)
    dn = m._GL_DT[dt]
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    row = m._desc(m._rows2d(x), (64, K), dn)
    args = dict(q_desc=row, k_desc=row, do_desc=row, vn_desc=row, dvn_desc=row, v_desc=row,
                ai_desc=m._desc(x.view(B * T, -1)[:, :HV * 64], (64, 64), dn), h_desc=m._desc(hh, (K, K), dn),
                gs_desc=m._desc(hh, (K, K), dn), gcum=f32, beta=torch.empty(4, dtype=dt), rq_in=f32, rk_in=f32,
                dq_v=torch.empty(4, dtype=dt), dk_v=f32, dq_o=torch.empty(4, dtype=dt), dk_o=torch.empty(4, dtype=dt),
                counts=i32, slot_head=i32, n_groups=8 * H, dv=torch.empty(4, dtype=dt),
                dbeta=torch.empty(4, dtype=dt), dg=f32, cu_seqlens=i32, chunk_indices=i32, scale=0.5, one=1.0, T=T,
                s_dq=H * K, s_dk=H * K, s_dv=HV * K)
    cx = dict(H=H, HV=HV, D=K, USE_L2=True, IS_VARLEN=True, num_warps=8)
    cx.update(flags)
    return compile_gluon(mp._bwd_parts_sm90_kernel, args, cx, num_warps=cx["num_warps"])


def compile_hopper_prepare(K=128, dtype=None, maxnreg=None, **flags):
    """The Hopper prepare kernel of the forward (gdn.kernels.chunk.hopper_prepare) for one configuration."""
    import torch
    from .kernels.chunk import hopper as m
    from .kernels.chunk import hopper_prepare as mp

    dt = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.bfloat16)
    B, T, H, HV = 1, 256, 2, 4
    x = torch.empty(B, T, H, K, dtype=dt)
    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    row = m._desc(m._rows2d(x), (64, K), m._GL_DT[dt])
    a = torch.empty(B, T, HV, 64, dtype=dt)
    tile = m._desc(m._rows2d(a), (64, 64), m._GL_DT[dt])
    args = dict(k_desc=row, q_desc=row, a_desc=tile, p_desc=tile, g=f32, beta=torch.empty(4, dtype=dt), gcum=f32,
                ainv=torch.empty(4, dtype=dt),
                rk_out=f32, rq_out=f32, p_out=torch.empty(4, dtype=dt), qf_out=f32, w_out=torch.empty(4, dtype=dt),
                flags=torch.empty(4, dtype=torch.int8), chunk_indices=i32,
                cu_seqlens=i32, T=T,
                scale=0.5, s_gb=T * HV, s_gt=HV, s_gh=1, s_bb=T * HV, s_bt=HV, s_bh=1)
    cx = dict(H=H, HV=HV, K=K, USE_L2=True, IS_VARLEN=True, STORE_RK=True, STORE_P=True, STORE_RQ=True, STORE_W=False,
              SOLVE_F16=True, num_warps=4)
    cx.update(flags)
    return compile_gluon(mp._chunk_prepare_sm90_kernel, args, cx, options={"maxnreg": maxnreg} if maxnreg else None)


PREPARE_CONFIGS = [dict(maxnreg=r, **f) for r in (None, 168)
                   for f in (dict(), dict(STORE_P=False), dict(USE_L2=False, IS_VARLEN=False, STORE_RK=False),
                             dict(K=64), dict(dtype="float16", H=4))] + \
    [dict(maxnreg=168, STORE_W=True), dict(maxnreg=168, STORE_W=True, K=64)] + \
    [dict(maxnreg=128, STORE_P=False), dict(maxnreg=128, STORE_P=False, K=64), dict(maxnreg=128),
     dict(maxnreg=128, K=64)] + \
    [dict(maxnreg=168, SOLVE_F16=False, **f)        # the tf32 solve (chunk_fwd.solve_sm90_f16 off)
     for f in (dict(), dict(STORE_P=False), dict(STORE_W=True), dict(K=64), dict(dtype="float16", H=4))]


PARTS_CONFIGS = [dict(), dict(USE_L2=False, IS_VARLEN=False), dict(K=64), dict(dtype="float16"),
                 dict(H=4), dict(H=4, USE_L2=False, IS_VARLEN=False)]


DH_CONFIGS = [dict(BV=bv, **f) for bv in (32, 64)
              for f in (dict(INIT=1), dict(INIT=0, IS_VARLEN=False, USE_L2=False, STORE_END=False),
                        dict(INIT=0, STORE_STEPS=False, END_BY_SEG=True),
                        dict(INIT=3, HAS_R=False, STORE_STEPS=False, END_BY_SEG=True),
                        dict(INIT=2, STORE_END=False))] + \
    [dict(BV=32, K=64), dict(BV=64, K=64, INIT=3, HAS_R=False, STORE_STEPS=False, END_BY_SEG=True),
     dict(BV=32, dtype="float16"), dict(BV=32, LOCAL=True), dict(BV=64, LOCAL=True),
     dict(BV=64, LOCAL=True, INIT=0, IS_VARLEN=False, USE_L2=False, STORE_END=False),
     dict(BV=32, K=64, LOCAL=True, dtype="float16"), dict(BV=128, LOCAL=True), dict(BV=128, LOCAL=True, W_AINV=True),
     dict(BV=128, LOCAL=True, INIT=0, IS_VARLEN=False, USE_L2=False, STORE_END=False)]


HOPPER_CONFIGS = [dict(BV=bv, from_ainv=fa, INIT=init, IS_VARLEN=vl, H0_BY_SEG=seg, H0_INDEXED=idx, HT_INDEXED=idx,
                       STORE_FINAL=not seg)
                  for bv in (32, 64) for fa in (True, False)
                  for (init, vl, seg, idx) in ((1, True, False, True), (0, False, False, False),
                                               (1, True, True, False))] + \
    [dict(BV=bv, from_ainv=fa, INIT=3, HT_BY_SEG=True, H0_INDEXED=False, HT_INDEXED=False, STORE_H=False,
          STORE_VNEW=False, STORE_FINAL=False)    # the segment pass (local states + transitions)
     for bv in (32, 64) for fa in (True, False)]


FUSED_CONFIGS = [dict(BV=bv, INIT=init, IS_VARLEN=vl, H0_BY_SEG=seg, H0_INDEXED=idx, HT_INDEXED=idx, O_INDEXED=idx,
                      STORE_FINAL=not seg, USE_L2=l2)
                 for bv in (16, 32, 64)      # 16: few-head inference forwards (chunk_fwd.state_sm90_narrow_bv)
                 for (init, vl, seg, idx, l2) in ((1, True, False, True, True), (0, False, False, False, False),
                                                  (1, True, True, False, True))] + \
    [dict(BV=bv, STORE_H=True, STORE_VNEW=True, **f) for bv in (32, 64)
     for f in (dict(), dict(INIT=0, IS_VARLEN=False, H0_INDEXED=False, HT_INDEXED=False, O_INDEXED=False))] + \
    [dict(BV=32, TMA_WARP=False), dict(BV=64, TMA_WARP=True)] + \
    [dict(BV=bv, PK=True, USE_L2=l2, **f) for bv in (32, 64) for l2 in (True, False)     # P formed in the kernel
     for f in (dict(), dict(INIT=1, IS_VARLEN=True, H0_BY_SEG=True, H0_INDEXED=False, HT_INDEXED=False,
                            O_INDEXED=False, STORE_FINAL=False))]


# the one-CTA-per-(value head, segment) segment pass (chunk_fwd.state_sm90_segment_t): varlen / batched, with and
# without the L2 norm, Ainv in its own buffer or packed into o's rows (head pitch 128), with PDL
SEGMENT_T_CONFIGS = [dict(PDL=True), dict(PDL=True, AP=128), dict(IS_VARLEN=False, USE_L2=False), dict(NS=3)]

FUSED_T_CONFIGS = [dict(), dict(INIT=0, IS_VARLEN=False, H0_INDEXED=False, HT_INDEXED=False, O_INDEXED=False,
                        USE_L2=False), dict(H0_BY_SEG=True, H0_INDEXED=False, STORE_FINAL=False)]

# the sm_90 forward's launches with programmatic dependent launch (chunk_fwd.pdl): each build's PTX is also checked
# for its wait coming before any global memory access (pdl_problem)
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True), dict(maxnreg=168, PDL=True)]
HOPPER_CONFIGS += [dict(BV=64, INIT=3, HT_BY_SEG=True, H0_INDEXED=False, HT_INDEXED=False, STORE_H=False,
                        STORE_VNEW=False, STORE_FINAL=False, PDL=True)]
FUSED_CONFIGS += [dict(BV=bv, PDL=True) for bv in (16, 32, 64)] + \
    [dict(BV=64, INIT=1, IS_VARLEN=True, H0_BY_SEG=True, H0_INDEXED=False, HT_INDEXED=False, O_INDEXED=False,
          STORE_FINAL=False, PDL=True)]
FUSED_T_CONFIGS += [dict(PDL=True)]
# Ainv and P packed into o's rows (head pitch 128: chunk_fwd.state_sm90_fused_t_packed), as the forward launches them
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True, AP=128), dict(maxnreg=168, PDL=True, AP=128)]
# an inference forward's P without r_q (only the training backward reads r_q), in its own buffers or in o's rows
PREPARE_CONFIGS += [dict(maxnreg=r, PDL=True, STORE_RQ=False, **f) for r in (128, 168) for f in (dict(), dict(AP=128))]
FUSED_T_CONFIGS += [dict(PDL=True, AP=128)]
# ... and the segment pass of a segmented register-state run reading that Ainv (head pitch 128)
HOPPER_CONFIGS += [dict(BV=64, INIT=3, HT_BY_SEG=True, H0_INDEXED=False, HT_INDEXED=False, STORE_H=False,
                        STORE_VNEW=False, STORE_FINAL=False, PDL=True, AP=128)]
# the register-state kernel forming P in its P partition (chunk_fwd.state_sm90_t_p_in_kernel, unsegmented plans),
# with Ainv alone in o's rows from a prepare without P (which loads q for r_q alone), with and without the L2 norm
FUSED_T_CONFIGS += [dict(PA=True, PDL=True, AP=128), dict(PA=True, PDL=True, AP=128, USE_L2=False)]
# the varlen prepare reading its chunks' spans from the chunk table (chunk_fwd.prepare_sm90_chunk_spans: the default)
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True, SPANS=True), dict(maxnreg=128, PDL=True, STORE_P=False, SPANS=True)]
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True, STORE_P=False, STORE_RQ=True, AP=128)]
# beta folded into the packed Ainv (chunk_fwd.state_sm90_beta_in_ainv): the prepare storing Ainv diag(beta) (with and
# without P), its overflow redo, and the two kernels reading it (the register-state kernel with its P partition or
# P read, the one-CTA segment pass)
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True, STORE_P=False, STORE_RQ=True, AP=128, SPANS=True, A_BETA=True),
                    dict(maxnreg=128, PDL=True, STORE_RQ=False, AP=128, A_BETA=True)]
FUSED_T_CONFIGS += [dict(PA=True, PDL=True, AP=128, A_BETA=True), dict(PDL=True, AP=128, A_BETA=True)]
SEGMENT_T_CONFIGS += [dict(PDL=True, AP=128, A_BETA=True)]
# an inference forward of the fused kernel forming P itself (V tile 64 by default, 32 by tuning): g_cum, r_k and
# the flags packed into o's rows (chunk_fwd.state_sm90_row_scalars_in_o; V = 128: VP 64, a copy per V tile), the
# prepare without P, with and without the L2 norm
PREPARE_CONFIGS += [dict(maxnreg=128, PDL=True, STORE_RQ=False, STORE_P=False, VP=64, VB=vb, NCOPY=64 // vb, **f)
                    for vb in (16, 32) for f in (dict(), dict(USE_L2=False, STORE_RK=False))]
FUSED_CONFIGS += [dict(BV=bv, PDL=True, VP=64, VB=bv // 2, PK=True, **f) for bv in (32, 64)
                  for f in (dict(), dict(USE_L2=False, IS_VARLEN=False, INIT=0, H0_INDEXED=False, HT_INDEXED=False,
                                         O_INDEXED=False))]


def compile_merge(**flags):
    """The segment merge (``chunk.segments._chunk_merge_kernel``, a portable kernel) for sm_90."""
    import torch
    from .kernels.chunk import segments

    f32, i32 = torch.empty(4, dtype=torch.float32), torch.empty(4, dtype=torch.int32)
    args = dict(h0=f32, ht=f32, h0_idx=i32, ht_idx=i32, trans=f32, hloc=f32, hs=f32, seg_offsets=i32, P0=4, P1=4,
                s0n=16384, s0h=2048, s0k=128, s0v=1, s1n=16384, s1h=2048, s1k=128, s1v=1)
    cx = dict(HV=8, K=128, V=128, BK=128, BV=16, HAS_H0=True, H0_INDEXED=True, STORE_FINAL=True, HT_INDEXED=True,
              PREC="tf32", STAGES=2, PDL=False)
    cx.update(flags)
    return compile_gluon(segments._chunk_merge_kernel, args, cx, num_warps=8, options={"num_stages": 2})


def compile_redo(**flags):
    """The fp16 solve's overflow redo (``chunk.prepare._prepare_redo_kernel``, a portable kernel) for sm_90."""
    import torch
    import triton.language as tl
    from .kernels.chunk import prepare

    bf, f32 = torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.float32)
    i32 = torch.empty(4, dtype=torch.int32)
    args = dict(flags=torch.empty(4, dtype=torch.int8), n_items=1000, k=bf, beta=bf, gcum=f32, ainv=bf, w=bf,
                chunk_indices=i32, cu_seqlens=i32, T=4096, s_kb=0, s_kt=256, s_kh=128, s_bb=0, s_bt=2, s_bh=1)
    if flags.get("VP"):     # the flags and g_cum in o's rows: o's fp32 view
        args["flags"] = f32
    cx = dict(H=2, HV=4, K=128, BK=64, USE_L2=True, IS_VARLEN=True, STORE_W=False, DT=tl.bfloat16, BLOCK=128, PDL=False)
    cx.update(flags)
    return compile_gluon(prepare._prepare_redo_kernel, args, cx, num_warps=4, options={"num_stages": 1})


# portable kernels of the sm_90 forward's launch chain, built with PDL (their plain builds: the scenarios above)
PDL_PORTABLE_BUILDS = [("merge", compile_merge, dict(PDL=True)),
                       ("merge, 3 stages (the sm_90 row)", compile_merge, dict(PDL=True, STAGES=3)),
                       ("overflow redo", compile_redo, dict(PDL=True)),
                       ("overflow redo, Ainv packed in o", compile_redo, dict(PDL=True, AP=128)),
                       ("overflow redo, g_cum and flags packed in o", compile_redo, dict(PDL=True, VP=64, VB=16)),
                       ("overflow redo, Ainv diag(beta) packed in o", compile_redo, dict(PDL=True, AP=128, A_BETA=True))]


def pdl_problem(compiled) -> str:
    """'' when the PTX of a build with programmatic dependent launch waits (``griddepcontrol.wait``) before its first
    global memory access (load, store, atomic, asynchronous or TMA copy), else what is wrong: nothing the kernel
    before it writes, or reads, may be touched earlier."""
    import re

    lines = compiled.asm["ptx"].splitlines()
    wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
    if wait is None:
        return "no griddepcontrol.wait"
    mem = next((i for i, ln in enumerate(lines) if re.search(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async)", ln)),
               None)
    if mem is not None and mem < wait:
        return f"global memory access before the wait: {lines[mem].strip()}"
    return ""


def default_partition_regs(compiled, worker_regs) -> int:
    """Registers per thread of a warp-specialized kernel's default partition inside its ``gl.warp_specialize``
    region, by the scheme of Triton's AllocateWarpGroups pass (3.6 - 3.9): the kernel launches
    ``metadata.num_warps`` warps (every partition padded to whole warpgroups) at 65536 / threads registers each,
    rounded down to 8; each worker warpgroup claims its ``worker_regs`` entry (rounded up to 8) and the default
    partition (one warpgroup, or more: the rest of the warps) gets what is left of the pool per thread, rounded down
    to 8, at most 256. Outside the region the default partition holds 256 and the idle workers give theirs back, so
    no claim can exceed the pool: what the split decides is how many registers each partition's code is compiled for
    (ptxas spills past it)."""
    warps = compiled.metadata.num_warps
    launch = 65536 // (warps * 32) // 8 * 8
    default_groups = warps // 4 - len(worker_regs)
    pool = (warps // 4) * launch
    return min(256, (pool - sum(-(-r // 8) * 8 for r in worker_regs)) // max(1, default_groups) // 8 * 8)


def register_pool_problem(compiled, worker_regs) -> str:
    """'' when the PTX of a warp-specialized kernel follows the register split of :func:`default_partition_regs`
    (each worker's claim, and the default partition's share inside the region when below 256, are ``setmaxnreg``
    instructions of the PTX; one warpgroup per worker partition, one or more for the default one: its share then
    claimed by a ``setmaxnreg.inc`` or ``.dec``), else why not: a change of the scheme in a new Triton, to be read
    before trusting the partitions' budgets."""
    import re

    found = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])
    claims = {int(n) for _, n in found}
    missing = [r for r in worker_regs if r not in claims]
    if missing:
        return f"no setmaxnreg to {missing} in the PTX (claims {sorted(claims)}): the scheme changed"
    warps = compiled.metadata.num_warps
    if warps % 4 or warps // 4 < 1 + len(worker_regs):
        return f"{warps} warps are not whole warpgroups, one or more per partition ({1 + len(worker_regs)} partitions)"
    wide = warps // 4 > 1 + len(worker_regs)        # a default partition of several warpgroups
    default = default_partition_regs(compiled, worker_regs)
    if default < 24:
        return f"the workers' claims {worker_regs} leave the default partition {default} registers"
    if default < 256 and ("dec", str(default)) not in found and not (wide and ("inc", str(default)) in found):
        return f"no setmaxnreg.dec to the default partition's share {default} (claims {sorted(claims)})"
    return ""


def ptxas_notes(compiled) -> "list | None":
    """The numbered notes (``(C75xx) ...``) that the ptxas Triton itself runs for sm_90 (``get_ptxas(90)``: CUDA 12.8
    in 3.6, the CUDA 13 ``ptxas-blackwell`` in 3.9) prints with ``-v`` for the build's PTX; [] for a build without
    wgmma (the notes are about it), None where that ptxas cannot be run."""
    import subprocess
    import tempfile

    ptx = compiled.asm["ptx"]
    if "wgmma.mma_async" not in ptx:
        return []
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        return None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError):
            return None
    if r.returncode != 0:
        return None
    return [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "(C75" in ln]


def wgmma_serialized_problem(notes) -> "str | None":
    """'' when ptxas keeps a build's asynchronous warpgroup products (wgmma) pipelined, else its C7514 (or C7512: too
    few registers) note, from the
    build's :func:`ptxas_notes` (None where those could not be read: None). Where ptxas finds a non-wgmma instruction
    reading an accumulator between a product's issue and its wait (after its own register allocation, so invisible
    in the PTX), it waits after every wgmma of the kernel, which is then a different kernel (the V tile 32 chain with
    an accumulator in flight across its loop's back-edge: +75%; the parts kernel without L2 norm on Triton 3.6:
    bench/NOTES.md, thirty-first session)."""
    if notes is None:
        return None
    serial = [ln for ln in notes if "C7514" in ln or "C7512" in ln]   # (C7512: for want of registers)
    return serial[0] if serial else ""


_ELEM_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i64": 8, "i32": 4, "i8": 1, "i1": 1}
SCRATCH_REACH = 4096    # bytes from its offset that a scratch buffer of unknown size is taken to cover


def _allocated_ttgir(compiled):
    """The kernel's TTGIR after Triton's shared-memory allocation (every ``local_alloc`` and scratch-using op
    carries ``allocation.offset``), as text; None where this Triton's pass API differs from 3.6-3.9's."""
    import tempfile

    try:
        from triton._C.libtriton import ir, nvidia, passes

        ctx = ir.context()
        ir.load_dialects(ctx)
        nvidia.load_dialects(ctx)
        with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
            f.write(compiled.asm["ttgir"])
        try:
            mod = ir.parse_mlir_module(f.name, ctx)
        finally:
            os.unlink(f.name)
        mod.context = ctx
        pm = ir.pass_manager(ctx)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, int(getattr(compiled.metadata, "ptx_version",
                                                                                  None) or 85))
        pm.run(mod, "gdn.aot")
        return str(mod)
    except (ImportError, AttributeError, TypeError):
        return None


def async_operand_problem(compiled) -> "str | None":
    """'' when no shared-memory buffer is placed on a tile that an asynchronous warpgroup product still reads, else
    the first such placement; None where the allocated IR is not available (:func:`_allocated_ttgir`). The hazard:
    Gluon's allocator counts a tile dead at its last use in the IR, an issued ``warpgroup_mma(is_async=True)`` is
    not a use after it, so a layout conversion's scratch (or a new buffer) between the issue and the wait that
    completes it may take the tile's bytes (the sm_90 prepare and parts kernels had this race; bench/NOTES.md,
    fifteenth session). The remedy: name the tiles in the wait's ``deps``. Read in program order (a wait with
    ``pendings = p`` completes a product followed by at least p others); where the IR gives no scratch size (Triton
    3.6) a scratch starting up to :data:`SCRATCH_REACH` bytes below a tile counts as on it."""
    text = _allocated_ttgir(compiled)
    return None if text is None else async_operand_race(text)


def async_operand_race(text: str) -> str:
    """:func:`async_operand_problem` on the text of an allocated TTGIR module."""
    import re

    tiles, root, events = {}, {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.#]+)(?::\d+)? = ttg\.local_alloc.*allocation\.offset = (\d+).*"
                     r"-> !ttg\.memdesc<([\dx]+)x(\w+),", line)
        if m:
            name, off, shape, elem = m.groups()
            size = _ELEM_BYTES.get(elem, 8)
            for d in shape.split("x"):
                size *= int(d)
            tiles[name] = (int(off), size)
            events.append(("place", int(off), size, line.strip()))
            continue
        m = re.match(r"\s*(%[\w.#]+) = ttg\.memdesc_\w+ (%[\w.#]+)", line)
        if m:
            root[m.group(1)] = root.get(m.group(2), m.group(2))
            continue
        m = re.match(r"\s*(%[\w.#]+) = ttng\.warp_group_dot (%[\w.#]+), (%[\w.#]+),.*isAsync = true", line)
        if m:
            events.append(("dot", m.group(1), [root.get(x, x) for x in m.group(2, 3)]))
            continue
        if "ttng.warp_group_dot_wait" in line:
            events.append(("wait", int(re.search(r"pendings = (\d+)", line).group(1))))
            continue
        m = re.search(r"allocation\.offset = (\d+)", line)
        if m:
            sz = re.search(r"allocation\.size = (\d+)", line)       # (Triton 3.9; 3.6 does not say)
            events.append(("place", int(m.group(1)), int(sz.group(1)) if sz else None, line.strip()))
    for i, ev in enumerate(events):
        if ev[0] != "dot":
            continue
        later, end = 0, len(events)
        for j in range(i + 1, len(events)):
            if events[j][0] == "dot":
                later += 1
            elif events[j][0] == "wait" and later >= events[j][1]:
                end = j
                break
        for t in ev[2]:
            if t not in tiles:
                continue        # a register operand
            lo, size = tiles[t]
            for j in range(i + 1, end):
                if events[j][0] != "place":
                    continue
                off, sz = events[j][1], events[j][2]
                if off < lo + size and off + (sz if sz is not None else SCRATCH_REACH) > lo:
                    return (f"the product {ev[1]} reads {t} (bytes {lo}..{lo + size}) while {events[j][3][:80]!r} "
                            f"is placed at {off}: name {t} in its wait's deps")
    return ""


def _compile_hopper() -> int:
    from .kernels import _gluon_api
    from .kernels.chunk import hopper as m

    if not _gluon_api.AVAILABLE:
        print("gdn.aot: hopper: Gluon not available in this Triton (the portable kernels run instead)", flush=True)
        return 0
    bad = unchecked = no_ptxas = 0
    injected = []       # builds where ptxas injects a wgmma wait (C7517): reported, not a failure
    builds = [("state pass", compile_hopper_state_pass, c) for c in HOPPER_CONFIGS]
    builds += [("fused pass", compile_hopper_fused_pass, c) for c in FUSED_CONFIGS]
    builds += [("register-state fused pass", compile_hopper_fused_t_pass, c) for c in FUSED_T_CONFIGS]
    builds += [("register-state segment pass", compile_hopper_segment_t_pass, c) for c in SEGMENT_T_CONFIGS]
    builds += [("reverse pass", compile_hopper_dh_pass, c) for c in DH_CONFIGS]
    builds += [("parts", compile_hopper_parts, c) for c in PARTS_CONFIGS]
    builds += [("prepare", compile_hopper_prepare, c) for c in PREPARE_CONFIGS]
    builds += PDL_PORTABLE_BUILDS
    # the warp-specialized kernels' worker register claims (the register-state kernel's fill its registers exactly)
    def ws_regs(build, cfg):
        if build is compile_hopper_fused_pass:
            return [m.OUTPUT_PARTITION_REGS] + ([m.T_LOADER_REGS] if cfg.get("TMA_WARP", _load_warp(cfg["BV"])) else [])
        if build is compile_hopper_segment_t_pass:
            from .kernels.chunk import hopper_segments as ms
            return [ms.SEG_LOADER_REGS]
        if build is compile_hopper_fused_t_pass:
            return ([m.T_PA_CHAIN_REGS, m.T_PA_AUX_REGS, m.T_PA_LOADER_REGS] if cfg.get("PA")
                    else [m.T_CHAIN_REGS, m.T_LOADER_REGS])
        return None
    for name, build, cfg in builds:
        try:
            compiled = build(**cfg)
            workers = ws_regs(build, cfg)
            why = register_pool_problem(compiled, workers) if workers else ""
            if why:
                raise RuntimeError(f"partition registers: {why}")
            why = pdl_problem(compiled) if cfg.get("PDL") else ""
            if why:
                raise RuntimeError(f"programmatic dependent launch: {why}")
            why = async_operand_problem(compiled)
            if why is None:
                unchecked += 1
            elif why:
                raise RuntimeError(f"shared-memory race: {why}")
            notes = ptxas_notes(compiled)
            why = wgmma_serialized_problem(notes)
            if why is None:
                no_ptxas += 1
            elif why:
                raise RuntimeError(f"wgmma serialized by ptxas: {why}")
            if notes and any("C7517" in ln for ln in notes):
                injected.append(f"{name} {cfg}")
        except Exception as e:  # noqa: BLE001 - reported, counted
            bad += 1
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            print(f"  FAIL hopper {name} {cfg}: {type(cause).__name__}: {cause}", flush=True)
    total = len(builds)
    print(f"gdn.aot: hopper: {total - bad} of {total} state-pass, fused, reverse-pass, parts and prepare "
          "configurations compile", flush=True)
    print(f"gdn.aot: hopper: async product operands checked in {total - unchecked} of {total} builds"
          + (" (this Triton's allocation passes are not the ones read here)" if unchecked else ""), flush=True)
    print(f"gdn.aot: hopper: wgmma pipelines checked by ptxas in {total - no_ptxas} of {total} builds"
          + (" (this Triton's ptxas could not be run)" if no_ptxas else ""), flush=True)
    if injected:
        print(f"gdn.aot: hopper: ptxas injects a wgmma wait (C7517: a register of a product read before its wait; "
              f"not a failure) in {len(injected)} builds, first {injected[0]}", flush=True)
    return 1 if bad else 0

def main(argv=None) -> int:
    """Run every scenario set (:data:`_ENV_SCENARIOS`) in a fresh process without ``TRITON_INTERPRET``."""
    if os.environ.get("GDN_AOT_CHILD") == "1":
        rc = _run_scenarios()
        if os.environ.get("GDN_AOT_HOPPER") == "1":
            rc |= _compile_hopper()
        return rc
    rc = 0
    for extra in _ENV_SCENARIOS:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(extra, GDN_AOT_CHILD="1", GDN_AOT_ENV=repr(extra), GDN_AOT_HOPPER="1" if not extra else "0")
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
        rc |= subprocess.run([sys.executable, "-m", "gdn.aot"], env=env).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
