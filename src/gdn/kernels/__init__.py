# The Triton version differences gdn handles (gdn.kernels._compat) apply before any kernel module is imported.
from . import _compat  # noqa: F401
