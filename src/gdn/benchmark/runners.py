"""One runner per op: build the inputs of a case, check every implementation against the float64 reference on them,
then time it. Each runner returns one row (see ``report.py``).

Correctness, recorded per implementation as ``<impl>_err`` (the largest relative error ``||x - ref|| / ||ref||`` over
the outputs listed in ``err_detail``), is taken on the inputs being timed:

- decode, recurrent: the full-size call on buffer set 0, compared on a few sequences at both ends of the batch (the
  last ones sit at the largest offsets) with ``gdn.reference.recurrent_gated_delta_rule_ref`` in float64: outputs and
  every state written.
- chunk_fwd, chunk_fwd_bwd, conv: the first ``check_tokens`` tokens of the first sequence of set 0 (the ops are
  causal, so this is a prefix of the timed problem), against ``chunk_gated_delta_rule_ref`` / ``causal_conv1d_ref``
  in float64: o, the final state and, for the backward, dq, dk, dv, dg, dbeta. chunk_fwd and conv also compare gdn's
  full-size output with each peer's (``gdn_vs_<peer>``).
- layer: gdn's block in bf16 against the same block in float64 on the PyTorch reference path (``GDN_BACKEND=torch``)
  on a short input: output and input gradient.
- layer_decode: the full-size cached step on buffer set 0, compared on a few sequences at both ends of the batch with
  ``gdn.layers.gated_deltanet.gated_deltanet_ref`` in float64 from the same cached states: output, and the conv and
  recurrent states written back to the cache.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import peers as P
from .cases import Case, cost
from .timing import rotation_sets

IMPLS = ("gdn", "fla", "flashinfer")


class ContextLost(RuntimeError):
    """The CUDA context no longer works (e.g. after an illegal memory access): nothing more can be timed in this
    process. ``row`` holds what the case had recorded."""

    def __init__(self, msg: str, row: Optional[dict] = None):
        super().__init__(msg)
        self.row = row


@dataclass
class Ctx:
    device: torch.device
    timer: object
    l2_bytes: int = 50 * 2 ** 20
    peers: frozenset = frozenset()       # peers enabled and importable
    check_tokens: int = 2048
    check_seqs: int = 8
    seed: int = 0


@dataclass
class Impl:
    name: str
    run: Optional[Callable[[int], object]] = None      # the timed call, on buffer set i
    check: Optional[Callable[[], Dict[str, float]]] = None
    output: Optional[Callable[[], torch.Tensor]] = None  # full-size main output on set 0 (cross-check)
    graph: bool = False
    note: Optional[str] = None
    error: Optional[str] = None                      # set when the implementation cannot run at all
    context: Optional[Callable[[], object]] = None   # context manager around check + timing


# ----------------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------------
def new_row(case: Case) -> dict:
    row = case.to_dict()
    row.update(key=case.key, n_sets=None, err_what=None, errors={}, notes=[], timing={}, err_detail={})
    for name in IMPLS:
        row[f"{name}_ms"] = None
        row[f"{name}_err"] = None
    return row


def dev_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` computed on the tensors' device in float64 (``gdn.testing.rel_err`` copies to the host,
    too slow for the gigabyte outputs compared here); NaN or inf anywhere gives inf."""
    x, ref = x.detach(), ref.detach()
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    num = den = 0.0
    xf, rf = x.reshape(-1), ref.reshape(-1)
    step = 1 << 26
    for s in range(0, xf.numel(), step):
        a = xf[s:s + step].to(torch.float64)
        b = rf[s:s + step].to(torch.float64)
        if not bool(torch.isfinite(a).all()):
            return float("inf")
        num += float(((a - b) ** 2).sum())
        den += float((b ** 2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _grad(outs, grads, inputs):
    """Backward through whichever outputs carry a graph (an implementation may return a final state without one)."""
    pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and o.requires_grad]
    if not pairs:
        raise RuntimeError("no output requires grad: the op's backward is not connected")
    return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)


def _alive(device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


def _free(device):
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


def _check_rows(n: int, k: int) -> torch.Tensor:
    """Up to ``k`` sequence indices: the first and the last ones."""
    if n <= k:
        return torch.arange(n)
    h = k // 2
    return torch.cat([torch.arange(h), torch.arange(n - (k - h), n)])


def _seed(ctx: Ctx, i: int):
    torch.manual_seed(ctx.seed * 1000 + i)


def _gates(shape, device):
    """log-space decay g = logsigmoid(N(3, 2)): mostly gentle (near 0), a tail down to about -5."""
    return F.logsigmoid(torch.randn(shape, device=device) * 2 + 3)


def _raw_gate_params(HV, device):
    A_log = torch.log(torch.empty(HV, device=device).uniform_(1, 16))
    dt_bias = torch.randn(HV, device=device) * 0.5
    return A_log, dt_bias


PEAK_OPS = ("chunk_fwd", "chunk_fwd_bwd", "layer")   # ops whose rows carry <impl>_peak_MB
DEVICE_TIME_OPS = PEAK_OPS      # eager-timed ops whose rows also carry <impl>_device_ms (the host kept ahead)


def peak_extra_mb(run: Callable[[int], object], device) -> Optional[float]:
    """MB allocated by one call of ``run(0)`` above what was allocated before it (its scratch, saved activations and
    outputs, which the call frees or drops afterwards): ``torch.cuda.max_memory_allocated`` after a reset. None off
    CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run(0)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20


def held_base(name: str, device) -> Optional[int]:
    """Bytes allocated before an implementation's first call of a row, its process-wide scratch dropped first
    (:func:`peers.drop_scratch`); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    P.drop_scratch(name)
    return torch.cuda.memory_allocated(device)


def held_mb(base: Optional[int], device) -> Optional[float]:
    """MB an implementation still holds after its calls of a row (the calls' results dropped): scratch kept between
    calls in process-wide caches, which ``peak_extra_mb`` (measured after them) does not see."""
    if base is None or device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return max(0.0, (torch.cuda.memory_allocated(device) - base) / 2 ** 20)


def measure(row: dict, impls: List[Impl], n_sets: int, ctx: Ctx) -> dict:
    """Check then time each implementation; every failure is recorded in the row, none escapes (except a lost
    CUDA context, which ends the run)."""
    row["n_sets"] = n_sets
    outputs = {}
    for impl in impls:
        name = impl.name
        if impl.error:
            row["errors"][name] = impl.error
            continue
        cm = impl.context() if impl.context else contextlib.nullcontext()
        try:
            base = held_base(name, ctx.device) if row.get("op") in PEAK_OPS else None
            with cm:
                if impl.check is not None:
                    try:
                        det = impl.check()
                        row["err_detail"][name] = det
                        row[f"{name}_err"] = max(det.values()) if det else None
                    except NotImplementedError:
                        raise
                    except Exception as e:
                        row["errors"][f"{name}_check"] = P.short_error(e)
                        if not _alive(ctx.device):
                            raise ContextLost(f"{name} check: {P.short_error(e)}", row)
                t = ctx.timer.time(impl.run, n_sets, graph=impl.graph)
                row[f"{name}_ms"] = t.median_ms
                if row.get("op") in PEAK_OPS:
                    row[f"{name}_peak_MB"] = peak_extra_mb(impl.run, ctx.device)
                    row[f"{name}_held_MB"] = held_mb(base, ctx.device)
                row["timing"][name] = {"mode": t.mode, "spread": t.spread, "samples": t.samples,
                                       "calls_per_sample": t.calls_per_sample}
                if row.get("op") in DEVICE_TIME_OPS and not t.mode.startswith("graph"):
                    d = ctx.timer.device_time(impl.run, n_sets)
                    row[f"{name}_device_ms"] = d.median_ms
                    row[f"{name}_host_ms"] = d.host_ms
                    row["timing"][name]["device_spread"] = d.spread
                if impl.output is not None:
                    outputs[name] = impl.output()
            if impl.note:
                row["notes"].append(f"{name}: {impl.note}")
        except ContextLost:
            raise
        except NotImplementedError as e:
            row["errors"][name] = P.short_error(e)
        except Exception as e:
            row["errors"][name] = P.short_error(e)
            if not _alive(ctx.device):
                raise ContextLost(f"{name}: {P.short_error(e)}", row)
        finally:
            _free(ctx.device)
    if "gdn" in outputs:
        for name, o in outputs.items():
            if name != "gdn":
                try:
                    row[f"gdn_vs_{name}"] = dev_rel_err(outputs["gdn"], o)
                except Exception as e:
                    row["errors"][f"gdn_vs_{name}"] = P.short_error(e)
    outputs.clear()
    return row


def _peer_impl(name: str, ctx: Ctx, build: Callable[[], Impl]) -> Optional[Impl]:
    """``build()`` for an enabled, importable peer (its import errors become the row's error); None otherwise."""
    if name not in ctx.peers:
        return None
    try:
        return build()
    except Exception as e:
        return Impl(name, error=P.short_error(e))


# ----------------------------------------------------------------------------------------------------------------------
# decode: one token, raw gates, k-last state updated in place, CUDA-graph replay
# ----------------------------------------------------------------------------------------------------------------------
def run_decode(case: Case, ctx: Ctx) -> dict:
    import gdn.ops as gops
    from gdn.reference import recurrent_gated_delta_rule_ref

    dev, B, H, HV, K, V = ctx.device, case.batch, case.H, case.HV, case.K, case.V
    sdt = torch.float32 if case.state_dtype == "fp32" else torch.bfloat16
    row = new_row(case)
    row["err_what"] = "o and new state of the timed call vs float64 reference, first/last sequences"
    n_sets = rotation_sets(cost(case)["bytes"], ctx.l2_bytes)
    _seed(ctx, 0)
    A_log, dt_bias = _raw_gate_params(HV, dev)
    sets = []
    for i in range(n_sets):
        _seed(ctx, i + 1)
        bf = dict(device=dev, dtype=torch.bfloat16)
        sets.append(dict(q=torch.randn(B, 1, H, K, **bf), k=torch.randn(B, 1, H, K, **bf),
                         v=torch.randn(B, 1, HV, V, **bf), a=torch.randn(B, 1, HV, **bf),
                         b=torch.randn(B, 1, HV, **bf),
                         state=(torch.randn(B, HV, V, K, device=dev) * 0.05).to(sdt)))
    idx = _check_rows(B, ctx.check_seqs).to(dev)
    pristine = sets[0]["state"][idx].clone()   # timing updates the states in place: each check restarts from here
    ref = {}

    def reference():
        if not ref:
            x = {n: sets[0][n][idx].double() for n in ("q", "k", "v", "a", "b")}
            ref["o"], ref["state"] = recurrent_gated_delta_rule_ref(
                x["q"], x["k"], x["v"], initial_state=pristine.double(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, state_layout="k_last", A_log=A_log.double(), a=x["a"],
                dt_bias=dt_bias.double(), b=x["b"])
        return ref["o"], ref["state"]

    def checker(call):
        def check():
            s = sets[0]
            s["state"][idx] = pristine
            o, st = call(s)
            ro, rs = reference()
            return {"o": dev_rel_err(o[idx], ro), "state": dev_rel_err(st[idx], rs)}
        return check

    def gdn_call(s):
        return gops.gated_delta_rule_decode(s["q"], s["k"], s["v"], s["state"], A_log, s["a"], dt_bias, s["b"],
                                            use_qk_l2norm=True, state_layout="k_last")

    impls = [Impl("gdn", run=lambda i: gdn_call(sets[i]), check=checker(gdn_call), graph=True)]

    def build_fla():
        fr = P.fla_recurrent()

        def call(s):
            return fr(s["q"], s["k"], s["v"], g=s["a"], beta=s["b"], initial_state=s["state"],
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)
        note = "fused_recurrent (T=1), final state written to a new float32 tensor (not in place)"
        return Impl("fla", run=lambda i: call(sets[i]), check=checker(call), graph=True, note=note)

    def build_fi():
        fi = P.flashinfer_decode()

        def call(s):
            return fi(s["q"], s["k"], s["v"], s["state"], A_log, s["a"], dt_bias, s["b"], use_qk_l2norm=True)
        return Impl("flashinfer", run=lambda i: call(sets[i]), check=checker(call), graph=True)

    impls += [x for x in (_peer_impl("fla", ctx, build_fla), _peer_impl("flashinfer", ctx, build_fi)) if x]
    return measure(row, impls, n_sets, ctx)


# ----------------------------------------------------------------------------------------------------------------------
# recurrent: T-token speculative verify from a state pool (2-D ssm_state_indices, num_accepted_tokens)
# ----------------------------------------------------------------------------------------------------------------------
def run_recurrent(case: Case, ctx: Ctx) -> dict:
    import gdn.ops as gops
    from gdn.reference import recurrent_gated_delta_rule_ref

    dev, N, T, H, HV, K, V = ctx.device, case.batch, case.seqlen, case.H, case.HV, case.K, case.V
    sdt = torch.float32 if case.state_dtype == "fp32" else torch.bfloat16
    row = new_row(case)
    row["err_what"] = ("o and the T states written to the pool by the timed call vs float64 reference, "
                       "first/last sequences")
    n_sets = rotation_sets(cost(case)["bytes"], ctx.l2_bytes)
    _seed(ctx, 0)
    A_log, dt_bias = _raw_gate_params(HV, dev)
    slots = (1 + torch.arange(N * T, device=dev, dtype=torch.int32)).view(N, T)   # slot 0 spare
    acc = torch.randint(1, T + 1, (N,), device=dev, dtype=torch.int32)
    read = slots[torch.arange(N, device=dev), acc.long() - 1].contiguous()
    sets = []
    for i in range(n_sets):
        _seed(ctx, i + 1)
        bf = dict(device=dev, dtype=torch.bfloat16)
        pool = (torch.randn(N * T + 1, HV, V, K, device=dev) * 0.05).to(sdt)
        sets.append(dict(q=torch.randn(N, T, H, K, **bf), k=torch.randn(N, T, H, K, **bf),
                         v=torch.randn(N, T, HV, V, **bf), a=torch.randn(N, T, HV, **bf),
                         b=torch.randn(N, T, HV, **bf), pool=pool))
    idx = _check_rows(N, ctx.check_seqs).to(dev)
    pristine = sets[0]["pool"][read[idx].long()].clone()   # start states of the checked sequences (timing mutates)
    refs = {}

    def reference():
        if not refs:
            s = sets[0]
            x = {n: s[n][idx].double() for n in ("q", "k", "v", "a", "b")}
            kw = dict(use_qk_l2norm_in_kernel=True, state_layout="k_last", A_log=A_log.double(),
                      dt_bias=dt_bias.double())
            init0 = pristine.double()
            ro, _ = recurrent_gated_delta_rule_ref(x["q"], x["k"], x["v"], initial_state=init0, a=x["a"], b=x["b"],
                                                   **kw)
            states = []
            for t in range(T):   # the state after token t: the reference on the first t + 1 tokens
                _, st = recurrent_gated_delta_rule_ref(
                    x["q"][:, :t + 1], x["k"][:, :t + 1], x["v"][:, :t + 1], initial_state=init0,
                    output_final_state=True, a=x["a"][:, :t + 1], b=x["b"][:, :t + 1], **kw)
                states.append(st)
            refs["o"], refs["states"] = ro, torch.stack(states, 1)   # [n, T, HV, V, K]
        return refs["o"], refs["states"]

    def check_pool(call):
        def check():
            s = sets[0]
            s["pool"][read[idx].long()] = pristine
            o = _first(call(s))
            ro, rst = reference()
            written = s["pool"][slots[idx].long()]           # [n, T, HV, V, K]
            return {"o": dev_rel_err(o[idx], ro), "states": dev_rel_err(written, rst)}
        return check

    def gdn_call(s):
        return gops.fused_recurrent_gated_delta_rule(
            s["q"], s["k"], s["v"], initial_state=s["pool"], output_final_state=True, use_qk_l2norm_in_kernel=True,
            state_layout="k_last", ssm_state_indices=slots, num_accepted_tokens=acc, inplace_final_state=True,
            A_log=A_log, a=s["a"], dt_bias=dt_bias, b=s["b"])

    impls = [Impl("gdn", run=lambda i: gdn_call(sets[i]), check=check_pool(gdn_call), graph=True)]

    def build_fla():
        fr = P.fla_recurrent()
        for s in sets:   # fla has no pool: gather each sequence's start state up front (not timed)
            s["init"] = s["pool"][read.long()].contiguous()

        def call(s):
            return fr(s["q"], s["k"], s["v"], g=s["a"], beta=s["b"], initial_state=s["init"],
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)

        def check():
            o, st = call(sets[0])   # its gathered start states were taken before anything ran
            ro, rst = reference()
            return {"o": dev_rel_err(o[idx], ro), "final_state": dev_rel_err(st[idx], rst[:, -1])}
        note = ("no state pool in fla 0.6.0: start states gathered beforehand (untimed), only the final state "
                "written (1 state write per sequence instead of T): less work than gdn/FlashInfer")
        return Impl("fla", run=lambda i: call(sets[i]), check=check, graph=True, note=note)

    def build_fi():
        if sdt != torch.float32:
            return Impl("flashinfer", error="gated_delta_rule_mtp with per-token pool slots needs a float32 pool")
        mtp = P.flashinfer_mtp()

        def call(s):
            return mtp(s["q"], s["k"], s["v"], s["pool"], read, A_log, s["a"], dt_bias, s["b"],
                       ssm_state_indices=slots, disable_state_update=False, use_qk_l2norm=True)
        return Impl("flashinfer", run=lambda i: call(sets[i]), check=check_pool(call), graph=True)

    impls += [x for x in (_peer_impl("fla", ctx, build_fla), _peer_impl("flashinfer", ctx, build_fi)) if x]
    return measure(row, impls, n_sets, ctx)


# ----------------------------------------------------------------------------------------------------------------------
# chunked prefill / training
# ----------------------------------------------------------------------------------------------------------------------
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


def run_chunk(case: Case, ctx: Ctx) -> dict:
    import gdn.ops as gops
    from gdn.reference import chunk_gated_delta_rule_ref

    bwd = case.op == "chunk_fwd_bwd"
    dev, B, T, H, HV, K, V = ctx.device, case.batch, case.seqlen, case.H, case.HV, case.K, case.V
    row = new_row(case)
    Pn = min(T, ctx.check_tokens)
    row["err_what"] = (f"o, final state{' and dq, dk, dv, dg, dbeta' if bwd else ''} on the first {Pn} tokens of "
                       "sequence 0 vs float64 reference")
    n_sets = rotation_sets(cost(case)["bytes"], ctx.l2_bytes)
    sets = []
    for i in range(n_sets):
        _seed(ctx, i + 1)
        bf = dict(device=dev, dtype=torch.bfloat16)
        s = dict(q=torch.randn(B, T, H, K, **bf), k=torch.randn(B, T, H, K, **bf), v=torch.randn(B, T, HV, V, **bf),
                 g=_gates((B, T, HV), dev), beta=torch.sigmoid(torch.randn(B, T, HV, **bf)),
                 h0=torch.randn(B, HV, K, V, device=dev) * 0.05)
        if bwd:
            for n in ("q", "k", "v", "g", "beta"):
                s[n].requires_grad_(True)
            s["do"] = torch.randn(B, T, HV, V, **bf)
            s["dht"] = torch.randn(B, HV, K, V, device=dev) * 0.05
        sets.append(s)
    names = ("q", "k", "v", "g", "beta")
    ref = {}

    def prefix():
        s = sets[0]
        p = {n: s[n][:1, :Pn].detach().clone() for n in names}
        p["h0"] = s["h0"][:1].clone()
        if bwd:
            p["do"], p["dht"] = s["do"][:1, :Pn].clone(), s["dht"][:1].clone()
        return p

    def reference():
        if not ref:
            p = prefix()
            x = {n: p[n].double().requires_grad_(bwd) for n in names}
            o, ht = chunk_gated_delta_rule_ref(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                               initial_state=p["h0"].double(), output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
            ref["o"], ref["ht"] = o.detach(), ht.detach()
            if bwd:
                gr = _grad((o, ht), (p["do"].double(), p["dht"].double()), [x[n] for n in names])
                ref.update({gn: gv for gn, gv in zip(GRAD_NAMES, gr)})
        return ref

    def errs(o, ht, grads=None) -> Dict[str, float]:
        r = reference()
        d = {"o": dev_rel_err(o, r["o"]), "final_state": dev_rel_err(ht, r["ht"])}
        if grads is not None:
            for gn, gv in zip(GRAD_NAMES, grads):
                d[gn] = dev_rel_err(gv, r[gn]) if gv is not None else float("inf")
        return d

    def standard_impl(name, fn, note=None, context=None):
        """gdn and fla share the calling convention (B, T, heads, dim; state [N, HV, K, V])."""
        def call(s):
            return fn(s["q"], s["k"], s["v"], s["g"], s["beta"], initial_state=s["h0"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)

        def check():
            p = prefix()
            if bwd:
                for n in names:
                    p[n].requires_grad_(True)
                o, ht = call(p)
                grads = _grad((o, ht), (p["do"], p["dht"]), [p[n] for n in names])
                return errs(o, ht, grads)
            with torch.no_grad():
                o, ht = call(p)
            return errs(o, ht)

        if bwd:
            def run(i):
                s = sets[i]
                o, ht = call(s)
                _grad((o, ht), (s["do"], s["dht"]), [s[n] for n in names])
            output = None
        else:
            def run(i):
                with torch.no_grad():
                    call(sets[i])

            def output():
                with torch.no_grad():
                    return call(sets[0])[0]
        return Impl(name, run=run, check=check, output=output, note=note, context=context)

    impls = [standard_impl("gdn", gops.chunk_gated_delta_rule)]

    def build_fla():
        if bwd:
            return standard_impl("fla", P.fla_chunk(), note=P.FLA_BWD_GUARD_NOTE, context=P.fla_bwd_guard_bypassed)
        return standard_impl("fla", P.fla_chunk())

    def build_fi():
        if bwd:
            return Impl("flashinfer", error="FlashInfer has no GDN backward")
        fi = P.flashinfer_prefill()

        def fi_inputs(s):
            return P.flashinfer_prefill_inputs(s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"])

        for s in sets:
            s["fi"] = fi_inputs(s)

        def call(f):
            return P.flashinfer_prefill_call(fi, f)

        def check():
            o, ht = call(fi_inputs(prefix()))
            return errs(o, ht)

        return Impl("flashinfer", run=lambda i: call(sets[i]["fi"]), check=check,
                    output=lambda: call(sets[0]["fi"])[0])

    impls += [x for x in (_peer_impl("fla", ctx, build_fla), _peer_impl("flashinfer", ctx, build_fi)) if x]
    # the float64 reference before any implementation's calls: built lazily by the first check, it was counted in
    # that implementation's <impl>_held_MB (2.125 MiB per value head for the 2048-token prefix: all of gdn's "held" in
    # the thirty-sixth session's first record)
    reference()
    return measure(row, impls, n_sets, ctx)


# ----------------------------------------------------------------------------------------------------------------------
# causal conv1d (forward, SiLU, no state): the packed Q|K|V channels
# ----------------------------------------------------------------------------------------------------------------------
def run_conv(case: Case, ctx: Ctx) -> dict:
    import gdn.ops as gops
    from gdn.reference import causal_conv1d_ref

    dev, B, T, D = ctx.device, case.batch, case.seqlen, case.conv_dim
    row = new_row(case)
    Pn = min(T, ctx.check_tokens)
    row["err_what"] = f"y on the first {Pn} tokens of sequence 0 vs float64 reference"
    n_sets = rotation_sets(cost(case)["bytes"], ctx.l2_bytes)
    _seed(ctx, 0)
    weight = (torch.randn(D, 4, device=dev) * 0.5).to(torch.bfloat16)
    sets = []
    for i in range(n_sets):
        _seed(ctx, i + 1)
        sets.append(torch.randn(B, T, D, device=dev, dtype=torch.bfloat16))
    ref = {}

    def check_with(call):
        def check():
            x = sets[0][:1, :Pn].clone()
            if "y" not in ref:
                ref["y"] = causal_conv1d_ref(x.double(), weight.double(), None, "silu")[0]
            with torch.no_grad():
                return {"y": dev_rel_err(call(x), ref["y"])}
        return check

    def impl(name, call):
        def run(i):
            with torch.no_grad():
                call(sets[i])

        def output():
            with torch.no_grad():
                return call(sets[0])
        return Impl(name, run=run, check=check_with(call), output=output)

    impls = [impl("gdn", lambda x: _first(gops.causal_conv1d(x, weight, None, activation="silu")))]

    def build_fla():
        conv = P.fla_conv()
        return impl("fla", lambda x: _first(conv(x, weight, None, activation="silu")))

    impls += [x for x in (_peer_impl("fla", ctx, build_fla),) if x]
    return measure(row, impls, n_sets, ctx)


# ----------------------------------------------------------------------------------------------------------------------
# the GatedDeltaNet block, forward + backward
# ----------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def run_layer(case: Case, ctx: Ctx) -> dict:
    dev, B, T, hidden = ctx.device, case.batch, case.seqlen, case.hidden or 2048
    H, HV, K, V = case.H, case.HV, case.K, case.V
    row = new_row(case)
    Pn = min(T, 512)
    row["err_what"] = (f"output and input gradient on a 1x{Pn} input vs the block in float64 with the same weights "
                       "(gdn.layers.gated_deltanet.gated_deltanet_ref)")
    _seed(ctx, 1)
    x = torch.randn(B, T, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, T, hidden, device=dev, dtype=torch.bfloat16)

    def timed(layer):
        params = [p for p in layer.parameters() if p.requires_grad]

        def run(i):
            out = _first(layer(x))
            torch.autograd.grad(out, [x] + params, dout, allow_unused=True)
        return run

    def build_gdn():
        from gdn.layers import GatedDeltaNet

        try:   # the block's own dtype policy (e.g. float32 gate parameters) where its constructor takes one
            layer = GatedDeltaNet(hidden, H, HV, K, V, device=dev, dtype=torch.bfloat16).train()
        except TypeError:
            layer = GatedDeltaNet(hidden, H, HV, K, V).to(device=dev, dtype=torch.bfloat16).train()

        def check():
            xs = x[:1, :Pn].detach().clone().requires_grad_(True)
            ds = dout[:1, :Pn]
            out = _first(layer(xs))
            (gx,) = torch.autograd.grad(out, [xs], ds)
            xr = xs.detach().double().requires_grad_(True)
            try:
                from gdn.layers.gated_deltanet import gated_deltanet_ref   # token-by-token float64 oracle
                ref_out = gated_deltanet_ref(layer, xr)[0]
            except ImportError:
                with _env("GDN_BACKEND", "torch"):
                    ref_out = _first(copy.deepcopy(layer).double()(xr))
            (rgx,) = torch.autograd.grad(ref_out, [xr], ds.double())
            return {"out": dev_rel_err(out, ref_out), "dx": dev_rel_err(gx, rgx)}
        return Impl("gdn", run=timed(layer), check=check)

    try:
        impls = [build_gdn()]
    except Exception as e:
        impls = [Impl("gdn", error=P.short_error(e))]

    def build_fla():
        cls = P.fla_layer_cls()
        layer = cls(hidden_size=hidden, expand_v=V / K, head_dim=K, num_heads=H, num_v_heads=HV,
                    mode="chunk").to(device=dev, dtype=torch.bfloat16).train()
        return Impl("fla", run=timed(layer), context=P.fla_bwd_guard_bypassed,
                    note="fla.layers.GatedDeltaNet (own parametrisation: no shared reference, no fla_err); "
                         + P.FLA_BWD_GUARD_NOTE)

    impls += [x for x in (_peer_impl("fla", ctx, build_fla),) if x]
    return measure(row, impls, 1, ctx)


# ----------------------------------------------------------------------------------------------------------------------
# one cached decode step of the GatedDeltaNet block (after a short prefill), CUDA-graph replay
# ----------------------------------------------------------------------------------------------------------------------
LAYER_DECODE_PREFILL = 16   # tokens per sequence prefilled before the timed step, so that the cache holds real states


def run_layer_decode(case: Case, ctx: Ctx) -> dict:
    from gdn.layers import GatedDeltaNet, GDNCache
    from gdn.layers.gated_deltanet import gated_deltanet_ref

    dev, B, hidden = ctx.device, case.batch, case.hidden or 2048
    sdt = torch.float32 if case.state_dtype == "fp32" else torch.bfloat16
    row = new_row(case)
    row["err_what"] = ("output and the conv / recurrent states written by the timed step vs the block in float64 from "
                       "the same cached states (gated_deltanet_ref), first/last sequences")
    n_sets = rotation_sets(cost(case)["bytes"], ctx.l2_bytes)
    _seed(ctx, 0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    layer = GatedDeltaNet(hidden, case.H, case.HV, case.K, case.V, **bf).eval()
    cache = GDNCache.for_layers(layer, num_slots=n_sets * B, dtype=sdt)   # conv dtype and layout: the defaults
    sets = []
    with torch.no_grad():
        for i in range(n_sets):   # each set its own slots: rotating sets rotates the states (the weights are shared)
            _seed(ctx, i + 1)
            batch = cache.batch(cache.allocate(B))
            layer(torch.randn(B, LAYER_DECODE_PREFILL, hidden, **bf), cache=batch)
            sets.append(dict(x=torch.randn(B, 1, hidden, **bf), batch=batch))
    conv_pool, ssm_pool = cache.conv_pool(layer.layer_idx), cache.ssm_pool(layer.layer_idx)
    idx = _check_rows(B, ctx.check_seqs).to(dev)
    rows = sets[0]["batch"].slots[idx].long()
    pristine = conv_pool[rows].clone(), ssm_pool[rows].clone()   # timing advances the states: checks restart here

    def step(i):
        with torch.no_grad():
            return layer(sets[i]["x"], cache=sets[i]["batch"])

    def check():
        conv_pool[rows], ssm_pool[rows] = pristine
        out = step(0)
        with torch.no_grad():
            ro, rc, rs = gated_deltanet_ref(layer, sets[0]["x"][idx], conv_state=pristine[0].double(),
                                            ssm_state=pristine[1].double(), state_layout=cache.state_layout)
        return {"out": dev_rel_err(out[idx], ro), "conv_state": dev_rel_err(conv_pool[rows], rc),
                "ssm_state": dev_rel_err(ssm_pool[rows], rs)}

    note = (f"in_proj (one GEMM), conv update + recurrent step + gated norm (one fused kernel where the decode_step "
            f"table's row says fused: every state dtype and layout today), out_proj after a {LAYER_DECODE_PREFILL}-token prefill; "
            f"cache: {case.state_dtype} recurrent and conv states (GDNCache's conv dtype defaults to its state dtype), "
            f"{cache.state_layout} layout (its default)")
    impls = [Impl("gdn", run=step, check=check, graph=True, note=note)]
    if "fla" in ctx.peers:
        impls.append(Impl("fla", error="not timed: fla.layers.GatedDeltaNet keeps its decode state in its own Cache "
                                       "object (a new final-state tensor per step, no slot pool), which a replayed "
                                       "graph would not advance"))
    if "flashinfer" in ctx.peers:
        impls.append(Impl("flashinfer", error="FlashInfer has no GDN layer"))
    return measure(row, impls, n_sets, ctx)


RUNNERS = {"decode": run_decode, "recurrent": run_recurrent, "chunk_fwd": run_chunk, "chunk_fwd_bwd": run_chunk,
           "conv": run_conv, "layer": run_layer, "layer_decode": run_layer_decode}


def run_case(case: Case, ctx: Ctx) -> dict:
    """The row of one case; input construction failures (e.g. out of memory) are recorded, not raised."""
    try:
        return RUNNERS[case.op](case, ctx)
    except ContextLost:
        raise
    except Exception as e:
        row = new_row(case)
        row["errors"]["case"] = P.short_error(e)
        if not _alive(ctx.device):
            raise ContextLost(f"{case.key}: {P.short_error(e)}", row)
        return row
    finally:
        _free(ctx.device)


__all__ = ["Ctx", "Impl", "ContextLost", "IMPLS", "RUNNERS", "run_case", "measure", "new_row", "dev_rel_err"]
