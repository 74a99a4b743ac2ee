"""Public ops of gdn (see API.md): validation, backend dispatch and autograd live here; kernels in gdn.kernels."""
from . import _library  # noqa: F401  (registers the torch.library ops before any torch.compile trace)
from .chunk import chunk_gated_delta_rule
from .conv import causal_conv1d, causal_conv1d_update
from .decode import gated_delta_rule_decode
from .gate import gdn_gate
from .norm import gated_rms_norm
from .recurrent import fused_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule_decode",
    "gdn_gate",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_rms_norm",
]
