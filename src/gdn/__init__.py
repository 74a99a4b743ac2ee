"""gdn: Gated DeltaNet kernels for training and serving.

Public ops live in :mod:`gdn.ops`, the float64 oracle in :mod:`gdn.reference`, the block in :mod:`gdn.layers`,
context/tensor parallelism in :mod:`gdn.distributed`, and the Hugging Face hook in :mod:`gdn.integrations`.
"""
from .ops import (  # noqa: F401
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule_decode,
    gdn_gate,
)

__version__ = "0.1.0"
