"""Host plans (gdn.kernels.host_plan): a recorded call's replay equals the Python path it stands for, the key
separates what the path depends on, and calls the recorder cannot follow are never planned.

On CPU the kernels run in Triton's interpreter (PLAN_CPU on here); the sm_90 paths (TMA descriptors, the compiled
launcher) are covered on the GPU by ``gdn check --ops chunk_backward`` ("host plan" rows)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from gdn.kernels import host_plan
from gdn.kernels.launch import launch
from gdn.testing import make_inputs

CALLS = 4       # per case: plain, recorded, replayed twice (host_plan.RECORD_AT = 2)


@pytest.fixture
def plans(monkeypatch, device):
    monkeypatch.setattr(host_plan, "PLAN_CPU", device == "cpu")
    monkeypatch.setattr(host_plan, "ENABLED", True)
    host_plan.clear()
    yield host_plan
    host_plan.clear()


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert torch.equal(a, b), f"{what}: replay differs from the Python path"


def _fwd_bwd(x, h0, cu, cu_host, l2, layout, pool=None, idx=None, seed=0):
    from gdn.ops import chunk_gated_delta_rule

    if pool is not None:
        with torch.no_grad():
            o, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                          cu_seqlens=cu, cu_seqlens_cpu=cu_host, use_qk_l2norm_in_kernel=l2,
                                          state_layout=layout, ssm_state_indices=idx)
        return [o, pool.clone()]
    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.g, x.beta)]
    h = h0.detach().clone().requires_grad_()
    o, ht = chunk_gated_delta_rule(*leaves, initial_state=h, output_final_state=True, cu_seqlens=cu,
                                   cu_seqlens_cpu=cu_host, use_qk_l2norm_in_kernel=l2, state_layout=layout)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device=o.device)
    dht = torch.randn(ht.shape, generator=gen, device=o.device)
    grads = torch.autograd.grad((o, ht), leaves + [h], (do, dht))
    return [o, ht, *grads]


@pytest.mark.parametrize("case", ["varlen_gva_l2", "batched_k_last", "pool"])
def test_replay_equals_python_path(plans, device, nan_empty, case):
    """Fresh inputs of one key every call; each call run with plans on and again with plans off: bitwise equal
    (outputs poisoned with NaN by ``nan_empty``, so an element the replay leaves unwritten fails too), and from the
    third call on the forward and backward are replays."""
    H, HV, K, V = 1, 2, 32, 16
    if case == "batched_k_last":
        B, lens, layout, l2 = 2, None, "k_last", False
    else:
        B, lens, layout, l2 = 1, [1, 63, 0, 65, 64], "v_last", case != "pool"
    T = 66 if lens is None else sum(lens)
    cu_host = None if lens is None else [0] + torch.tensor(lens).cumsum(0).tolist()
    cu = None if lens is None else torch.tensor(cu_host, dtype=torch.int32, device=device)
    N = B if lens is None else len(lens)
    for call in range(CALLS):
        x = make_inputs(B, T, H, HV, K, V, dtype=torch.float32, device=device)
        sshape = (HV, K, V) if layout == "v_last" else (HV, V, K)
        h0 = torch.randn(N, *sshape, device=device)
        pool = idx = None
        if case == "pool":
            pool = torch.randn(N + 3, *sshape, device=device)
            idx = torch.tensor([4, -1, 0, 2, 6][:N], dtype=torch.int32, device=device)
        seed = int(torch.randint(0, 2 ** 31, ()))
        got = _fwd_bwd(x, h0, cu, cu_host, l2, layout, None if pool is None else pool.clone(), idx, seed)
        host_plan.ENABLED = False
        want = _fwd_bwd(x, h0, cu, cu_host, l2, layout, None if pool is None else pool.clone(), idx, seed)
        host_plan.ENABLED = True
        for n, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"call {call}, output {n}")
    st = plans.stats()
    assert st["plans"] == (1 if case == "pool" else 2) and not st["why"], st


def test_key_separates_shapes_strides_and_tuning(plans, device, monkeypatch):
    """A new shape, a strided view instead of a contiguous tensor and another GDN_TUNE are new keys (their own
    plans, their own results); replays of the first key still match its Python path afterwards."""
    from gdn.ops import chunk_gated_delta_rule

    def run(x, **kw):
        with torch.no_grad():
            return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm_in_kernel=True, **kw)[0]

    def check(make, **kw):
        for _ in range(3):
            x = make()
            got = run(x, **kw)
            host_plan.ENABLED = False
            want = run(x, **kw)
            host_plan.ENABLED = True
            _same(got, want, "output")

    base = lambda: make_inputs(1, 70, 1, 2, 32, 16, device=device)  # noqa: E731
    check(base)
    assert plans.stats()["plans"] == 1
    check(lambda: make_inputs(1, 130, 1, 2, 32, 16, device=device))
    assert plans.stats()["plans"] == 2

    def strided():
        x = make_inputs(1, 70, 1, 2, 32, 16, device=device)
        wide = torch.randn(1, 70, 1, 48, device=device)
        wide[..., :32] = x.q
        x.q = wide[..., :32]
        return x

    check(strided)
    assert plans.stats()["plans"] == 3
    monkeypatch.setenv("GDN_TUNE", "chunk_fwd.segment_chunks=1")
    check(base)
    assert plans.stats()["plans"] == 4
    monkeypatch.delenv("GDN_TUNE")
    check(base)
    assert plans.stats()["plans"] == 4


@triton.jit
def _axpy_kernel(x, y, out, a, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, a * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)


def _axpy(x, y, a, out):
    n = x.numel()
    launch(_axpy_kernel, (triton.cdiv(n, 64),), x, y, out, a, n, BLOCK=64)


@host_plan.planned
def _two_steps(x, y, a: float):
    """out = a (a x + y) + (x[1:] padded with a zero); through an intermediate, a view of the input and a fill."""
    tmp = torch.empty_like(x)
    _axpy(x, y, a, tmp)
    shifted = torch.zeros_like(x)
    _axpy(x[1:], shifted[:-1], 1.0, shifted[:-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _axpy(tmp, shifted, a, out)
    return out, {"n": x.numel(), "tmp_shape": tuple(tmp.shape)}


def _check_two_steps(x, y, a):
    out, meta = _two_steps(x, y, a)
    shifted = torch.zeros_like(x)
    shifted[:-1] = x[1:]
    torch.testing.assert_close(out, a * (a * x + y) + shifted, rtol=1e-6, atol=1e-6)
    assert meta == {"n": x.numel(), "tmp_shape": tuple(x.shape)}


def test_replay_of_views_fills_and_scalars(plans, device):
    for _ in range(CALLS):
        _check_two_steps(torch.randn(100, device=device), torch.randn(100, device=device), 0.5)
    assert plans.stats()["plans"] == 1
    # another scalar is another key: recorded anew, not replayed with 0.5
    for _ in range(CALLS):
        _check_two_steps(torch.randn(100, device=device), torch.randn(100, device=device), 2.0)
    assert plans.stats()["plans"] == 2


def test_key_separates_aliasing(plans, device):
    """Recorded with y the same tensor as x, replayed with a distinct y: a new key, not the first call's plan (which
    may read x where y is meant)."""
    for _ in range(3):
        x = torch.randn(100, device=device)
        _check_two_steps(x, x, 0.5)
    for _ in range(3):
        _check_two_steps(torch.randn(100, device=device), torch.randn(100, device=device), 0.5)
    assert plans.stats()["plans"] == 2


_TABLE = {}


@host_plan.planned
def _with_constants(x):
    """out = 2 x + 1, returned beside parts that hold no tensor of the call: a tuple with a list and a tensor made
    before the call (a cached table), a dict, a list."""
    if x.device not in _TABLE:
        _TABLE[x.device] = torch.arange(3, device=x.device)
    table = _TABLE[x.device]
    out = torch.empty_like(x)
    _axpy(x, torch.ones_like(x), 2.0, out)
    return out, (x.numel(), [1, 2], table), {"n": x.numel(), "out": out}, [x.numel()]


def test_replay_builds_constant_tuples_once(plans, device):
    """A replay returns this call's tensors and lists / dicts made anew, and the tuples that hold no tensor of the
    call built once (the same object every replay, equal to the Python path's)."""
    seen = []
    for _ in range(CALLS):
        x = torch.randn(10, device=device)
        out, const, meta, lst = _with_constants(x)
        torch.testing.assert_close(out, 2 * x + 1, rtol=1e-6, atol=1e-6)
        assert const[:2] == (10, [1, 2]) and const[2] is _TABLE[x.device]
        assert meta["n"] == 10 and meta["out"] is out and lst == [10]
        seen.append((const, meta, lst))
    assert plans.stats()["plans"] == 1
    (c2, m2, l2), (c3, m3, l3) = seen[2], seen[3]      # the two replays
    assert c2 is c3, "a constant tuple is built once per plan"
    assert m2 is not m3 and l2 is not l3, "dicts and lists outside such a tuple are new per call"


@host_plan.planned
def _filled(x):
    """Allocations with fill values (full, new_full, ones_like), combined by a launch."""
    a = torch.full((5,), 1.5, device=x.device)
    b = x.new_full((5,), 2.5)
    out = torch.ones_like(x[:5])
    _axpy(a, b, 2.0, out)
    return out


def test_replay_of_filled_allocations(plans, device):
    for _ in range(CALLS):
        out = _filled(torch.randn(8, device=device))
        assert torch.equal(out, torch.full((5,), 5.5, device=device))
    assert plans.stats()["plans"] == 1 and not plans.stats()["why"]


def test_replay_of_clones_conversions_and_copies(plans, device):
    for dtype in (torch.float32, torch.float64):
        for _ in range(CALLS):
            x = torch.randn(6, 10, device=device)
            out = _clones(x, dtype)
            want = x.t().to(dtype)
            assert out.dtype == dtype and torch.equal(out[0], want) and torch.equal(out[1], 2 * want)
    assert plans.stats()["plans"] == 2 and not plans.stats()["why"]


def _launched(plan) -> list:
    """The tensor templates of each launch step's positional arguments."""
    return [[a[1] for a in s[3] if a[0] == "t"] for s in plan.steps if s[0] == "launch"]


def test_replay_frees_intermediates_after_their_last_use(plans, device):
    """The intermediates tmp and shifted of _two_steps live in one workspace allocation (both alive at the last
    launch: distinct 512-byte aligned extents), dropped after that launch; the returned out is its own allocation,
    kept."""
    for _ in range(3):
        _two_steps(torch.randn(10, device=device), torch.randn(10, device=device), 1.0)
    (entry,) = [e for e in host_plan._PLANS.values() if e.plan is not None]
    plan = entry.plan
    allocs = [s[1] for s in plan.steps if s[0] == "alloc"]
    assert allocs == [3, 2] and plan.allocs[3][:3] == ((1024,), (1,), torch.uint8), plan.steps
    last = _launched(plan)[-1]
    assert last[0][:3] == ("wv", 3, 0) and last[1][:3] == ("wv", 3, 512) and last[2] == ("al", 2), last
    frees = [s[1] for s in plan.steps if s[0] == "free"]
    dropped = {r for f in frees for r in f}
    assert ("al", 3) in dropped and ("al", 2) not in dropped and ("in", 0) in dropped, plan.steps


@host_plan.planned
def _chain(x):
    """Three intermediates in sequence: t1 is dead before t3 (float32, the others x's float64) is made, t2 lives
    across both."""
    t1 = torch.empty_like(x)
    _axpy(x, x, 1.0, t1)                      # t1 = 2x
    t2 = torch.empty_like(x)
    _axpy(t1, x, 1.0, t2)                     # t2 = 3x (t1's last use)
    t3 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _axpy(t2, x, 2.0, t3)                     # t3 = 7x
    out = torch.empty_like(x)
    _axpy(t3, t2, 1.0, out)                   # out = 10x
    return out


def test_workspace_reuses_the_bytes_of_dead_intermediates(plans, device):
    """An intermediate made after another one's last use takes its bytes (the caching allocator's reuse in the
    recorded call), one alive at the same time does not; the replay's output stays right."""
    for _ in range(CALLS):
        x = torch.randn(300, device=device, dtype=torch.float64)
        torch.testing.assert_close(_chain(x), 10 * x, rtol=1e-6, atol=1e-6)
    (entry,) = [e for e in host_plan._PLANS.values() if e.plan is not None]
    t1, t2, t3 = (_launched(entry.plan)[i][-1] for i in range(3))
    # 2400 bytes each for t1 and t2 (2560 with the rounding), 1200 for t3: in t1's place
    assert t1[:3] == ("wv", 4, 0) and t2[:3] == ("wv", 4, 2560) and t3[:3] == ("wv", 4, 0), (t1, t2, t3)
    assert t3[5] == torch.float32 and entry.plan.allocs[4][0] == (5120,)


@host_plan.planned
def _scalars_in_rows(x, out=None):
    """The pattern of hopper.row_scalar_pack: fp32 values written into the bytes of a 16-bit tensor (``out``, an
    input, or an allocation) through a reinterpreting view, read back through another one, then overwritten; and an
    intermediate (in the plan's workspace) read through a view of its bytes in another dtype."""
    n = x.numel()
    o = out if out is not None else torch.empty(2 * n, dtype=torch.bfloat16, device=x.device)
    f = o.view(torch.float32)                         # [n] fp32 over the 2 n bf16 elements
    _axpy(x, x, 1.0, f)                               # f = 2 x
    tmp = torch.empty(n, dtype=torch.float32, device=x.device)
    _axpy(f, x, 1.0, tmp)                             # tmp = 3 x
    half = tmp.view(torch.bfloat16)[: n].view(torch.float32)   # tmp's first half through a bf16 view
    res = torch.empty(n // 2, dtype=torch.float32, device=x.device)
    _axpy(half, f[n // 2:], 1.0, res)                 # res = 3 x[:n/2] + 2 x[n/2:]
    return o, res


def test_replay_of_reinterpreting_views(plans, device):
    """Views of an allocation's, an input's and an intermediate's bytes in another dtype ("rv" templates; o's rows
    holding fp32 scalars in the sm_90 forward) are planned, and the replay writes and reads the same bytes as the
    Python path, in the output and in the caller's ``out``."""
    for with_out in (False, True):
        for _ in range(CALLS):
            x = torch.randn(64, device=device)
            out = torch.full((128,), float("nan"), dtype=torch.bfloat16, device=device) if with_out else None
            o, res = _scalars_in_rows(x, out)
            assert o.dtype == torch.bfloat16 and o.shape == (128,) and (out is None or o is out)
            torch.testing.assert_close(o.view(torch.float32), 2 * x)
            torch.testing.assert_close(res, 3 * x[:32] + 2 * x[32:])
    st = plans.stats()
    assert st["plans"] == 2 and st["given_up"] == 0, st
    kinds = {a[1][0] for e in host_plan._PLANS.values() for s in e.plan.steps if s[0] == "launch" for a in s[3]
             if a[0] == "t"}
    assert "rv" in kinds and "wv" in kinds, kinds


@host_plan.planned
def _computes(x):
    out = torch.empty_like(x)
    _axpy(x * 1.0, x, 1.0, out)       # a computation in torch: an operator the plan does not replay
    return out


@host_plan.planned
def _clones(x, dtype):
    """x.t() made contiguous and converted on its device, then copied into a view: steps a plan replays."""
    y = x.t().contiguous().to(dtype)
    out = torch.empty(2, *y.shape, dtype=dtype, device=x.device)
    out[0].copy_(y)
    _axpy(y.reshape(-1), y.reshape(-1), 1.0, out[1].view(-1))
    return out


@host_plan.planned
def _reads_device_values(x, n):
    out = torch.empty_like(x)
    k = int(n.sum())                  # a read of tensor values: the path depends on them
    _axpy(x, x, float(k), out)
    return out


def test_calls_the_recorder_cannot_follow_are_never_planned(plans, device):
    for _ in range(5):
        x = torch.randn(50, device=device)
        torch.testing.assert_close(_computes(x), 2 * x)
    for k in (1, 2, 3, 4, 5):
        x = torch.randn(50, device=device)
        n = torch.tensor([k], device=device).float()
        torch.testing.assert_close(_reads_device_values(x, n), (k + 1) * x)
    st = plans.stats()
    assert st["plans"] == 0 and st["given_up"] == 2, st
    assert "mul" in st["why"]["_computes"] and "sum" in st["why"]["_reads_device_values"], st


def test_off_for_cpu_calls_unless_asked_and_under_verify(monkeypatch, device):
    from gdn.kernels import launch as launch_mod

    host_plan.clear()
    if device == "cpu":     # (with CUDA, kernels take no CPU tensors)
        monkeypatch.setattr(host_plan, "PLAN_CPU", False)
        for _ in range(3):
            _check_two_steps(torch.randn(10), torch.randn(10), 1.0)
        assert host_plan.stats()["keys"] == 0
    monkeypatch.setattr(host_plan, "PLAN_CPU", device == "cpu")
    monkeypatch.setattr(launch_mod, "VERIFY", True)
    for _ in range(3):
        _check_two_steps(torch.randn(10, device=device), torch.randn(10, device=device), 1.0)
    assert host_plan.stats()["keys"] == 0


_PAUSE = {}


@host_plan.planned
def _pausing(x):
    """Two launches with a pause between them on the recording call (the test's other thread launches meanwhile)."""
    out = torch.empty_like(x)
    _axpy(x, x, 1.0, out)
    ev = _PAUSE.get("ev")
    if ev is not None:
        _PAUSE["in"].set()
        ev.wait(timeout=60)
    _axpy(out, x, 1.0, out)
    return out


def test_launches_of_other_threads_are_not_recorded(plans, device):
    import threading

    x = torch.randn(64, device=device)
    _pausing(x)                                   # first call: the Python path
    _PAUSE.update(ev=threading.Event(), **{"in": threading.Event()})
    t = threading.Thread(target=_pausing, args=(x,))
    t.start()                                     # second call, recorded on thread t
    try:
        assert _PAUSE["in"].wait(timeout=60)
        y = torch.randn(64, device=device)
        _axpy(y, y, 1.0, torch.empty_like(y))     # a launch of this thread while t records
    finally:
        _PAUSE["ev"].set()
        t.join()
        _PAUSE.clear()
    (entry,) = host_plan._PLANS.values()
    assert entry.plan is not None and sum(s[0] == "launch" for s in entry.plan.steps) == 2
    for _ in range(2):
        x = torch.randn(64, device=device)
        torch.testing.assert_close(_pausing(x), 3 * x)


@dataclasses.dataclass
class _Desc:
    """Stands in for a TMA tensor descriptor (its fields as Gluon's; the base filled in per call)."""
    base: object
    shape: list
    strides: list
    block_shape: list
    padding: str = "zero"


def test_fast_launch_fills_only_the_calls_tensors_and_descriptors(monkeypatch):
    """A bound launch step (host_plan._FastLaunch) passes the launcher what launch.fire would get from the
    Python path: on the generic form the argument list with this call's tensors and descriptors (and keyword
    templates) filled in; on the direct form (Triton 3.6's C launcher, stood in for here) each tensor as its device
    address (an int: a view's base address plus its offset), every descriptor expanded as Triton expands it, encoded
    once per base address, the tail of constexprs after the arguments, on the stream the replay passes."""
    from gdn.kernels import launch as L

    inputs = [torch.randn(8, 4), torch.randn(16, 4)]
    allocs = [torch.empty(8, 4)]
    targs = [("t", ("in", 0)), ("v", 7), ("d", _Desc, dict(shape=[16, 4], strides=[4, 1], block_shape=[8, 4]),
                                           ("in", 1)),
             ("t", ("av", 0, (4, 4), (4, 1), 16)), ("v", 0.5)]
    fired = []
    monkeypatch.setattr(L, "fire", lambda bound, grid, args, kwargs: fired.append((bound, grid, args, kwargs)))
    monkeypatch.setattr(L, "direct", lambda bound, n: None)
    step = host_plan._FastLaunch("bound", (3, 2), targs, {"n": ("t", ("in", 0))})
    step(inputs, allocs, None)
    (bound, grid, args, kwargs), = fired
    assert bound == "bound" and grid == (3, 2) and kwargs["n"] is inputs[0]
    assert args[0] is inputs[0] and args[1] == 7 and args[4] == 0.5
    assert isinstance(args[2], _Desc) and args[2].base is inputs[1] and args[2].shape == [16, 4]
    assert args[3].data_ptr() == allocs[0].data_ptr() + 16 * 4 and args[3].shape == (4, 4)

    # the direct form: one descriptor at argument 2 (of 5), a tail of two constexprs
    calls, encoded = [], []

    def encode(d, meta):
        encoded.append((d.base.data_ptr(), meta))
        return ["map", *d.shape, *d.strides]

    monkeypatch.setattr(L, "direct", lambda bound, n: (lambda *a: calls.append(a), "fn", ("head",), (16, True),
                                                       [(2, "meta2")]))
    monkeypatch.setattr(L, "encode", encode)
    step = host_plan._FastLaunch("bound", (3,), targs, {})
    for x in (inputs[1], inputs[1], torch.randn(16, 4)):
        step([inputs[0], x], allocs, 99)
    assert len(calls) == 3 and len(encoded) == 2       # the repeated base address: encoded once
    for c, x in zip(calls, (inputs[1], inputs[1])):
        assert c[:6] == (3, 1, 1, 99, "fn", "head")
        assert c[6] == inputs[0].data_ptr() and type(c[6]) is int
        assert c[7] == 7 and c[8:13] == ("map", 16, 4, 4, 1) and c[14] == 0.5
        assert c[13] == allocs[0].data_ptr() + 64 and c[15:] == (16, True)
    # an input view's address: the input's own plus the view's element offset (in the input's dtype)
    iv = host_plan._pointer(("iv", 1, (2, 4), (4, 1), 5), [inputs[0], inputs[1][2:]], allocs)
    assert iv == inputs[1][2:].data_ptr() + 5 * 4 == inputs[1].view(-1)[13:].data_ptr()
    assert encoded[0] == (inputs[1].data_ptr(), "meta2")
    # a template the direct form cannot take (a descriptor where a plain value stands) falls back to fire
    monkeypatch.setattr(L, "direct", lambda bound, n: (None, "fn", (), (), [(1, "meta")]))
    assert host_plan._FastLaunch("bound", (1,), targs, {}).raw is None


# ----------------------------------------------------------------------------------------------------------------------
# the public op planned whole (gdn.ops.chunk._planned_call)
# ----------------------------------------------------------------------------------------------------------------------
def _public_plans():
    from gdn.ops import chunk as chunk_mod

    return host_plan.stats(chunk_mod._planned_call())["plans"]


def _count_validations(monkeypatch):
    from gdn.ops import chunk as chunk_mod

    seen = []
    real = chunk_mod._validate

    def counted(*a, **kw):
        seen.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(chunk_mod, "_validate", counted)
    return seen


@pytest.mark.parametrize("case", ["batched_k_last", "varlen_host_copy", "pool_unchecked"])
def test_public_op_replays_skip_validation(plans, device, nan_empty, monkeypatch, case):
    """Inference calls of the public op are planned whole: one key per call, the validation run only by the plain
    and the recorded call, replays bitwise equal to the Python path (outputs poisoned: nothing left unwritten), a
    pool's rows updated in place as by the Python path."""
    from gdn.ops import chunk_gated_delta_rule

    if case == "pool_unchecked":   # pool index checks read device values: planned only where they are skipped
        monkeypatch.setenv("GDN_SKIP_VALUE_CHECKS", "1")
    seen = _count_validations(monkeypatch)
    H, HV, K, V = 1, 2, 32, 16
    lens = None if case == "batched_k_last" else [1, 63, 0, 65]
    B = 2 if lens is None else 1
    T = 66 if lens is None else sum(lens)
    cu_host = None if lens is None else [0] + torch.tensor(lens).cumsum(0).tolist()
    cu = None if lens is None else torch.tensor(cu_host, dtype=torch.int32, device=device)
    N = B if lens is None else len(lens)
    layout = "k_last" if lens is None else "v_last"
    sshape = (HV, K, V) if layout == "v_last" else (HV, V, K)
    on = 0
    for call in range(CALLS):
        x = make_inputs(B, T, H, HV, K, V, dtype=torch.float32, device=device)
        state = torch.randn((N + 3 if case == "pool_unchecked" else N), *sshape, device=device)
        idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=device) if case == "pool_unchecked" else None
        outs = []
        for enabled in (True, False):
            host_plan.ENABLED = enabled
            n0 = len(seen)
            s = state.clone()
            with torch.no_grad():
                o, ht = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=s, output_final_state=True,
                                               cu_seqlens=cu, cu_seqlens_cpu=cu_host, use_qk_l2norm_in_kernel=True,
                                               state_layout=layout, ssm_state_indices=idx)
            on += (len(seen) - n0) if enabled else 0
            outs.append((o, ht, s))
        host_plan.ENABLED = True
        for n, (a, b) in enumerate(zip(*outs)):
            _same(a, b, f"call {call}, output {n}")
        if idx is not None:
            assert outs[0][1] is outs[0][2], "a pool is returned as the final state"
    assert on == 2, f"validation ran on {on} of {CALLS} planned calls (plain and recorded only)"
    assert _public_plans() == 1, plans.stats()
    # the forward's own planned function ran its Python path inside the public call's: no key of its own
    assert plans.stats()["keys"] == 1, plans.stats()


def test_public_op_plans_only_calls_validated_by_their_key(plans, device, monkeypatch):
    """What a replay could not check is decided per call: pool indices checked on the host (an out-of-range index
    after three good calls of the same key still raises), a call that needs a gradient (not planned: its gradients
    flow), the backend (GDN_BACKEND=torch runs the reference), and a changed shape (a new key: validated)."""
    from gdn.ops import chunk as chunk_mod
    from gdn.ops import chunk_gated_delta_rule

    H, HV, K, V, T = 1, 2, 32, 16, 70
    x = make_inputs(1, T, H, HV, K, V, dtype=torch.float32, device=device)
    pool = torch.randn(4, HV, K, V, device=device)
    for _ in range(3):
        with torch.no_grad():
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                   ssm_state_indices=torch.tensor([2], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="ssm_state_indices"):
        with torch.no_grad():
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                   ssm_state_indices=torch.tensor([4], dtype=torch.int32, device=device))
    assert _public_plans() == 0

    h0 = torch.randn(1, HV, K, V, device=device)
    for _ in range(CALLS):
        with torch.no_grad():
            o_plan, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0)
    assert _public_plans() == 1
    q = x.q.detach().clone().requires_grad_()
    o, _ = chunk_gated_delta_rule(q, x.k, x.v, x.g, x.beta, initial_state=h0)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    torch.testing.assert_close(o.detach(), o_plan)

    ref = []
    real = chunk_mod._torch_path
    monkeypatch.setattr(chunk_mod, "_torch_path", lambda *a, **kw: ref.append(1) or real(*a, **kw))
    monkeypatch.setenv("GDN_BACKEND", "torch")
    with torch.no_grad():
        o_ref, _ = chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0)
    assert ref == [1], "GDN_BACKEND=torch after replays runs the reference"
    torch.testing.assert_close(o_ref, o_plan, rtol=2e-3, atol=2e-3)
    monkeypatch.delenv("GDN_BACKEND")

    with pytest.raises(ValueError, match="initial_state"):
        with torch.no_grad():
            chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0[:, :, :8])
