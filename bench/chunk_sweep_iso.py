#!/usr/bin/env python3
"""Chunk-forward config sweep with every config in its own process (a config that faults the GPU cannot take the
others down). Usage on the GPU machine, from the repository root::

    python3 bench/chunk_sweep_iso.py --shapes 1x8192:16/32,4x4096:16/32 --configs '[{}, {"fuse_output": false}]' \
        --out $OUT/sweep.json [--blocking]

Each config runs ``python -m gdn.kernels.chunk_fwd --stages`` (prepare / state / output times); rows are collected
into one JSON list; failures are recorded with the tail of their output (``--blocking`` sets
CUDA_LAUNCH_BLOCKING=1 so a fault names its kernel)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

p = argparse.ArgumentParser()
p.add_argument("--shapes", required=True)
p.add_argument("--configs", required=True)
p.add_argument("--out", required=True)
p.add_argument("--iters", type=int, default=20)
p.add_argument("--timeout", type=float, default=120)
p.add_argument("--blocking", action="store_true")
a = p.parse_args()
env = dict(os.environ, PYTHONPATH="src" + os.pathsep + os.environ.get("PYTHONPATH", ""))
if a.blocking:
    env["CUDA_LAUNCH_BLOCKING"] = "1"
rows = []
for cfg in json.loads(a.configs):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "gdn.kernels.chunk_fwd", "--stages", "--iters", str(a.iters), "--shapes", a.shapes,
           "--configs", json.dumps([cfg]), "--json", path]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        out = (r.stdout + r.stderr).strip()
        ok = r.returncode == 0
    except subprocess.TimeoutExpired:
        out, ok = "timeout", False
    got = json.load(open(path)) if ok and os.path.getsize(path) else []
    rows += got
    for line in out.splitlines():
        if " ms " in line or "FAILED" in line:
            print(line[:240], flush=True)
    if not ok:
        tail = "\n".join(out.splitlines()[-6:])
        print(f"config {json.dumps(cfg)} exited badly:\n{tail[:1200]}", flush=True)
        rows.append(dict(config=cfg, error=tail[-1500:]))
json.dump(rows, open(a.out, "w"), indent=1)
