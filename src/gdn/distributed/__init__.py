"""Distributed training for gdn over ``torch.distributed`` (NCCL or gloo).

* :func:`cp_chunk_gated_delta_rule`, :func:`cp_causal_conv1d`: context parallelism, each rank holding a contiguous
  slice along T (of B sequences, or of one packed row of documents with global ``cu_seqlens``).
* :func:`shard_gated_deltanet` and friends (:mod:`gdn.distributed.tensor_parallel`): tensor parallelism of
  :class:`gdn.layers.GatedDeltaNet`, heads sharded over a process group.
"""
from .context_parallel import cp_chunk_gated_delta_rule
from .conv import cp_causal_conv1d
from .tensor_parallel import (
    allreduce_grad_in_backward,
    copy_to_tensor_parallel_region,
    gather_full_state_dict,
    merge_state_dicts,
    reduce_from_tensor_parallel_region,
    shard_gated_deltanet,
    shard_index,
    shard_state_dict,
)

__all__ = [
    "cp_chunk_gated_delta_rule",
    "cp_causal_conv1d",
    "shard_gated_deltanet",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "allreduce_grad_in_backward",
    "shard_index",
    "shard_state_dict",
    "merge_state_dicts",
    "gather_full_state_dict",
]
