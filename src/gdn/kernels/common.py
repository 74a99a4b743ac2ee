"""Small Triton helpers shared by the kernel families."""
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """torch.nn.functional.softplus with its default threshold 20 (x above it returns x), fp32."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def gdn_gate_value(a, A_log, dt_bias):
    """log-space decay g = -exp(A_log) * softplus(a + dt_bias), fp32."""
    return -tl.exp(A_log) * softplus(a + dt_bias)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))
