"""The one place that knows where Gluon's Hopper API lives in each Triton release (3.6 onwards).

``AVAILABLE`` is False where Triton has no Gluon (or an API this module does not know): the sm_90 kernels are then
not defined and the portable Triton kernels run instead. Nothing here touches a GPU.
"""
AVAILABLE = False
try:
    from triton.experimental import gluon  # noqa: F401
    from triton.experimental.gluon import language as gl  # noqa: F401
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    # TMA copies: async_copy_global_to_shared / async_copy_shared_to_global up to 3.6; async_load / async_store from
    # the release that renamed them (3.9 keeps the old names only as functions that raise)
    if hasattr(tma, "async_load"):
        tma_load, tma_store = tma.async_load, tma.async_store
    else:
        tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
    # CTA-wide barrier: gl.thread_barrier up to 3.6, gl.barrier later
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    # a shared-memory view with another dtype / shape / layout: shared_memory_descriptor._reinterpret up to 3.6,
    # .reinterpret later (Gluon code picks the name by this flag as a constexpr)
    PUBLIC_REINTERPRET = hasattr(gl.shared_memory_descriptor, "reinterpret")
    AVAILABLE = hasattr(tma, "store_wait")
except Exception:  # pragma: no cover - Triton without Gluon
    AVAILABLE = False
