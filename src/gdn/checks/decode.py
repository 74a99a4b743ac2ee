"""gdn check: gated_delta_rule_decode (FlashInfer competition inputs) vs the seed's float32 formula in float64."""
import torch

from ..ops import gated_delta_rule_decode
from ..reference import decode_ref
from ..testing import make_inputs, rel_err, to64
from . import Result, register


@register
def decode_pool(device):
    big = device.type == "cuda"
    H, HV, K, V = (16, 32, 128, 128) if big else (2, 4, 32, 32)
    out = []
    # on the GPU both batch sizes reach the large-batch tilings of the decode kernel (B * HV >= 2048 and >= 8192)
    cases = [(B, sd, tol) for B in ((64, 256) if big else (3,))
             for sd, tol in ((torch.float32, 1e-2), (torch.bfloat16, 1.5e-2))]  # o is bf16
    for B, state_dtype, tol in cases:
        x = make_inputs(B, 1, H, HV, K, V, dtype=torch.bfloat16, device=device)
        P = B + 5
        pool = torch.randn(P, HV, V, K, device=device).to(state_dtype)
        before = pool.clone()
        perm = torch.randperm(P, device=device)[:B]
        perm[1] = -1
        o, _ = gated_delta_rule_decode(x.q, x.k, x.v, pool, x.A_log, x.a, x.dt_bias, x.b, use_qk_l2norm=True,
                                       state_indices=perm)
        live = [i for i in range(B) if i != 1]
        ro, rs = decode_ref(*to64(x.q, x.k, x.v), before[perm.clamp(min=0)].double().cpu(),
                            *to64(x.A_log, x.a, x.dt_bias, x.b), use_qk_l2norm=True)
        name = f"k_last pool B={B} {str(state_dtype)[6:]}"
        out.append(Result("decode", name + " o", rel_err(o[live], ro[live]), tol))
        out.append(Result("decode", name + " state", rel_err(pool[perm[live]].float(), rs[live]), tol))
        pad_ok = bool((o[1] == 0).all())
        untouched = [r for r in range(P) if r not in set(perm.tolist())]
        same = torch.equal(pool[untouched], before[untouched])
        out.append(Result("decode", name + " padding/untouched", 0.0 if pad_ok and same else float("inf"), 0.0))
    return out
