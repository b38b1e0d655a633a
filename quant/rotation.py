"""Orthogonal input rotations for int8 products (the incoherence step of QuaRot, Ashkboos et
al. 2024, applied per Dense layer, with no calibration).

A linear layer computes y = x W. For an orthogonal R, y = (x R)(Rᵀ W): the layer may quantise
x R and Rᵀ W instead of x and W. A Hadamard-like R mixes every input channel into every output
channel with weights ±1/√n, so one channel that is hundreds of times larger than the rest (the
"massive activations" of Llama-family models) or a few channels that are steadily larger (an
RMSNorm's uneven output) are spread over all channels. A per-token int8 scale then fits the
token's overall size instead of its largest channel, and the ordinary channels keep their
levels. The weights are rotated once, when the model is converted; the activations at run time.

R is a Kronecker product of small orthonormal factors, so x R costs n·(a + b + …) operations per
token for n = a·b·…, not n²: a Sylvester Hadamard matrix for the power-of-two part of n and, for
the rest m, a Paley Hadamard matrix when m − 1 is a prime ≡ 3 (mod 4) (m = 12, 20, 24, 72, …).
Where no such m divides n by a power of two, the odd part of n gets a fixed orthogonal matrix
(QR of a Gaussian matrix from a fixed seed): orthogonal all the same, just less even.

A nonzero `seed` makes R = D H with D a diagonal of random signs drawn from that seed (QuaRot's
randomised Hadamard transform): another rotation as even as H, so a seed sweep measures how
much an int8 figure owes to the particular rotation. Seed 0 is H itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_SEED = 20240401  # the odd-part fallback's matrix is part of the format: never change it
_MAX_FACTOR = 128


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, int(p ** 0.5) + 1))


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _sylvester_factors(n: int) -> list[np.ndarray]:
    """Sylvester's H_n as a Kronecker product of factors of at most _MAX_FACTOR (exactly equal:
    H_a ⊗ H_b = H_ab), so x H costs n·(the factors' sizes summed), not n², per token."""
    out = []
    while n > 1:
        out.append(_sylvester(min(n, _MAX_FACTOR)))
        n //= out[-1].shape[0]
    return out


def _paley(m: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order m for a prime q = m - 1 ≡ 3 (mod 4)."""
    q = m - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in squares else -1 for i in range(1, q)])
    jac = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)])  # skew: Qᵀ = -Q
    s = np.zeros((m, m))
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
    return s + np.eye(m)


def _fixed_orthogonal(m: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(_SEED + m).standard_normal((m, m)))
    return q * np.sign(np.diag(r))  # the sign fix makes the factorisation unique


@functools.cache
def rotation_factors(n: int) -> tuple[np.ndarray, ...]:
    """Orthonormal float64 factors whose Kronecker product is the n x n rotation."""
    if n < 1:
        raise ValueError(f"n={n}: a rotation needs a positive size")
    two = n & -n  # the largest power of two dividing n
    for p2 in (two >> k for k in range(two.bit_length())):
        m = n // p2
        if m == 1 or (m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            factors = ([_paley(m)] if m > 1 else []) + _sylvester_factors(p2)
            break
    else:
        factors = [_fixed_orthogonal(n // two) * np.sqrt(n // two)] + _sylvester_factors(two)
    factors = factors or [np.ones((1, 1))]
    out = tuple(f / np.sqrt(f.shape[0]) for f in factors)
    for f in out:  # a wrong construction must not pass silently: R must be orthogonal
        if not np.allclose(f @ f.T, np.eye(f.shape[0]), atol=1e-9):
            raise RuntimeError(f"rotation factor of order {f.shape[0]} (width {n}) is not "
                               f"orthogonal")
    return out


@functools.cache
def rotation_signs(n: int, seed: int) -> np.ndarray | None:
    """The diagonal of D (±1, float64), or None for seed 0 (R = H)."""
    if seed == 0:
        return None
    return np.where(np.random.default_rng(seed).random(n) < 0.5, -1.0, 1.0)


def rotate(x: jax.Array, seed: int = 0) -> jax.Array:
    """x R over the last axis: [..., n] -> [..., n], in x's dtype."""
    n = x.shape[-1]
    factors = rotation_factors(n)
    signs = rotation_signs(n, seed)
    if signs is not None:
        x = x * jnp.asarray(signs, x.dtype).reshape((1,) * (x.ndim - 1) + (n,))
    lead = x.shape[:-1]
    y = x.reshape(lead + tuple(f.shape[0] for f in factors))
    for i, f in enumerate(factors):  # contract one Kronecker axis at a time
        axis = len(lead) + i
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(f, x.dtype), axes=([axis], [0])), -1, axis)
    return y.reshape(lead + (n,))


def rotate_kernel(w: jax.Array, seed: int = 0) -> jax.Array:
    """Rᵀ W (float32) for a kernel [..., in, out] (R acts on `in`), so that
    rotate(x, seed) @ rotate_kernel(w, seed) == x @ w up to rounding. It stays float32 for the
    int8 quantiser: a bf16 kernel is not rounded to bf16 a second time after the rotation."""
    wt = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., out, in]: rows times R = (Rᵀ W)ᵀ
    return jnp.swapaxes(rotate(wt, seed), -1, -2)
