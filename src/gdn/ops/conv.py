"""causal_conv1d / causal_conv1d_update: placeholder until the conv kernels land (issue 5)."""


def causal_conv1d(x, weight, bias=None, activation="silu", *, cu_seqlens=None, conv_state=None,
                  conv_state_indices=None):
    raise NotImplementedError("causal_conv1d is not implemented yet")


def causal_conv1d_update(x, conv_state, weight, bias=None, activation="silu", *, conv_state_indices=None):
    raise NotImplementedError("causal_conv1d_update is not implemented yet")
