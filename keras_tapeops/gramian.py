"""Helpers on the `K x K` Gramian `G = J J^T` of the task rows.

Every aggregator of `keras_tapeops.aggregation` computes its task weights
from `G` alone (torchjd's "Gramian weighting" style), so these few helpers
are all the linear algebra the step needs. Everything runs in float32 TF ops
inside the step (no host round trip).
"""

import functools
import itertools

import numpy as np
import tensorflow as tf

# Eigenvalues of a Gramian below RCOND x its largest are treated as zero
# (pseudo-inverse, rank). Float32 Gramians of large models carry relative
# rounding errors of about sqrt(P) x 1.2e-7, so a tighter cutoff would turn
# rounding noise of parallel task gradients into huge weights.
RCOND = 1e-4


def nan_unless_finite(weighting):
    """Decorates `weighting(gramian, *args)`: nan weights for a non-finite Gramian.

    A step whose task rows hold inf or nan (a float16 overflow under mixed
    precision, a NaN target) has a non-finite Gramian, on which the
    eigendecompositions and Cholesky factorizations of the weightings fail
    with an error ("Self-adjoint eigen decomposition was not successful")
    that stops `fit`. The decorated weighting runs on a zero Gramian
    instead and returns nan weights, so the aggregated gradient is
    non-finite and the step is skipped as stock Keras skips it (the
    LossScaleOptimizer skips it and lowers its scale; `kt.SkipNonFinite`
    skips it).

    Args:
        weighting: `f(gramian, *args, **kwargs) -> [K]` float32 weights.

    Returns:
        The same function, safe on non-finite input.
    """

    @functools.wraps(weighting)
    def safe(gramian, *args, **kwargs):
        gramian = tf.convert_to_tensor(gramian, tf.float32)
        finite = tf.reduce_all(tf.math.is_finite(gramian))
        weights = weighting(tf.where(finite, gramian, 0.0), *args, **kwargs)
        return tf.where(finite, weights, float("nan"))

    return safe


def normalize(gramian, eps):
    """`G / trace(G)`: the Gramian of `J / ||J||_F`; zeros when `trace < eps` (torchjd)."""
    trace = tf.linalg.trace(gramian)
    safe = tf.where(trace < eps, tf.ones_like(trace), trace)
    return tf.where(trace < eps, tf.zeros_like(gramian), gramian / safe)


def regularize(gramian, eps):
    """`G + eps I`: makes a (normalized) Gramian positive definite (torchjd)."""
    k = tf.shape(gramian)[0]
    return gramian + eps * tf.eye(k, dtype=gramian.dtype)


def eigh_ascending(gramian):
    """Eigenvalues (ascending, clipped at 0) and eigenvectors of the symmetric `G`."""
    symmetric = 0.5 * (gramian + tf.transpose(gramian))
    values, vectors = tf.linalg.eigh(symmetric)
    return tf.maximum(values, 0.0), vectors


def psd_pinv(gramian, rcond=RCOND):
    """Pseudo-inverse of a positive semi-definite `G` (eigenvalues <= rcond x max dropped)."""
    return symmetric_pinv(gramian, rcond)


def symmetric_pinv(matrices, rcond=None):
    """Pseudo-inverses of symmetric (possibly indefinite) matrices, batched.

    One eigendecomposition each (cheaper than `tf.linalg.pinv`'s SVD, same
    result for symmetric input); eigenvalues with `|lambda| <= rcond x max|lambda|`
    are dropped (`rcond` defaults to `tf.linalg.pinv`'s `10 x size x eps`).

    Args:
        matrices: `[..., n, n]` symmetric float32.
        rcond: relative cutoff, or None.

    Returns:
        `[..., n, n]` float32.
    """
    n = int(matrices.shape[-1])
    if rcond is None:
        rcond = 10.0 * n * float(np.finfo(np.float32).eps)
    values, vectors = tf.linalg.eigh(0.5 * (matrices + tf.linalg.matrix_transpose(matrices)))
    limit = rcond * tf.reduce_max(tf.abs(values), axis=-1, keepdims=True)
    kept = tf.abs(values) > limit
    inverse = tf.where(kept, 1.0 / tf.where(kept, values, 1.0), 0.0)
    return tf.matmul(vectors * inverse[..., tf.newaxis, :], vectors, transpose_b=True)


def row_norms(gramian):
    """`||g_k||`: the square roots of the diagonal."""
    return tf.sqrt(tf.maximum(tf.linalg.diag_part(gramian), 0.0))


def cosine_similarities(gramian):
    """`cos(g_i, g_j)`, the `[K, K]` matrix; 0 where a row is zero."""
    norms = row_norms(gramian)
    outer = norms[:, tf.newaxis] * norms[tf.newaxis, :]
    return tf.where(outer > 0.0, gramian / tf.where(outer > 0.0, outer, 1.0), 0.0)


def pairs(k):
    """The `(i, j)` index pairs with `i < j`, in the order metrics are logged."""
    return list(itertools.combinations(range(k), 2))


def subsets(k):
    """All non-empty subsets of `range(k)` as a `[2^k - 1, k]` float32 0/1 mask."""
    masks = [[(s >> i) & 1 for i in range(k)] for s in range(1, 2**k)]
    return tf.constant(np.array(masks, dtype=np.float32))


def masked_blocks(gramian, masks):
    """For each 0/1 mask `m`: `G` restricted to `m` (zeros elsewhere) plus `I` off `m`.

    The result is block diagonal, so solving with it solves the sub-system
    `G[m, m] x[m] = b[m]` and leaves `x = b` off the mask.

    Args:
        gramian: `[K, K]`.
        masks: `[N, K]` 0/1 floats.

    Returns:
        `[N, K, K]`.
    """
    outer = masks[:, :, tf.newaxis] * masks[:, tf.newaxis, :]
    return outer * gramian[tf.newaxis] + tf.linalg.diag(1.0 - masks)


def quadratic(weights, gramian):
    """`w^T G w` for each row `w` of `weights` (`[..., K]`)."""
    return tf.reduce_sum(tf.linalg.matvec(gramian, weights) * weights, axis=-1)


def onto_simplex_cheaply(weights):
    """Clips negatives and rescales to sum 1 (a feasible point, not the projection).

    Rows that have no positive entry (or are not finite) come back as nan,
    so the caller can rank them last.
    """
    clipped = tf.maximum(weights, 0.0)
    total = tf.reduce_sum(clipped, axis=-1, keepdims=True)
    ok = tf.logical_and(total > 0.0, tf.math.is_finite(total))
    return tf.where(ok, clipped / tf.where(ok, total, 1.0), float("nan"))


def argmin_rows(candidates, objective):
    """The row of `candidates` with the smallest finite `objective` value."""
    objective = tf.where(tf.math.is_finite(objective), objective, float("inf"))
    return tf.gather(candidates, tf.argmin(objective, axis=0))
