"""Chunked (WY / UT transform) gated delta rule kernels: prefill and training.

Forward (``forward.py`` ties them): ``prepare.py`` (gate cumsum, K K^T, triangular solve, W / U) -> ``state.py`` (the
sequential pass over chunks; ``segments.py`` splits long sequences and merges the segment states) -> ``output.py``.
Hopper (sm_90) forms in Gluon: ``hopper_prepare.py`` (the prepare), ``hopper.py`` (the state pass, alone or with the
output fused in), ``hopper_segments.py`` (the segment pass of segmented runs, one CTA per (value head, segment)).
Backward: ``backward/`` (dv_local, the reverse pass, the parallel parts A / B and the q/k kernel). Host planning
(chunk tables, segment lengths): ``plan.py``; shared helpers: ``common.py``; tuning: the ``chunk_fwd`` and
``chunk_bwd`` tables of :mod:`gdn.kernels.tuning`. The public op is :func:`gdn.ops.chunk_gated_delta_rule`; kernel
modules never import :mod:`gdn.ops` (``tests/test_architecture.py``).
"""
from .backward import chunk_bwd_dh, chunk_bwd_main, chunk_gated_delta_rule_bwd
from .common import CHUNK_SIZE
from .forward import chunk_gated_delta_rule_fwd
from .output import chunk_output
from .plan import ChunkIndex, prepare_chunk_indices
from .prepare import chunk_fwd_prepare, chunk_local_cumsum, chunk_scaled_dot_kkt_solve, recompute_w_u
from .state import chunk_state_pass

__all__ = ["CHUNK_SIZE", "ChunkIndex", "prepare_chunk_indices", "chunk_local_cumsum", "chunk_fwd_prepare",
           "chunk_scaled_dot_kkt_solve", "recompute_w_u", "chunk_state_pass", "chunk_output",
           "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd", "chunk_bwd_dh", "chunk_bwd_main"]
