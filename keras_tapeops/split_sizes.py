"""How a batch of n samples is cut into micro-batches (backend-neutral, Python ints).

`m = min(k, n)` micro-batches: the first `m - r` hold `q = n // m` samples,
the last `r = n % m` hold `q + 1`; sizes differ by at most one and the
samples keep their order. The TensorFlow loop (accumulation/splitting.py)
and the JAX scan (backend/jax/micro_batches.py) both follow it.
"""

from __future__ import annotations

from typing import Any

import keras


def micro_batch_sizes(n: int, k: int) -> list[int]:
    """The micro-batch sizes for a batch of `n` samples split `k` ways (Python ints).

    Args:
        n: number of samples in the batch (int >= 1).
        k: requested number of micro-batches (int >= 1).

    Returns:
        A list of `min(k, n)` ints summing to `n`, small ones first.

    Example:
    ```python
    micro_batch_sizes(10, 4)  # [2, 2, 3, 3]
    ```
    """
    m = max(min(k, n), 1)
    q, r = divmod(n, m)
    return [q] * (m - r) + [q + 1] * r


def equal_size_groups(n: int, k: int) -> list[tuple[int, int, int]]:
    """The runs of equal-sized micro-batches: `[(start, count, size)]`.

    Args:
        n: number of samples in the batch (int >= 1).
        k: requested number of micro-batches (int >= 1).

    Returns:
        One or two `(start, count, size)` triples: samples
        `start .. start + count * size` form `count` micro-batches of `size`.

    Example:
    ```python
    equal_size_groups(10, 4)  # [(0, 2, 2), (4, 2, 3)]
    ```
    """
    out: list[tuple[int, int, int]] = []
    start = 0
    for size in micro_batch_sizes(n, k):
        if out and out[-1][2] == size:
            first, count, _ = out[-1]
            out[-1] = (first, count + 1, size)
        else:
            out.append((start, 1, size))
        start += size
    return out


def static_batch_size(x: Any) -> int:
    """The number of samples in batch `x` (its first non-None leaf's first dimension).

    Args:
        x: a batch's inputs (any Keras nested structure), with a static
            batch dimension (as every JAX batch has).

    Returns:
        The batch size, an int.

    Example:
    ```python
    static_batch_size({"a": np.zeros((8, 3)), "b": None})  # 8
    ```
    """
    leaves = [t for t in keras.tree.flatten(x) if t is not None]
    return int(leaves[0].shape[0])
