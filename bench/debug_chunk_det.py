"""GPU triage of the chunked forward at 1x8192 16/32: run-to-run determinism and error vs the float64 reference for
the default config, no segments, forced segments, with and without an initial state."""
import torch

from gdn.kernels.chunk_fwd import config_override
from gdn.ops import chunk_gated_delta_rule
from gdn.reference import chunk_gated_delta_rule_ref
from gdn.testing import rel_err

torch.manual_seed(0)
B, T, H, HV, K, V = 1, 8192, 16, 32, 128, 128
dev = "cuda"
q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
g = -torch.rand(B, T, HV, device=dev) * 0.5 - 0.01
beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
h0 = torch.randn(B, HV, K, V, device=dev) * 0.1
for init in (None, h0):
    ro, rs = chunk_gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                        initial_state=None if init is None else init.double(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    for cfg in ({}, {"segment_chunks": -1}, {"segment_chunks": 16}, {"fuse_output": True}, {"state_mode": "wu"}):
        with config_override(**cfg):
            outs = [chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True) for _ in range(3)]
        same = all(torch.equal(outs[0][0], o[0]) and torch.equal(outs[0][1], o[1]) for o in outs[1:])
        print(f"h0={init is not None} {cfg}: deterministic={same} o_err={rel_err(outs[0][0], ro):.2e} "
              f"o_err_run3={rel_err(outs[2][0], ro):.2e} state_err={rel_err(outs[0][1], rs):.2e}", flush=True)
