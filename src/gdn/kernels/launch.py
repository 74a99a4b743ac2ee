"""Kernel launches with less host time than ``kernel[grid](*args, **kwargs)``.

Triton's ``JITFunction.run`` spends ~35 us of host time per launch of a 50-argument kernel before the C launcher
runs (argument binding and specialisation ~24 us, the cache key ~6 us, the rest ~7 us: bench/NOTES.md, "Host
time"). :func:`launch` keys the compiled kernel by a key of its own instead (~12 us in all), and calls the
compiled kernel's launcher directly, exactly as ``JITFunction.run`` does (same launcher arguments, read in the
releases listed in ``_PROTOCOL``). The first launch of every key, and every launch where the fast path does not
apply (Triton's interpreter, a release outside ``_PROTOCOL``, a launch hook set (a profiler's), a callable grid),
goes through ``kernel[grid]``.

Correctness rests on one property: two calls with equal keys get the same kernel from Triton. Triton specialises
each argument by (what ``native_specialize_impl`` returns, checked against this module's key by
``tests/kernels/test_launch.py`` on every release CI runs):

* tensor: its dtype and whether its data pointer is a multiple of 16;
* int: ``1`` is a constant; otherwise i32 / i64 / u64 by range and whether it is a multiple of 16;
* bool, float: their type only; None: a constant; a TMA tensor descriptor: its dtype, block shape and layout;
* a constexpr parameter and every keyword argument (constexprs and options): by value; a runtime argument passed
  by keyword: by its key, as a positional one.

The key holds all of that (bools, strings and other values by value: finer, never coarser), plus the device and
Triton's debug / instrumentation settings. ``VERIFY = True`` (``gdn check`` sets it) makes every fast launch also ask
Triton which kernel it would run and raise if that is not the one the key found.

Host plans (:mod:`gdn.kernels.host_plan`) hook in here: while one records, :func:`launch` reports every launch of
the recording thread to it (after the launch ran, with operators of the launcher itself not counted as the call's);
a replay binds each launch once (:func:`bind`: the compiled kernel this key found) and fires it (:func:`fire`).
"""
from __future__ import annotations

import inspect
import threading

import torch
from triton import knobs as _knobs

from ..config import triton_interpret
from . import _compat

try:  # grid dependency control (programmatic dependent launch), in triton.language.extra.cuda from 3.6 on
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - a release without it: no kernel is launched with PDL
    gdc_wait = None

try:  # Triton's own stream query (torch's raw current stream), as JITFunction.run uses
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - CPU-only torch builds
    _raw_stream = None

# releases whose JITFunction.run -> CompiledKernel.run protocol this module reproduces (read in 3.6 and 3.9)
_PROTOCOL = ((3, 6), (3, 9))
VERIFY = False

_I32 = 1 << 31
_I64 = 1 << 63
_Tensor = torch.Tensor
_CACHE: dict = {}
_SIGNATURES: dict = {}


def _version() -> tuple:
    import triton

    return _compat._version(triton.__version__)


def _enabled() -> bool:
    if triton_interpret() or _raw_stream is None:
        return False
    lo, hi = _PROTOCOL
    return lo <= _version() <= hi


_ENABLED = _enabled()


def arg_key(a):
    """This module's key of one non-constexpr argument (see the module docstring): equal keys imply equal Triton
    specialisations."""
    c = a.__class__
    if c is int:
        if a == 1:
            return 1
        return (a & 15) == 0, -_I32 <= a < _I32, a < _I64
    if c is _Tensor or isinstance(a, _Tensor):
        return a.dtype, not (a.data_ptr() & 15)
    if c is float:
        return float
    base = getattr(a, "base", None)
    if isinstance(base, _Tensor):   # a TMA tensor descriptor (Gluon / triton.tools)
        return base.dtype, tuple(a.block_shape), getattr(a, "layout", None), getattr(a, "padding", None)
    return a


def _signature(kernel):
    """(names, defaults, runtime parameter names, is-constexpr flags) of the kernel's parameters, memoised per
    kernel (the entry keeps the kernel alive, so its id stays its own)."""
    entry = _SIGNATURES.get(id(kernel))
    if entry is None:
        params = kernel.params
        sig = (tuple(p.name for p in params), tuple(p.default for p in params),
               frozenset(p.name for p in params if not p.is_constexpr), tuple(p.is_constexpr for p in params))
        entry = _SIGNATURES[id(kernel)] = (sig, kernel)
    return entry[0]


def _tail(kernel, n, kwargs):
    """Values of the parameters after the n positional ones, in signature order (keyword or default), as
    ``JITFunction.run`` passes them to the launcher."""
    names, defaults, _, _ = _signature(kernel)
    out = tuple([kwargs.get(name, d) for name, d in zip(names[n:], defaults[n:])])
    for name, v in zip(names[n:], out):
        if v is inspect.Parameter.empty:
            raise TypeError(f"missing argument {name!r} of {kernel}")
    return out


def _hooked(hook) -> bool:
    """Whether a launch hook is set (Triton >= 3.6 keeps a HookChain there, empty unless a profiler adds to it)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with the host-time fast path above; returns what that returns on the slow
    path (the compiled kernel), None on the fast path."""
    rec = _RECORDERS.get(threading.get_ident()) if _RECORDERS else None
    if rec is not None:     # a host plan is being recorded on this thread (host_plan.py)
        rec.in_launch += 1     # operators run by the launcher itself (the interpreter's copies) are not the call's
        try:
            out = _launch(kernel, grid, args, kwargs)
        finally:
            rec.in_launch -= 1
        rec.on_launch(kernel, grid, args, kwargs, current_stream())
        return out
    return _launch(kernel, grid, args, kwargs)


def _key(kernel, args, kwargs):
    """(this module's key of a launch, whether runtime arguments are passed by keyword)."""
    n = len(args)
    _, _, runtime, is_constexpr = _signature(kernel)
    # keywords: constexprs / options by value, runtime arguments (passed by keyword) by their key
    dynamic = not runtime.isdisjoint(kwargs)
    kw_key = tuple([(k, arg_key(v)) if k in runtime else (k, v) for k, v in kwargs.items()]) if dynamic else \
        tuple(kwargs.items())
    key = (id(kernel), torch.cuda.current_device(), knobs_key(), tuple(map(arg_key, args)), kw_key,
           tuple([a for a, c in zip(args, is_constexpr) if c]) if True in is_constexpr[:n] else ())
    return key, dynamic


def fast_ok(kernel) -> bool:
    """Whether a launch of ``kernel`` may take the fast path now (no interpreter, supported release, no pre-run or
    launch hooks)."""
    if not _ENABLED or kernel.pre_run_hooks:
        return False
    rt = _knobs.runtime
    return not (_hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook))


_THREAD = threading.local()


def ensure_context() -> None:
    """Make the current device's primary CUDA context current on this thread, once per thread and device. Triton
    encodes a launch's TMA descriptors (``cuTensorMapEncodeTiled``) before its C launcher makes a context current,
    and that call fails with "invalid device context" on a thread where no CUDA runtime call ran yet: autograd's
    device thread when the op's backward is the first work on it (its allocations served from torch's cache)."""
    if not torch.cuda.is_initialized():
        return
    dev = torch.cuda.current_device()
    done = getattr(_THREAD, "devices", None)
    if done is None:
        done = _THREAD.devices = set()
    if dev not in done:
        # runtime calls, which bind the device's primary context to this thread; the stream query (the one measured
        # to fix it) is not made while the stream captures a CUDA graph, where it is not allowed
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(dev).query()
        done.add(dev)


def _launch(kernel, grid, args, kwargs):
    if callable(grid) or not fast_ok(kernel):
        ensure_context()
        return kernel[grid](*args, **kwargs)
    key, dynamic = _key(kernel, args, kwargs)
    entry = _CACHE.get(key)
    if entry is None:
        ensure_context()
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            _CACHE[key] = (compiled, None if dynamic else _tail(kernel, len(args), kwargs))
        return compiled
    if VERIFY:
        want = kernel.warmup(*args, grid=grid, **kwargs)
        if want is not entry[0]:
            raise RuntimeError(f"gdn.kernels.launch: the key of {kernel} found another compiled kernel than "
                               f"Triton's own specialisation (Triton {_version()}); launch.VERIFY caught it")
    fire((kernel, entry), grid, args, kwargs)
    return None


def bind(kernel, args, kwargs):
    """The compiled kernel that :func:`launch` would run for these arguments, as a handle for :func:`fire`, or None
    (fast path off, or not compiled yet). Host plans bind a launch once: equal plan keys imply equal launch keys."""
    if not fast_ok(kernel):
        return None
    entry = _CACHE.get(_key(kernel, args, kwargs)[0])
    return None if entry is None else (kernel, entry)


def fire(bound, grid, args, kwargs) -> None:
    """Launch a bound kernel (:func:`bind`) on the current stream, as ``JITFunction.run`` does."""
    kernel, (compiled, tail) = bound
    ensure_context()
    if tail is None:   # runtime arguments among the keywords: this call's values
        tail = _tail(kernel, len(args), kwargs)
    g = len(grid)
    compiled.run(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1,
                 _raw_stream(torch.cuda.current_device()), compiled.function, compiled.packed_metadata, None, None,
                 None, *args, *tail)


def direct(bound, nargs: int):
    """Triton 3.6: the bound kernel's C launcher itself, for callers that pass its final arguments (host-plan
    replays): ``(raw, function, head, tail, descriptors)`` where a launch is ``raw(gx, gy, gz, stream, function,
    *head, *expanded)``, ``expanded`` being the kernel's arguments (``nargs`` positional ones, then ``tail``) with
    each TMA descriptor at position ``p`` of ``descriptors = [(p, metadata)]`` replaced by :func:`encode`'s list.
    That skips what ``CompiledKernel.run`` adds per launch (scratch checks, the descriptor walk over every argument
    and each descriptor's encoding). None where the release, the kernel or the arguments do not have that form
    (another release, global or profile scratch, runtime keywords, a descriptor the compiler did not lower to
    TMA): :func:`fire` then."""
    kernel, (compiled, tail) = bound
    if tail is None or _version() != (3, 6):
        return None
    run = compiled.run
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    inner = run.launch
    code = getattr(inner, "__code__", None)
    if code is None:        # no descriptor arguments: Triton 3.6 installs the C launcher itself
        raw, descs = inner, []
    else:                   # wrap_handle_tensordesc's closure over the C launcher
        cells = dict(zip(code.co_freevars, inner.__closure__ or ()))
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= set(cells):
            return None
        raw = cells["launcher"].cell_contents
        idx = sorted(cells["tensordesc_indices"].cell_contents)
        meta = cells["tensordesc_meta"].cell_contents
        if len(meta) != len(idx) or any(m is None for m in meta) or (idx and idx[-1] >= nargs):
            return None
        descs = list(zip(idx, meta))
    head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
    return raw, compiled.function, head, tail, descs


def encode(desc, metadata) -> list:
    """A TMA descriptor argument as Triton 3.6's launcher expands it: [encoded tensor map, *shape, *strides]."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    ensure_context()
    return make_tensordesc_arg(desc, metadata)


_RECORDERS: dict = {}   # thread id -> the host-plan recorder of a call running on that thread


def set_recorder(rec) -> None:
    """Report every launch of this thread to the host-plan recorder ``rec`` (``rec.on_launch``); None: stop."""
    if rec is None:
        _RECORDERS.pop(threading.get_ident(), None)
    else:
        _RECORDERS[threading.get_ident()] = rec


_PDL_DEVICES: dict = {}


def pdl_args(on: bool, device) -> dict:
    """Keyword arguments that launch a kernel with programmatic dependent launch when ``on``: its ``PDL`` constexpr
    (``pdl_enter``, the kernel's first statement, then waits for the kernel before it) and Triton's launch_pdl
    option, ``{"PDL": True, "launch_pdl": True}``, on sm_90 and newer outside the interpreter; else {} (the kernel's
    PDL default False: an ordinary launch)."""
    if not on or gdc_wait is None or triton_interpret() or getattr(device, "type", "cpu") != "cuda":
        return {}
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL_DEVICES.get(idx)
    if ok is None:
        ok = _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if ok else {}


def knobs_key() -> tuple:
    """Triton's settings that select another compiled kernel for the same arguments (part of every launch key; host
    plans key on them too, since a replay fires the kernel its first launch bound)."""
    return _knobs.runtime.debug, _knobs.compilation.instrumentation_mode


def current_stream():
    """The raw current CUDA stream where CUDA is in use (None otherwise): host plans check that every launch of a
    recorded call goes where the call began."""
    if _raw_stream is None or not torch.cuda.is_initialized():
        return None
    return _raw_stream(torch.cuda.current_device())


__all__ = ["launch", "pdl_args", "arg_key", "bind", "fire", "direct", "encode", "fast_ok", "set_recorder", "knobs_key",
           "current_stream", "VERIFY"]
