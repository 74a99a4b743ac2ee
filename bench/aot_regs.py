#!/usr/bin/env python3
"""Compile a Triton kernel for sm_90 on a machine without a GPU and report registers, spills and shared memory.

    from bench.aot_regs import aot_report
    aot_report(kernel, dict(q=torch.empty(1, dtype=torch.bfloat16), T=1, scale=1.0, ...),   # runtime args
               dict(H=16, K=128, ...), num_warps=4, num_stages=2)

Runtime arguments are given by example value (tensor -> pointer of its dtype, int -> i32, float -> fp32,
None -> constexpr None, a string -> that signature type, e.g. ``"tensordesc<bf16[128,64]>"``); every pointer and int argument gets the ``tt.divisibility 16`` attribute the JIT gives
arguments divisible by 16 (without it loads do not vectorise and spills look far worse than on the GPU).
Unset TRITON_INTERPRET before importing triton. Method: bench/chunk_notes.md, last section.
"""
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
       torch.int32: "i32", torch.int64: "i64"}


def aot_compile(kernel, args: dict, constexprs: dict, num_warps=4, num_stages=2, maxnreg=None):
    fn = kernel.fn if hasattr(kernel, "fn") and not hasattr(kernel, "arg_names") else kernel
    names = fn.arg_names
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
            consts[(i,)] = constexprs[n]
            continue
        val = args[n]
        if val is None:
            sig[n] = "constexpr"
            consts[(i,)] = None
        elif isinstance(val, str):   # an explicit signature type, e.g. "tensordesc<bf16[128,64]>" (TMA descriptor)
            sig[n] = val
        elif isinstance(val, torch.Tensor):
            sig[n] = "*" + _TY[val.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            sig[n] = "i1"
        elif isinstance(val, int):
            sig[n] = "i32"
            if val % 16 == 0 and val != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[n] = "fp32"
        else:
            raise TypeError(f"{n}: {type(val)}")
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump(compiled, flag: str) -> str:
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    out = subprocess.run([tool, flag, path], capture_output=True, text=True).stdout
    os.unlink(path)
    return out


SEQ_OPS = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "STSM", "STG", "UTMA", "DEPBAR.LE", "LDGSTS", "LDG", "BRA")


def sass_sequence(compiled, ops=SEQ_OPS, loop_only: bool = False) -> str:
    """The kernel's SASS reduced to the listed instruction kinds in program order, runs compressed
    (``HGMMAx8 WARPGROUP.DEPBARx1 BAR.SYNCx15 ...``): shows what sits between a loop's tensor-core products
    (barriers of layout conversions, global stores, waits for asynchronous copies). ``loop_only``: just the body of
    the longest backward branch (the main loop)."""
    rows = []
    for line in _cuobjdump(compiled, "-sass").splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*)", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2), m.group(3)))
    if loop_only:
        loops = [(int(t.group(1), 16), a) for a, op, rest in rows if op == "BRA"
                 for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < a]
        if loops:
            lo, hi = max(loops, key=lambda x: x[1] - x[0])
            rows = [r for r in rows if lo <= r[0] <= hi]
    seq = []
    for _, op, _ in rows:
        kind = next((k for k in ops if op.startswith(k)), None)
        if kind is None:
            continue
        if seq and seq[-1][0] == kind:
            seq[-1][1] += 1
        else:
            seq.append([kind, 1])
    return " ".join(f"{k}x{n}" for k, n in seq)


def resource_usage(compiled) -> dict:
    out = _cuobjdump(compiled, "--dump-resource-usage")
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return dict(regs=int(reg.group(1)) if reg else None, stack=int(stack.group(1)) if stack else None,
                shared=compiled.metadata.shared)


def aot_report(kernel, args, constexprs, label="", **kw):
    r = resource_usage(aot_compile(kernel, args, constexprs, **kw))
    print(f"{label:40s} regs {r['regs']:4d}  stack(spill) {r['stack']:5d} B  shared {r['shared']:6d} B", flush=True)
    return r
