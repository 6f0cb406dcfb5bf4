"""Rows: the Jacobian of a vector of objectives with respect to variables.

The one place where the multi-gradient options compute per-task or
per-example gradients. A row is one objective's gradient over the selected
variables, flattened and concatenated; `K` objectives give a `K x P` matrix.
Aggregators (`keras_tapeops.aggregation`) reduce it, mostly through its
`K x K` Gramian `J J^T`.
"""

import tensorflow as tf


def jacobian_rows(tape, objectives, variables, method="pfor"):
    """The rows `d objectives[k] / d variables`, as one `[K, P]` float32 matrix.

    Args:
        tape: the `tf.GradientTape` that recorded `objectives` (persistent
            for `method="loop"`).
        objectives: a `[K]` tensor (e.g. per-task or per-example losses).
        variables: the variables (or watched tensors) to differentiate by.
        method: `"pfor"` (one vectorized Jacobian) or `"loop"` (one
            backward pass per objective, `tape.jacobian` without pfor).

    Returns:
        A `[K, P]` float32 tensor, P the total size of `variables`: the
        `task_rows` stacks, flattened and concatenated; a variable the
        objectives do not reach contributes zeros.

    Example:
    ```python
    with tf.GradientTape(persistent=True) as tape:
        losses = tf.stack([loss_a, loss_b])
    rows = jacobian_rows(tape, losses, model.trainable_variables)
    ```
    """
    if method not in ("pfor", "loop"):
        raise ValueError(f"`method` must be 'pfor' or 'loop'. Received: method={method!r}")
    parts = task_rows(tape, objectives, variables, method)
    k = tf.shape(objectives)[0]
    return tf.concat([tf.reshape(part, [k, -1]) for part in parts], axis=1)


def gramian(rows):
    """`J J^T`: the `[K, K]` inner products of the rows."""
    return tf.matmul(rows, rows, transpose_b=True)


def combine(weights, rows):
    """`weights^T J`: one `[P]` gradient from `[K]` weights and `[K, P]` rows."""
    return tf.linalg.matvec(rows, tf.cast(weights, rows.dtype), transpose_a=True)


def split_like(vector, variables):
    """Cuts a flat `[P]` vector into tensors shaped like `variables`, cast to their dtypes."""
    out, start = [], 0
    for v in variables:
        size = int(tf.size(v)) if v.shape.num_elements() is None else v.shape.num_elements()
        out.append(tf.cast(tf.reshape(vector[start : start + size], v.shape), v.dtype))
        start += size
    return out


def sum_over_replicas_if(condition, tensors):
    """`tensors` summed over replicas where `condition` (equal on every replica) holds.

    Under `tf.distribute` a synchronization inside a replica-context
    `tf.cond` is not supported, so the condition is taken in cross-replica
    context (`merge_call`) and the sums are made there; where it does not
    hold, zeros are returned and nothing is communicated. Without a
    strategy (or with one replica) `tensors` are returned unchanged.

    Args:
        condition: a scalar bool tensor, the same on every replica.
        tensors: a list of this replica's tensors.

    Returns:
        A list: the sums over replicas (or zeros), the same on every replica.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(tensors)

    def cross_replica(strategy, condition, *tensors):
        condition = strategy.experimental_local_results(condition)[0]
        return tf.cond(
            condition,
            lambda: [strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None) for t in tensors],
            lambda: [tf.zeros_like(strategy.experimental_local_results(t)[0]) for t in tensors],
        )

    return list(context.merge_call(cross_replica, args=(condition, *tensors)))


def task_rows(tape, objectives, variables, method="loop"):
    """The tasks' rows kept per variable: for each, the `[K, *variable.shape]` stack.

    Keeping one stack per variable (instead of one flat `[K, P]` matrix)
    saves the copies a concatenation and a split would make:
    `gramian_of_parts` and `combine_parts` work on the stacks directly.

    With `method="loop"` and a list of scalars, each scalar is
    differentiated on its own (`tape.gradient(objectives[k], ...)`), so each
    backward pass runs only through the part of the graph that task depends
    on (its head and the shared layers), not through every head with a zero
    cotangent as a one-hot cotangent on their stack would. With
    `method="pfor"`, pass their stack built inside the tape (one vectorized
    `tape.jacobian`).

    Args:
        tape: the persistent `tf.GradientTape` that recorded `objectives`.
        objectives: a list of K scalar tensors ("loop"), or a `[K]` tensor
            recorded by the tape ("pfor").
        variables: the variables (or watched tensors) to differentiate by.
        method: `"loop"` or `"pfor"`.

    Returns:
        A list aligned with `variables` of `[K, *shape]` float32 tensors
        (zeros where an objective does not reach).

    Example:
    ```python
    parts = task_rows(tape, [loss_a, loss_b], shared_variables)
    gramian = gramian_of_parts(parts)
    ```
    """
    zero = tf.UnconnectedGradients.ZERO
    if not isinstance(objectives, (list, tuple)):
        jacobians = tape.jacobian(
            objectives,
            variables,
            unconnected_gradients=zero,
            experimental_use_pfor=method == "pfor",
        )
        return [tf.cast(tf.convert_to_tensor(j), tf.float32) for j in jacobians]
    if method != "loop":
        raise ValueError(
            "`task_rows` with method='pfor' needs the objectives stacked inside the "
            f"tape. Received: method={method!r} with a list of objectives"
        )
    per_task = [tape.gradient(o, variables, unconnected_gradients=zero) for o in objectives]
    return [
        tf.stack([tf.cast(tf.convert_to_tensor(grads[i]), tf.float32) for grads in per_task])
        for i in range(len(variables))
    ]


def gramian_of_parts(parts):
    """`J J^T` of the rows held as per-variable `[K, ...]` stacks (see `task_rows`)."""
    products = []
    for part in parts:
        flat = tf.reshape(part, [tf.shape(part)[0], -1])
        products.append(tf.matmul(flat, flat, transpose_b=True))
    return tf.add_n(products)


def combine_parts(weights, parts):
    """`weights^T J` per variable: a list of tensors shaped like the variables."""
    return [tf.tensordot(tf.cast(weights, part.dtype), part, axes=1) for part in parts]
