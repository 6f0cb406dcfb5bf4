"""DP-SGD's seeds, on every backend: validation, a fresh seed, its two halves.

A seed is a non-negative integer below 2**52; it travels between replicas
as two 26-bit halves, each exact in a float64 (TensorFlow's all-reduce, see
`keras_tapeops.privacy.noise`) and in a uint32 (JAX's PRNG keys, see
`keras_tapeops.backend.jax.privacy`).
"""

from __future__ import annotations

import numbers
import secrets

import numpy as np

HALF_BITS = 26  # a 52-bit seed travels exactly as two halves
SEED_LIMIT = 1 << (2 * HALF_BITS)


def check_seed(seed: object) -> int | None:
    """Returns `seed` as an int (or None) if it is None or an integer in `[0, 2**52)`.

    A larger seed would travel as its low 52 bits (`seed_halves`), so that
    `2**52 + 5` would draw what `5` draws: it is refused instead.

    Args:
        seed: the `seed` argument of `kt.DPSGD` or `kt.privacy.poisson_batches`.

    Returns:
        None or the seed as a Python int; raises ValueError otherwise.
    """
    if seed is None:
        return None
    if (
        isinstance(seed, (bool, np.bool_))
        or not isinstance(seed, numbers.Integral)
        or not 0 <= int(seed) < SEED_LIMIT
    ):
        raise ValueError(
            f"`seed` must be None or an integer in [0, 2**52). Received: seed={seed!r}"
        )
    return int(seed)


def fresh_seed() -> int:
    """A random 52-bit seed from the operating system's entropy."""
    return secrets.randbits(2 * HALF_BITS)


def seed_halves(seed: int) -> tuple[int, int]:
    """`(high, low)` 26-bit halves of a seed (Python ints).

    Example:
    ```python
    seed_halves((5 << 26) + 7)   # (5, 7)
    ```
    """
    seed = int(seed) % SEED_LIMIT
    return seed >> HALF_BITS, seed & ((1 << HALF_BITS) - 1)
