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

    if not hasattr(tma, "async_copy_global_to_shared") and hasattr(tma, "async_load"):
        tma.async_copy_global_to_shared = tma.async_load
    if not hasattr(tma, "async_copy_shared_to_global") and hasattr(tma, "async_store"):
        tma.async_copy_shared_to_global = tma.async_store
    AVAILABLE = all(hasattr(tma, n) for n in ("async_copy_global_to_shared", "async_copy_shared_to_global",
                                              "store_wait"))
except Exception:  # pragma: no cover - Triton without Gluon
    AVAILABLE = False
