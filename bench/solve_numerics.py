#!/usr/bin/env python3
"""Accuracy of the prepare kernel's triangular solve forms at tf32, simulated on the CPU (no GPU needed).

    python3 bench/solve_numerics.py [--chunks 200]

(I + A)^-1 for A = strictLower(diag(beta) (Gamma * K K^T)) of one 64-token chunk (normalised bf16 keys), computed
the way ``gdn.kernels.chunk.prepare._unit_lower_inverse64`` does it, with every 64x64 product's operands rounded to
tf32 (10-bit mantissa, round to nearest even: what the tensor cores read for ``input_precision="tf32"``) and the
diagonal blocks inverted by fp32 forward substitution; printed: the worst ``max |error| / max |inverse|`` against
float64 per form and per kind of chunk. Kinds: nearly equal keys with beta ~ 1 and no decay (the hard case: the
inverse's entries grow), random keys with decay, correlated keys with gates near 1, a shared key component with
beta 0.99. Forms: 16x16 blocks merged by M powers (the default), and 16 / 8 / 4 blocks merged pairwise by the 2 x 2
block formula (``chunk_fwd.solve_block``). The numbers are in bench/NOTES.md (pending A/B table).
"""
import argparse

import torch


def tf32(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int32)
    b = (b + (((b >> 13) & 1) + 0xFFF)) & ~0x1FFF
    return b.view(torch.float32)


def dot(a, b):
    return tf32(a) @ tf32(b)


def block_inverses(A: torch.Tensor, blk: int) -> torch.Tensor:
    """Block-diagonal inverse of I + A's diagonal blk x blk blocks, by fp32 forward substitution."""
    D = torch.zeros_like(A)
    eye = torch.eye(blk)
    for b in range(64 // blk):
        s = slice(b * blk, (b + 1) * blk)
        Y = eye.clone()
        for i in range(1, blk):
            Y[i] = eye[i] - A[s, s][i, :i] @ Y[:i]
        D[s, s] = Y
    return D


def inverse_m_powers(A: torch.Tensor) -> torch.Tensor:
    """BLK 16: (I - M + M^2 - M^3) Dinv with M = Dinv L."""
    Dinv = block_inverses(A, 16)
    r = torch.arange(64)
    L = torch.where((r[:, None] // 16) > (r[None, :] // 16), A, 0.0)
    M = dot(Dinv, L)
    M2 = dot(M, M)
    return dot(torch.eye(64) - M + M2 - dot(M, M2), Dinv)


def inverse_pairwise(A: torch.Tensor, blk: int) -> torch.Tensor:
    """BLK 16 / 8 / 4: X <- X - X L_s X per level, L_s the block of A below each pair's diagonal."""
    X = block_inverses(A, blk)
    r = torch.arange(64)
    s = blk
    while s < 64:
        rs, cs = r[:, None] // s, r[None, :] // s
        X = X - dot(dot(X, torch.where((rs == cs + 1) & (rs % 2 == 1), A, 0.0)), X)
        s *= 2
    return X


def chunk(kind: int, gen: torch.Generator) -> torch.Tensor:
    K = 128
    rn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    ru = lambda *s: torch.rand(*s, generator=gen)   # noqa: E731
    if kind == 0:
        k, beta, g = rn(K) + 0.05 * rn(64, K), 0.95 + 0.05 * ru(64), torch.zeros(64)
    elif kind == 1:
        k, beta, g = rn(64, K), ru(64), -0.5 * ru(64)
    elif kind == 2:
        k, beta, g = rn(K) + 0.3 * rn(64, K), ru(64), -1e-3 * ru(64)
    else:
        k, beta, g = rn(64, K) + 2 * rn(K), 0.99 * torch.ones(64), torch.zeros(64)
    k = (k / k.norm(dim=1, keepdim=True)).to(torch.bfloat16).float()
    c = g.cumsum(0)
    return torch.tril(beta[:, None] * (k @ k.T) * torch.exp(c[:, None] - c[None, :]), -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=200)
    args = ap.parse_args()
    forms = {"16, M powers (default)": inverse_m_powers,
             "16, pairwise": lambda A: inverse_pairwise(A, 16),
             "8, pairwise": lambda A: inverse_pairwise(A, 8),
             "4, pairwise": lambda A: inverse_pairwise(A, 4)}
    kinds = ("nearly equal keys, beta ~1", "random keys, decay", "correlated keys, gates ~1", "shared component")
    worst = {(f, k): 0.0 for f in forms for k in range(4)}
    gen = torch.Generator().manual_seed(0)
    for n in range(args.chunks):
        A = chunk(n % 4, gen)
        ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A.double())
        for f, fn in forms.items():
            e = ((fn(A).double() - ref).abs().max() / ref.abs().max()).item()
            worst[(f, n % 4)] = max(worst[(f, n % 4)], e)
    print("worst max |error| / max |inverse| vs float64, products at tf32")
    print(f"{'form':<24}" + "".join(f"{k[:26]:>28}" for k in kinds))
    for f in forms:
        print(f"{f:<24}" + "".join(f"{worst[(f, k)]:>28.2e}" for k in range(4)))


if __name__ == "__main__":
    main()
