"""Exact solvers for the small quadratic programs of MGDA, UPGrad and CAGrad.

The sub-problems live on the `K x K` Gramian (K = number of tasks), so they
are solved exactly inside the step by enumerating active sets: every subset
of the K coordinates gives one candidate from one small linear solve (all
solves are batched into one TF op), every candidate is made feasible, and the
feasible candidate with the lowest objective wins. The optimum is always one
of the candidates (it solves the equality-constrained problem on its own
support), and no candidate can undercut it (each is feasible), so the result
is the optimum up to float32 round-off, with no iteration count and no
tolerance to tune. The cost is `2^K` solves of size <= K + 1, which is why
these aggregators accept at most `MAX_TASKS` tasks.

No host round trip: everything is TF ops on float32 tensors (batched
eigendecompositions and Cholesky solves; XLA-compatible).
"""

import tensorflow as tf

from keras_tapeops import gramian as gram

# 2^12 candidate supports of size <= 13: a few milliseconds on a CPU.
MAX_TASKS = 12


def min_norm_weights(gramian):
    """The weights of the min-norm point of the convex hull of the rows (MGDA).

    Solves `min_a a^T G a` subject to `a >= 0`, `sum(a) = 1`. For each
    support `S` the candidate solves the KKT system
    `[[G_SS, 1], [1^T, 0]] [a_S; -nu] = [0; 1]` (with a pseudo-inverse, so
    duplicate or collinear rows do not break it).

    Args:
        gramian: `[K, K]` float32 Gramian `J J^T`.

    Returns:
        `[K]` float32 weights on the simplex (uniform when every row is zero).

    Example:
    ```python
    min_norm_weights(tf.constant([[1.0, -1.0], [-1.0, 1.0]]))  # [0.5, 0.5]
    ```
    """
    k = int(gramian.shape[0])
    g = gram.normalize(gramian, 1e-20)  # same weights, scale-free numbers
    masks = gram.subsets(k)
    n = masks.shape[0]
    blocks = gram.masked_blocks(g, masks)
    top = tf.concat([blocks, masks[:, :, tf.newaxis]], axis=2)
    bottom = tf.concat([masks[:, tf.newaxis, :], tf.zeros([n, 1, 1])], axis=2)
    bordered = tf.concat([top, bottom], axis=1)
    rhs = tf.one_hot(k, k + 1)
    solution = tf.linalg.matvec(gram.symmetric_pinv(bordered), rhs)
    candidates = gram.onto_simplex_cheaply(solution[:, :k])
    best = gram.argmin_rows(candidates, gram.quadratic(candidates, g))
    uniform = tf.fill([k], 1.0 / k)
    return tf.where(tf.linalg.trace(g) > 0.0, best, uniform)


def dual_cone_weights(gramian, lower_bounds):
    """For each row `u` of `lower_bounds`: `argmin_v v^T G v` subject to `v >= u`.

    This is the projection of `J^T u` onto the dual cone of the rows of `J`,
    in weight space (torchjd's `project_weights`, which calls quadprog). For
    each set `F` of free coordinates the candidate fixes `v = u` off `F` and
    solves `G_FF v_F = -G_F,notF u_notF` (a Cholesky solve: `G` must be
    positive definite, as UPGrad's regularized Gramian is).

    Args:
        gramian: `[K, K]` positive definite float32 matrix.
        lower_bounds: `[M, K]` float32, one problem per row.

    Returns:
        `[M, K]` float32 solutions.

    Example:
    ```python
    dual_cone_weights(tf.eye(2), tf.constant([[0.5, 0.0]]))  # [[0.5, 0.0]]
    ```
    """
    k = int(gramian.shape[0])
    free = tf.concat([tf.zeros([1, k]), gram.subsets(k)], axis=0)  # [N, K]
    chol = tf.linalg.cholesky(gram.masked_blocks(gramian, free))  # [N, K, K]
    bound = lower_bounds[tf.newaxis, :, :] * (1.0 - free)[:, tf.newaxis, :]  # [N, M, K]
    pushed = tf.linalg.matvec(gramian[tf.newaxis, tf.newaxis], bound)
    rhs = free[:, tf.newaxis, :] * (-pushed) + bound  # [N, M, K]
    solved = tf.linalg.cholesky_solve(chol, tf.transpose(rhs, [0, 2, 1]))  # [N, K, M]
    candidates = tf.maximum(tf.transpose(solved, [2, 0, 1]), lower_bounds[:, tf.newaxis, :])
    objective = gram.quadratic(candidates, gramian)  # [M, N]
    objective = tf.where(tf.math.is_finite(objective), objective, float("inf"))
    index = tf.argmin(objective, axis=1)
    return tf.gather(candidates, index, axis=1, batch_dims=1)
