"""Modules built on gdn's ops: the Gated DeltaNet block, its state cache and the fused gated RMSNorm."""
from .cache import GDNCache, GDNCacheBatch
from .gated_deltanet import GatedDeltaNet, gated_deltanet_ref
from .norm import GatedRMSNorm

__all__ = ["GatedDeltaNet", "GDNCache", "GDNCacheBatch", "GatedRMSNorm", "gated_deltanet_ref"]
