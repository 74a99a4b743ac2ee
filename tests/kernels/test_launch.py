"""gdn.kernels.launch: its key is at least as fine as Triton's specialisation (checked against the installed Triton's
own ``native_specialize_impl``, so a release that changes the rules fails here), and the fast path passes the
launcher what ``JITFunction.run`` would (a stand-in kernel records it; the GPU tests launch for real)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn.kernels import launch as L

triton_jit = pytest.importorskip("triton.runtime.jit")
_C = pytest.importorskip("triton._C.libtriton")
from triton.backends.compiler import BaseBackend  # noqa: E402


def _triton_spec(a):
    return _C.native_specialize_impl(BaseBackend, a, False, True, True)


_BOUNDS = [0, 1, 2, 15, 16, 17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**63 - 16, 2**63, 2**64 - 16]
_ints = st.one_of(st.sampled_from(_BOUNDS + [-b for b in _BOUNDS if b <= 2**63]), st.integers(-2**63, 2**40),
                  st.integers(0, 2**64 - 1))


def _refines(values):
    """Every pair of values with equal gdn keys has equal Triton specialisations."""
    seen = {}
    for a in values:
        k, s = L.arg_key(a), _triton_spec(a)
        assert seen.setdefault(k, s) == s, (a, k, s, seen[k])


@settings(max_examples=60, deadline=None)
@given(st.lists(_ints, min_size=2, max_size=40))
def test_int_key_refines_triton_specialisation(values):
    _refines(values + _BOUNDS)


def test_tensor_float_bool_none_keys_refine_triton_specialisation():
    base = {dt: torch.empty(256, dtype=dt) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                                        torch.int64, torch.float64)}
    views = [t[o:] for t in base.values() for o in range(0, 17)]
    _refines(views + [0.5, -3.0, 1e30, True, False, None])
    # the keys do tell apart what Triton tells apart (else the test above would pass on a constant key)
    t = base[torch.bfloat16]
    assert L.arg_key(t) != L.arg_key(t[1:]) and L.arg_key(t) == L.arg_key(t[8:])
    assert L.arg_key(t) != L.arg_key(base[torch.float16])
    assert len({L.arg_key(v) for v in (1, 2, 16, 2**31, 2**63)}) == 5


def test_descriptor_key_refines_triton_specialisation():
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    descs = []
    for dt, gdt in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        x = torch.empty(512, 128, dtype=dt)
        for block in ([64, 128], [64, 64], [128, 64]):
            lay = gl.NVMMASharedLayout.get_default_for(block, gdt)
            descs += [hopper.TensorDescriptor.from_tensor(x, block, lay),
                      hopper.TensorDescriptor.from_tensor(x[64:], block, lay)]
    _refines(descs)
    assert len({L.arg_key(d) for d in descs}) == 6


def test_unchecked_descriptor_equals_the_checked_one():
    """hopper._desc builds the TMA descriptor without the dataclass's validation (host time): the result must be the
    descriptor the checked constructor gives (every field, equality, the launch key), on the installed Triton."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from gdn.kernels import _gluon_api as G
    from gdn.kernels.chunk import hopper as H

    if not G.AVAILABLE:
        pytest.skip("no Gluon TMA in this Triton")
    base = torch.randn(3, 100, 4, 128).to(torch.bfloat16)
    for x2d, block in ((H._rows2d(base), (64, 128)), (base.view(-1, 128), (128, 32)), (base[1].reshape(100, 512), (64, 64))):
        fast = H._desc(x2d, block, "bfloat16")
        checked = G.TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), list(block),
                                     H._smem_layout(tuple(block), "bfloat16"))
        assert type(fast) is type(checked) and vars(fast) == vars(checked) and fast == checked
        assert fast.base is x2d and L.arg_key(fast) == L.arg_key(checked)


def _kernel_src(x_ptr, y_ptr, n, scale, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = False, TAIL: "tl.constexpr" = 7):
    pass


class _Compiled:
    """Stands in for a CompiledKernel: records what its launcher is given."""
    function = "fn"
    packed_metadata = "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _Kernel:
    """Stands in for a JITFunction with the real one's parameters; ``kernel[grid]`` (the slow path) is recorded."""

    def __init__(self):
        self.params = triton_jit.JITFunction(_kernel_src).params
        self.pre_run_hooks = []
        self.slow = []
        self.compiled = {}

    def _key(self, args, kwargs):
        """Triton's key: the bound parameters (runtime ones by specialisation, constexprs by value) and the options."""
        bound = dict(zip([p.name for p in self.params], args))
        bound.update({n: v for n, v in kwargs.items() if n not in bound})
        names = {p.name for p in self.params}
        spec = tuple((p.name, bound[p.name] if p.is_constexpr else _triton_spec(bound[p.name]))
                     for p in self.params if p.name in bound)
        return spec + tuple(sorted((n, v) for n, v in kwargs.items() if n not in names))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            key = self._key(args, kwargs)
            self.slow.append(key)
            return self.compiled.setdefault(key, _Compiled())
        return run

    def warmup(self, *args, grid, **kwargs):
        return self.compiled.setdefault(self._key(args, kwargs), _Compiled())   # compiles (here: makes) what it has not seen


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setattr(L, "_ENABLED", True)
    monkeypatch.setattr(L, "_raw_stream", lambda dev: 1234)
    monkeypatch.setattr(L, "VERIFY", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_CACHE", {})
    monkeypatch.setattr(L, "_SIGNATURES", {})


def test_fast_path_passes_the_launcher_what_jit_run_would(fast_path):
    k = _Kernel()
    x = torch.empty(64)
    y = torch.empty(64)
    L.launch(k, (3,), x, y, 32, 0.5, BLOCK=16, num_warps=4)
    assert len(k.slow) == 1
    n = torch.randint(1, 100, ()).item() * 16
    L.launch(k, (5, 2), x, y, n, 0.25, BLOCK=16, num_warps=4)        # same key: fast
    assert len(k.slow) == 1
    (compiled,) = k.compiled.values()
    # grid padded to 3, the stream, the handles, no hooks, then every parameter in signature order with defaults
    assert compiled.calls == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, y, n, 0.25, 16, False, 7)]
    # what Triton tells apart gets a fresh slow launch: alignment, the constant 1, divisibility, constexpr values
    L.launch(k, (1,), x[1:], y, 32, 0.5, BLOCK=16, num_warps=4)
    L.launch(k, (1,), x, y, 1, 0.5, BLOCK=16, num_warps=4)
    L.launch(k, (1,), x, y, 33, 0.5, BLOCK=16, num_warps=4)
    L.launch(k, (1,), x, y, 32, 0.5, BLOCK=32, num_warps=4)
    L.launch(k, (1,), x, y, 32, 0.5, 16, num_warps=4)                # BLOCK positional: keyed by value
    L.launch(k, (1,), x, y, 32, 0.5, 16, True, num_warps=4)
    L.launch(k, (1,), x, y, 32, 0.5, BLOCK=16, num_warps=8)
    assert len(k.slow) == 8
    L.launch(k, (1,), x, y, 32, 0.5, 16, True, num_warps=4)          # repeated: fast, FLAG positional
    assert len(k.slow) == 8
    flagged = k.compiled[k.slow[6]]
    assert flagged is not compiled and flagged.calls[-1][9:] == (x, y, 32, 0.5, 16, True, 7)


def test_fast_path_verify_catches_a_key_that_is_too_coarse(fast_path, monkeypatch):
    k = _Kernel()
    x = torch.empty(64)
    monkeypatch.setattr(L, "arg_key", lambda a: 0)                 # a key that ignores everything
    L.launch(k, (1,), x, x, 32, 0.5, BLOCK=16)
    with pytest.raises(RuntimeError, match="VERIFY"):
        L.launch(k, (1,), x[1:], x, 32, 0.5, BLOCK=16)


def test_slow_path_where_the_fast_one_does_not_apply(fast_path):
    k = _Kernel()
    x = torch.empty(64)
    for _ in range(2):
        L.launch(k, lambda meta: (1,), x, x, 32, 0.5, BLOCK=16)     # callable grid
    k.pre_run_hooks.append(lambda *a, **kw: None)
    for _ in range(2):
        L.launch(k, (1,), x, x, 32, 0.5, BLOCK=16)
    assert len(k.slow) == 4


def test_missing_argument_is_a_type_error(fast_path):
    k = _Kernel()
    with pytest.raises(TypeError, match="BLOCK"):
        L._tail(k, 4, {})
    assert L._tail(k, 4, {"BLOCK": 8}) == (8, False, 7)


def test_runtime_arguments_by_keyword(fast_path):
    """A runtime argument passed by keyword is keyed like a positional one, and each fast launch passes this call's
    value (not the first call's)."""
    k = _Kernel()
    x, y = torch.empty(64), torch.empty(64)
    L.launch(k, (1,), x, y, 32, scale=0.5, BLOCK=16)
    L.launch(k, (1,), x, y, 48, scale=0.25, BLOCK=16)                # same key: fast, with 48 and 0.25
    L.launch(k, (1,), x, y, n=64, scale=0.125, BLOCK=16)             # n by keyword: another key
    L.launch(k, (1,), x, y, n=80, scale=0.125, BLOCK=16)             # fast
    L.launch(k, (1,), x, y, n=81, scale=0.125, BLOCK=16)             # not a multiple of 16: slow
    assert len(k.slow) == 3
    calls = [c for comp in k.compiled.values() for c in comp.calls]
    assert sorted(c[9:13] for c in calls) == [(x, y, 48, 0.25), (x, y, 80, 0.125)]


def test_direct_launch_expands_arguments_as_triton_does(monkeypatch):
    """launch.direct (host-plan replays' straight call of the C launcher) on Triton 3.6: the launcher and the
    descriptor positions read from Triton's own wrap_handle_tensordesc closure, and the final arguments equal what
    that wrapper passes the C launcher (descriptor encoding stood in for: it needs a GPU). Other releases: None."""
    import triton
    from triton.backends.nvidia import driver as D

    got = []

    def c_launcher(*a):
        got.append(a)

    signature = {"x": "*fp32", "d": "tensordesc<bf16[8, 4]>", "n": "i32", "B": "constexpr"}
    meta = [dict(swizzle=128, elem_size=2, elem_type=10, block_size=[8, 4], fp4_padded=False)]

    class Run:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

    class Compiled:
        run, function, packed_metadata = Run(), "fn", "packed"

    if L._version() != (3, 6):
        Run.launch = c_launcher
        assert L.direct(("kernel", (Compiled, (16,))), 3) is None
        return
    monkeypatch.setattr(D, "make_tensordesc_arg",
                        lambda arg, m: [("map", arg.base.data_ptr(), m["swizzle"]), *arg.shape, *arg.strides])
    Run.launch = D.wrap_handle_tensordesc(c_launcher, signature, meta)
    x, base = torch.empty(4), torch.empty(16, 4, dtype=torch.bfloat16)
    desc = _Desc(base, [16, 4], [4, 1], [8, 4])
    Run.launch(2, 3, 1, 77, "fn", False, True, None, None, "packed", None, None, None, x, desc, 5, 16)   # Triton's way
    raw, function, head, tail, descs = L.direct(("kernel", (Compiled, (16,))), 3)
    assert raw is c_launcher and function == "fn" and tail == (16,) and descs == [(1, meta[0])]
    raw(2, 3, 1, 77, function, *head, x, *L.encode(desc, meta[0]), 5, *tail)                         # ours
    assert len(got) == 2 and got[0] == got[1]
    assert got[1][13:] == (x, ("map", base.data_ptr(), 128), 16, 4, 4, 1, 5, 16)
    Run.global_scratch_size = 64            # scratch to allocate per launch: not this form
    assert L.direct(("kernel", (Compiled, (16,))), 3) is None


class _Desc:
    def __init__(self, base, shape, strides, block_shape, padding="zero"):
        self.base, self.shape, self.strides, self.block_shape, self.padding = base, shape, strides, block_shape, padding


def test_pdl_args_only_for_cuda_sm90_outside_the_interpreter(monkeypatch):
    """Programmatic dependent launch keywords: none on the CPU, in the interpreter, when off or before sm_90; the
    kernel's PDL switch and Triton's launch_pdl option on sm_90 and newer."""
    import types

    cuda = types.SimpleNamespace(type="cuda", index=0)
    assert L.pdl_args(True, torch.device("cpu")) == {}
    assert L.pdl_args(False, cuda) == {}
    monkeypatch.setattr(L, "triton_interpret", lambda: False)
    on = {"PDL": True, "launch_pdl": True}
    for cap, want in (((8, 0), {}), ((9, 0), on), ((10, 0), on)):
        monkeypatch.setattr(L, "_PDL_DEVICES", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx, c=cap: c)
        assert L.pdl_args(True, cuda) == want
    monkeypatch.setattr(L, "triton_interpret", lambda: True)
    assert L.pdl_args(True, cuda) == {}


def test_pdl_problem_reads_the_ptx_order():
    """gdn.aot.pdl_problem: a global access before griddepcontrol.wait (or no wait at all) is reported."""
    import types

    from gdn.aot import pdl_problem

    ok = "mov.u32 %r1, 0;\n\tgriddepcontrol.wait;\n\tld.global.b32 %r2, [%rd1];\n\tcp.async.bulk.tensor.2d [x];"
    early = "ld.global.b32 %r2, [%rd1];\n\tgriddepcontrol.wait;"
    tma_early = "cp.async.bulk.tensor.2d.shared::cluster.global [x];\n\tgriddepcontrol.wait;"
    assert pdl_problem(types.SimpleNamespace(asm={"ptx": ok})) == ""
    assert "before the wait" in pdl_problem(types.SimpleNamespace(asm={"ptx": early}))
    assert "before the wait" in pdl_problem(types.SimpleNamespace(asm={"ptx": tma_early}))
    assert pdl_problem(types.SimpleNamespace(asm={"ptx": "ld.global.b32 %r2, [%rd1];"})) == "no griddepcontrol.wait"
