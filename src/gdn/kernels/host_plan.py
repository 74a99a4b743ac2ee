"""Host plans: the host work of a kernel-level call recorded once and replayed on later calls of the same key.

A chunked forward or backward spends ~0.3-0.8 ms of host time per call in Python (validation of what the kernels
take, chunk tables, segment and tile plans, tuning lookups, views, descriptors, ~800 Python calls), which makes the
small training rows host-bound. All of it depends only on what the key below holds, so :func:`planned` runs a call
normally the first time a key is seen, records the second call (every allocation, fill and kernel launch, with the
tensors they touch expressed as views of the call's inputs or allocations), and from the third call on replays the
record: allocate, fill, build the launch arguments and descriptors from this call's tensors, launch, free (a launch
step keeps its constant arguments in place; on Triton 3.6 it calls the C launcher itself, each TMA descriptor encoded
once per base address: :class:`_FastLaunch`).

The key of a call: the function, and per argument (walked through tuples, lists, dicts and named tuples) a tensor's
dtype, shape, strides, device and data pointer modulo 16 (the kernels' alignment specialisation; for integer CPU
tensors, whose values the host reads, the values too), or the value of an int / float / bool / str / None / dtype /
device; how the tensors share memory (which share a storage, at what distance); the current CUDA device, whether
the stream is capturing a graph, GDN_TUNE, the generation of the tuning overrides (``tuning.override`` blocks),
Triton's debug / instrumentation knobs and :data:`EPOCH`. A call with any other argument type is never planned, nor
one whose first argument is not a CUDA tensor (unless :data:`PLAN_CPU`: Triton's interpreter in the tests).

What keeps a replay equal to the call it stands for (checked while recording; any failure leaves the key
unplanned): every torch operator the call runs is seen by a ``TorchDispatchMode``: allocations (``empty``,
``zeros``, ...), fills, clones, copies and dtype conversions on the tensors' own device are recorded, views allowed,
anything else (a computation, a read of device values like ``.item()`` or ``.cpu()``) makes the call unplannable;
every launch must go through :func:`gdn.kernels.launch.launch` with a tuple grid on the stream the call began on; a
launch argument's tensor must be a view inside one input's extent, a view of an allocation, or a tensor that existed
before the call (a cached table: kept by reference). Operators run inside a launch (the interpreter's copies) are
the launcher's own. Replays hold each allocation and input only until its last use (kernels are stream-ordered); the
intermediates (allocations the output does not hold) are laid out once in one workspace, each at an offset no other
intermediate uses while both live (what the caching allocator did for the recorded call: a replay's peak memory is
the recorded call's up to the 512-byte rounding of each), so a replay makes one allocation for all of them and
passes the launcher their addresses; the output's tuples that hold no tensor of the call (a cached chunk table)
are built once per plan. ``launch.VERIFY`` (``gdn check``) and launch hooks
(profilers) bypass replays. The public ``chunk_gated_delta_rule`` plans its inference calls whole
(``gdn.ops.chunk._planned_call``: one key per call, the validation skipped on replays); a planned function called
while another runs (not a replay) runs its Python path: its launches are recorded by the outer plan, and a key of its
own would cost each call of an unplanned outer key a second walk and take a plan slot that no replay consults.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import tune_raw
from . import launch as _launch_mod
from . import tuning as _tuning

ENABLED = True      # planned calls record and replay (False: every call runs its Python path)
PLAN_CPU = False    # plan calls on CPU tensors too (Triton's interpreter: the tests of this module turn it on)
RECORD_AT = 2       # the call of a key that is recorded (1-based); earlier ones warm the caches and compile
MAX_PLANS = 256
MAX_TRIES = 3       # recordings of one key that may fail (e.g. a cache rebuilt during the call) before it is given up
EPOCH = 0           # bumped by clear(): keys of earlier plans no longer match

_aten = torch.ops.aten
_ALLOC_OPS = {_aten.empty.memory_format: None, _aten.empty_strided.default: None, _aten.empty_like.default: None,
              _aten.new_empty.default: None, _aten.new_empty_strided.default: None, _aten.zeros.default: 0,
              _aten.zeros_like.default: 0, _aten.new_zeros.default: 0, _aten.ones.default: 1,
              _aten.ones_like.default: 1, _aten.new_ones.default: 1}
_FULL_OPS = {_aten.full.default: lambda a: a[1], _aten.full_like.default: lambda a: a[1],      # -> the fill value
             _aten.new_full.default: lambda a: a[2]}
_FILL_OPS = (_aten.zero_.default, _aten.fill_.Scalar)
_NEW_FROM = (_aten.clone.default, _aten._to_copy.default)     # a new tensor from one tensor on its device
_VIEWS = (_aten._unsafe_view.default, _aten.alias.default)
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)
_CPU_VALUES_MAX = 65536

_PLANS: dict = {}
_local = threading.local()


class _Unplannable(Exception):
    pass


def clear() -> None:
    """Forget every plan (tests that patch module internals call this; plans recorded before would not see it)."""
    global EPOCH
    _PLANS.clear()
    EPOCH += 1


# ----------------------------------------------------------------------------------------------------------------------
# keys
# ----------------------------------------------------------------------------------------------------------------------
def _walk(items, key: list, inputs: list) -> None:
    """Append the key of every item of ``items`` (an iterable) to ``key`` and its tensors to ``inputs``."""
    for x in items:
        c = x.__class__
        if c is torch.Tensor or (c not in _SCALARS and isinstance(x, torch.Tensor)):
            inputs.append(x)
            if x.is_cuda or x.is_floating_point():
                key.append((x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() & 15))
            else:   # host integers: the host may read them
                if x.numel() > _CPU_VALUES_MAX:
                    raise _Unplannable
                key.append((x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() & 15,
                            tuple(x.reshape(-1).tolist())))
        elif c in _SCALARS:
            key.append(c)
            key.append(x)
        elif c is tuple or c is list:
            if all([y.__class__ is int for y in x]):
                key.append((c, tuple(x)))
            else:
                key.append((c, len(x)))
                _walk(x, key, inputs)
        elif c is dict:
            key.append((c, tuple(x)))
            _walk(x.values(), key, inputs)
        elif isinstance(x, tuple) and hasattr(c, "_fields"):
            key.append(c)
            _walk(x, key, inputs)
        else:
            raise _Unplannable


def _aliasing(inputs) -> tuple:
    """How the inputs share memory: per input, the first input on the same storage and the byte distance of their
    data pointers (a view's template is then the same memory relative to every input it could come from)."""
    first, out = {}, []
    for i, x in enumerate(inputs):
        if not x.numel():
            out.append(None)
            continue
        sp = x.untyped_storage().data_ptr()
        j = first.setdefault(sp, i)
        out.append(None if j == i else (j, x.data_ptr() - inputs[j].data_ptr()))
    return tuple(out)


def _call_key(fn, args, kwargs):
    first = args[0] if args else None
    if not (isinstance(first, torch.Tensor) and (first.is_cuda or PLAN_CPU)):
        raise _Unplannable      # the call's device is its first argument's
    key, inputs = [fn, EPOCH, tune_raw(), _tuning._GENERATION[0], _launch_mod.knobs_key()], []
    _walk(args, key, inputs)
    key.append(tuple(kwargs))
    _walk(kwargs.values(), key, inputs)
    key.append(_aliasing(inputs))
    if torch.cuda.is_initialized():
        key.append(torch.cuda.current_device())
        key.append(torch.cuda.is_current_stream_capturing())
    return tuple(key), inputs


# ----------------------------------------------------------------------------------------------------------------------
# recording
# ----------------------------------------------------------------------------------------------------------------------
# tensor templates: ("in", i) input i itself; ("iv", i, size, stride, offset) a view of input i (offset relative to
# the input's own); ("al", j) allocation j itself; ("av", j, size, stride, offset); ("c", t) a tensor from before the
# call; ("e", size, stride, dtype, device) an empty tensor; ("rv", base, size, stride, byte offset, dtype) the bytes of
# a dense allocation or input (template ``base``) in another dtype; in plans only, ("wv", w, byte offset, size, stride,
# dtype) an intermediate in the workspace allocation w (_Plan). Values: ("t", template), ("d", type, fields, template)
# a TMA descriptor, ("v", value).
def _last(size, stride) -> int:
    """The offset of a non-empty tensor's last element from its first, in elements."""
    return sum((s - 1) * st for s, st in zip(size, stride))


def _extent(t: torch.Tensor):
    lo = t.storage_offset()
    return lo, lo + _last(t.shape, t.stride())


class _Recorder(TorchDispatchMode):
    def __init__(self, inputs, stream):
        super().__init__()
        self.inputs = inputs
        self.stream = stream
        self.owners = {}        # storage data pointer -> ("in", [input indices]) or ("al", allocation index)
        self.allocs = []        # (size, stride, dtype, device)
        self.steps = []         # ("alloc", j) / ("fill", ...) / ("new", ...) / ("copy", ...) / ("launch", ...): _Plan
        self.bad = None
        self.in_launch = 0      # > 0 inside a launch: the launcher's own operators are not recorded
        for i, x in enumerate(inputs):
            if x.numel():
                owner = self.owners.setdefault(x.untyped_storage().data_ptr(), ("in", []))
                if owner[0] == "in":
                    owner[1].append(i)

    # -- tensors ---------------------------------------------------------------------------------------------------
    def template(self, t: torch.Tensor):
        if t.numel() == 0:
            return ("e", tuple(t.shape), t.stride(), t.dtype, t.device)
        owner = self.owners.get(t.untyped_storage().data_ptr())
        if owner is None:
            return ("c", t)
        if owner[0] == "al":
            j = owner[1]
            size, stride, dtype, _ = self.allocs[j]
            if t.dtype != dtype:    # its bytes in another dtype (o's rows holding fp32 scalars: hopper.row_scalar_pack)
                return self._reinterpreted(t, ("al", j), *self.allocs[j][:3])
            if tuple(t.shape) == size and t.stride() == stride and t.storage_offset() == 0:
                return ("al", j)
            return ("av", j, tuple(t.shape), t.stride(), t.storage_offset())
        lo, hi = _extent(t)
        for i in owner[1]:      # (inputs on one storage keep their distances in every call of the key: _aliasing)
            x = self.inputs[i]
            if x.dtype != t.dtype:
                try:
                    return self._reinterpreted(t, ("in", i), tuple(x.shape), x.stride(), x.dtype, x)
                except _Unplannable:
                    continue
            xlo, xhi = _extent(x)
            if xlo <= lo and hi <= xhi:
                if tuple(t.shape) == tuple(x.shape) and t.stride() == x.stride() and lo == xlo:
                    return ("in", i)
                return ("iv", i, tuple(t.shape), t.stride(), lo - xlo)
        raise _Unplannable

    @staticmethod
    def _reinterpreted(t, base, size, stride, dtype, x=None):
        """("rv", base, shape, stride, byte offset, dtype): ``t`` viewing the bytes of the dense tensor ``base``
        (an allocation, or input ``x``) [size, stride, dtype] in its own dtype, at a byte offset from base's first
        element that is a multiple of t's element size, inside base's bytes."""
        if not _contiguous(size, stride):
            raise _Unplannable
        start = x.data_ptr() if x is not None else t.untyped_storage().data_ptr()
        off = t.data_ptr() - start
        if off < 0 or off % t.element_size() or off + _nbytes(t.shape, t.stride(), t.dtype) > _nbytes(size, stride,
                                                                                                     dtype):
            raise _Unplannable
        return ("rv", base, tuple(t.shape), t.stride(), off, t.dtype)

    def value(self, a):
        if isinstance(a, torch.Tensor):
            return ("t", self.template(a))
        base = getattr(a, "base", None)
        if isinstance(base, torch.Tensor) and hasattr(a, "__dict__"):    # a TMA tensor descriptor
            # its declared fields only, and nothing else on it: an attribute a launcher might have cached on the
            # object (an encoded tensor map of the recorded base) must not travel into a replay
            if not dataclasses.is_dataclass(a):
                raise _Unplannable
            names = {f.name for f in dataclasses.fields(a)}
            if not set(a.__dict__) <= names:
                raise _Unplannable
            fields = {k: v for k, v in a.__dict__.items() if k != "base"}
            if any(isinstance(v, torch.Tensor) for v in fields.values()):
                raise _Unplannable
            return ("d", type(a), fields, self.template(base))
        if callable(a) and not isinstance(a, type):
            raise _Unplannable
        return ("v", a)

    # -- events ----------------------------------------------------------------------------------------------------
    def on_launch(self, kernel, grid, args, kwargs, stream):
        if self.bad is not None:
            return
        try:
            if callable(grid) or stream != self.stream:
                raise _Unplannable
            self.steps.append(("launch", kernel, tuple(int(x) for x in grid), [self.value(a) for a in args],
                               {k: self.value(v) for k, v in kwargs.items()}))
        except _Unplannable:
            self.bad = f"launch of {getattr(kernel, '__name__', kernel)}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.bad is not None or self.in_launch or func.is_view or func in _VIEWS:
            return out
        try:
            if func in _ALLOC_OPS or func in _FULL_OPS:
                if not isinstance(out, torch.Tensor):
                    raise _Unplannable
                fill = _ALLOC_OPS[func] if func in _ALLOC_OPS else _FULL_OPS[func](args)
                self.alloc(out, fill)
            elif func in _NEW_FROM:
                src = args[0]
                if not isinstance(out, torch.Tensor) or out.device != src.device or len(args) != 1:
                    raise _Unplannable      # a host transfer, or a form not recorded here
                tmpl = self.template(src)
                j = self.alloc(out, None, step=False)
                self.steps.append(("new", j, func, tmpl, dict(kwargs)))
            elif func is _aten.copy_.default:
                if len(args) != 2 or kwargs or args[0].device != args[1].device:
                    raise _Unplannable
                self.steps.append(("copy", self.template(args[0]), self.template(args[1])))
            elif func in _FILL_OPS:
                v = 0 if func is _aten.zero_.default else args[1]
                if not isinstance(v, (int, float, bool)):
                    raise _Unplannable
                self.steps.append(("fill", self.template(args[0]), v))
            else:
                raise _Unplannable
        except _Unplannable:
            self.bad = str(func)
        return out

    def alloc(self, t: torch.Tensor, fill, step=True) -> int:
        j = len(self.allocs)
        self.allocs.append((tuple(t.shape), t.stride(), t.dtype, t.device))
        if step:
            self.steps.append(("alloc", j))
        if t.numel():
            self.owners[t.untyped_storage().data_ptr()] = ("al", j)
        if fill is not None:
            if not isinstance(fill, (int, float, bool)):
                raise _Unplannable
            self.steps.append(("fill", ("al", j), fill))
        return j

    def output(self, x):
        if isinstance(x, torch.Tensor):
            return ("t", self.template(x))
        c = x.__class__
        if c is tuple or c is list:
            return ("seq", c, [self.output(y) for y in x])
        if c is dict:
            return ("dict", [(k, self.output(y)) for k, y in x.items()])
        if isinstance(x, tuple) and hasattr(c, "_fields"):
            return ("named", c, [self.output(y) for y in x])
        return ("v", x)


def _fold(tmpl):
    """``(folded, constant)``: the output template ``tmpl`` with each tuple or named tuple that holds no tensor of
    this call (only values and tensors from before the call, e.g. a cached chunk table) built once, as a ("v", value)
    template shared by every replay; ``constant``: whether ``tmpl`` holds no tensor of this call. Lists and dicts
    inside such a tuple are shared too (``planned`` functions return values that do not change between calls of a
    key, and a cached object is shared by the calls it stands for anyway); lists and dicts outside one stay
    templates, built anew per call."""
    kind = tmpl[0]
    if kind == "v":
        return tmpl, True
    if kind == "t":
        return (("v", tmpl[1][1]), True) if tmpl[1][0] == "c" else (tmpl, False)
    if kind == "dict":
        parts = [(k, _fold(y)) for k, y in tmpl[1]]
        return ("dict", [(k, y) for k, (y, _) in parts]), all(c for _, (_, c) in parts)
    parts = [_fold(y) for y in tmpl[2]]
    folded = (kind, tmpl[1], [y for y, _ in parts])
    const = all(c for _, c in parts)
    if const and (kind == "named" or tmpl[1] is tuple):
        return ("v", _build(folded, (), ())), True
    return folded, const


def _uses(tmpl, out: set) -> None:
    """Collect ("al", j) / ("in", i) references of a value / output template."""
    kind = tmpl[0]
    if kind == "t":
        _uses_tensor(tmpl[1], out)
    elif kind == "d":
        _uses_tensor(tmpl[3], out)
    elif kind in ("seq", "named"):
        for y in tmpl[2]:
            _uses(y, out)
    elif kind == "dict":
        for _, y in tmpl[1]:
            _uses(y, out)


def _uses_tensor(t, out: set) -> None:
    if t[0] == "rv":
        _uses_tensor(t[1], out)
    elif t[0] in ("al", "av", "wv"):
        out.add(("al", t[1]))
    elif t[0] in ("in", "iv"):
        out.add(("in", t[1]))


# ----------------------------------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------------------------------
class _Plan:
    """A recorded call: steps ("alloc", j, ...) / ("fill", template, v) / ("new", j, op, template, kwargs) (a clone or
    same-device conversion) / ("copy", dst, src) / ("launch", kernel, grid, args, kwargs, bound) / ("free", refs), and
    the output template."""

    __slots__ = ("allocs", "steps", "out")

    def __init__(self, rec: _Recorder, out_tmpl):
        self.allocs = list(rec.allocs)
        self.out = _fold(out_tmpl)[0]
        kept = set()
        _uses(out_tmpl, kept)
        rec_steps = self._workspace(rec.steps, kept)
        used = [_step_uses(s) for s in rec_steps]
        # allocations nothing reads or returns are not made; everything else is dropped after its last use
        needed = set().union(*used, kept) if used else set(kept)
        last = {}
        for n, refs in enumerate(used):
            for r in refs:
                last[r] = n
        steps = []
        for n, s in enumerate(rec_steps):
            if s[0] == "alloc":
                if ("al", s[1]) in needed:
                    size, stride, dtype, device = self.allocs[s[1]]
                    steps.append(("alloc", s[1], size, stride, dtype, device, _contiguous(size, stride)))
                continue
            steps.append(s + ((None,) if s[0] == "launch" else ()))
            dead = tuple(r for r, m in last.items() if m == n and r not in kept)
            if dead:
                steps.append(("free", dead))
        self.steps = steps

    def _workspace(self, steps: list, kept: set) -> list:
        """The recorded steps with the intermediates moved into one workspace allocation (appended to
        ``self.allocs``): each intermediate made by an allocation step, used by a later step and not held by the
        output gets the lowest 512-byte aligned offset that no intermediate alive at the same time covers (first fit
        in allocation order; alive from its allocation step to its last use); its templates become "wv" templates of
        the workspace and its allocation step goes (the workspace's is at the first one's place)."""
        first, last = {}, {}
        for n, st in enumerate(steps):
            if st[0] == "alloc":
                first[st[1]] = n
            for r in _step_uses(st):
                if r[0] == "al":
                    last[r[1]] = n
        cands = [j for j in sorted(first, key=first.get)
                 if ("al", j) not in kept and j in last and _nbytes(*self.allocs[j][:3])]
        devices = {self.allocs[j][3] for j in cands}
        if not cands or len(devices) != 1:
            return steps
        placed, where = [], {}     # (first step, last step, offset, bytes); j -> byte offset
        for j in cands:
            nb = -(-_nbytes(*self.allocs[j][:3]) // _WS_ALIGN) * _WS_ALIGN
            a, b = first[j], last[j]
            off = 0
            for lo, hi in sorted((o, o + m) for (s0, s1, o, m) in placed if s0 <= b and a <= s1):
                if off + nb <= lo:
                    break
                off = max(off, hi)
            placed.append((a, b, off, nb))
            where[j] = off
        w = len(self.allocs)
        self.allocs.append(((max(o + m for (_, _, o, m) in placed),), (1,), torch.uint8, devices.pop()))

        def tensor(t):
            if t[0] == "al" and t[1] in where:
                size, stride, dtype, _ = self.allocs[t[1]]
                return ("wv", w, where[t[1]], size, stride, dtype)
            if t[0] == "av" and t[1] in where:
                dtype = self.allocs[t[1]][2]
                return ("wv", w, where[t[1]] + t[4] * dtype.itemsize, t[2], t[3], dtype)
            if t[0] == "rv" and t[1][0] == "al" and t[1][1] in where:
                return ("wv", w, where[t[1][1]] + t[4], t[2], t[3], t[5])
            return t

        def value(v):
            if v[0] == "t":
                return ("t", tensor(v[1]))
            if v[0] == "d":
                return ("d", v[1], v[2], tensor(v[3]))
            return v

        out, made = [], False
        for st in steps:
            kind = st[0]
            if kind == "alloc":
                if st[1] not in where:
                    out.append(st)
                elif not made:
                    out.append(("alloc", w))
                    made = True
            elif kind == "fill":
                out.append(("fill", tensor(st[1]), st[2]))
            elif kind == "copy":
                out.append(("copy", tensor(st[1]), tensor(st[2])))
            elif kind == "new":
                out.append(st[:3] + (tensor(st[3]),) + st[4:])
            else:   # launch
                out.append(st[:3] + ([value(a) for a in st[3]], {k: value(v) for k, v in st[4].items()}))
        return out

    def replay(self, inputs: list):
        allocs = [None] * len(self.allocs)
        stream = _launch_mod.current_stream()     # every launch of the call is on the stream it began on
        for n, s in enumerate(self.steps):
            kind = s[0]
            if kind == "launch":
                self._launch(n, s, inputs, allocs, stream)
            elif kind == "alloc":
                _, j, size, stride, dtype, device, contiguous = s
                allocs[j] = torch.empty(size, dtype=dtype, device=device) if contiguous else \
                    torch.empty_strided(size, stride, dtype=dtype, device=device)
            elif kind == "fill":
                _tensor(s[1], inputs, allocs).fill_(s[2])
            elif kind == "new":     # clone / _to_copy of a tensor on its device
                allocs[s[1]] = s[2](_tensor(s[3], inputs, allocs), **s[4])
            elif kind == "copy":
                _tensor(s[1], inputs, allocs).copy_(_tensor(s[2], inputs, allocs))
            else:   # free
                for which, i in s[1]:
                    if which == "al":
                        allocs[i] = None
                    else:
                        inputs[i] = None
        return _build(self.out, inputs, allocs)

    def _launch(self, n, s, inputs, allocs, stream):
        _, kernel, grid, targs, tkwargs, fast = s
        if fast is not None and _launch_mod.fast_ok(kernel):
            fast(inputs, allocs, stream)
            return
        args = [_value(a, inputs, allocs) for a in targs]
        kwargs = {k: _value(v, inputs, allocs) for k, v in tkwargs.items()} if tkwargs else {}
        if fast is None:
            bound = _launch_mod.bind(kernel, args, kwargs)
            if bound is not None:
                self.steps[n] = s[:5] + (_FastLaunch(bound, grid, targs, tkwargs),)
        _launch_mod.launch(kernel, grid, *args, **kwargs)


class _FastLaunch:
    """One launch step of a plan, bound to its compiled kernel (:func:`gdn.kernels.launch.bind`): the argument list
    with its values in place, so that a replay fills in only this call's tensors and TMA descriptors. Where
    :func:`gdn.kernels.launch.direct` gives the C launcher (Triton 3.6), the arguments are kept in its expanded
    form and go to it straight, each descriptor encoded once per base address (a descriptor's other fields are
    the plan's: the same base address means the same tensor map); elsewhere through ``launch.fire``."""

    __slots__ = ("bound", "grid", "args", "tensors", "descs", "kwargs", "raw")
    _ENCODED_MAX = 16      # base addresses remembered per descriptor argument

    def __init__(self, bound, grid, targs, tkwargs):
        self.bound, self.grid, self.kwargs = bound, grid, tkwargs
        self.raw = None
        if not any(v[0] != "v" for v in tkwargs.values()) and self._direct(targs):
            return
        self.args = [a[1] if a[0] == "v" else None for a in targs]
        self.tensors = tuple((i, a[1]) for i, a in enumerate(targs) if a[0] == "t")
        self.descs = tuple((i, a[1], a[2], a[3]) for i, a in enumerate(targs) if a[0] == "d")

    def _direct(self, targs) -> bool:
        d = _launch_mod.direct(self.bound, len(targs))
        if d is None:
            return False
        raw, function, head, tail, meta = d
        meta = dict(meta)
        args, tensors, descs = [], [], []
        for i, a in enumerate(list(targs) + [("v", x) for x in tail]):
            if i in meta:       # [tensor map, *shape, *strides]: as many slots as encode() returns
                if a[0] != "d" or "shape" not in a[2]:
                    return False
                width = 1 + 2 * len(a[2]["shape"])
                descs.append((len(args), width, a[1], a[2], a[3], meta[i], {}))
                args.extend([None] * width)
            elif a[0] == "t":
                tensors.append((len(args), a[1]))
                args.append(None)
            elif a[0] == "v":
                args.append(a[1])
            else:
                return False
        g = tuple(self.grid) + (1,) * (3 - len(self.grid))
        self.raw = (raw, g[0], g[1], g[2], function, head)
        self.args, self.tensors, self.descs = args, tuple(tensors), tuple(descs)
        return True

    def __call__(self, inputs, allocs, stream):
        args = self.args.copy()
        if self.raw is None:
            for i, t in self.tensors:
                args[i] = _tensor(t, inputs, allocs)
            for i, typ, fields, t in self.descs:
                args[i] = _descriptor(typ, fields, _tensor(t, inputs, allocs))
            kwargs = {k: _value(v, inputs, allocs) for k, v in self.kwargs.items()} if self.kwargs else {}
            _launch_mod.fire(self.bound, self.grid, args, kwargs)
            return
        for i, t in self.tensors:     # the C launcher takes a device pointer as an int as it is (no view to build,
            args[i] = _pointer(t, inputs, allocs)     # no data_ptr() call and pointer-attribute query of its own)
        for i, width, typ, fields, t, meta, encoded in self.descs:
            ptr = _pointer(t, inputs, allocs)
            e = encoded.get(ptr)
            if e is None:
                e = _launch_mod.encode(_descriptor(typ, fields, _tensor(t, inputs, allocs)), meta)
                if len(e) != width:
                    raise RuntimeError(f"gdn host plan: a TMA descriptor expanded to {len(e)} launcher arguments, "
                                       f"not {width}")
                if len(encoded) >= self._ENCODED_MAX:
                    encoded.clear()
                encoded[ptr] = e
            args[i:i + width] = e
        raw, gx, gy, gz, function, head = self.raw
        raw(gx, gy, gz, stream, function, *head, *args)


_WS_ALIGN = 512    # bytes: the caching allocator's block rounding (kernels are specialised on 16-byte alignment)


def _step_uses(s) -> set:
    """The ("al", j) / ("in", i) references of a recorded step (its allocation aside)."""
    refs = set()
    if s[0] == "fill":
        _uses_tensor(s[1], refs)
    elif s[0] == "copy":
        _uses_tensor(s[1], refs)
        _uses_tensor(s[2], refs)
    elif s[0] == "new":
        refs.add(("al", s[1]))
        _uses_tensor(s[3], refs)
    elif s[0] == "launch":
        for a in s[3]:
            _uses(a, refs)
        for a in s[4].values():
            _uses(a, refs)
    return refs


def _nbytes(size, stride, dtype) -> int:
    """Bytes a tensor of this size / stride / dtype spans from its first element (0 when empty)."""
    if any(n == 0 for n in size):
        return 0
    return (1 + _last(size, stride)) * dtype.itemsize


def _contiguous(size, stride) -> bool:
    expect = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expect:
            return False
        expect *= s
    return True


def _tensor(t, inputs, allocs):
    kind = t[0]
    if kind == "al":
        return allocs[t[1]]
    if kind == "in":
        return inputs[t[1]]
    if kind == "av":
        return allocs[t[1]].as_strided(t[2], t[3], t[4])
    if kind == "iv":
        x = inputs[t[1]]
        return x.as_strided(t[2], t[3], x.storage_offset() + t[4])
    if kind == "wv":
        x = allocs[t[1]].view(t[5])
        return x.as_strided(t[3], t[4], t[2] // x.element_size())
    if kind == "rv":
        x = _tensor(t[1], inputs, allocs)
        first = x.storage_offset() * x.element_size() + t[4]
        return torch.empty(0, dtype=t[5], device=x.device).set_(x.untyped_storage(), first // t[5].itemsize, t[2],
                                                                t[3])
    if kind == "c":
        return t[1]
    return torch.empty_strided(t[1], t[2], dtype=t[3], device=t[4])


def _pointer(t, inputs, allocs):
    """The device address of the tensor template ``t`` in this call, as an int (where the template is a view: its
    base's address plus its element offset; a view keeps its base's dtype, ``_Recorder.template``); an empty
    tensor's template gives the tensor itself."""
    kind = t[0]
    if kind == "al":
        return allocs[t[1]].data_ptr()
    if kind == "wv":     # an intermediate: the workspace's address plus its byte offset
        return allocs[t[1]].data_ptr() + t[2]
    if kind == "in":
        return inputs[t[1]].data_ptr()
    if kind == "av" or kind == "iv":     # an allocation's offset is from its start, an input view's from the input's
        x = allocs[t[1]] if kind == "av" else inputs[t[1]]
        return x.data_ptr() + t[4] * x.element_size()
    if kind == "rv":                     # a byte offset from its base's first element
        return _pointer(t[1], inputs, allocs) + t[4]
    if kind == "c":
        return t[1].data_ptr()
    return _tensor(t, inputs, allocs)


def _value(a, inputs, allocs):
    kind = a[0]
    if kind == "v":
        return a[1]
    if kind == "t":
        return _tensor(a[1], inputs, allocs)
    return _descriptor(a[1], a[2], _tensor(a[3], inputs, allocs))


def _descriptor(typ, fields, base):
    """A TMA descriptor of the recorded type and fields (``_Recorder.value``) over this call's ``base`` tensor, built
    without the type's ``__init__`` (its checks held for the recorded call's equal fields)."""
    d = object.__new__(typ)
    d.__dict__.update(fields)
    d.base = base
    return d


def _build(tmpl, inputs, allocs):
    kind = tmpl[0]
    if kind == "t":
        return _tensor(tmpl[1], inputs, allocs)
    if kind == "v":
        return tmpl[1]
    if kind == "seq":
        return tmpl[1](_build(y, inputs, allocs) for y in tmpl[2])
    if kind == "named":
        return tmpl[1](*[_build(y, inputs, allocs) for y in tmpl[2]])
    return {k: _build(y, inputs, allocs) for k, y in tmpl[1]}


# ----------------------------------------------------------------------------------------------------------------------
# the decorator
# ----------------------------------------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("calls", "plan", "failures", "why")

    def __init__(self):
        self.calls, self.plan, self.failures, self.why = 0, None, 0, None


def _record(fn, args, kwargs, inputs, entry):
    stream = _launch_mod.current_stream()
    rec = _Recorder(inputs, stream)
    _launch_mod.set_recorder(rec)
    try:
        with rec:
            out = fn(*args, **kwargs)
    finally:
        _launch_mod.set_recorder(None)
    if rec.bad is None:
        try:
            entry.plan = _Plan(rec, rec.output(out))
        except _Unplannable:
            rec.bad = "output"
    if rec.bad is not None:
        entry.failures += 1
        entry.why = rec.bad
    return out


def planned(fn):
    """Decorator: record and replay the host work of ``fn`` per call key (module docstring). ``fn`` must launch
    every kernel through :func:`gdn.kernels.launch.launch` and return tensors (in tuples, lists, dicts, named
    tuples) or values that never change between calls of one key."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not ENABLED or _launch_mod.VERIFY or getattr(_local, "nested", False):
            return fn(*args, **kwargs)
        try:
            key, inputs = _call_key(wrapper, args, kwargs)
        except _Unplannable:
            return fn(*args, **kwargs)
        entry = _PLANS.get(key)
        if entry is not None and entry.plan is not None:
            del args, kwargs    # the plan drops each input at its last use (the caller may hold none)
            return entry.plan.replay(inputs)
        if entry is None:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.pop(next(iter(_PLANS)))
            entry = _PLANS[key] = _Entry()
        entry.calls += 1
        _local.nested = True     # planned functions that fn calls run their Python path (see the module docstring)
        try:
            if entry.calls < RECORD_AT or entry.failures >= MAX_TRIES:
                return fn(*args, **kwargs)
            return _record(fn, args, kwargs, inputs, entry)
        finally:
            _local.nested = False

    return wrapper


def stats(fn=None) -> dict:
    """{"plans": keys with a plan, "keys": keys seen, "given_up": keys whose recordings failed MAX_TRIES times,
    "why": what stopped the last failed recording of each function (an operator, a launch, "output")}; of the keys
    of the planned function ``fn`` alone where given."""
    items = [(k, e) for k, e in _PLANS.items() if fn is None or k[0] is fn]
    return {"plans": sum(e.plan is not None for _, e in items), "keys": len(items),
            "given_up": sum(e.failures >= MAX_TRIES for _, e in items),
            "why": {k[0].__name__: e.why for k, e in items if e.why is not None}}


__all__ = ["planned", "clear", "stats", "ENABLED", "RECORD_AT"]
