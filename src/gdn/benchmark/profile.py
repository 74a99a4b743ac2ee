"""``gdn profile``: the time of every kernel of one chunked forward (+ backward) call, from torch.profiler's CUDA
kernel records (gdn, and with ``--fla`` / ``--flashinfer`` those peers' when importable), or of one cached decode
step of the GatedDeltaNet layer (``--layer-decode N``). The tool for an A/B of a tuning field::

    gdn profile --shapes 1x32768:16/32,4x4096:16/32 --out $OUT/profile.json
    GDN_TUNE=chunk_fwd.state_stages=3 gdn profile --forward --out $OUT/profile_stages3.json
    gdn profile --layer-decode 256 --state-dtype fp32 --layout v_last --out $OUT/layer_decode.json
    gdn profile --layer-train 4x4096:16/32 --out $OUT/layer.json    # the layer's forward + backward, idle gaps
    gdn profile --host --forward --shapes 1x8192:16/32,1x8192:8/16 --out $OUT/host.json   # host vs wall per call
    gdn profile --forward --varlen --shapes 4x4096:16/32 --out $OUT/varlen.json   # packed with cu_seqlens
    gdn profile --forward --varlen --flashinfer --shapes 1x65536:2/8   # FlashInfer's kernels beside gdn's

Inputs per shape ``NxT:H/HV``: bf16 q/k/v/beta, fp32 g, K = V = 128, L2 norm on, fp32 initial and final state; one
warm-up call, then ``--iters`` profiled calls; prints every kernel's mean time per call (us) and their sum, and the
call's device time (CUDA events, the host kept ahead, as ``gdn bench`` takes it): above the sum where the GPU idles
between the call's kernels, below it where they overlap (programmatic dependent launch).
"""
from __future__ import annotations

from collections import defaultdict

import torch


def parse_shapes(spec: str):
    """"1x8192:16/32,4x4096:16/32" -> [(N, T, H, HV), ...]."""
    out = []
    for item in spec.split(","):
        nt, heads = item.strip().split(":")
        n, t = (int(x) for x in nt.split("x"))
        h, hv = (int(x) for x in heads.split("/"))
        out.append((n, t, h, hv))
    return out


def _inputs(N, T, H, HV, device, K=128, V=128, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(N, T, H, K, device=device, generator=g).bfloat16().requires_grad_()
    k = torch.randn(N, T, H, K, device=device, generator=g).bfloat16().requires_grad_()
    v = torch.randn(N, T, HV, V, device=device, generator=g).bfloat16().requires_grad_()
    gl = (-torch.rand(N, T, HV, device=device, generator=g) * 0.2).float().requires_grad_()
    beta = torch.rand(N, T, HV, device=device, generator=g).bfloat16().requires_grad_()
    h0 = torch.randn(N, HV, K, V, device=device, generator=g).float() * 0.1
    do = torch.randn(N, T, HV, V, device=device, generator=g).bfloat16()
    return q, k, v, gl, beta, h0, do


def _packed(q, k, v, gl, beta, do, requires_grad: bool):
    """The N sequences of ``_inputs`` packed along T of one batch row, as serving engines call the op: (q, k, v, g,
    beta, do, cu_seqlens (device), cu_seqlens_cpu)."""
    N, T = q.shape[:2]
    q, k, v, gl, beta = (t.detach().reshape(1, N * T, *t.shape[2:]).requires_grad_(requires_grad)
                         for t in (q, k, v, gl, beta))
    cu_cpu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    return q, k, v, gl, beta, do.reshape(1, N * T, *do.shape[2:]), cu_cpu.to(q.device), cu_cpu


def _walls(step, iters: int, reps: int = 3):
    """Wall-clock seconds per call of ``step`` (``iters`` calls between two synchronisations), ``reps`` times."""
    import time

    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / iters)
    return out


def kernel_times(fn, iters: int):
    """[(kernel name, us per call, launches per call)] of ``fn`` on CUDA, slowest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot, cnt = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:90]] += e.device_time
            cnt[e.name[:90]] += 1
    return sorted(((n, t / iters, cnt[n] / iters) for n, t in tot.items()), key=lambda r: -r[1])


def _device_ms(step) -> float:
    """Device time per call of ``step`` (median, CUDA events, the host kept ahead: ``CudaTimer.device_time``)."""
    from gdn.benchmark.timing import CudaTimer

    return CudaTimer("cuda", target_s=0.1).device_time(lambda i: step()).median_ms


def run(shapes: str, iters: int = 5, forward_only: bool = False, fla: bool = False, out=None, print_fn=print,
        varlen: bool = False, flashinfer: bool = False):
    """Profile every shape; returns rows ``{peer, shape, mode, total_us, device_us, kernels: [{name, us, calls}]}``
    (also written to ``out`` as JSON when given). ``varlen``: the N sequences packed into one batch row with
    ``cu_seqlens`` (and its host copy), as serving engines call the op; else a batch of N rows. ``flashinfer``:
    FlashInfer's prefill too, forward calls only (it has no backward), on its conventions
    (:func:`gdn.benchmark.peers.flashinfer_prefill_inputs`, converted before the profiled calls); it always takes
    cu_seqlens, so its rows are the same whether ``varlen`` or not."""
    import json

    from gdn.ops import chunk_gated_delta_rule

    if not torch.cuda.is_available():
        raise RuntimeError("gdn profile needs a CUDA device")
    peers = {"gdn": chunk_gated_delta_rule}
    if fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
            peers["fla"] = fla_chunk
        except Exception as e:  # noqa: BLE001 - optional peer
            print_fn(f"fla not importable: {e}")
    if flashinfer and forward_only:
        from gdn.benchmark import peers as PE

        try:
            fi = PE.flashinfer_prefill()

            def fi_op(q, k, v, g, beta, *, fi_x, scale, **_):
                """FlashInfer on the inputs converted for it before the profiled calls (``fi_x``)."""
                return PE.flashinfer_prefill_call(fi, fi_x, scale)
            peers["flashinfer"] = fi_op
        except Exception as e:  # noqa: BLE001 - optional peer
            print_fn(f"flashinfer not importable: {e}")
    elif flashinfer:
        print_fn("flashinfer: no GDN backward, profiled with --forward only")
    mode = ("fwd" if forward_only else "fwd+bwd") + (" varlen" if varlen else "")
    rows = []
    for (N, T, H, HV) in parse_shapes(shapes):
        q, k, v, gl, beta, h0, do = _inputs(N, T, H, HV, "cuda")
        cu = {}
        if varlen:
            q, k, v, gl, beta, do, cu_dev, cu_cpu = _packed(q, k, v, gl, beta, do, not forward_only)
            cu = dict(cu_seqlens=cu_dev)
        shape = f"{N}x{T}:{H}/{HV}"
        for name, op in peers.items():
            # (cu_seqlens_cpu for gdn only: fla 0.6 does not take it)
            kw = dict(cu, cu_seqlens_cpu=cu_cpu) if (varlen and name == "gdn") else cu
            if name == "flashinfer":
                kw = dict(fi_x=PE.flashinfer_prefill_inputs(q.detach(), k.detach(), v.detach(), gl.detach(),
                                                            beta.detach(), h0, cu.get("cu_seqlens")))

            def step(op=op, kw=kw):
                with torch.set_grad_enabled(not forward_only):
                    o, _ = op(q, k, v, gl, beta, scale=128 ** -0.5, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, **kw)
                    if not forward_only:
                        torch.autograd.grad(o, (q, k, v, gl, beta), do)
            try:
                ks = kernel_times(step, iters)
                dev_us = _device_ms(step) * 1e3
            except Exception as e:  # noqa: BLE001 - one failing peer / shape must not stop the others
                print_fn(f"{name} {shape}: failed: {e}")
                continue
            total = sum(r[1] for r in ks)
            print_fn(f"\n== {name} {shape} {mode}: sum of kernels {total / 1000:.3f} ms per call, device time "
                     f"{dev_us / 1000:.3f} ms")
            for n, t, c in ks:
                print_fn(f"  {t:9.1f} us  x{c:4.1f}  {n}")
            rows.append(dict(peer=name, shape=shape, mode=mode, total_us=total, device_us=dev_us,
                             kernels=[dict(name=n, us=t, calls=c) for n, t, c in ks]))
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def host_times(shapes: str, iters: int = 20, forward_only: bool = False, out=None, print_fn=print):
    """Host time of the chunked op per call, shape by shape, called the way serving engines call it (``B = 1``,
    ``cu_seqlens`` with its host copy ``cu_seqlens_cpu``; ``N`` sequences of ``T`` tokens): ``host_ms``, the CPU time
    to enqueue one call while the GPU is held busy (``torch.cuda._sleep`` ahead, so no call waits for the GPU);
    ``wall_ms``, the time per call back to back (what ``gdn bench`` sees). ``host_ms`` near ``wall_ms``: the row is
    host-bound. Best of three rounds of ``iters`` calls each. Returns rows ``{shape, mode, host_ms, wall_ms, planned,
    unplanned}``: the host plans made for the shape's calls (:func:`gdn.kernels.host_plan.stats`) and, per planned
    function whose recording failed, what stopped it (a call that runs its Python path every time)."""
    import json
    import time

    from gdn.kernels import host_plan
    from gdn.ops import chunk_gated_delta_rule

    if not torch.cuda.is_available():
        raise RuntimeError("gdn profile needs a CUDA device")
    mode = "fwd" if forward_only else "fwd+bwd"
    rows = []
    for (N, T, H, HV) in parse_shapes(shapes):
        q, k, v, gl, beta, h0, do = _inputs(N, T, H, HV, "cuda")
        q, k, v, gl, beta, do, cu, cu_cpu = _packed(q, k, v, gl, beta, do, not forward_only)

        def step():
            with torch.set_grad_enabled(not forward_only):
                o, _ = chunk_gated_delta_rule(q, k, v, gl, beta, scale=128 ** -0.5, initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                              use_qk_l2norm_in_kernel=True)
                if not forward_only:
                    torch.autograd.grad(o, (q, k, v, gl, beta), do)

        host_plan.clear()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        host = []
        for _ in range(3):
            torch.cuda._sleep(int(2e9))     # ~1 s of GPU time: every call below is enqueued behind it
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            host.append((time.perf_counter() - t0) / iters * 1e3)
            torch.cuda.synchronize()
        wall = [t * 1e3 for t in _walls(step, iters)]
        st = host_plan.stats()
        row = dict(shape=f"{N}x{T}:{H}/{HV}", mode=mode, host_ms=min(host), wall_ms=min(wall), planned=st["plans"],
                   unplanned=st["why"])
        print_fn(f"{row['shape']:>16} {mode:7}  host {row['host_ms']:.3f} ms  wall {row['wall_ms']:.3f} ms"
                 f"{'  (host-bound)' if row['host_ms'] > 0.9 * row['wall_ms'] else ''}"
                 f"  host plans {st['plans']}{'  NOT planned: ' + str(st['why']) if st['why'] else ''}")
        rows.append(row)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def layer_decode(N: int, state_dtype: str = "fp32", layout: str = "v_last", hidden: int = 2048, H: int = 16,
                 HV: int = 32, iters: int = 20, out=None, print_fn=print):
    """Kernels of one cached decode step of :class:`gdn.layers.GatedDeltaNet` (bf16 weights, ``N`` sequences x 1
    token, states of ``state_dtype`` in ``layout`` after a 16-token prefill), plus the step's CUDA-graph replay time
    and the fraction of copy bandwidth its bytes (the layer_decode floor of ``gdn.benchmark.cases``) reach."""
    import json

    from gdn.benchmark.cases import Case, cost
    from gdn.benchmark.timing import CudaTimer, measure_copy_GBps
    from gdn.layers import GDNCache, GatedDeltaNet

    dev = torch.device("cuda")
    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    torch.manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    layer = GatedDeltaNet(hidden, H, HV, 128, 128, **bf).eval()
    cache = GDNCache.for_layers(layer, num_slots=N, dtype=sdt, state_layout=layout)
    batch = cache.batch(cache.allocate(N))
    x = torch.randn(N, 1, hidden, **bf)
    with torch.no_grad():
        layer(torch.randn(N, 16, hidden, **bf), cache=batch)

    def step():
        with torch.no_grad():
            return layer(x, cache=batch)

    ks = kernel_times(step, iters)
    total = sum(r[1] for r in ks)
    timing = CudaTimer(dev).time(lambda i: step(), graph=True)   # CUDA-graph replay (mode says if it fell back)
    replay_us = timing.median_ms * 1000
    case = Case(op="layer_decode", model="qwen3next-tp1", batch=N, seqlen=1, H=H, HV=HV, K=128, V=128,
                state_dtype=state_dtype, hidden=hidden)
    nbytes = cost(case)["bytes"]
    gbps = measure_copy_GBps(dev)
    frac = nbytes / (replay_us * 1e-6) / (gbps * 1e9)
    print_fn(f"\n== layer_decode N={N} {state_dtype} {layout}: {timing.mode} {replay_us:.1f} us, sum of kernels "
             f"{total:.1f} us, {nbytes / 1e6:.1f} MB -> {frac:.1%} of copy ({gbps:.0f} GB/s)")
    for n, t, c in ks:
        print_fn(f"  {t:9.1f} us  x{c:4.1f}  {n}")
    row = dict(op="layer_decode", N=N, state_dtype=state_dtype, layout=layout, replay_us=replay_us, mode=timing.mode, total_us=total,
               bytes=nbytes, copy_GBps=gbps, frac_of_copy_bw=frac,
               kernels=[dict(name=n, us=t, calls=c) for n, t, c in ks])
    if out:
        with open(out, "w") as f:
            json.dump(row, f, indent=1)
    return row


def _idle_gaps(prof, top: int = 8):
    """(GPU idle time between consecutive kernels in us, the ``top`` largest gaps as (us, kernel before, kernel
    after)) of a profile's CUDA kernel records."""
    ks = sorted(((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda r: r[0])
    idle, gaps, end, prev = 0.0, [], None, ""
    for s, e, n in ks:
        if end is not None and s > end:
            idle += s - end
            gaps.append((s - end, prev, n))
        if end is None or e > end:
            end, prev = e, n
    return idle, sorted(gaps, key=lambda r: -r[0])[:top]


def layer_train(shape: str, hidden: int = 2048, iters: int = 10, out=None, print_fn=print):
    """Kernels of one forward + backward of :class:`gdn.layers.GatedDeltaNet` (bf16, ``NxT:H/HV``, K = V = 128,
    batched input, as ``gdn bench --ops layer`` times it): per-kernel times, their sum, the wall time per call and
    the GPU's idle time between kernels (host and launch gaps) with the largest gaps."""
    import json

    from gdn.layers import GatedDeltaNet

    (N, T, H, HV), = parse_shapes(shape)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden, H, HV, 128, 128, device=dev, dtype=torch.bfloat16).train()
    x = torch.randn(N, T, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(N, T, hidden, device=dev, dtype=torch.bfloat16)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        torch.autograd.grad(layer(x), [x] + params, dout, allow_unused=True)

    ks = kernel_times(step, iters)
    total = sum(r[1] for r in ks)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    idle, gaps = _idle_gaps(prof)
    walls = [t * 1e6 for t in _walls(step, iters)]
    peak = torch.cuda.max_memory_allocated(dev) / 1e6
    print_fn(f"\n== layer fwd+bwd {shape} hidden {hidden}: wall {min(walls):.1f} us per call (of {walls}), sum of "
             f"kernels {total:.1f} us, GPU idle between kernels {idle / iters:.1f} us per call; peak {peak:.0f} MB")
    for n, t, c in ks:
        print_fn(f"  {t:9.1f} us  x{c:4.1f}  {n}")
    print_fn("  largest gaps (us, kernel before -> after):")
    for g, a, b in gaps:
        print_fn(f"    {g:8.1f}  {a} -> {b}")
    row = dict(op="layer", shape=shape, hidden=hidden, wall_us=min(walls), walls_us=walls, total_us=total,
               idle_us=idle / iters, peak_MB=peak, gaps=[dict(us=g, before=a, after=b) for g, a, b in gaps],
               kernels=[dict(name=n, us=t, calls=c) for n, t, c in ks])
    if out:
        with open(out, "w") as f:
            json.dump(row, f, indent=1)
    return row


def add_arguments(p):
    p.add_argument("--shapes", default="1x32768:16/32,4x4096:16/32", help="NxT:H/HV, comma-separated")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--forward", action="store_true", help="the forward only (default: forward + backward)")
    p.add_argument("--varlen", action="store_true",
                   help="the N sequences of a shape packed into one row with cu_seqlens, as serving engines call it "
                        "(default: a batch of N rows)")
    p.add_argument("--fla", action="store_true", help="also profile fla's chunked op when importable")
    p.add_argument("--flashinfer", action="store_true",
                   help="also profile FlashInfer's chunked prefill when importable (with --forward)")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    p.add_argument("--host", action="store_true",
                   help="host time per call (GPU held busy) and wall time per call, varlen as engines call it")
    p.add_argument("--layer-decode", type=int, default=0, metavar="N",
                   help="profile one cached decode step of the GatedDeltaNet layer for N sequences instead")
    p.add_argument("--layer-train", default=None, metavar="NxT:H/HV",
                   help="profile one forward + backward of the GatedDeltaNet layer (hidden 2048, bf16) instead")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help="--layer-decode: state dtype")
    p.add_argument("--layout", choices=("v_last", "k_last"), default="v_last", help="--layer-decode: state layout")


def main(args) -> int:
    if args.layer_train:
        layer_train(args.layer_train, iters=max(args.iters, 10), out=args.out)
    elif args.layer_decode:
        layer_decode(args.layer_decode, args.state_dtype, args.layout, iters=max(args.iters, 20), out=args.out)
    elif args.host:
        host_times(args.shapes, max(args.iters, 10), args.forward, args.out)
    else:
        run(args.shapes, args.iters, args.forward, args.fla, args.out, varlen=args.varlen, flashinfer=args.flashinfer)
    return 0


__all__ = ["run", "host_times", "layer_decode", "layer_train", "kernel_times", "parse_shapes", "add_arguments", "main"]
