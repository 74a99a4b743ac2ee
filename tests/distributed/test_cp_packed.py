"""Context parallelism over packed rows (global cu_seqlens) on gloo with 2, 3 and 4 processes.

Against the single-process ops on the whole row: ``cp_chunk_gated_delta_rule`` (outputs, final states and the
gradients of q, k, v, g, beta, initial_state), ``cp_causal_conv1d`` (y; x, weight, bias gradients) and the
``GatedDeltaNet`` layer with ``cp_group`` (output, input gradient, every parameter gradient; with ``tp_group`` too on
4 processes). Split patterns: documents inside a shard, crossing one boundary, crossing several ranks (a rank whose
whole shard lies inside one document), empty shards, shards shorter than the conv window, documents of length 0 and 1
and of chunk +- 1 tokens, boundaries on document starts. One spawn per world size runs all its cases; the parent
computes the references while the ranks run. Inside the ranks ``torch.empty`` fills with NaN, so an output element
that is never written shows up.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _gloo import free_port, init_gloo
from gdn.testing import make_inputs, rel_err

CUDA = torch.cuda.is_available()
TOL = 5e-3 if CUDA else 1e-5
TOKEN_GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def _dev():
    return "cuda" if CUDA else "cpu"


def _cu(lens, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=dtype)


def _slices(lens):
    pts = _cu(lens).tolist()
    return list(zip(pts[:-1], pts[1:]))


# ----------------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------------
def _make(case: dict, seed: int) -> dict:
    if case["kind"] == "errors":
        return {}
    gen = torch.Generator().manual_seed(seed)
    T = sum(case["shards"])
    kind = case["kind"]
    if kind == "op":
        assert sum(case["docs"]) == T
        N = len(case["docs"])
        inp = make_inputs(1, T, case["H"], case["HV"], case["K"], case["V"], seed=seed,
                          g_range=case.get("g_range", (-0.08, -0.002)), normalize_qk=True)
        HV, K, V = case["HV"], case["K"], case["V"]
        shape = (N, HV, K, V) if case["layout"] == "v_last" else (N, HV, V, K)
        return dict(q=inp.q, k=inp.k, v=inp.v, g=inp.g, beta=inp.beta,
                    h0=torch.randn(*shape, generator=gen) * 0.3 if case["init"] else None,
                    do=torch.randn(1, T, HV, V, generator=gen), dfinal=torch.randn(*shape, generator=gen),
                    share=torch.rand(len(case["shards"]), generator=gen).tolist())
    if kind == "conv":
        B, D, W = case.get("B", 1), case["D"], case["W"]
        return dict(x=torch.randn(B, T, D, generator=gen), w=torch.randn(D, W, generator=gen) * 0.5,
                    b=torch.randn(D, generator=gen) * 0.1 if case["bias"] else None,
                    dy=torch.randn(B, T, D, generator=gen))
    layer = _build_layer(case)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        layer.norm.weight.copy_(torch.rand(layer.norm.weight.shape, generator=gen) + 0.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.copy_(torch.randn(layer.conv1d.bias.shape, generator=gen) * 0.1)
    return dict(state={n: t.detach().clone() for n, t in layer.state_dict().items()},
                x=torch.randn(1, T, case["hidden"], generator=gen), dy=torch.randn(1, T, case["hidden"], generator=gen))


def _build_layer(case: dict, **kw):
    from gdn.layers import GatedDeltaNet

    return GatedDeltaNet(case["hidden"], case["H"], case["HV"], case["K"], case["V"], conv_size=4,
                         projection=case["projection"], conv_bias=case["conv_bias"], device=_dev(),
                         dtype=torch.float32, **kw)


# ----------------------------------------------------------------------------------------------------------------------
# one rank
# ----------------------------------------------------------------------------------------------------------------------
def _leaf(t, dev):
    return None if t is None else t.to(dev).clone().requires_grad_(True)


def _run_op(case, data, rank, group=None):
    from gdn.distributed import context_parallel as cp
    from gdn.distributed import cp_chunk_gated_delta_rule

    cp._MAX_AUG_COLS = 0 if case.get("two_calls") else 256
    dev = _dev()
    s, e = _slices(case["shards"])[rank]
    xs = {n: _leaf(data[n][:, s:e], dev) for n in ("q", "k", "v", "g", "beta")}
    h0 = _leaf(data["h0"], dev)
    cu = _cu(case["docs"], case.get("cu_dtype", torch.int32)).to(dev)
    o, final = cp_chunk_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], None, h0, case["final"],
                                         True, cu_seqlens=cu, state_layout=case["layout"], group=group)
    loss = (o * data["do"][:, s:e].to(dev)).sum()
    if case["final"]:  # every rank gives part of the final state's gradient: the op sums them
        loss = loss + (final * data["dfinal"].to(dev)).sum() * data["share"][rank]
    loss.backward()
    res = {"o": o.detach().cpu(), "final": None if final is None else final.detach().cpu(),
           "dh0": None if h0 is None else h0.grad.cpu()}
    res.update({"d" + n: x.grad.cpu() for n, x in xs.items()})
    if case.get("no_grad"):
        with torch.no_grad():
            o2, f2 = cp_chunk_gated_delta_rule(*(data[n][:, s:e].to(dev) for n in ("q", "k", "v", "g", "beta")),
                                               None, None if h0 is None else h0.detach(), case["final"], True,
                                               cu_seqlens=cu, state_layout=case["layout"], group=group)
        res["o_no_grad"], res["final_no_grad"] = o2.cpu(), None if f2 is None else f2.cpu()
    return res


def _run_conv(case, data, rank, group=None):
    from gdn.distributed import cp_causal_conv1d

    dev = _dev()
    s, e = _slices(case["shards"])[rank]
    x, w, b = _leaf(data["x"][:, s:e], dev), _leaf(data["w"], dev), _leaf(data["b"], dev)
    cu = None if case.get("docs") is None else _cu(case["docs"]).to(dev)
    y = cp_causal_conv1d(x, w, b, case["act"], cu_seqlens=cu, group=group)
    (y * data["dy"][:, s:e].to(dev)).sum().backward()
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": w.grad.cpu(), "db": None if b is None else b.grad.cpu()}


def _run_layer(case, data, rank, world):
    from gdn.distributed import gather_full_state_dict, shard_gated_deltanet

    tp = case.get("tp", 1)
    cp_n = world // tp
    # ranks r = c * tp + t: tensor-parallel groups of consecutive ranks, context-parallel groups across them
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp_n)] if tp > 1 else None
    cp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    c, t = divmod(rank, tp)
    dev = _dev()
    full = _build_layer(case, cp_group=cp_groups[t])
    full.load_state_dict(data["state"])
    layer = shard_gated_deltanet(full, tp_groups[c]) if tp > 1 else full
    assert layer.cp_group is cp_groups[t]
    s, e = _slices(case["shards"])[c]
    x = _leaf(data["x"][:, s:e], dev)
    y = layer(x, cu_seqlens=_cu(case["docs"]).to(dev))
    (y * data["dy"][:, s:e].to(dev)).sum().backward()
    grads = gather_full_state_dict(layer, tp_groups[c], grads=True) if tp > 1 else \
        {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "grads": {n: g.cpu() for n, g in grads.items()},
            "cp_rank": c, "tp_rank": t}


def _run_errors(rank, world):
    """Bad arguments raise ValueError naming them (every rank alike, so nobody is left in a collective)."""
    import pytest

    from gdn.distributed import cp_causal_conv1d, cp_chunk_gated_delta_rule

    T = 5 + rank
    q, v, g = torch.randn(1, T, 1, 16), torch.randn(1, T, 2, 16), -torch.rand(1, T, 2)
    total = sum(5 + r for r in range(world))
    good = torch.tensor([0, 3, total], dtype=torch.int32)
    checks = [
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 3, total + 1]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 4, 3, total]))),
        ("cu_seqlens", dict(cu_seqlens=good.float())),
        ("initial_state", dict(cu_seqlens=good, initial_state=torch.zeros(3, 2, 16, 16))),
        ("shard_lengths", dict(cu_seqlens=good, shard_lengths=[T] * (world + 1))),
    ]
    for name, kw in checks:
        with pytest.raises(ValueError, match=name):
            cp_chunk_gated_delta_rule(q, q, v, g, g.sigmoid(), **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cp_chunk_gated_delta_rule(*(x.expand(2, *x.shape[1:]) for x in (q, q, v, g, g)), cu_seqlens=good)
    with pytest.raises(ValueError, match="weight"):
        cp_causal_conv1d(torch.randn(1, T, 8), torch.randn(6, 4), cu_seqlens=good)
    with pytest.raises(ValueError, match="activation"):
        cp_causal_conv1d(torch.randn(1, T, 8), torch.randn(8, 4), activation="relu", cu_seqlens=good)
    return {"ok": True}


def _worker(rank: int, world: int, port: int, cases: list, datas: list, out_dir: str) -> None:
    init_gloo(rank, world, port)
    orig_empty = torch.empty

    def empty(*args, **kwargs):  # poison: an element nobody writes is NaN
        x = orig_empty(*args, **kwargs)
        if x.is_floating_point():
            x.fill_(float("nan"))
        return x

    torch.empty = empty
    try:
        for i, (case, data) in enumerate(zip(cases, datas)):
            kind = case["kind"]
            if kind == "errors":
                res = _run_errors(rank, world)
            elif kind == "layer":
                res = _run_layer(case, data, rank, world)
            else:
                res = (_run_op if kind == "op" else _run_conv)(case, data, rank)
            torch.save(res, os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
    finally:
        torch.empty = orig_empty
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# references (the parent, single process)
# ----------------------------------------------------------------------------------------------------------------------
def _ref(case, data):
    from gdn.ops import causal_conv1d, chunk_gated_delta_rule

    dev = _dev()
    if case["kind"] == "errors":
        return None
    if case["kind"] == "op":
        xs = {n: _leaf(data[n], dev) for n in ("q", "k", "v", "g", "beta")}
        h0 = _leaf(data["h0"], dev)
        o, final = chunk_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], None, h0, case["final"],
                                          _cu(case["docs"]).to(dev), True, state_layout=case["layout"])
        loss = (o * data["do"].to(dev)).sum()
        if case["final"]:
            loss = loss + (final * data["dfinal"].to(dev)).sum() * sum(data["share"])
        loss.backward()
        res = {"o": o.detach().cpu(), "final": None if final is None else final.detach().cpu(),
               "dh0": None if h0 is None else h0.grad.cpu()}
        res.update({"d" + n: x.grad.cpu() for n, x in xs.items()})
        return res
    if case["kind"] == "conv":
        x, w, b = _leaf(data["x"], dev), _leaf(data["w"], dev), _leaf(data["b"], dev)
        cu = None if case.get("docs") is None else _cu(case["docs"]).to(dev)
        y = causal_conv1d(x, w, b, case["act"], cu_seqlens=cu)
        (y * data["dy"].to(dev)).sum().backward()
        return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "dw": w.grad.cpu(),
                "db": None if b is None else b.grad.cpu()}
    layer = _build_layer(case)
    layer.load_state_dict(data["state"])
    x = _leaf(data["x"], dev)
    y = layer(x, cu_seqlens=_cu(case["docs"]).to(dev))
    (y * data["dy"].to(dev)).sum().backward()
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "grads": {n: p.grad.cpu() for n, p in layer.named_parameters()}}


def _close(name, got, ref, msg, tol=TOL):
    assert got is not None and torch.isfinite(got).all(), f"{name}: missing or not finite ({msg})"
    err = rel_err(got, ref)
    assert err < tol, f"{name}: rel err {err:.2e} ({msg})"


# The gate parameters' gradients ([HV] each) are sums over every token of terms of both signs that largely cancel;
# summed per rank and then over the ranks, their fp32 rounding differs from the one-process sum by up to ~1e-5
# relative (seen 1e-6 .. 1.5e-5 over random seeds), with every token-level quantity at ~1e-7.
CANCELLING = {"A_log": 1e-4, "dt_bias": 1e-4}


def _compare(case, parts, ref, msg):
    kind = case["kind"]
    if kind == "errors":
        assert all(p["ok"] for p in parts)
    elif kind == "op":
        for n in ("o",) + TOKEN_GRADS:
            _close(n, torch.cat([p[n] for p in parts], 1), ref[n], msg)
        if case["final"]:
            for r, p in enumerate(parts):
                _close(f"final_state on rank {r}", p["final"], ref["final"], msg)
        else:
            assert all(p["final"] is None for p in parts)
        if case["init"]:  # each rank's partial sum
            _close("d initial_state (sum over ranks)", sum(p["dh0"] for p in parts), ref["dh0"], msg)
        if case.get("no_grad"):
            _close("o without grad", torch.cat([p["o_no_grad"] for p in parts], 1), ref["o"], msg)
            if case["final"]:
                _close("final without grad", parts[-1]["final_no_grad"], ref["final"], msg)
    elif kind == "conv":
        _close("y", torch.cat([p["y"] for p in parts], 1), ref["y"], msg)
        _close("dx", torch.cat([p["dx"] for p in parts], 1), ref["dx"], msg)
        _close("dweight (sum over ranks)", sum(p["dw"] for p in parts), ref["dw"], msg)
        if case["bias"]:
            _close("dbias (sum over ranks)", sum(p["db"] for p in parts), ref["db"], msg)
    else:
        lead = sorted((p for p in parts if p["tp_rank"] == 0), key=lambda p: p["cp_rank"])
        for t in range(case.get("tp", 1)):  # every tensor-parallel rank holds the same slice of y and dx
            row = sorted((p for p in parts if p["tp_rank"] == t), key=lambda p: p["cp_rank"])
            _close(f"layer output (tp rank {t})", torch.cat([p["y"] for p in row], 1), ref["y"], msg)
            _close(f"layer input grad (tp rank {t})", torch.cat([p["dx"] for p in row], 1), ref["dx"], msg)
        assert set(lead[0]["grads"]) == set(ref["grads"])
        for n, g in ref["grads"].items():
            _close(f"grad of {n} (sum over cp ranks)", sum(p["grads"][n] for p in lead), g, msg,
                   CANCELLING.get(n, TOL) if not CUDA else TOL)


def _check(cases: list, world: int, tmp_path) -> None:
    seed = int.from_bytes(os.urandom(3), "little")
    datas = [_make(c, seed + 10 * i) for i, c in enumerate(cases)]
    procs = mp.start_processes(_worker, args=(world, free_port(), cases, datas, str(tmp_path)), nprocs=world,
                               join=False, start_method="spawn")
    refs = [_ref(c, d) for c, d in zip(cases, datas)]  # while the ranks run
    while not procs.join():
        pass
    for i, (case, ref) in enumerate(zip(cases, refs)):
        parts = [torch.load(os.path.join(tmp_path, f"case{i}_rank{r}.pt")) for r in range(world)]
        _compare(case, parts, ref, f"case {case} seed {seed + 10 * i}")


def _op(docs, shards, **kw):
    base = dict(kind="op", H=1, HV=2, K=16, V=16, layout="v_last", init=True, final=True)
    base.update(kw)
    return dict(base, docs=docs, shards=shards)


def _conv(docs, shards, **kw):
    base = dict(kind="conv", D=8, W=4, bias=True, act="silu")
    base.update(kw)
    return dict(base, docs=docs, shards=shards)


def _layer(docs, shards, **kw):
    base = dict(kind="layer", hidden=24, H=2, HV=4, K=16, V=16, projection="qwen3_next", conv_bias=False)
    base.update(kw)
    return dict(base, docs=docs, shards=shards)


CASES_2 = [
    # the boundary on a document start (nothing crosses; nothing exchanged but the final states)
    _op([30, 20, 40], [50, 40]),
    # one document crossing the boundary, chunk +- 1 lengths, lengths 0 and 1 around it; k_last; int64 cu_seqlens
    _op([63, 65, 1, 0, 64], [70, 123], layout="k_last", cu_dtype=torch.int64),
    # the boundary right after a 1-token document, empty documents at both ends of the row; gates near 0 and 1
    _op([0, 1, 0, 40, 0, 1, 30, 0], [41, 31], g_range=(-4.0, -1e-4), HV=4, H=2),
    # a single document over both ranks, no initial state, no final state; the no-grad forward
    _op([77], [33, 44], init=False, final=False, no_grad=True),
    _conv([5, 30, 2, 1, 12], [6, 44]),
    _conv([3, 2, 9], [1, 13], act=None, bias=False),   # a 1-token shard inside a document
    _conv(None, [7, 9], B=2),                           # the batch form (no cu_seqlens)
    _layer([10, 25, 1, 14], [20, 30]),
    dict(kind="errors", shards=[5, 6]),
]

CASES_3 = [
    # a document crossing two boundaries (rank 1 lies inside it), V != K, GVA
    _op([10, 100, 15], [30, 40, 55], V=32, H=1, HV=2),
    # an empty shard inside a document; the two-call fallback (V + K too wide for one call)
    _op([20, 50, 20], [30, 0, 60], two_calls=True, no_grad=True),
    # every shard starts a document except the last; a 0-length document on a boundary
    _op([25, 0, 25, 40], [25, 25, 40], layout="k_last"),
    # shards shorter than the conv window: the halo comes from two previous ranks
    _conv([1, 20], [18, 2, 1]),
    _conv([4, 4, 3], [3, 2, 6], bias=False),
    _layer([7, 40, 3], [15, 20, 15], projection="qwen3_5", conv_bias=True),
]

CASES_4 = [
    # one document over all four ranks (ranks 1 and 2 inside it) between two short ones; chunk +- 1 shards
    _op([5, 120, 3], [20, 63, 20, 25]),
    # chunk +- 1 documents, 1- and 0-token documents, a 0-length shard at the end
    _op([63, 64, 65, 1, 0, 2], [40, 80, 75, 0], layout="k_last", HV=2),
    # the halo over three previous ranks (1-token shards), documents starting inside the window
    _conv([2, 3, 1, 10], [1, 1, 1, 13]),
    _conv([16], [1, 1, 1, 13], W=3),
    _layer([30, 50], [20, 20, 20, 20]),
    # context parallel (2) x tensor parallel (2)
    _layer([12, 40, 8], [27, 33], tp=2),
]


def test_cp_packed_two_ranks(tmp_path):
    _check(CASES_2, 2, tmp_path)


def test_cp_packed_three_ranks(tmp_path):
    _check(CASES_3, 3, tmp_path)


def test_cp_packed_four_ranks(tmp_path):
    _check(CASES_4, 4, tmp_path)
