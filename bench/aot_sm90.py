#!/usr/bin/env python3
"""Compile the Gluon sm_90 state pass for Hopper on a machine without a GPU (ptxas from the Triton wheel) and print
registers, spills, shared memory and the main loop's instruction sequence per configuration:
``python3 bench/aot_sm90.py``. (Compile-only coverage of every configuration: ``python -m gdn.aot``.)"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from aot_regs import _cuobjdump, sass_sequence  # noqa: E402
from gdn.aot import compile_hopper_state_pass  # noqa: E402

if __name__ == "__main__":
    for bv, ns, fa in ((64, 2, True), (64, 3, True), (32, 2, True), (16, 2, True), (64, 2, False), (32, 2, False)):
        c = compile_hopper_state_pass(BV=bv, NS=ns, from_ainv=fa)
        res = [ln.strip() for ln in _cuobjdump(c, "-res-usage").splitlines() if "REG:" in ln]
        print(f"state pass sm90 BV={bv} NS={ns} {'ainv' if fa else 'wu'}: "
              f"{res[0].split(' TEXTURE')[0] if res else '?'}, {c.metadata.shared} B shared")
        print("   ", sass_sequence(c, loop_only=True))
