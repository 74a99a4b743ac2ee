"""Quick GPU triage: each check module in its own process (time, pass/fail), then the chunked op forward/backward at
an issue shape with CUDA_LAUNCH_BLOCKING=1 so a bad access names its kernel."""
import os
import subprocess
import sys
import time

env = dict(os.environ, PYTHONPATH="src" + os.pathsep + os.environ.get("PYTHONPATH", ""))
mods = sys.argv[1].split(",") if len(sys.argv) > 1 else ["chunk", "chunk_backward", "conv", "norm", "layer"]
for m in mods:
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "gdn.cli", "check", "--device", "cuda", "--ops", m], env=env,
                       capture_output=True, text=True, timeout=240)
    print(f"== {m}: rc {r.returncode} in {time.time() - t:.0f}s")
    print("\n".join((r.stdout + r.stderr).strip().splitlines()[-25:]))

code = r"""
import time, torch
from gdn.ops import chunk_gated_delta_rule
torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    B, T, H, HV, K, V = 1, 8192, 16, 32, 128, 128
    q = torch.randn(B, T, H, K, device='cuda', dtype=dt, requires_grad=True)
    k = torch.randn(B, T, H, K, device='cuda', dtype=dt, requires_grad=True)
    v = torch.randn(B, T, HV, V, device='cuda', dtype=dt, requires_grad=True)
    g = (-torch.rand(B, T, HV, device='cuda')).requires_grad_()
    beta = torch.rand(B, T, HV, device='cuda', dtype=dt).requires_grad_()
    for it in range(3):
        torch.cuda.synchronize(); t = time.time()
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize(); t1 = time.time()
        (o.float().sum() + s.sum()).backward()
        torch.cuda.synchronize(); t2 = time.time()
        print(dt, 'iter', it, 'fwd %.3f ms  bwd %.3f ms' % ((t1 - t) * 1e3, (t2 - t1) * 1e3), flush=True)
"""
r = subprocess.run([sys.executable, "-c", code], env=dict(env, CUDA_LAUNCH_BLOCKING="1"), capture_output=True,
                   text=True, timeout=300)
print("== chunk fwd/bwd 1x8192: rc", r.returncode)
print("\n".join((r.stdout + r.stderr).strip().splitlines()[-30:]))
