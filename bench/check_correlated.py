"""GPU check of the chunked forward on hard inputs: nearly identical keys, beta ~ 1, no decay (the triangular solve's
block powers grow; the forward's merge runs in tf32 for bf16 inputs). Prints rel. errors of o and the final state
against the float64 reference; exits 1 above the op's tolerances (fp32 2e-3, bf16 1.5e-2)."""
import sys

import torch

from gdn.ops import chunk_gated_delta_rule
from gdn.reference import chunk_gated_delta_rule_ref
from gdn.testing import rel_err

torch.manual_seed(0)
bad = 0
for dt, tol in ((torch.float32, 2e-3), (torch.bfloat16, 1.5e-2)):
    for spread in (0.05, 0.3):
        B, T, H, HV, K, V = 2, 1000, 4, 8, 128, 128
        base = torch.randn(K, device="cuda")
        k = (base + spread * torch.randn(B, T, H, K, device="cuda")).to(dt)
        q = torch.randn(B, T, H, K, device="cuda").to(dt)
        v = torch.randn(B, T, HV, V, device="cuda").to(dt)
        g = -0.001 * torch.rand(B, T, HV, device="cuda")
        beta = (0.95 + 0.05 * torch.rand(B, T, HV, device="cuda")).to(dt)
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ro, rht = chunk_gated_delta_rule_ref(*(x.double().cpu() for x in (q, k, v, g, beta)), None, None, True, None,
                                             True)
        eo, es = rel_err(o.cpu(), ro), rel_err(ht.cpu(), rht)
        ok = eo < tol and es < tol
        bad += not ok
        print(f"{str(dt)[6:]:9s} key spread {spread}: o {eo:.2e}  state {es:.2e}  tol {tol:.0e}  {'PASS' if ok else 'FAIL'}")
sys.exit(1 if bad else 0)
