"""gdn check --ops serving: a seeded serving schedule over one state pool against a float64 replay.

A random schedule of prefills (chunked op; with and without initial states, copy-on-write from prefix-cache
checkpoints, checkpoints written), decodes (the decode op and the recurrent op, separate write rows), speculative
verifies (2-D indices + ``num_accepted_tokens``, per-token states to separate rows) and commits (accepting a prefix
of the drafted tokens), with -1 padding entries and sequence lengths 0/1/63/64/65/... . After every step each pool
row that the step wrote is compared with the float64 replay (relative error) and every other row must be bitwise
unchanged; outputs are compared too and padding outputs must be zeros. ``run_schedule`` is also the CI test
(``tests/ops/test_serving_stress.py``, small shapes in the interpreter).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from ..ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_delta_rule_decode
from ..reference import recurrent_gated_delta_rule_ref
from ..testing import make_inputs, rel_err, to64
from . import Result, register

LENGTHS = (0, 1, 2, 63, 64, 65, 127, 128, 129)


@dataclass
class _Req:
    row: int                      # pool row holding the request's state (its committed state)
    spec_rows: List[int] = field(default_factory=list)  # per-token rows of the last verify (not committed yet)


class _Sim:
    def __init__(self, seed, device, P, HV, K, V, H, layout, state_dtype, max_len):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.dev, self.HV, self.K, self.V, self.H, self.layout = device, HV, K, V, H, layout
        self.max_len = max_len
        shape = (P, HV, K, V) if layout == "v_last" else (P, HV, V, K)
        self.pool = torch.randn(shape, device=device).to(state_dtype)
        self.truth = self.pool.detach().to("cpu", torch.float64).clone()  # float64 replay of every row
        self.free = list(range(P))
        self.rng.shuffle(self.free)
        self.reqs: List[_Req] = []
        self.cache: List[int] = []    # rows holding prefix-cache checkpoints (read-only for later prefills)
        self.worst: Dict[str, float] = {}
        self.bad: List[str] = []

    # ---- helpers
    def take(self) -> int:
        return self.free.pop() if self.free else -1

    def note(self, key, err):
        self.worst[key] = max(self.worst.get(key, 0.0), err)

    def compare(self, step, before, written: Dict[int, torch.Tensor], tol):
        """Rows in ``written`` (row -> float64 state) against the replay; all others bitwise unchanged."""
        for r, st in written.items():
            self.truth[r] = st
        rows = sorted(written)
        if rows:
            err = max(rel_err(self.pool[r], self.truth[r]) for r in rows)
            self.note("state", err)
            if err > tol:
                self.bad.append(f"step {step}: written row error {err:.3g} > {tol}")
        mask = torch.ones(self.pool.shape[0], dtype=torch.bool)
        mask[rows] = False
        if not torch.equal(self.pool[mask.to(self.pool.device)], before[mask.to(self.pool.device)]):
            self.bad.append(f"step {step}: a row the step does not write changed")

    def check_o(self, step, o, ro, pad_tokens, tol):
        o = o.reshape(-1, self.HV, self.V)
        ro = ro.reshape(-1, self.HV, self.V)
        keep = torch.ones(o.shape[0], dtype=torch.bool)
        keep[pad_tokens] = False
        if pad_tokens and not bool((o[pad_tokens] == 0).all()):
            self.bad.append(f"step {step}: padding outputs not zero")
        if bool(keep.any()):
            err = rel_err(o[keep.to(o.device)], ro[keep])
            self.note("o", err)
            if err > tol:
                self.bad.append(f"step {step}: output error {err:.3g} > {tol}")

    def ref(self, x, starts, cu=None, raw=False):
        """float64 (o, per-sequence per-token states) from replay rows ``starts`` (None: zeros)."""
        shape = self.truth.shape[1:]
        h0 = torch.stack([self.truth[r] if r is not None and r >= 0 else torch.zeros(shape, dtype=torch.float64)
                          for r in starts])
        q, k, v = to64(x.q, x.k, x.v)
        gates = (dict(zip(("A_log", "a", "dt_bias", "b"), to64(x.A_log, x.a, x.dt_bias, x.b))) if raw
                 else dict(zip(("g", "beta"), to64(x.g, x.beta))))
        o, _, st = recurrent_gated_delta_rule_ref(q, k, v, initial_state=h0, cu_seqlens=None if cu is None else
                                                  cu.cpu(), state_layout=self.layout, return_token_states=True,
                                                  **gates)
        return o, st


def _cu(lens, device):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, device=device, dtype=torch.int32)


def _prefill(sim: _Sim, step, tol):
    rng, dev = sim.rng, sim.dev
    n_new = rng.randint(1, 3)
    lens, rd, wr, ck, starts, owners, pad = [], [], [], [], [], [], []
    every, C = 64, 2
    use_ck = rng.random() < 0.6
    for i in range(n_new + 1):
        if i == n_new:  # one padding entry
            if rng.random() < 0.5:
                break
            lens.append(rng.choice(LENGTHS[:5]))
            rd.append(-1), wr.append(-1), ck.append([-1] * C), starts.append(None), pad.append(len(lens) - 1)
            continue
        L = min(rng.choice(LENGTHS + ((256, 513, sim.max_len) if sim.max_len > 129 else ())), sim.max_len)
        w = sim.take()
        if w < 0:
            break
        if sim.cache and rng.random() < 0.5:  # prefix-cache hit: read a checkpoint row, write a new row (COW)
            r = rng.choice(sim.cache)
        elif rng.random() < 0.5:  # a fresh request: its own row zeroed first (no initial state)
            r = w
            sim.pool[r].zero_()
            sim.truth[r].zero_()
        else:  # resume from a random (free) row's stale content: initial state carried in, written in place
            r = w
        lens.append(L), rd.append(r), wr.append(w), starts.append(r), owners.append(w)
        ck.append([sim.take() if (use_ck and rng.random() < 0.7) else -1 for _ in range(C)])
    if not lens:
        return
    cu = _cu(lens, dev)
    x = make_inputs(1, int(cu[-1]), sim.H, sim.HV, sim.K, sim.V, device=dev)
    before = sim.pool.clone()
    kw = dict(checkpoint_every_n_tokens=every, checkpoint_indices=torch.tensor(ck, device=dev)) if use_ck else {}
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=sim.pool, cu_seqlens=cu,
                                      ssm_state_indices=torch.tensor(rd, device=dev), state_layout=sim.layout,
                                      output_state_indices=torch.tensor(wr, device=dev), **kw)
    ro, st = sim.ref(x, starts, cu)
    written = {}
    for n, L in enumerate(lens):
        if rd[n] < 0:
            continue
        written[wr[n]] = st[n][-1] if L else sim.truth[rd[n]].clone()
        for c in range(C):
            tok = (c + 1) * every
            if use_ck and ck[n][c] >= 0:
                if tok <= L:
                    written[ck[n][c]] = st[n][tok - 1]
                    sim.cache.append(ck[n][c])
                else:
                    sim.free.append(ck[n][c])  # past the end: not written, the row goes back
    c0 = cu.tolist()
    sim.check_o(step, o, ro, [t for n in pad for t in range(c0[n], c0[n + 1])], tol)
    sim.compare(step, before, written, tol)
    sim.reqs += [_Req(w) for w in owners]


def _commit(sim: _Sim, req: _Req):
    """Accept a prefix of the drafted tokens: the state after the last accepted one becomes the request's row."""
    if req.spec_rows:
        a = sim.rng.randint(1, len(req.spec_rows))
        keep = req.spec_rows[a - 1]
        sim.free += [r for r in req.spec_rows if r != keep] + [req.row]
        req.row, req.spec_rows = keep, []


def _decode(sim: _Sim, step, tol):
    rng, dev = sim.rng, sim.dev
    batch = rng.sample(sim.reqs, min(len(sim.reqs), rng.randint(1, 4)))
    for r in batch:
        _commit(sim, r)
    rd, wr, starts, pad = [], [], [], []
    for req in batch:
        w = sim.take() if rng.random() < 0.5 else req.row   # copy-on-write or in place
        w = req.row if w < 0 else w
        rd.append(req.row), wr.append(w), starts.append(req.row)
    if rng.random() < 0.5:
        pad.append(len(rd))
        rd.append(-1), wr.append(sim.free[-1] if sim.free else -1), starts.append(None)
    B = len(rd)
    raw = rng.random() < 0.5
    x = make_inputs(B, 1, sim.H, sim.HV, sim.K, sim.V, device=dev)
    before = sim.pool.clone()
    ri, wi = torch.tensor(rd, device=dev), torch.tensor(wr, device=dev)
    if raw:
        o, _ = gated_delta_rule_decode(x.q, x.k, x.v, sim.pool, x.A_log, x.a, x.dt_bias, x.b, state_indices=ri,
                                       state_layout=sim.layout, output_state_indices=wi, output=torch.empty_like(x.v))
    else:
        o, _ = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=sim.pool,
                                                ssm_state_indices=ri, inplace_final_state=True,
                                                state_layout=sim.layout, output_state_indices=wi)
    ro, st = sim.ref(x, starts, raw=raw)
    written = {wr[n]: st[n][-1] for n in range(B) if rd[n] >= 0}
    sim.check_o(step, o, ro, pad, tol)
    sim.compare(step, before, written, tol)
    for req, w in zip(batch, wr):
        if w != req.row:
            sim.free.append(req.row)
            req.row = w


def _verify(sim: _Sim, step, tol):
    """Speculative verify: T drafted tokens per request; read the committed state (2-D indices whose column
    num_accepted - 1 holds it), the state after token t -> a fresh row out[n, t]."""
    rng, dev = sim.rng, sim.dev
    T = rng.randint(1, 4)
    batch = rng.sample(sim.reqs, min(len(sim.reqs), rng.randint(1, 3)))
    if not batch or len(sim.free) < T * len(batch) + 1:
        return
    for req in batch:
        _commit(sim, req)
    rd, wr, acc, starts = [], [], [], []
    for req in batch:
        a = rng.randint(1, T)
        row = [sim.free[rng.randrange(len(sim.free))] if rng.random() < 0.5 else -1 for _ in range(T)]
        row[a - 1] = req.row
        rd.append(row), acc.append(a), starts.append(req.row)
        wr.append([sim.take() for _ in range(T)])
    rd.append([-1] * T), wr.append([-1] * T), acc.append(1), starts.append(None)  # a padding sequence
    N = len(rd)
    x = make_inputs(N, T, sim.H, sim.HV, sim.K, sim.V, device=dev)
    before = sim.pool.clone()
    o, _ = fused_recurrent_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=sim.pool,
                                            ssm_state_indices=torch.tensor(rd, device=dev),
                                            num_accepted_tokens=torch.tensor(acc, device=dev),
                                            inplace_final_state=True, state_layout=sim.layout,
                                            output_state_indices=torch.tensor(wr, device=dev))
    ro, st = sim.ref(x, starts)
    written = {wr[n][t]: st[n][t] for n in range(N - 1) for t in range(T)}
    sim.check_o(step, o, ro, list(range((N - 1) * T, N * T)), tol)
    sim.compare(step, before, written, tol)
    for req, w in zip(batch, wr):
        req.spec_rows = w


def _finish(sim: _Sim):
    """A request ends (its rows go back), and a prefix-cache checkpoint is evicted."""
    if sim.reqs:
        req = sim.reqs.pop(sim.rng.randrange(len(sim.reqs)))
        sim.free += [req.row] + req.spec_rows
    if sim.cache:
        sim.free.append(sim.cache.pop(sim.rng.randrange(len(sim.cache))))


def run_schedule(seed: int, steps: int, device, *, P=48, H=1, HV=2, K=16, V=16, layout="v_last",
                 state_dtype=torch.float32, max_len=129, tol=None) -> _Sim:
    """Run one seeded schedule; returns the simulator (``bad``: failures, ``worst``: largest errors)."""
    device = torch.device(device)
    tol = tol if tol is not None else (2e-4 if state_dtype == torch.float32 else 3e-2)
    sim = _Sim(seed, device, P, HV, K, V, H, layout, state_dtype, max_len)
    for step in range(steps):
        kinds = ["prefill"] + (["decode", "verify", "finish"] if sim.reqs else [])
        kind = sim.rng.choice(kinds) if step else "prefill"
        if kind == "finish" and len(sim.reqs) < 3 and len(sim.free) >= 8:
            kind = "decode"
        if kind == "prefill" and len(sim.free) < 8:
            kind = "finish"
        if kind == "prefill":
            _prefill(sim, step, tol)
        elif kind == "decode":
            _decode(sim, step, tol)
        elif kind == "verify":
            _verify(sim, step, tol)
        else:
            _finish(sim)
    return sim


@register
def serving_schedule(device):
    big = device.type == "cuda"
    out = []
    cfgs = ([(s, lay, sd) for s in (1, 2) for lay in ("k_last", "v_last") for sd in (torch.float32, torch.bfloat16)]
            if big else [(1, "k_last", torch.float32)])
    for seed, layout, sd in cfgs:
        kw = dict(P=512, H=2, HV=4, K=64, V=64, max_len=700) if big else {}
        sim = run_schedule(seed, 40 if big else 6, device, layout=layout, state_dtype=sd, **kw)
        name = f"seed {seed} {layout} {str(sd)[6:]}"
        out.append(Result("serving", name + " state", sim.worst.get("state", 0.0),
                          2e-4 if sd == torch.float32 else 3e-2))
        out.append(Result("serving", name + " o", sim.worst.get("o", 0.0), 2e-4 if sd == torch.float32 else 3e-2))
        out.append(Result("serving", name + " rows/padding", float("inf") if sim.bad else 0.0, 0.0,
                          note="; ".join(sim.bad[:3])))
    return out
